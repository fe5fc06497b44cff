"""The configuration of ``powersgd-triton train``: :class:`TrainConfig`, the hook names and the workload defaults.

:meth:`TrainConfig.resolved` checks the fields; :func:`powersgd_triton.train.loop.validate` adds the checks that
depend on the machine. :mod:`powersgd_triton.train.loop` re-exports these names.
"""

import argparse
import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Tuple

from powersgd_triton.variants import NAMES, VARIANTS

# ours (powersgd_triton.variants), then PyTorch's powerSGD_hook and plain all-reduce
HOOKS = NAMES + ("reference", "allreduce")
COMPARE_HOOKS = tuple(v.name for v in VARIANTS if v.compared) + ("reference", "allreduce")
# With --fsdp RxS (HSDP): our layer-wise hooks over the replicate group, and native HSDP ("allreduce": a 2-D mesh).
FSDP_HOOKS = tuple(v.name for v in VARIANTS if v.fsdp) + ("allreduce",)

# Per-workload defaults (chosen so that a default run takes well under a minute on 2 CPU cores).
WORKLOAD_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "digits": dict(epochs=10, lr=0.1, batch_size=32, momentum=0.9, weight_decay=1e-4, optimizer="sgd"),
    "mnist5k": dict(epochs=8, lr=0.1, batch_size=32, momentum=0.9, weight_decay=1e-4, optimizer="sgd"),
    "charlm": dict(epochs=3, lr=1e-2, batch_size=16, momentum=0.0, weight_decay=0.0, optimizer="adam",
                   steps=600, clip=1.0),
}

# One DDP bucket for PyTorch's hook: it orders its collectives from gloo worker threads and aborts with more
# than one bucket on gloo (see ecosystem notes §2.4), so its rows run with this bucket cap.
REFERENCE_BUCKET_CAP_MB = 1024.0


@dataclass


class TrainConfig:
    """Everything a run needs; ``None`` fields take the workload's default (:data:`WORKLOAD_DEFAULTS`)."""

    workload: str = "digits"
    hooks: Tuple[str, ...] = ("powersgd",)
    world_size: int = 2
    matrix_approximation_rank: int = 4  # PowerSGD's r (PyTorch's matrix_approximation_rank), not a process rank
    start_iter: int = 10  # start_powerSGD_iter: plain all-reduce before it
    epochs: Optional[int] = None
    steps: Optional[int] = None  # total steps; overrides epochs
    lr: Optional[float] = None
    batch_size: Optional[int] = None  # per rank
    momentum: Optional[float] = None
    weight_decay: Optional[float] = None
    optimizer: Optional[str] = None  # "sgd" | "adam"
    clip: Optional[float] = None  # gradient-norm clipping (charlm)
    seq_len: int = 64  # charlm window
    seed: int = 0
    device: str = "cpu"
    backend: str = "auto"  # process group backend: gloo | nccl | auto
    kernels: str = "auto"  # our hooks' backend= keyword: auto | triton | torch
    bucket_cap_mb: Optional[float] = None  # DDP bucket cap for our hooks and all-reduce (None: DDP default)
    fsdp: Optional[Tuple[int, int]] = None  # (R, S): HSDP with FSDP2 on R x S ranks instead of DDP (see train.fsdp)
    reference_bucket_cap_mb: float = REFERENCE_BUCKET_CAP_MB
    use_error_feedback: bool = True
    warm_start: bool = True
    # our hooks' PowerSGDState(communication_dtype=): None (the bucket's dtype), "float32", "bfloat16", "float16"
    communication_dtype: Optional[str] = None
    # our hooks' PowerSGDState(verify=): "first" (default), "always", "off"
    verify: str = "first"
    # mixed precision: None, "fp16" (autocast float16 + GradScaler, passed to our hooks' state) or "bf16" (autocast)
    amp: Optional[str] = None
    min_compression_rate: float = 2.0
    progress: bool = True
    timeout: float = 900.0  # whole launch, seconds
    collective_timeout: float = 120.0  # process group timeout, seconds
    port: int = 0
    # debugging: make one rank raise at one step (tests of the failure path)
    fail_rank: Optional[int] = None
    fail_step: int = 0

    def resolved(self) -> "TrainConfig":
        """A copy with the workload defaults filled in (raises ``ValueError`` on a bad field).

        The field checks only; :func:`validate` adds what depends on the machine (torchrun's world, data, devices).
        """
        if self.workload not in WORKLOAD_DEFAULTS:
            raise ValueError(f"unknown workload {self.workload!r}; expected one of {tuple(WORKLOAD_DEFAULTS)}")
        bad = [h for h in self.hooks if h not in HOOKS]
        if bad or not self.hooks:
            raise ValueError(f"unknown hook(s) {bad}; expected some of {HOOKS}")
        values = asdict(self)
        values["hooks"] = tuple(self.hooks)
        length_given = values["epochs"] is not None or values["steps"] is not None
        for key, default in WORKLOAD_DEFAULTS[self.workload].items():
            if key == "steps" and length_given:
                continue  # an explicit --epochs or --steps replaces the workload's default length
            if values.get(key) is None:
                values[key] = default
        cfg = TrainConfig(**values)
        if cfg.world_size < 1:  # before --fsdp R x S replaces it: the option is refused, not silently ignored
            raise ValueError(f"--world-size must be at least 1, got {cfg.world_size}")
        if cfg.fsdp is not None:
            check_fsdp_config(cfg)  # sets world_size = R * S
        if cfg.matrix_approximation_rank < 1:
            raise ValueError("--matrix-approximation-rank must be at least 1, got "
                             f"{cfg.matrix_approximation_rank}")
        warm_only = [v.name for v in VARIANTS if v.warm_start_only and v.name in cfg.hooks]
        if warm_only and not cfg.warm_start:
            raise ValueError(f"--hook {warm_only[0]} needs warm start (its kept factors carry the power iteration): "
                             "drop --no-warm-start")
        if cfg.start_iter < 2 and (cfg.use_error_feedback or cfg.warm_start):
            raise ValueError(
                "--start-iter must be at least 2 with error feedback or warm start (DDP rebuilds its buckets "
                f"after the first step), got {cfg.start_iter}"
            )
        if cfg.epochs is not None and cfg.epochs < 1:
            raise ValueError(f"--epochs must be at least 1, got {cfg.epochs}")
        if cfg.steps is not None and cfg.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {cfg.steps}")
        if cfg.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {cfg.batch_size}")
        if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
            raise ValueError(f"--lr must be a positive number, got {cfg.lr}")
        if cfg.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {cfg.device!r}")
        if cfg.backend == "auto":
            cfg.backend = "nccl" if cfg.device == "cuda" else "gloo"
        if cfg.backend not in ("gloo", "nccl"):
            raise ValueError(f"--backend must be gloo, nccl or auto, got {cfg.backend!r}")
        if cfg.backend == "nccl" and cfg.device != "cuda":
            raise ValueError("--backend nccl needs --device cuda")
        if cfg.kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"--kernels must be auto, triton or torch, got {cfg.kernels!r}")
        if cfg.communication_dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError("--communication-dtype must be bucket, float32, bfloat16 or float16, got "
                             f"{cfg.communication_dtype!r}")
        if cfg.amp not in (None, "fp16", "bf16"):
            raise ValueError(f"--amp must be fp16 or bf16, got {cfg.amp!r}")
        if cfg.optimizer not in ("sgd", "adam"):
            raise ValueError(f"optimizer must be sgd or adam, got {cfg.optimizer!r}")
        if not 0 <= cfg.seed < 2**32:  # numpy's and torch's generators take 32-bit seeds
            raise ValueError(f"--seed must be between 0 and 2**32 - 1, got {cfg.seed}")
        if cfg.fail_rank is not None and not 0 <= cfg.fail_rank < cfg.world_size:
            raise ValueError(f"fail rank {cfg.fail_rank} is not a rank of a world of {cfg.world_size}")
        return cfg

    def to_json(self) -> Dict[str, Any]:
        out = asdict(self)
        out["hooks"] = list(self.hooks)
        out["fsdp"] = None if self.fsdp is None else list(self.fsdp)
        return out


