"""Sections ``hooks`` and ``hooks-extra``: the whole hook step, PyTorch's ``powerSGD_hook`` against ours."""

import time

import torch

from powersgd_triton import benchmarking as B
from powersgd_triton import teardown

from .common import (BUCKET_MB, CAP, DEVICE, DRY, FIRST_BUCKET_MB, MAX_HOOK_BUCKETS, QUICK, RANK, RESERVE, RESULTS,
                     ROTATE, SHRINK, generator, item_error, left, log, maybe_save, sync, timed)
from .model import predicted, prediction_key

# =============================================================================================== 5. hooks
def _pg_backend():
    if "pg" in RESULTS:
        return RESULTS["pg"]
    import torch.distributed as dist

    backend = "gloo"
    if DEVICE.type == "cuda" and dist.is_nccl_available():
        try:
            B.ensure_process_group("nccl")
            x = torch.ones(4, device=DEVICE)
            dist.all_reduce(x)
            torch.cuda.synchronize()
            backend = "nccl"
        except Exception as exc:
            log(f"  nccl world of 1 failed ({type(exc).__name__}: {exc}); using gloo")
            teardown.destroy_process_group()
    if not dist.is_initialized():
        B.ensure_process_group("gloo")
    RESULTS["pg"] = backend
    return backend


def _hook_counts(row, step, hook_step):
    counts = B.count_step(step, hook_step=hook_step)
    d = counts.as_dict()
    row.update(aten_compute=counts.aten_compute, aten_total=counts.aten_total,
               allreduce_calls=counts.allreduce_calls, allreduce_bytes=counts.allreduce_bytes,
               allreduce_per_bucket=d["allreduce_per_bucket"], triton_launches=counts.triton_launches,
               top_ops=d["top_ops"])


def _device_kernels(row, step):
    """Device kernels of one step from torch.profiler (NCCL's all-reduce kernels included, for both hooks)."""
    if DEVICE.type != "cuda":
        row["kernels_per_step"] = None
        return
    row["device"] = B.count_cuda_kernels(step)
    row["kernels_per_step"] = row["device"]["kernels"]


def _hook_memory(row, step, hook_step):
    held = step.memory()
    row["held_per_bucket"] = {str(k): v for k, v in held.items()}
    row["held_bytes"] = sum(held.values())
    with B.synchronous_collectives(hook_step):
        row["peak_extra_bytes"] = B.peak_extra_bytes(step, DEVICE)


def _hook_buckets(model, dtype, gen):
    buckets = B.model_buckets(model, dtype, DEVICE, bucket_cap_mb=BUCKET_MB, first_bucket_mb=FIRST_BUCKET_MB,
                              shrink=SHRINK, generator=gen)
    if MAX_HOOK_BUCKETS is not None and len(buckets) > MAX_HOOK_BUCKETS:
        # the last one kept is the step's last (the hooks advance their step count there)
        buckets = [B.FakeGradBucket(b.buffer(), b.shapes, index=i, num_buckets=MAX_HOOK_BUCKETS)
                   for i, b in enumerate(buckets[:MAX_HOOK_BUCKETS])]
    return buckets


def _ahead_check(row, model, rank, dtype):
    """Bitwise: the next step's Q orthogonalized ahead on the side stream (the default) gives the outputs of
    orthogonalizing it at the start of each step (``_step.OPTIONS.orthogonalize_ahead = False``), over 4 compressed steps
    of the same buckets."""
    from powersgd_triton.hooks import driver as _step

    outs = []
    for ahead in (True, False):
        _step.OPTIONS.orthogonalize_ahead = ahead
        try:
            buckets = _hook_buckets(model, dtype, generator(1234))
            s = B.HookStep("ours", buckets, rank, backend="triton").warmup(1)
            for _ in range(3):
                s()
            sync()
            outs.append([b.buffer().clone() for b in buckets])
        finally:
            _step.OPTIONS.orthogonalize_ahead = True
    row["ahead_bitwise"] = all(torch.equal(a, b) for a, b in zip(*outs))
    log(f"  {'':36s} next Q orthogonalized ahead == at the step's start, bitwise: {row['ahead_bitwise']}")


