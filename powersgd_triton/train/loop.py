"""The per-rank training loop of ``powersgd-triton train``: DDP + a communication hook on a real workload.

Entry points:

* :func:`run_training(config) -> dict` starts ``config.world_size`` local ranks (or joins a torchrun job) and
  returns the metrics of every hook in ``config.hooks`` (see :func:`train_one` for the keys).
* :func:`rank_main(rank, world_size, init_method, config)` is what one rank runs: init the process group, train
  each hook in turn from the same seed (same initial weights, same data order), barrier, destroy the group.

Bytes are measured, not computed: while a model trains, ``torch.distributed.all_reduce`` is replaced by a counting
wrapper (:class:`AllReduceCounter`) that adds ``numel * element_size`` of every tensor the hook all-reduces;
PyTorch's hooks and ours call ``dist.all_reduce`` through the module attribute.

Layout: :class:`TrainConfig`, the hook names and the workload defaults live in :mod:`.config`, the counter in
:mod:`.counting`; this module re-exports them.
"""

import gc
import math
import os
import sys
import time
from dataclasses import astuple, replace
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from powersgd_triton import teardown
from powersgd_triton.compat import env as _env
from powersgd_triton.train import data as data_mod
from powersgd_triton.train.config import (  # noqa: F401 - COMPARE_HOOKS, FSDP_HOOKS, WORKLOAD_DEFAULTS re-exported
    COMPARE_HOOKS, FSDP_HOOKS, HOOKS, REFERENCE_BUCKET_CAP_MB, WORKLOAD_DEFAULTS, TrainConfig,
)
from powersgd_triton.train.counting import AllReduceCounter
from powersgd_triton.train.models import build_model
from powersgd_triton.variants import VARIANTS


# ---------------------------------------------------------------------------------------------------------------
# Hooks


def check_available(cfg: "TrainConfig") -> None:
    """Fail early, in the launching process, when the workload's data package is missing
    (:class:`~powersgd_triton.train.data.DataUnavailable`) or the devices do not fit (``ValueError``)."""
    data_mod.check_available(cfg.workload)
    if cfg.device == "cuda":
        from powersgd_triton.train import launch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available on this machine")
        n = torch.cuda.device_count()
        if launch.torchrun_env() is None and cfg.world_size > n:
            raise ValueError(f"--device cuda uses one GPU per rank: --world-size {cfg.world_size} > {n} GPUs")
    training_plan(cfg)  # raises ValueError when a global batch is larger than the training set
    if ("reference" in cfg.hooks and cfg.backend == "gloo" and cfg.fsdp is None
            and cfg.reference_bucket_cap_mb != REFERENCE_BUCKET_CAP_MB):
        data = data_mod.load_workload(cfg.workload, cfg.seed) if cfg.workload == "charlm" else None
        with torch.device("meta"):
            grad_mb = sum(p.numel() * p.element_size() for p in build_model(cfg.workload, data).parameters()) / 2**20
        if cfg.reference_bucket_cap_mb < grad_mb:
            raise ValueError(
                f"--reference-bucket-cap-mb {cfg.reference_bucket_cap_mb:g} splits the model's {grad_mb:.2f} MB of "
                "gradients into several DDP buckets: PyTorch's powerSGD_hook on gloo then issues collectives from "
                "callback threads in a rank-dependent order and hangs; give at least the model's size")


_VALIDATED = "_validated_fields"  # set by validate() on its result (not a dataclass field: to_json leaves it out)


