"""The names ``bench --link`` takes and what a pair of ranks is asked to measure (:class:`Spec`), without torch.

Hooks are named as ``powersgd-triton train --hook`` names them (``allreduce``, ``reference`` for PyTorch's
``powerSGD_hook``, and the names of :data:`powersgd_triton.variants.VARIANTS`), plus ``<ours>_bf16``: our hook with
bfloat16 factors (``PowerSGDState(communication_dtype=torch.bfloat16)``, ``train --communication-dtype bfloat16``).
"""

import json
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

from powersgd_triton.train.config import HOOKS, WORKLOAD_DEFAULTS
from powersgd_triton.variants import NAMES as OUR_HOOKS
from powersgd_triton.variants import VARIANTS

BF16_SUFFIX = "_bf16"
ALLREDUCE = "allreduce"
REFERENCE = "reference"
LINK_HOOKS: Tuple[str, ...] = tuple(HOOKS) + tuple(h + BF16_SUFFIX for h in OUR_HOOKS)
# plain all-reduce, PyTorch's hook, our per-matrix hooks, our layer-wise hook with bf16 factors
DEFAULT_HOOKS: Tuple[str, ...] = ((ALLREDUCE, REFERENCE) + tuple(v.name for v in VARIANTS if not v.batched)
                                  + (VARIANTS[0].name + BF16_SUFFIX,))
OURS = VARIANTS[0].name  # the layer-wise hook: the one whose crossover the chart marks

RESNET18 = "resnet18"  # :mod:`powersgd_triton.linkbench.workloads`
WORKLOADS: Tuple[str, ...] = tuple(WORKLOAD_DEFAULTS) + (RESNET18,)
# timed (compressed) steps per hook when --steps is not given: ~1/4 to 2 minutes per rate on a 2-core machine
DEFAULT_STEPS: Dict[str, int] = {"digits": 30, "mnist5k": 30, "charlm": 20, RESNET18: 8}
DEFAULT_START_ITER = 4  # start_powerSGD_iter: DDP rebuilds its buckets after the first step


def train_hook(name: str) -> Tuple[str, Optional[str]]:
    """The train command's hook name and ``communication_dtype`` of a link hook name: ``"powersgd_bf16"`` ->
    ``("powersgd", "bfloat16")``, ``"reference"`` -> ``("reference", None)``. ``ValueError`` for an unknown name."""
    if name.endswith(BF16_SUFFIX) and name[: -len(BF16_SUFFIX)] in OUR_HOOKS:
        return name[: -len(BF16_SUFFIX)], "bfloat16"
    if name not in HOOKS:
        raise ValueError(f"unknown hook {name!r}; expected one of {', '.join(LINK_HOOKS)}")
    return name, None


def is_ours(name: str) -> bool:
    """``name`` is one of our hooks (with or without bf16 factors)."""
    return train_hook(name)[0] in OUR_HOOKS


@dataclass
class Spec:
    """What one launch of the ranks measures: one workload at one link rate, every hook in turn.

    ``steps``: timed steps per hook, after ``start_iter`` warm-up steps of plain all-reduce (``start_powerSGD_iter``);
    ``batch_size``: per rank (``None``: the workload's); ``threads``: torch threads per rank (``None``: torch's
    default); ``device``: ``cpu`` (gloo) or ``cuda`` (nccl, one GPU per local rank); ``rate``: the link's label;
    ``bucket_cap_mb``: DDP's bucket cap for our hooks and all-reduce (``None``: see
    :func:`powersgd_triton.linkbench.ranks.bucket_cap_mb`)."""

    workload: str
    hooks: List[str]
    rate: str
    steps: int
    start_iter: int = DEFAULT_START_ITER
    matrix_approximation_rank: int = 4
    batch_size: Optional[int] = None
    seed: int = 0
    threads: Optional[int] = None
    device: str = "cpu"
    collective_timeout: float = 600.0
    bucket_cap_mb: Optional[float] = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Spec":
        return cls(**json.loads(text))
