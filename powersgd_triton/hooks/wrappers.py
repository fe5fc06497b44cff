"""Low-precision wrappers of DDP comm hooks that work on CPU (gloo) and CUDA builds alike.

``bf16_compress_wrapper(hook)`` casts the bucket to ``torch.bfloat16`` before ``hook`` runs (so the all-reduces of
P, Q and the uncompressed gradients carry half the bytes) and casts the result back, as PyTorch's
``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_wrapper`` does. PyTorch's version cannot be
registered on CPU builds: ``DistributedDataParallel.register_comm_hook`` refuses hooks *named*
``bf16_compress_hook`` / ``bf16_compress_wrapper_hook`` unless CUDA >= 11 with NCCL >= 2.10 is there, although gloo
all-reduces bfloat16 fine. Ours has another name, and is otherwise the same.

The PowerSGD state keeps its error-feedback memory, P and Q in float32 whatever the bucket dtype; only the bucket and
the messages are bfloat16. PyTorch's ``fp16_compress_wrapper`` has no such restriction and is re-exported here.

No ``from __future__ import annotations``: DDP checks the annotations of the returned hook as objects.
"""

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_wrapper

__all__ = ["bf16_compress_wrapper", "fp16_compress_wrapper"]


def bf16_compress_wrapper(
    hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]],
) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """Cast the bucket to ``torch.bfloat16`` for ``hook`` and the result back to the gradients' dtype.

    Works on CPU (gloo) and CUDA builds. Example::

        >>> ddp_model.register_comm_hook(state, bf16_compress_wrapper(powerSGD_hook))
    """

    def powersgd_bf16_wrapper_hook(hook_state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        bucket.set_buffer(bucket.buffer().to(torch.bfloat16))
        fut = hook(hook_state, bucket)

        def decompress(fut):
            decompressed = bucket.buffer()
            decompressed.copy_(fut.value())  # in place: no second copy of the bucket
            return decompressed

        return fut.then(decompress)

    return powersgd_bf16_wrapper_hook
