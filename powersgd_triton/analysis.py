"""Approximation quality of the PowerSGD hooks on real gradients (what ``notebooks/02_accuracy_vs_reference``
plots).

:func:`approximation_errors` starts ``world_size`` gloo ranks with the train command's launcher. Every rank builds
the train command's model for a workload (``digits``: the small convnet, ``charlm``: the character LSTM; see
:mod:`powersgd_triton.train.models`), computes its *local* gradient on its own share of each global batch (the
train command's batching), and hands that gradient, in a one-bucket stand-in for DDP's ``GradBucket``
(:class:`powersgd_triton.benchmarking.FakeGradBucket`), to

* ``"ours"``: :func:`powersgd_triton.powerSGD_hook`,
* ``"reference"``: PyTorch's ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook``,
* ``"ours_cold"``: ours with ``warm_start=False`` (a fresh random Q at every step),
* each of our layer-wise variants that PyTorch does not have, by its name in
  :data:`powersgd_triton.variants.VARIANTS` (not in the default ``impls``),

one state per (hook, approximation rank r), all created with the same arguments and seed. The hooks really
all-reduce between the ranks. For every compressed layer and step it records the relative error

    ‖M − P·Qᵀ‖_F / ‖M‖_F,   M = the average of the ranks' gradients of that layer (what all-reduce returns),

and the smallest error any rank-r matrix can reach (Eckart–Young: the truncated SVD of M,
``sqrt(sum_{i >= r} σ_i²) / ‖M‖``), under ``"svd"``.

Error feedback is off (``use_error_feedback=False``), so every hook approximates M itself rather than M plus its
own memory; warm start is on except for ``ours_cold``. Two modes:

* ``"fixed"``: the same batch at every step, so M does not change; with warm start each step is one more power
  iteration on M and the error falls towards the SVD optimum;
* ``"trajectory"``: a new batch every step and the weights move with plain SGD on M (the all-reduce average, so
  every hook sees the same gradients), as in training; warm start tracks a subspace that changes from step to step.
  The SGD learning rate is :data:`TRAJECTORY_LR` of the workload unless given (no momentum; 1.0 for the LSTM, as
  the paper's plain-SGD LSTM runs).

The first ``start_powerSGD_iter = 2`` hook calls (plain all-reduce, required with warm start) happen on the first
gradient and are not recorded.

Also :func:`results_sections` / :func:`gpu_results`: the dated sections and markdown tables of a benchmark results
file (``bench/RESULTS.md``), which ``notebooks/03_speed_vs_reference`` shows for GPUs.
"""

import math
import re
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from powersgd_triton import teardown
from powersgd_triton.layout import should_compress
from powersgd_triton.variants import VARIANTS

_OTHERS = tuple(v for v in VARIANTS if v.pytorch_twin is None and not v.batched)
DEFAULT_IMPLS = ("ours", "reference", "ours_cold")
IMPLS = DEFAULT_IMPLS + tuple(v.name for v in _OTHERS)
IMPL_LABELS = {
    "ours": "powersgd_triton.powerSGD_hook",
    "reference": "torch powerSGD_hook",
    "ours_cold": "powersgd_triton, no warm start",
    **{v.name: v.function for v in _OTHERS},
    "svd": "best rank-r (SVD)",
}
MODES = ("fixed", "trajectory")
TRAJECTORY_LR = {"digits": 0.1, "mnist5k": 0.1, "charlm": 1.0}  # plain SGD, no momentum
START_ITER = 2