def validate(config: TrainConfig, torchrun: Any = ...) -> TrainConfig:
    """The configuration a run uses, checked: the one place ``powersgd-triton train`` and :func:`run_training` check it.

    In order: under torchrun (``torchrun``: a :class:`~powersgd_triton.train.launch.TorchrunEnv`, ``None`` when not
    under one; by default read from the environment) its world size replaces ``config.world_size``;
    :meth:`TrainConfig.resolved` (workload defaults, field checks, ``--fsdp``); torchrun's world size against the
    ``R x S`` of ``--fsdp``; :func:`check_available` (data package, GPUs, batch against the training set); with
    ``kernels="triton"``, whether Triton can run on the device here. ``config`` is not changed.

    Returns a resolved copy that :func:`run_training` takes as it is (unless a field was changed since). Raises
    ``ValueError`` (messages name the command-line option) or
    :class:`~powersgd_triton.train.data.DataUnavailable`; :class:`~powersgd_triton.train.launch.LaunchError` when
    the torchrun environment is incomplete.
    """
    if torchrun is ...:
        from powersgd_triton.train import launch

        torchrun = launch.torchrun_env()
    if torchrun is not None:
        config = replace(config, world_size=torchrun.world_size)
    cfg = config.resolved()
    if torchrun is not None and cfg.world_size != torchrun.world_size:  # --fsdp R x S sets it
        raise ValueError(f"--fsdp {cfg.fsdp[0]}x{cfg.fsdp[1]} needs {cfg.world_size} ranks; torchrun started "
                         f"{torchrun.world_size}")
    check_available(cfg)
    if cfg.kernels == "triton":
        device = torch.device(cfg.device)
        if not _env.triton_can_run(device):
            reason = _env.triton_unavailable_reason(device)
            raise ValueError(f"--kernels triton cannot run on {cfg.device} here: {reason}")
    cfg.__dict__[_VALIDATED] = astuple(cfg)
    return cfg


def _is_validated(cfg: TrainConfig) -> bool:
    """``cfg`` came from :func:`validate` and no field changed since."""
    return cfg.__dict__.get(_VALIDATED) == astuple(cfg)


def make_hook(name: str, cfg: TrainConfig, grad_scaler=None):
    """``(state, hook)`` for DDP's ``register_comm_hook`` (``hook`` is never ``None``: all-reduce goes through
    PyTorch's Python ``allreduce_hook`` so that its bytes are counted the same way). Our hooks get
    ``cfg.communication_dtype`` and ``grad_scaler`` (``--amp fp16``); PyTorch's hook has neither."""
    if name == "allreduce":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        return None, default_hooks.allreduce_hook
    if name not in HOOKS:
        raise ValueError(f"unknown hook {name!r}; expected one of {HOOKS}")
    from powersgd_triton.benchmarking import make_hook as make_powersgd_hook

    impl = "pytorch" if name == "reference" else name  # make_hook knows our variants by name
    extra = {}
    if impl != "pytorch":
        extra = dict(communication_dtype=cfg.communication_dtype, grad_scaler=grad_scaler, verify=cfg.verify)
    return make_powersgd_hook(impl, cfg.matrix_approximation_rank, backend=cfg.kernels,
                              start_powerSGD_iter=cfg.start_iter, min_compression_rate=cfg.min_compression_rate,
                              use_error_feedback=cfg.use_error_feedback, warm_start=cfg.warm_start,
                              random_seed=cfg.seed, **extra)


HOOK_LABELS = {
    **{v.name: v.function for v in VARIANTS},
    "reference": "torch powerSGD_hook",
    "allreduce": "all-reduce",
}


# ---------------------------------------------------------------------------------------------------------------
# The loop


def _device_for(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: CUDA is not available on this machine")
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise RuntimeError(f"--device cuda: local rank {local_rank} has no GPU (this machine has {n})")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _schedule(steps_total: int, base_lr: float, step: int) -> float:
    """Cosine decay from ``base_lr`` to 0 over the run."""
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * step / max(1, steps_total)))


@torch.no_grad()
def evaluate(model: torch.nn.Module, cfg: TrainConfig, data, device: torch.device) -> Dict[str, float]:
    """Test loss (nats) and accuracy of ``model`` on the whole test set; for charlm also bits per character."""
    was_training = model.training
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    if cfg.workload == "charlm":
        for x, y in data_mod.text_eval_batches(data.test, cfg.seq_len, 64):
            x, y = x.to(device), y.to(device)
            logits = model(x)
            total_loss += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
            correct += (logits.argmax(-1) == y).sum().item()
            count += y.numel()
    else:
        for i in range(0, len(data.x_test), 512):
            x, y = data.x_test[i : i + 512].to(device), data.y_test[i : i + 512].to(device)
            logits = model(x)
            total_loss += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(-1) == y).sum().item()
            count += y.numel()
    model.train(was_training)
    out = {"loss": total_loss / count, "accuracy": correct / count}
    if cfg.workload == "charlm":
        out["bits_per_char"] = out["loss"] / math.log(2.0)
    return out


