"""Counting collectives: :func:`synchronous_collectives` runs every ``dist.all_reduce`` synchronously and records
it (:class:`CollectiveRecord`: bucket, elements, bytes, dtype); the returned works and futures are complete, so
``then()`` callbacks run inline on the calling thread (where :class:`~.opcount.OpCounter` sees them).
"""

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # pragma: no cover
    from powersgd_triton.benchmarking.hooks import HookStep


class _DoneWork:
    """A finished ``Work``: ``wait()`` returns at once, ``get_future()`` is a completed future of ``[tensor]``."""

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self):
        return [self._tensor]

    def get_future(self):
        t = self._tensor
        fut = torch.futures.Future(devices=[t.device]) if t.device.type == "cuda" else torch.futures.Future()
        fut.set_result([t])
        return fut


@dataclass
class CollectiveRecord:
    bucket: Optional[int]
    numel: int
    nbytes: int
    dtype: str


@contextlib.contextmanager
def synchronous_collectives(step: Optional["HookStep"] = None):
    """Run every ``dist.all_reduce`` synchronously and record it (bucket, elements, bytes, dtype).

    Returned works and futures are already complete, so ``then()`` callbacks run inline on the calling thread (for
    :class:`OpCounter`). The numbers are unchanged (the real all-reduce still runs). Only for counting, not timing.
    Yields the list of :class:`CollectiveRecord`.
    """
    records: List[CollectiveRecord] = []
    original = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        records.append(CollectiveRecord(step.current_bucket if step is not None else None, tensor.numel(),
                                        tensor.numel() * tensor.element_size(), str(tensor.dtype).replace("torch.", "")))
        original(tensor, op=op, group=group, async_op=False)
        return _DoneWork(tensor) if async_op else None

    dist.all_reduce = all_reduce
    try:
        yield records
    finally:
        dist.all_reduce = original
