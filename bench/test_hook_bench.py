"""PyTorch's ``powerSGD_hook`` against ours: one compressed step of the whole hook, and each bucket kernel alone.

World size 1 (an in-process gloo group, nccl on a GPU), DDP-like 25 MB buckets of real models' gradient shapes,
ranks 1/4/16, fp32 and bf16. Ours runs its torch backend on CPU and its Triton backend on a GPU. Nothing here
asserts a speed: pytest-benchmark prints the times and ``conftest.py`` prints the side-by-side ratios and the counts
(ATen ops, launches, all-reduce calls and bytes, memory held and peak), all measured in this run.
"""

import pytest
import torch

from powersgd_triton import benchmarking as B

_CACHE = {}


def _sync(device):
    return torch.cuda.synchronize if device.type == "cuda" else None


def _buckets(cfg, model, dtype):
    """The model's buckets for (model, dtype), shared by consecutive tests (one entry kept: memory)."""
    key = (model, dtype, cfg.shrink, cfg.bucket_mb, cfg.first_bucket_mb, str(cfg.device))
    if key not in _CACHE:
        _CACHE.clear()
        gen = torch.Generator(device=cfg.device).manual_seed(1234)
        _CACHE[key] = B.model_buckets(model, dtype, cfg.device, bucket_cap_mb=cfg.bucket_mb,
                                      first_bucket_mb=cfg.first_bucket_mb, shrink=cfg.shrink, generator=gen)
    return _CACHE[key]


def _timed(benchmark, fn, cfg):
    sync = _sync(cfg.device)

    def target():
        fn()
        if sync is not None:
            sync()

    benchmark.pedantic(target, rounds=cfg.rounds, warmup_rounds=0 if cfg.quick else 1, iterations=1)


def _triton_launches_per_step(cfg, model, dtype, rank):
    """Launches of one step of our hook on the Triton backend, measured.

    GPU: device kernels from the profiler. CPU: Triton launches counted under the interpreter without executing
    them (fresh buckets: the outputs are garbage) plus the ATen compute ops that backend issues besides them.
    """
    if cfg.device.type == "cuda":
        return None  # the timed step already ran the Triton backend: counted there
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton missing"
    from powersgd_triton.compat import env as _env

    if not _env.interpreter_enabled():
        return "needs TRITON_INTERPRET=1"
    gen = torch.Generator().manual_seed(99)
    buckets = B.model_buckets(model, dtype, "cpu", bucket_cap_mb=cfg.bucket_mb, first_bucket_mb=cfg.first_bucket_mb,
                              shrink=cfg.shrink, generator=gen)
    with B.count_triton_launches(execute=False):
        step = B.HookStep("ours", buckets, rank, backend="triton").warmup(1)
    counts = B.count_step(step, hook_step=step, triton_execute=False)
    return f"{counts.triton_launches} Triton + {counts.aten_compute} ATen"


def test_hook_step(benchmark, bench_cfg, hook_case):
    """One compressed step of the whole hook over every bucket of the model."""
    model, rank, dtype, impl = hook_case
    cfg = bench_cfg
    B.ensure_process_group()
    buckets = _buckets(cfg, model, dtype)
    step = B.HookStep(impl, buckets, rank, backend=cfg.backend).warmup(1)
    benchmark.group = f"hook step {model} r{rank} {dtype}"
    _timed(benchmark, step, cfg)

    counts = B.count_step(step, hook_step=step)
    held = step.memory()
    with B.synchronous_collectives(step):
        peak = B.peak_extra_bytes(step, cfg.device)
    rec = dict(kind="hook", model=model, rank=rank, dtype=dtype, impl=impl, bench=benchmark,
               buckets=len(buckets), grad_bytes=step.nbytes, aten_compute=counts.aten_compute,
               aten_total=counts.aten_total, allreduce_calls=counts.allreduce_calls,
               allreduce_bytes=counts.allreduce_bytes, held_bytes=sum(held.values()), peak_extra_bytes=peak)
    if cfg.device.type == "cuda":
        rec["launches"] = B.count_cuda_kernels(step)["kernels"]
    elif impl == "ours":
        rec["launches"] = _triton_launches_per_step(cfg, model, dtype, rank)
    rec["allreduce_per_bucket"] = counts.per_bucket()
    rec["held_per_bucket"] = dict(held)
    benchmark.extra_info.update({k: v for k, v in rec.items() if k not in ("bench", "allreduce_per_bucket",
                                                                           "held_per_bucket")})
    benchmark.extra_info["allreduce_per_bucket"] = counts.as_dict()["allreduce_per_bucket"]
    benchmark.extra_info["held_per_bucket"] = {str(k): v for k, v in held.items()}
    benchmark.extra_info["top_ops"] = counts.as_dict()["top_ops"]
    cfg.results.append(rec)
    # sanity, not speed: the hook compressed (three all-reduces per bucket) and the buffers stayed finite
    assert counts.allreduce_calls >= len(buckets)
    assert all(torch.isfinite(b.buffer()).all() for b in buckets)


def _kernel_bucket(buckets):
    """The full-size bucket with the most gradients (the first and last buckets of DDP are smaller)."""
    full = [b for b in buckets if b.nbytes >= 0.5 * max(x.nbytes for x in buckets)]
    return max(full, key=lambda b: len(b.shapes))


def test_bucket_kernel(benchmark, bench_cfg, kernel_case):
    """One bucket step alone on one 25 MB bucket: ours (ops.*) vs the code of PyTorch's hook for that step."""
    model, rank, dtype, kernel, impl = kernel_case
    cfg = bench_cfg
    bucket = _kernel_bucket(_buckets(cfg, model, dtype))
    gen = torch.Generator(device=cfg.device).manual_seed(7)
    kb = B.KernelBench(bucket, rank, generator=gen)
    if kb.layout.num_matrices == 0:
        pytest.skip("no compressed matrix in this bucket")
    fn = kb.ours(kernel, backend=cfg.backend) if impl == "ours" else kb.pytorch(kernel)
    benchmark.group = f"kernel {kernel} {model} r{rank} {dtype}"
    _timed(benchmark, fn, cfg)

    with B.OpCounter() as ops:
        fn()
    rec = dict(kind="kernel", model=model, rank=rank, dtype=dtype, kernel=kernel, impl=impl, bench=benchmark,
               bytes=kb.bytes(kernel), matrices=kb.layout.num_matrices, aten_compute=ops.compute,
               aten_total=ops.total)
    if impl == "ours":
        if cfg.device.type == "cuda":
            with B.count_triton_launches() as launches:
                fn()
            rec["launches"] = launches["n"]
        else:
            from powersgd_triton.compat import env as _env

            if _env.interpreter_enabled():
                with B.count_triton_launches(execute=False) as launches:
                    kb.ours(kernel, backend="triton")()
                rec["launches"] = launches["n"]
    benchmark.extra_info.update({k: v for k, v in rec.items() if k != "bench"})
    cfg.results.append(rec)