def training_plan(cfg: TrainConfig, data=None) -> Tuple[int, int, int]:
    """(training items, steps per epoch, total steps) of ``cfg``; without ``data`` from the known data set sizes.

    Raises ValueError when one global batch (``batch_size`` x world size) is larger than the training set."""
    if data is None:
        n_items = data_mod.num_train_items(cfg.workload, cfg.seq_len)
    elif cfg.workload == "charlm":
        n_items = data_mod.text_window_starts(len(data.train) - cfg.seq_len, cfg.seq_len)
    else:
        n_items = len(data.x_train)
    per_epoch = data_mod.steps_per_epoch(n_items, cfg.batch_size, cfg.world_size)
    if per_epoch < 1:
        raise ValueError(
            f"--batch-size {cfg.batch_size} × world size {cfg.world_size} is larger than the {n_items} training "
            f"items of {cfg.workload}"
        )
    total = cfg.steps if cfg.steps is not None else per_epoch * cfg.epochs
    return n_items, per_epoch, total


def rank_batch(cfg: TrainConfig, data, perm, step_in_epoch, epoch, rank, device):
    """This rank's ``(x, y)`` of step ``step_in_epoch`` of ``epoch``: the ``rank``-th consecutive ``batch_size``
    slice of the global batch taken from the epoch's permutation ``perm`` (int64 [items]); for charlm, ``seq_len``
    windows at an epoch-dependent phase (x, y int64 [batch, seq_len]); else the data set's rows (float32 features,
    int64 labels). On ``device``."""
    idx = data_mod.rank_batch_indices(perm, step_in_epoch, cfg.batch_size, rank, cfg.world_size)
    if cfg.workload == "charlm":
        offset = int(epoch * 7919 + cfg.seed) % cfg.seq_len  # a different window phase each epoch
        x, y = data_mod.text_batch(data.train, idx, cfg.seq_len, offset)
    else:
        x, y = data.x_train[idx], data.y_train[idx]
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def batch_loss(cfg: TrainConfig, model, x, y):
    """Mean cross-entropy of ``model(x)`` against ``y`` (per character for charlm), a float32 scalar tensor."""
    logits = model(x)
    if cfg.workload == "charlm":
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return F.cross_entropy(logits, y)


def _bucket_sizes(ddp) -> List[int]:
    try:
        info = ddp._get_ddp_logging_data()
        raw = info.get("rebuilt_bucket_sizes") if info.get("has_rebuilt_buckets") else info.get("bucket_sizes")
        return [int(s) for s in str(raw).split(",") if s.strip()]
    except Exception:  # pragma: no cover - private API
        return []


def ddp_bucket_cap_mb(hook_name: str, cfg: TrainConfig) -> Optional[float]:
    """The DDP ``bucket_cap_mb`` of ``hook_name``'s run (None: DDP's default). PyTorch's hook takes
    ``--reference-bucket-cap-mb`` (one bucket: it needs one on gloo); beside it, every other row takes the same, so that
    the rows of a comparison run on the same buckets, unless ``--bucket-cap-mb`` sets ours; alone, ``--bucket-cap-mb``
    or DDP's default."""
    if hook_name == "reference":
        return cfg.reference_bucket_cap_mb
    if cfg.bucket_cap_mb is not None:
        return cfg.bucket_cap_mb
    return cfg.reference_bucket_cap_mb if "reference" in cfg.hooks else None


