"""The PowerSGD DDP communication hooks, registered with ``ddp_model.register_comm_hook(state, hook)``.

* :mod:`.layerwise` - ``powerSGD_hook`` (each gradient matrix of a bucket) and ``batched_powerSGD_hook`` (the whole
  bucket as one square matrix), PyTorch's two hooks;
* :mod:`.alternating` - ``alternating_powerSGD_hook``: one all-reduce per bucket per step, P and Q in turn;
* :mod:`.driver` - what every hook shares: checks, warm-up, the bucket's memory, the factor all-reduce, the order
  of the collectives;
* :mod:`.wrappers` - ``fp16_compress_wrapper`` / ``bf16_compress_wrapper``.

No ``from __future__ import annotations`` here: DDP checks the hooks' annotations as objects.
"""

from powersgd_triton.hooks.alternating import alternating_powerSGD_hook
from powersgd_triton.hooks.layerwise import batched_powerSGD_hook, powerSGD_hook
from powersgd_triton.hooks.wrappers import bf16_compress_wrapper, fp16_compress_wrapper

# the public import paths, as DDP's logging, pickles and the train command's metrics name the hooks
powerSGD_hook.__module__ = batched_powerSGD_hook.__module__ = __name__
alternating_powerSGD_hook.__module__ = "powersgd_triton.alternating"
bf16_compress_wrapper.__module__ = fp16_compress_wrapper.__module__ = "powersgd_triton.wrappers"

__all__ = ["powerSGD_hook", "batched_powerSGD_hook", "alternating_powerSGD_hook", "bf16_compress_wrapper",
           "fp16_compress_wrapper"]
