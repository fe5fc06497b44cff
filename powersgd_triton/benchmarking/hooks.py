"""The hooks under test and one DDP-like step of them: :func:`ensure_process_group` (an in-process world of size 1),
:func:`make_hook` (PyTorch's ``powerSGD_hook`` or one of ours, same arguments) and :class:`HookStep`
(the hook called for every bucket of a model, in index order).
"""

from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

from powersgd_triton.benchmarking.buckets import FakeGradBucket
from powersgd_triton.benchmarking.memory import held_bytes
from powersgd_triton.variants import BY_NAME, VARIANTS


IMPLS = ("pytorch", "ours")  # what compare_hooks and bench/ run by default
# make_hook also knows the variants PyTorch does not have (powersgd_triton.variants), and every variant by name
ALL_IMPLS = IMPLS + tuple(v.name for v in VARIANTS if v.pytorch_twin is None)


def ensure_process_group(backend: Optional[str] = None) -> str:
    """Initialise an in-process world of size 1 (``HashStore``) if none is; returns the backend in use.

    ``backend=None``: nccl when CUDA and NCCL are there, else gloo. An already initialised group is kept.
    """
    if dist.is_initialized():
        return str(dist.get_backend())
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return backend


def make_hook(impl: str, rank: int, *, batched: bool = False, backend: str = "auto", start_powerSGD_iter: int = 2,
              **state_kwargs):
    """``(state, hook)`` for ``impl`` ("pytorch": torch's own, "ours": our twin of it, or the name of one of our
    variants, :data:`powersgd_triton.variants.VARIANTS`), same PowerSGD arguments for all. ``batched`` picks the
    batched hook of "pytorch" and "ours".

    Defaults are PyTorch's (``min_compression_rate=2``, error feedback and warm start on, epsilon 0) except
    ``start_powerSGD_iter=2`` (the smallest allowed with error feedback). ``backend`` only applies to ours.
    Raises ``ValueError`` for an unknown impl, ``RuntimeError`` for a layer-wise-only variant with ``batched=True``.
    """
    kwargs = dict(process_group=None, matrix_approximation_rank=int(rank), start_powerSGD_iter=start_powerSGD_iter)
    kwargs.update(state_kwargs)
    if impl == "pytorch":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as m

        return m.PowerSGDState(**kwargs), (m.batched_powerSGD_hook if batched else m.powerSGD_hook)
    if impl == "ours":
        impl = "batched" if batched else "powersgd"
    elif impl in BY_NAME and batched and not BY_NAME[impl].batched:
        raise RuntimeError(f"the {impl} hook is layer-wise only")
    if impl in BY_NAME:
        import powersgd_triton as pkg

        return pkg.PowerSGDState(backend=backend, **kwargs), BY_NAME[impl].load()
    raise ValueError(f"unknown impl {impl!r}; expected one of {ALL_IMPLS}")


class HookStep:
    """One DDP-like step of a hook over all ``buckets``: the hook is called for each bucket in index order.

    ``wait_each``: wait for each bucket's future before calling the hook on the next bucket (default on every
    backend but nccl). With gloo, PyTorch's hook runs its ``then()`` callbacks on gloo's worker threads and each
    callback blocks on a new all-reduce: with several buckets in flight every worker thread can end up blocked and
    the step deadlocks (seen here with world size 1 and ResNet-50's 5 buckets). With nccl (futures complete at
    enqueue) all hooks are called first and the futures waited for at the end, as DDP does.

    The buffers are updated in place by the hook; with error feedback the next step's input is the previous one
    (``M + E`` = approximation + new error), so repeated steps keep their magnitude and never reach zeros.
    ``current_bucket`` tells :func:`synchronous_collectives` which bucket a collective belongs to.
    """

    def __init__(self, impl: str, buckets: Sequence[FakeGradBucket], rank: int, *, batched: bool = False,
                 backend: str = "auto", wait_each: Optional[bool] = None, **state_kwargs):
        self.impl = impl
        self.buckets = list(buckets)
        self.rank = rank
        self.state, self.hook = make_hook(impl, rank, batched=batched, backend=backend, **state_kwargs)
        self.current_bucket: Optional[int] = None
        if wait_each is None:
            wait_each = not (dist.is_initialized() and "nccl" in str(dist.get_backend()).lower())
        self.wait_each = wait_each

    def __call__(self) -> None:
        futs = []
        for b in self.buckets:
            self.current_bucket = b.index()
            fut = self.hook(self.state, b)
            if self.wait_each:
                fut.wait()
            else:
                futs.append(fut)
        self.current_bucket = None
        for f in futs:
            f.wait()

    def warmup(self, compressed_steps: int = 1) -> "HookStep":
        """Run the plain all-reduce iterations, then ``compressed_steps`` compressed ones (allocations, first Q)."""
        guard = 0
        while self.state.iter < self.state.start_powerSGD_iter:
            self()
            guard += 1
            if guard > self.state.start_powerSGD_iter + 2:
                raise RuntimeError("hook state does not advance its iteration counter")
        for _ in range(compressed_steps):
            self()
        return self

    def memory(self) -> Dict[Optional[int], int]:
        """Bytes of tensors the hook's state keeps, per bucket index (:func:`held_bytes`)."""
        return held_bytes(self.state)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)