def hook_case(model, rank, dtype, cap):
    rows = RESULTS["sections"].setdefault("hooks", {}).setdefault("rows", [])
    pg = _pg_backend()
    gen = generator()
    case = dict(model=model, **{RANK: rank}, dtype=str(dtype)[6:], process_group=pg)
    times = {}
    for impl in ("pytorch", "ours"):
        if time.time() > cap or left() < RESERVE["hooks"]:
            RESULTS["skipped"].append(f"hooks {model} r{rank} {dtype} {impl} (time)")
            return
        key = f"{model} r{rank} {str(dtype)[6:]} {impl}"
        try:
            t0 = time.time()
            # two copies of the buckets and states, used in turn: inputs rotate, nothing stays in L2
            steps = []
            for _ in range(ROTATE):
                buckets = _hook_buckets(model, dtype, gen)
                steps.append(B.HookStep(impl, buckets, rank, backend="triton").warmup(1 if DRY else 2))
            sync()
            turn = [0]

            def step():
                s = steps[turn[0] % len(steps)]
                turn[0] += 1
                s()

            t = timed(step, min_reps=10, max_ms=2000)
            s0 = steps[0]
            row = dict(case, impl=impl, variant=s0.impl, buckets=len(s0.buckets), grad_bytes=s0.nbytes, **t)
            if impl == "ours":  # PERFORMANCE MODEL: its prediction beside the measurement (None without it)
                row["model_ms"] = predicted(prediction_key("hook", model, dtype, rank))
            rows.append(row)  # the time is kept even if a count below fails
            times[impl] = t["median_ms"]
            pred = f"; model {row['model_ms']:.3f}" if row.get("model_ms") is not None else ""
            log(f"  {key:36s} [{s0.impl}] {t['median_ms']:9.3f} ms/step (median; p20 {t['p20_ms']:.3f}, "
                f"p80 {t['p80_ms']:.3f}{pred})")
            hs = s0 if isinstance(s0, B.HookStep) else None
            for what, fn in (("counts", lambda: _hook_counts(row, s0, hs)),
                             ("device kernels", lambda: _device_kernels(row, s0)),
                             ("memory", lambda: _hook_memory(row, s0, hs)),
                             ("ahead", lambda: _ahead_check(row, model, rank, dtype) if impl == "ours" else None)):
                try:
                    fn()
                except Exception as exc:  # noqa: PERF203
                    row[f"{what} error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    item_error("hooks", f"{key} {what}", exc)
            row["finite"] = bool(all(torch.isfinite(b.buffer()).all() for b in s0.buckets))
            row["seconds"] = round(time.time() - t0, 1)
            maybe_save()
            log(f"  {'':36s} device kernels/step {row.get('kernels_per_step')}, ATen {row.get('aten_compute')}, "
                f"Triton {row.get('triton_launches')}, all-reduces {row.get('allreduce_calls')}, held "
                f"{B.fmt_bytes(row.get('held_bytes'))}, peak extra {B.fmt_bytes(row.get('peak_extra_bytes'))} "
                f"({row['seconds']}s)")
            del steps
        except Exception as exc:
            item_error("hooks", key, exc)
        finally:
            if DEVICE.type == "cuda":
                torch.cuda.empty_cache()
    if "pytorch" in times and "ours" in times:
        log(f"  => {model} r{rank} {str(dtype)[6:]}: PyTorch/ours = {times['pytorch'] / times['ours']:.2f}x")


def hook_plan(extra=False):
    """(model, rank, dtype) of the hooks section (``extra``: hooks-extra)."""
    f32, bf16 = torch.float32, torch.bfloat16
    if DRY:
        return [] if extra else [("resnet50", 4, f32)]  # bf16 goes through the same code
    if QUICK:
        return [] if extra else [("resnet50", 4, f32), ("resnet50", 4, bf16)]
    if extra:
        return [("gpt2", 4, bf16), ("resnet50", 16, f32)]
    return [("resnet50", 4, f32), ("resnet50", 4, bf16), ("resnet50", 1, f32), ("gpt2", 4, f32), ("gpt2", 1, f32)]


def section_hooks():
    cap = time.time() + CAP["hooks"]
    for model, rank, dtype in hook_plan():
        hook_case(model, rank, dtype, cap)


def section_hooks_extra():
    cap = time.time() + CAP["hooks-extra"]
    for model, rank, dtype in hook_plan(extra=True):
        hook_case(model, rank, dtype, cap)
