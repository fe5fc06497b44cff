"""Sections ``kernels`` and ``kernels-extra``: each kernel's bandwidth on the 25 MB buckets, PyTorch's code beside."""

import time

import torch

from powersgd_triton import benchmarking as B
from powersgd_triton.shapes import numel

from .common import (BUCKET_MB, CAP, DEVICE, DRY, FIRST_BUCKET_MB, MAX_KERNEL_BUCKETS, QUICK, RANK, RESERVE, RESULTS,
                     SHRINK, copy_gbs, generator, item_error, left, log, maybe_save, timed)
from .model import predicted, prediction_key

# =============================================================================================== 4. kernels
def _distinct_buckets(model, dtype):
    """The model's buckets whose shape lists differ, with how many times each occurs, big first."""
    groups = B.model_bucket_shapes(model, dtype, BUCKET_MB, FIRST_BUCKET_MB, SHRINK)
    seen = {}
    for i, shapes in enumerate(groups):
        key = tuple(shapes)
        if key in seen:
            seen[key]["count"] += 1
        else:
            seen[key] = dict(index=i, shapes=shapes, count=1)
    esize = torch.empty((), dtype=dtype).element_size()
    out = list(seen.values())
    for d in out:
        d["nbytes"] = sum(numel(s) for s in d["shapes"]) * esize
    return out


def _is_25mb(nbytes):
    mb = nbytes / 2**20
    return 0.6 * BUCKET_MB <= mb <= 1.6 * BUCKET_MB


def _kernel_buckets(model, dtype):
    """The buckets the kernels section measures: DDP's 25 MB buckets (and larger), distinct shape lists only."""
    done = 0
    for d in _distinct_buckets(model, dtype):
        if MAX_KERNEL_BUCKETS is not None and done >= MAX_KERNEL_BUCKETS:
            return
        if not (_is_25mb(d["nbytes"]) or d["nbytes"] > 2 * BUCKET_MB * 2**20):
            continue  # DDP's small first and last buckets: launch-bound, not what the bandwidth target is about
        done += 1
        yield d


def _kernel_bench(d, dtype, rank, gen):
    bucket = B.FakeGradBucket(B.random_buffer(sum(numel(s) for s in d["shapes"]), dtype, DEVICE, gen),
                              d["shapes"], index=d["index"], num_buckets=d["index"] + 1)
    return bucket, B.KernelBench(bucket, rank, generator=gen)


def kernel_rows(model, dtype, rank, with_pytorch, cap):
    rows = RESULTS["sections"].setdefault("kernels", {}).setdefault("rows", [])
    gen = generator()
    cbw = copy_gbs()
    for d in _kernel_buckets(model, dtype):
        if time.time() > cap or left() < RESERVE["kernels"]:
            RESULTS["skipped"].append(f"kernels {model} {dtype} r{rank} bucket {d['index']} and later (time)")
            return
        bucket, kb = _kernel_bench(d, dtype, rank, gen)
        if kb.layout.num_matrices == 0:
            continue
        for kernel in B.KERNELS:
            impls = ("ours", "pytorch") if with_pytorch else ("ours",)
            for impl in impls:
                key = f"{model} b{d['index']} {str(dtype)[6:]} r{rank} {kernel} {impl}"
                try:
                    fn = kb.ours(kernel, backend="triton") if impl == "ours" else kb.pytorch(kernel)
                    t = timed(fn, min_reps=20, max_ms=300)
                except Exception as exc:
                    item_error("kernels", key, exc)
                    continue
                nbytes = kb.bytes(kernel)
                gbs = nbytes / t["median_ms"] / 1e6
                row = dict(model=model, bucket=d["index"], occurs=d["count"], bucket_bytes=d["nbytes"],
                           is_25mb=_is_25mb(d["nbytes"]), dtype=str(dtype)[6:], **{RANK: rank}, kernel=kernel,
                           impl=impl, matrices=kb.layout.num_matrices, bytes=nbytes, **t, gb_s=gbs,
                           frac_copy=(gbs / cbw) if cbw else None)
                if impl == "ours":  # PERFORMANCE MODEL: its prediction (made by section model) beside the measurement
                    row["model_ms"] = predicted(prediction_key("kernel", model, dtype, rank, d["index"], kernel))
                rows.append(row)
                maybe_save()
                frac = f"{100 * row['frac_copy']:.0f}% of copy" if cbw else ""
                pred = f" (model {row['model_ms']:.3f} ms)" if row.get("model_ms") is not None else ""
                log(f"  {key:50s} {t['median_ms']:8.3f} ms {gbs:8.1f} GB/s {frac}{pred}")
        del kb, bucket


def kernel_plan(extra=False):
    """(model, dtype, rank, with PyTorch's code beside) of the kernels section (``extra``: kernels-extra)."""
    f32, bf16 = torch.float32, torch.bfloat16
    if extra:
        return [] if QUICK else [("resnet50", f32, r, False) for r in ((1,) if DRY else (1, 16))]
    plan = [("resnet50", f32, 4, True), ("resnet50", bf16, 4, False), ("gpt2", f32, 4, True), ("gpt2", bf16, 4, False)]
    return plan[:1] if (DRY or QUICK) else plan


def section_kernels():
    cap = time.time() + CAP["kernels"]
    for model, dtype, rank, with_pytorch in kernel_plan():
        kernel_rows(model, dtype, rank, with_pytorch=with_pytorch, cap=cap)


def section_kernels_extra():
    cap = time.time() + CAP["kernels-extra"]
    for model, dtype, rank, with_pytorch in kernel_plan(extra=True):
        kernel_rows(model, dtype, rank, with_pytorch=with_pytorch, cap=cap)