@dataclass
class ApproximationConfig:
    """What :func:`approximation_errors` runs; ``None`` fields take the train command's workload defaults."""

    workload: str = "digits"  # "digits" | "charlm" (also "mnist5k")
    mode: str = "fixed"  # "fixed" | "trajectory"
    ranks: Tuple[int, ...] = (1, 2, 4)  # matrix approximation ranks r
    impls: Tuple[str, ...] = DEFAULT_IMPLS
    steps: int = 10  # recorded (compressed) steps
    world_size: int = 2
    batch_size: Optional[int] = None  # per rank
    lr: Optional[float] = None  # trajectory mode: plain SGD (default TRAJECTORY_LR[workload])
    seed: int = 0
    kernels: str = "auto"  # our hooks' backend=
    device: str = "cpu"
    min_compression_rate: float = 2.0
    timeout: float = 300.0

    def check(self) -> None:
        from powersgd_triton.train.data import WORKLOADS

        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; expected one of {WORKLOADS}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {MODES}")
        bad = [i for i in self.impls if i not in IMPLS]
        if bad or not self.impls:
            raise ValueError(f"unknown impl(s) {bad}; expected some of {IMPLS}")
        if not self.ranks or min(self.ranks) < 1:
            raise ValueError(f"ranks must be >= 1, got {self.ranks}")
        if self.steps < 1 or self.world_size < 1:
            raise ValueError("steps and world_size must be at least 1")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")


def svd_optimum(matrix: torch.Tensor, rank: int) -> float:
    """Smallest ‖M − X‖_F / ‖M‖_F over matrices X of rank <= ``rank`` (Eckart–Young), M viewed as (shape[0], -1).

    ``nan`` for an all-zero M.
    """
    return svd_optima(matrix, (rank,))[rank]


def svd_optima(matrix: torch.Tensor, ranks: Sequence[int]) -> Dict[int, float]:
    """:func:`svd_optimum` for several ranks from one SVD of ``matrix``."""
    m = matrix.detach().reshape(matrix.shape[0], -1).double().cpu()
    s = torch.linalg.svdvals(m)
    total = float((s * s).sum())
    if total == 0.0:
        return {r: float("nan") for r in ranks}
    return {r: math.sqrt(max(0.0, float((s[r:] ** 2).sum())) / total) for r in ranks}


def relative_error(target: torch.Tensor, approx: torch.Tensor) -> float:
    """‖target − approx‖_F / ‖target‖_F in float64 (``nan`` for an all-zero target)."""
    t = target.detach().double()
    norm = float(t.norm())
    if norm == 0.0:
        return float("nan")
    return float((t - approx.detach().double()).norm()) / norm


def compressed_layers(shapes: Dict[str, Tuple[int, ...]], rank: int, min_compression_rate: float = 2.0) -> List[str]:
    """Names of the layers the layer-wise hook compresses at ``rank`` (PyTorch's test, see
    :func:`powersgd_triton.layout.should_compress`); the others are all-reduced exactly."""
    out = []
    for name, s in shapes.items():
        if len(s) < 2:
            continue
        n = s[0]
        m = math.prod(s) // n
        if should_compress(n, m, min(n, m, rank), min_compression_rate)[0]:
            out.append(name)
    return out


def _make_state(impl: str, rank: int, cfg: ApproximationConfig):
    from powersgd_triton.benchmarking import make_hook

    kind = {"reference": "pytorch", "ours_cold": "ours"}.get(impl, impl)
    return make_hook(kind, rank, backend=cfg.kernels, start_powerSGD_iter=START_ITER,
                     min_compression_rate=cfg.min_compression_rate, use_error_feedback=False,
                     warm_start=impl != "ours_cold", random_seed=cfg.seed)


