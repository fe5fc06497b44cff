"""What one step did, measured: :func:`count_step` runs a step once under the op counter, synchronous collectives
and the Triton launch hook, and returns :class:`StepCounts`.
"""

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

from powersgd_triton.benchmarking.collectives import CollectiveRecord, synchronous_collectives
from powersgd_triton.benchmarking.launches import count_triton_launches
from powersgd_triton.benchmarking.opcount import OpCounter

if TYPE_CHECKING:  # pragma: no cover
    from powersgd_triton.benchmarking.hooks import HookStep


@dataclass
class StepCounts:
    """What one step did, measured (see :func:`count_step`)."""

    aten_compute: int = 0
    aten_total: int = 0
    by_op: Dict[str, int] = field(default_factory=dict)
    collectives: List[CollectiveRecord] = field(default_factory=list)
    triton_launches: Optional[int] = None
    triton_by_kernel: Dict[str, int] = field(default_factory=dict)

    @property
    def allreduce_calls(self) -> int:
        return len(self.collectives)

    @property
    def allreduce_bytes(self) -> int:
        return sum(c.nbytes for c in self.collectives)

    def per_bucket(self) -> Dict[int, Tuple[int, int]]:
        """``{bucket: (all-reduce calls, bytes)}``."""
        out: Dict[int, Tuple[int, int]] = {}
        for c in self.collectives:
            calls, nbytes = out.get(c.bucket, (0, 0))
            out[c.bucket] = (calls + 1, nbytes + c.nbytes)
        return out

    def as_dict(self) -> dict:
        return {
            "aten_compute": self.aten_compute,
            "aten_total": self.aten_total,
            "allreduce_calls": self.allreduce_calls,
            "allreduce_bytes": self.allreduce_bytes,
            "allreduce_per_bucket": {str(k): list(v) for k, v in self.per_bucket().items()},
            "triton_launches": self.triton_launches,
            "triton_by_kernel": dict(self.triton_by_kernel),
            "top_ops": dict(Counter(self.by_op).most_common(12)),
        }


def count_step(step: Callable[[], None], *, hook_step: Optional["HookStep"] = None, triton_execute: bool = True) -> StepCounts:
    """Run ``step()`` once with the op counter, synchronous collectives and the Triton launch hook."""
    with synchronous_collectives(hook_step) as records, count_triton_launches(execute=triton_execute) as launches:
        with OpCounter() as ops:
            step()
    return StepCounts(
        aten_compute=ops.compute,
        aten_total=ops.total,
        by_op=dict(ops.by_op),
        collectives=list(records),
        triton_launches=launches["n"],
        triton_by_kernel=dict(launches["by"]),
    )