def train_one(hook_name: str, cfg: TrainConfig, data, rank: int, device: torch.device, log) -> Dict[str, Any]:
    """Train a fresh model (seeded) under ``hook_name``; returns this rank's metrics (losses are local)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.workload, data).to(device)
    # --amp: autocast in the bucket's forward; fp16 also scales the loss (GradScaler), bf16 does not need to
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.amp or "")
    scaler = torch.amp.GradScaler(device.type) if cfg.amp == "fp16" else None
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    ddp_kwargs: Dict[str, Any] = {}
    counted_ranks = None  # every all-reduce counts (DDP)
    evaluates = rank == 0  # the ranks that run the evaluation forward (rank 0 records it)
    if cfg.fsdp is not None:
        from powersgd_triton.train.fsdp import wrap_model

        fsdp_run = wrap_model(hook_name, cfg, model, rank)
        ddp = model
        state, hook = fsdp_run.state, fsdp_run.hook
        gradient_bytes = fsdp_run.shard_bytes
        counted_ranks = fsdp_run.replicate_ranks
        evaluates = fsdp_run.evaluates
    else:
        cap = ddp_bucket_cap_mb(hook_name, cfg)
        if cap is not None:
            ddp_kwargs["bucket_cap_mb"] = cap
        if device.type == "cuda":
            ddp_kwargs["device_ids"] = [device.index]
        ddp = DDP(model, **ddp_kwargs)
        state, hook = make_hook(hook_name, cfg, grad_scaler=scaler)
        ddp.register_comm_hook(state, hook)
    inner = model  # the module that evaluates (the DDP wrapper's module; the FSDP root itself)

    if cfg.optimizer == "adam":
        opt = torch.optim.Adam(ddp.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)

    n_items, per_epoch, total_steps = training_plan(cfg, data)
    n_epochs = math.ceil(total_steps / per_epoch)
    losses: List[float] = []
    step_bytes: List[int] = []
    step_calls: List[int] = []
    step_seconds: List[float] = []
    test_acc: List[float] = []
    test_loss: List[float] = []
    test_bpc: List[float] = []
    step = 0
    counter = AllReduceCounter(counted_ranks).install()
    t_run = time.perf_counter()
    try:
        for epoch in range(n_epochs):
            perm = data_mod.epoch_permutation(n_items, cfg.seed, epoch)
            steps_here = min(per_epoch, total_steps - step)
            bar = log.bar(total=steps_here, desc=f"{hook_name} epoch {epoch + 1}/{n_epochs}")
            ddp.train()
            epoch_loss = 0.0
            for i in range(steps_here):
                if cfg.fail_rank == rank and step == cfg.fail_step:
                    raise RuntimeError(f"injected failure on rank {rank} at step {step} (--debug-fail-rank)")
                for group in opt.param_groups:
                    group["lr"] = _schedule(total_steps, cfg.lr, step)
                x, y = rank_batch(cfg, data, perm, i, epoch, rank, device)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                if amp_dtype is not None:
                    with torch.autocast(device.type, dtype=amp_dtype):
                        loss = batch_loss(cfg, ddp, x, y)
                else:
                    loss = batch_loss(cfg, ddp, x, y)
                if scaler is not None:
                    scaler.scale(loss).backward()
                    if cfg.clip:
                        scaler.unscale_(opt)
                        torch.nn.utils.clip_grad_norm_(ddp.parameters(), cfg.clip)
                    scaler.step(opt)  # skipped when a gradient is not finite (then the scale is halved)
                    scaler.update()
                else:
                    loss.backward()
                    if cfg.clip:
                        torch.nn.utils.clip_grad_norm_(ddp.parameters(), cfg.clip)
                    opt.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                step_seconds.append(time.perf_counter() - t0)
                b, c = counter.take()
                step_bytes.append(b)
                step_calls.append(c)
                lv = loss.item()
                if not math.isfinite(lv):
                    raise FloatingPointError(f"loss became {lv} at step {step} under hook {hook_name}")
                losses.append(lv)
                epoch_loss += lv
                step += 1
                bar.update(1)
                if i % 10 == 0:
                    bar.set_postfix(loss=f"{lv:.3f}")
            bar.close()
            # every rank holds the same weights; rank 0 evaluates (others go on to the next all-reduce and wait;
            # with FSDP rank 0's shard group runs the forward with it)
            if evaluates and rank != 0:
                evaluate(inner, cfg, data, device)
            if rank == 0:
                ev = evaluate(inner, cfg, data, device)
                test_acc.append(ev["accuracy"])
                test_loss.append(ev["loss"])
                if "bits_per_char" in ev:
                    test_bpc.append(ev["bits_per_char"])
                extra = f"  test bpc {ev['bits_per_char']:.3f}" if "bits_per_char" in ev else ""
                compressed = [bb for s, bb in enumerate(step_bytes) if s >= cfg.start_iter]
                sent = (f"{sum(compressed) / len(compressed) / 1024:.1f} KiB all-reduced/compressed step" if compressed
                        else f"no compressed step yet (compression from step {cfg.start_iter})")
                log.line(
                    f"[{hook_name}] epoch {epoch + 1}/{n_epochs}  steps {step}  "
                    f"train loss {epoch_loss / max(1, steps_here):.4f}  test loss {ev['loss']:.4f}  "
                    f"test acc {ev['accuracy']:.4f}{extra}  "
                    f"{1000 * sum(step_seconds[-steps_here:]) / max(1, steps_here):.1f} ms/step  "
                    f"{sent}"
                )
    finally:
        counter.uninstall()
    seconds_total = time.perf_counter() - t_run

    compressed_idx = [s for s in range(len(step_bytes)) if s >= cfg.start_iter]
    if not compressed_idx:  # too short a run to reach compression: report over all steps
        compressed_idx = list(range(len(step_bytes)))
    warm_idx = [s for s in range(len(step_bytes)) if s < cfg.start_iter]

    def mean(values, idx):
        return float(sum(values[s] for s in idx) / len(idx)) if idx else 0.0

    compression_rate = 1.0
    numel_before = numel_after = None
    if state is not None and hasattr(state, "compression_stats"):
        rate, numel_before, numel_after = state.compression_stats()
        compression_rate = float(rate) if numel_after else 1.0

    # which numeric backend our hooks actually ran ("triton" or "torch"), per bucket
    kernel_backends = sorted(
        {str(m.backend) for m in getattr(state, "buckets", {}).values() if getattr(m, "backend", None)}
    )
    out: Dict[str, Any] = {
        "hook": hook_name,
        "kernel_backend": ",".join(kernel_backends) or None,
        "hook_function": f"{getattr(hook, '__module__', '')}.{getattr(hook, '__qualname__', '')}",
        "final_test_accuracy": test_acc[-1] if test_acc else None,
        "final_test_loss": test_loss[-1] if test_loss else None,
        "test_accuracy": test_acc,
        "test_loss": test_loss,
        "loss": losses,
        "steps": step,
        "epochs": n_epochs,
        "steps_per_epoch": per_epoch,
        "start_iter": cfg.start_iter,
        "compressed_steps": sum(1 for s in range(step) if s >= cfg.start_iter),
        "seconds_per_step": mean(step_seconds, compressed_idx),
        "seconds_total": seconds_total,
        "allreduce_bytes_per_step": mean(step_bytes, compressed_idx),
        "allreduce_calls_per_step": mean(step_calls, compressed_idx),
        "allreduce_bytes_per_warmup_step": mean(step_bytes, warm_idx),
        "allreduce_calls_per_warmup_step": mean(step_calls, warm_idx),
        "allreduce_bytes": step_bytes,
        "gradient_bytes": gradient_bytes,
        "compression_rate": compression_rate,
        "numel_before_compression": numel_before,
        "numel_after_compression": numel_after,
        "ddp_bucket_sizes": _bucket_sizes(ddp) if cfg.fsdp is None else None,
        "bucket_cap_mb": ddp_kwargs.get("bucket_cap_mb"),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if out["allreduce_bytes_per_step"]:
        out["measured_compression"] = gradient_bytes / out["allreduce_bytes_per_step"]
    if cfg.workload == "charlm":
        out["test_bits_per_char"] = test_bpc
        out["final_test_bits_per_char"] = test_bpc[-1] if test_bpc else None
    if cfg.fsdp is not None:
        out.update(fsdp_run.metrics())
    del ddp, opt
    return out


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _Log:
    """Rank 0 prints a tqdm bar per epoch (when stderr is a terminal: none in a log file) and one line per epoch; other
    ranks are quiet."""

    def __init__(self, enabled: bool, progress: bool):
        self.enabled = enabled
        # without tqdm, or stderr redirected to a file or pipe: plain lines only
        self.progress = enabled and progress and _env.has_progress_bar() and _isatty(sys.stderr)

    def bar(self, total: int, desc: str):
        tqdm = _env.progress_bar(auto=True)
        return tqdm(total=total, desc=desc, leave=False, disable=not self.progress, file=sys.stderr,
                    dynamic_ncols=True, mininterval=0.5)

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self.progress:
            _env.progress_bar(auto=True).write(text, file=sys.stdout)
        else:
            print(text, flush=True)


def rank_main(rank: int, world_size: int, init_method: Optional[str], cfg: TrainConfig, local_rank: Optional[int] = None):
    """One rank: init the process group, train every hook of ``cfg.hooks``, return rank 0's ``{hook: metrics}``.

    ``init_method=None`` means ``env://`` (torchrun). The per-step losses returned are averaged over the ranks.
    """
    torch.set_num_threads(1)
    if rank != 0:  # only rank 0 talks; the others log errors only
        import logging
        import warnings

        logging.getLogger().setLevel(logging.ERROR)
        warnings.simplefilter("ignore")
    device = _device_for(cfg, rank if local_rank is None else local_rank)
    timeout = timedelta(seconds=cfg.collective_timeout)
    if init_method is None:
        dist.init_process_group(cfg.backend, timeout=timeout)
    else:
        dist.init_process_group(cfg.backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timeout)
    log = _Log(enabled=(rank == 0), progress=cfg.progress)
    results: Dict[str, Dict[str, Any]] = {}
    try:
        data = data_mod.load_workload(cfg.workload, cfg.seed)
        for hook_name in cfg.hooks:
            metrics = train_one(hook_name, cfg, data, rank, device, log)
            # average the per-step losses over ranks (outside the counted region)
            losses = torch.tensor(metrics["loss"], dtype=torch.float64, device=device)
            dist.all_reduce(losses)
            metrics["loss"] = (losses / world_size).tolist()
            results[hook_name] = metrics
        dist.barrier()
    finally:
        if dist.is_initialized():
            # DDP's reducer (freed by train_one, but in reference cycles) holds the process group and its last
            # work objects: collect it while the interpreter is alive, else gloo's threads can abort the rank at
            # exit ("terminate called without an active exception", pytorch/pytorch#190489; as
            # examples/torchrun_ddp.py)
            gc.collect()
            teardown.destroy_process_group()  # not torch's: see powersgd_triton.teardown
    return results if rank == 0 else None


def run_training(config: TrainConfig) -> Dict[str, Any]:
    """Train every hook of ``config.hooks`` on ``config.world_size`` local ranks (or in this torchrun rank).

    On CPU the ranks this starts get :data:`~powersgd_triton.train.launch.CPU_NUMERICS_ENV` (the math libraries
    capped at AVX2, MKL's compatible path; a variable already set in the environment wins), so a seed gives the same
    digits on every x86-64 machine; under torchrun this process is the rank and runs in its environment as it is
    (``powersgd-triton train`` sets them there before the libraries first run).

    Returns ``{"runs": {hook: metrics}, "config": {...}}`` on rank 0 (and ``None`` on other torchrun ranks).
    ``config`` is checked by :func:`validate` (once: a configuration :func:`validate` returned is used as it is).
    Raises :class:`~powersgd_triton.train.launch.LaunchError` subclasses when a rank fails or times out, and
    ``ValueError`` for a bad configuration.
    """
    from powersgd_triton.train import launch

    env = launch.torchrun_env()
    cfg = config if _is_validated(config) else validate(config, env)
    if env is not None:
        runs = rank_main(env.rank, env.world_size, None, cfg, local_rank=env.local_rank)
        if env.rank != 0:
            return None
    else:
        # CUDA needs a fresh interpreter per rank; on CPU the fork server (not a fork of the caller, which may have
        # threads: a Jupyter kernel, a test runner)
        method = "spawn" if cfg.device == "cuda" else "forkserver"
        pins = launch.cpu_numerics_env() if cfg.device == "cpu" else {}
        runs = launch.launch(rank_main, cfg.world_size, (cfg,), port=cfg.port, timeout=cfg.timeout,
                             start_method=method, env=pins)
    return {"runs": runs, "config": _config_json(cfg, pinned=env is None)}


def _config_json(cfg: TrainConfig, pinned: bool = False) -> Dict[str, Any]:
    import platform

    out = cfg.to_json()
    out.update(
        torch_version=torch.__version__,
        python_version=platform.python_version(),
        num_threads_per_rank=1,
        hook_labels={h: HOOK_LABELS[h] for h in cfg.hooks},
    )
    if cfg.device == "cpu":  # what the ranks' CPU math libraries ran with: pinned, the user's own, or unset (None)
        from powersgd_triton.train.launch import CPU_NUMERICS_ENV

        out["cpu_numerics_env"] = {k: os.environ.get(k, v if pinned else None) for k, v in CPU_NUMERICS_ENV.items()}
    try:
        from importlib.metadata import version

        out["triton_version"] = version("triton")
    except Exception:
        out["triton_version"] = None
    return out