def _rank_main(rank: int, world_size: int, init_method: str, cfg: ApproximationConfig) -> Optional[Dict[str, Any]]:
    from powersgd_triton.benchmarking import FakeGradBucket
    from powersgd_triton.train import data as data_mod
    from powersgd_triton.train.loop import TrainConfig, batch_loss, rank_batch, training_plan
    from powersgd_triton.train.models import build_model

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=cfg.timeout))
    try:
        tcfg = TrainConfig(workload=cfg.workload, world_size=world_size, seed=cfg.seed, batch_size=cfg.batch_size,
                           device=cfg.device, progress=False).resolved()
        lr = cfg.lr if cfg.lr is not None else TRAJECTORY_LR[cfg.workload]
        data = data_mod.load_workload(cfg.workload, cfg.seed)
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.workload, data).to(device)
        # DDP's bucket order: parameters in reverse order
        params = [(name, p) for name, p in model.named_parameters() if p.requires_grad][::-1]
        shapes = {name: tuple(p.shape) for name, p in params}
        numels = [p.numel() for _, p in params]
        offsets = [0]
        for n in numels:
            offsets.append(offsets[-1] + n)
        runners = {}
        for impl in cfg.impls:
            for r in cfg.ranks:
                state, hook = _make_state(impl, r, cfg)
                buf = torch.empty(offsets[-1], device=device)
                runners[(impl, r)] = (state, hook, FakeGradBucket(buf, list(shapes.values())))
        layers = {r: compressed_layers(shapes, r, cfg.min_compression_rate) for r in cfg.ranks}
        index = {name: i for i, (name, _) in enumerate(params)}

        n_items, per_epoch, _ = training_plan(tcfg, data)
        records: List[Dict[str, Any]] = []
        total = START_ITER + cfg.steps
        for t in range(total):
            step = 0 if cfg.mode == "fixed" else max(0, t - START_ITER)
            epoch, i = divmod(step, per_epoch)
            perm = data_mod.epoch_permutation(n_items, cfg.seed, epoch)
            x, y = rank_batch(tcfg, data, perm, i, epoch, rank, device)
            model.zero_grad(set_to_none=False)
            batch_loss(tcfg, model, x, y).backward()
            local = torch.cat([p.grad.reshape(-1) for _, p in params])
            mean = local.clone()
            dist.all_reduce(mean)
            mean /= world_size
            recorded = t >= START_ITER
            for (impl, r), (state, hook, bucket) in runners.items():
                bucket.buffer().copy_(local)
                out = hook(state, bucket).wait()
                if not recorded or rank != 0:
                    continue
                for name in layers[r]:
                    k = index[name]
                    sl = slice(offsets[k], offsets[k + 1])
                    records.append(dict(step=t - START_ITER + 1, layer=name, rank=r, impl=impl,
                                        error=relative_error(mean[sl], out[sl])))
            if recorded and rank == 0:
                for name in dict.fromkeys(name for r in cfg.ranks for name in layers[r]):
                    k = index[name]
                    ranks_here = [r for r in cfg.ranks if name in layers[r]]
                    best = svd_optima(mean[offsets[k] : offsets[k + 1]].view(shapes[name]), ranks_here)
                    for r in ranks_here:
                        records.append(dict(step=t - START_ITER + 1, layer=name, rank=r, impl="svd", error=best[r]))
            if cfg.mode == "trajectory" and recorded:
                with torch.no_grad():
                    for k, (_, p) in enumerate(params):
                        p.add_(mean[offsets[k] : offsets[k + 1]].view_as(p), alpha=-lr)
        compression = {}
        for (impl, r), (state, _, _) in runners.items():
            rate, before, after = state.compression_stats()
            compression[f"{impl}/r{r}"] = float(rate)
        backends = sorted({str(m.backend) for (impl, _), (s, _, _) in runners.items() if impl != "reference"
                           for m in getattr(s, "buckets", {}).values()})
        dist.barrier()
        if rank != 0:
            return None
        return {
            "config": asdict(cfg),
            "layers": {name: list(s) for name, s in shapes.items()},
            "matrix_shapes": {name: [s[0], math.prod(s) // s[0]] for name, s in shapes.items() if len(s) >= 2},
            "compressed_layers": {r: layers[r] for r in cfg.ranks},
            "records": records,
            "compression_rate": compression,
            "kernel_backend": ",".join(backends) or None,
            "lr": lr if cfg.mode == "trajectory" else None,
            "batch_size": tcfg.batch_size,
        }
    finally:
        teardown.destroy_process_group()  # torch's, safe against gloo's worker threads (powersgd_triton.teardown)


def approximation_errors(config: Optional[ApproximationConfig] = None, **overrides) -> Dict[str, Any]:
    """Run the hooks on real gradients over ``world_size`` local gloo ranks; returns rank 0's results.

    Keys: ``records`` (a list of ``{step, layer, rank, impl, error}``, ``impl`` one of ``config.impls`` or
    ``"svd"``; steps count from 1), ``layers`` (parameter shapes), ``matrix_shapes`` (as the hook views them),
    ``compressed_layers`` (per r), ``compression_rate`` (``state.compression_stats()[0]`` per ``impl/r``),
    ``kernel_backend`` (what our hooks ran: ``"triton"`` or ``"torch"``), ``config``.
    Raises ``ValueError`` for a bad config and :class:`~powersgd_triton.train.launch.LaunchError` when a rank fails.
    """
    from powersgd_triton.train import launch

    cfg = ApproximationConfig(**{**asdict(config or ApproximationConfig()), **overrides})
    cfg.ranks = tuple(cfg.ranks)
    cfg.impls = tuple(cfg.impls)
    cfg.check()
    method = "spawn" if cfg.device == "cuda" else "forkserver"  # see train.loop.run_training
    return launch.launch(_rank_main, cfg.world_size, (cfg,), timeout=cfg.timeout, start_method=method)


def select(records: Sequence[Dict[str, Any]], **where) -> List[Dict[str, Any]]:
    """The records whose fields equal ``where`` (e.g. ``select(recs, impl="ours", rank=2)``), in order."""
    return [rec for rec in records if all(rec.get(k) == v for k, v in where.items())]


def series(records: Sequence[Dict[str, Any]], **where) -> Tuple[List[int], List[float]]:
    """``(steps, errors)`` of the records matching ``where`` (one layer, one impl, one rank), sorted by step."""
    rows = sorted(select(records, **where), key=lambda rec: rec["step"])
    return [rec["step"] for rec in rows], [rec["error"] for rec in rows]


# ---------------------------------------------------------------------------------------------------------------
# Measured tables of bench/RESULTS.md (notebooks/03 shows the GPU ones)

_GPU_WORDS = re.compile(r"\b(gpu|cuda|h100|h200|a100|l40s?|rtx|sm_?\d\d)\b", re.IGNORECASE)
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _table(lines: List[str]) -> Optional[Dict[str, Any]]:
    def cells(line: str) -> List[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]

    if len(lines) < 2 or not set(lines[1].replace("|", "").strip()) <= set("-: "):
        return None
    columns = cells(lines[0])
    rows = [dict(zip(columns, cells(line))) for line in lines[2:]]
    return {"columns": columns, "rows": rows}


def results_sections(text: str) -> List[Dict[str, Any]]:
    """The ``## `` sections of a benchmark results file (``bench/RESULTS.md``) with their markdown tables.

    Each section: ``heading``, ``date`` (the first ``YYYY-MM-DD`` of the heading, else of the body, else None),
    ``machine`` (the text after ``Machine:`` on the first line that starts with it, else None), ``gpu`` (the heading
    names a GPU: GPU, CUDA, H100, H200, A100, ...), and ``tables``: ``{"title": the closest ``###`` heading above (or
    the section heading), "columns": [...], "rows": [{column: cell}]}``.
    """
    sections: List[Dict[str, Any]] = []
    current: Optional[Dict[str, Any]] = None
    subtitle = ""
    block: List[str] = []

    def flush_table():
        nonlocal block
        if current is not None and block:
            t = _table(block)
            if t is not None:
                t["title"] = subtitle or current["heading"]
                current["tables"].append(t)
        block = []

    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("|"):
            block.append(stripped)
            continue
        flush_table()
        if line.startswith("## "):
            heading = line[3:].strip()
            current = {"heading": heading, "date": None, "machine": None, "gpu": bool(_GPU_WORDS.search(heading)),
                       "tables": [], "_body": []}
            sections.append(current)
            subtitle = ""
        elif line.startswith("### ") and current is not None:
            subtitle = line[4:].strip()
        elif current is not None:
            current["_body"].append(line)
            if current["machine"] is None and stripped.startswith("Machine:"):
                current["machine"] = stripped[len("Machine:"):].strip()
    flush_table()
    for s in sections:
        body = "\n".join(s.pop("_body"))
        m = _DATE.search(s["heading"]) or _DATE.search(body)
        s["date"] = m.group(0) if m else None
    return sections


def gpu_results(path: str) -> List[Dict[str, Any]]:
    """The GPU sections (with at least one table) of the results file at ``path``; ``[]`` if it does not exist."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return []
    return [s for s in results_sections(text) if s["gpu"] and s["tables"]]