# ------------------------------------------------------------------------------- --fsdp RxS (see train.fsdp)
FSDP_LABELS = {
    **{v.name: f"{v.function} over the replicate group" for v in VARIANTS if v.fsdp},
    "allreduce": "native HSDP (2-D mesh) all-reduce",
}


def parse_mesh(text: str) -> Tuple[int, int]:
    """``"2x2"`` (or ``2×2``) -> ``(R, S)``; ``argparse.ArgumentTypeError`` otherwise."""
    parts = str(text).lower().replace("×", "x").split("x")
    try:
        r, s = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RxS (replicas x shards), e.g. 2x2; got {text!r}") from None
    if r < 2 or s < 1:
        raise argparse.ArgumentTypeError(
            f"--fsdp {text}: needs at least 2 replicas (R) to have a replicate all-reduce to compress, and S >= 1"
        )
    return r, s


def check_fsdp_config(cfg) -> None:
    """Validate the FSDP fields of a resolved :class:`TrainConfig` (``ValueError``) and
    set ``world_size = R * S``."""
    try:
        r, s = (int(v) for v in cfg.fsdp)
    except (TypeError, ValueError):
        raise ValueError(f"fsdp must be (R, S), got {cfg.fsdp!r}") from None
    if r < 2 or s < 1:
        raise ValueError(f"--fsdp {r}x{s}: needs R >= 2 replicas and S >= 1 shards")
    bad = [h for h in cfg.hooks if h not in FSDP_HOOKS]
    if bad:
        raise ValueError(f"--fsdp runs the hooks {', '.join(FSDP_HOOKS)} (allreduce: native HSDP); not {', '.join(bad)}")
    if cfg.bucket_cap_mb is not None:
        raise ValueError("--bucket-cap-mb is a DDP option; with --fsdp each FSDP module is one group")
    cfg.fsdp = (r, s)
    cfg.world_size = r * s
