"""Section ``model``: every performance-model prediction the ``kernels`` and ``hooks`` sections print, computed before
them (its ahead-of-time compiles for the GPU, ``ptxas -v`` and ``cuobjdump`` per launch, run here, under this
section's own time cap, never inside a timed section); they look the results up (:func:`gpucheck.model.predicted`)."""

import time

import torch

from powersgd_triton import benchmarking as B
from powersgd_triton.shapes import numel

from .common import (ARGS, BUCKET_MB, CAP, DEVICE, DRY, FIRST_BUCKET_MB, MAX_HOOK_BUCKETS, RESERVE, SHRINK, left, log,
                     section_open, skip)
from .hooks import hook_plan
from .kernels import _kernel_buckets, kernel_plan
from .model import PREDICTIONS, perf_prediction, prediction_key


def _cpu_bucket(shapes, dtype, index=0, num_buckets=1):
    """A bucket of ``shapes`` in host memory (the model reads only the layout; no device memory)."""
    return B.FakeGradBucket(torch.zeros(sum(numel(s) for s in shapes), dtype=dtype), shapes, index=index,
                            num_buckets=num_buckets)


def model_items():
    """``(key, what, kwargs)`` of every prediction the chosen kernels/hooks sections will look up."""
    chosen = ARGS.sections.split(",")
    items = []
    for sec, extra in (("kernels", False), ("kernels-extra", True)):
        if sec not in chosen:
            continue
        for model, dtype, rank, _ in kernel_plan(extra):
            for d in _kernel_buckets(model, dtype):
                layout = B.bucket_layout(_cpu_bucket(d["shapes"], dtype), rank)
                if layout.num_matrices == 0:
                    continue
                for kernel in B.KERNELS:
                    items.append((prediction_key("kernel", model, dtype, rank, d["index"], kernel), "kernel",
                                  dict(kernel=kernel, layout=layout, dtype=dtype, rank=rank)))
    for sec, extra in (("hooks", False), ("hooks-extra", True)):
        if sec not in chosen:
            continue
        for model, rank, dtype in hook_plan(extra):
            groups = B.model_bucket_shapes(model, dtype, BUCKET_MB, FIRST_BUCKET_MB, SHRINK)
            if MAX_HOOK_BUCKETS is not None:
                groups = groups[:MAX_HOOK_BUCKETS]
            buckets = [_cpu_bucket(g, dtype, i, len(groups)) for i, g in enumerate(groups)]
            items.append((prediction_key("hook", model, dtype, rank), "hook",
                          dict(model=model, rank=rank, dtype=dtype, buckets=buckets)))
    seen, out = set(), []
    for it in items:
        if it[0] not in seen:
            seen.add(it[0])
            out.append(it)
    return out


def section_model():
    sec = section_open("model")
    items = model_items()
    sec.update(planned=len(items), made=0, seconds=0.0)
    if DRY or DEVICE.type != "cuda":
        for key, _, _ in items:
            PREDICTIONS[key] = None
        skip("model: the performance model's predictions",
             "dry run: the model predicts an H100/H200 and compiles for it with TRITON_INTERPRET unset; "
             "the tables show '-'")
        return
    t0 = time.time()
    cap = t0 + CAP["model"]
    for i, (key, what, kw) in enumerate(items):
        if time.time() > cap or left() < RESERVE["model"]:
            for k, _, _ in items[i:]:
                PREDICTIONS[k] = None
            skip(f"model: {len(items) - i} of {len(items)} predictions", "time: shown as '-'")
            break
        PREDICTIONS[key] = perf_prediction(what, **kw)
        sec["made"] += 1
    sec["seconds"] = round(time.time() - t0, 1)
    none = sum(1 for k, _, _ in items if PREDICTIONS.get(k) is None)
    log(f"  model: {sec['made']} of {len(items)} predictions in {sec['seconds']} s ({none} without a value: "
        "not an H100/H200, or the compile failed)")
