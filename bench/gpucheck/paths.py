"""Section ``paths``: the kernel paths most likely to differ on a GPU, each with the GPU heuristic's own config (the one
an untuned hook runs; the dry run gets it too, in the interpreter) against a float64 oracle on fresh random inputs:

* ``project_t`` on the split tensor-core path (``SPLIT_BF16``: bfloat16 dots on exactly split operands), bf16 and
  fp16 gradients at rank 8 and 16 (R padded to 16): float32 accuracy (one bfloat16 rounding of P gives ~2e-3, a
  TF32 dot ~5e-4; the tolerance is 1e-4);
* ``reconstruct`` and ``project`` with ``tl.dot`` (rank 16): the output and the new error memory;
* ``orthogonalize`` of factors longer than ``SHORT_ROWS`` (rank 4 and 16): the float64 Gram launch, then the apply
  launch, out of place and in place (the hooks' P; the dry run scales the config's rows down, ``DRY_ORTHO``: the
  interpreter cannot afford 9000-row factors);
* ``orthogonalize`` of short factors split over ``APPLY_ROWS`` programs (rank 16, out of place: the next step's Q).

Each case also checks that the path was taken (the config's flags, the planned launches); a case that did not take it
fails.
"""

import time

import torch

from powersgd_triton.compat import env as _env
from powersgd_triton import ops
from powersgd_triton import benchmarking as B
from powersgd_triton.ops import reference

from .common import (CAP, DEVICE, DRY, RANK, RESERVE, generator, item_error, left, log, maybe_save, section_open, skip,
                     sync)
from .correctness import _bucket_from_shapes, _rel

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
TOL = {F32: 1e-4, BF16: 1e-2, F16: 1e-2}  # values stored in the gradient dtype; factors and E are float32: 1e-4
FACTOR_TOL = 1e-4
if DRY:  # the interpreter: small buckets, and the orthogonalize configs' rows scaled down (DRY_ORTHO)
    MM_SHAPES = [(64, 40), (40, 33), (5, 48), (20, 17), (64,)]
    GRAM_SHAPES = {4: [(200, 24), (40, 30), (7,)], 16: [(200, 24), (30, 40), (7,)]}
    APPLY_SHAPES = [(24, 300), (30, 40), (7,)]
else:
    MM_SHAPES = [(2048, 1024), (1000, 333), (64, 4096), (20, 17), (768,)]
    GRAM_SHAPES = {4: [(9000, 24), (40, 30), (7,)], 16: [(4500, 24), (30, 40), (7,)]}  # P rows > SHORT_ROWS
    APPLY_SHAPES = [(24, 3000), (30, 40), (7,)]  # Q rows 3000: APPLY_ROWS (1024) < rows <= SHORT_ROWS (4096), R 16
# dry run: the heuristic's orthogonalize config with its rows scaled down (same launches, 16x fewer rows)
DRY_ORTHO = {"p": dict(BLOCK=64, SHORT_ROWS=64, GRAM_ROWS=64, SPLIT_ROWS=64),
             "q": dict(BLOCK=32, SHORT_ROWS=512, GRAM_ROWS=64, APPLY_ROWS=128)}

CASES = [("project_t split-bf16", BF16, 8), ("project_t split-bf16", F16, 16), ("reconstruct tl.dot", F32, 16),
         ("reconstruct tl.dot", BF16, 16), ("project tl.dot", F32, 16), ("orthogonalize gram", F32, 4),
         ("orthogonalize gram", F32, 16), ("orthogonalize apply-rows", F32, 16)]


def gpu_config(kernel: str, layout, dtype) -> dict:
    """The GPU heuristic's config for ``kernel`` on ``layout`` (:func:`configs.heuristic_config` as on a GPU, also
    under the interpreter)."""
    from powersgd_triton.ops import configs

    saved = _env.interpreter_enabled
    _env.interpreter_enabled = lambda: False
    try:
        return configs.heuristic_config(kernel, layout, dtype)
    finally:
        _env.interpreter_enabled = saved


def case_shapes(case: str, rank: int):
    """The gradient shapes of a case's bucket (``min_compression_rate`` 1)."""
    if case == "orthogonalize gram":
        return GRAM_SHAPES[rank]
    return APPLY_SHAPES if case.endswith("apply-rows") else MM_SHAPES


def check_path(case: str, dtype, rank: int, gen) -> dict:
    from powersgd_triton.ops import configs, orthogonalization

    f64 = torch.float64
    nan = float("nan")
    bucket = _bucket_from_shapes(case_shapes(case, rank), dtype, gen)
    lay = B.bucket_layout(bucket, rank, min_compression_rate=1.0)
    buf = bucket.buffer()
    before = buf.clone()
    p = B.random_buffer(lay.p_numel, F32, DEVICE, gen)
    q = B.random_buffer(lay.q_numel, F32, DEVICE, gen)
    err = B.random_buffer(lay.e_numel, F32, DEVICE, gen, scale=0.1)
    checks, path = {}, {}
    if case.startswith("project_t"):
        cfg = gpu_config("project_t", lay, dtype)
        path["SPLIT_BF16"] = configs.split_bf16_dot(cfg, dtype)
        out = torch.full_like(q, nan)
        ops.project_t(buf, lay, p, out, backend="triton", config=cfg)
        sync()
        ref = torch.empty(lay.q_numel, dtype=f64, device=DEVICE)
        reference.project_t(before, lay, p.double(), ref, compute_dtype=f64)
        checks["Q"] = (_rel(out, ref), FACTOR_TOL)
    elif case.startswith("project"):
        cfg = gpu_config("project", lay, dtype)
        path["USE_DOT"] = bool(cfg.get("USE_DOT"))
        out = torch.full_like(p, nan)
        ops.project(buf, lay, q, out, err, backend="triton", config=cfg)
        sync()
        ref_buf, ref = before.clone(), torch.empty(lay.p_numel, dtype=f64, device=DEVICE)
        reference.project(ref_buf, lay, q.double(), ref, err.double(), compute_dtype=f64)
        checks["P"] = (_rel(out, ref), FACTOR_TOL)
    elif case.startswith("reconstruct"):
        cfg = gpu_config("reconstruct", lay, dtype)
        path["USE_DOT"] = bool(cfg.get("USE_DOT"))
        e_in = err.clone()
        ops.reconstruct(buf, lay, p, q, 0.5, err, torch.tensor(True, device=DEVICE), backend="triton", config=cfg)
        sync()
        ref_buf, ref_e = before.clone(), e_in.double()
        reference.reconstruct(ref_buf, lay, p.double(), q.double(), 0.5, ref_e, None, compute_dtype=f64)
        checks["bucket"] = (_rel(buf, ref_buf), TOL[dtype])
        checks["E"] = (_rel(err, ref_e), FACTOR_TOL)
    else:
        which = "q" if case.endswith("apply-rows") else "p"
        cfg = gpu_config("orthogonalize", lay, F32)
        if DRY:
            cfg = dict(cfg, **DRY_ORTHO[which])
        x = p if which == "p" else q
        in_place = which == "p"
        plan = orthogonalization.orthogonalize_plan(lay, which, cfg, in_place=in_place)
        names = [d["kernel"] for d in plan]
        if which == "p":
            path["float64 Gram launch"] = "orthogonalize_gram" in names
        else:
            path["APPLY_ROWS programs"] = "APPLY_ROWS" in cfg and plan[-1]["programs"] > lay.num_matrices
        ref = torch.empty(x.numel(), dtype=f64, device=DEVICE)
        reference.orthogonalize(x.double(), lay, which, 0.0, out=ref, compute_dtype=f64)
        out = torch.full_like(x, nan)
        ops.orthogonalize(x, lay, which, 0.0, out=out, backend="triton", config=cfg)
        sync()
        checks[which.upper()] = (_rel(out, ref), FACTOR_TOL)
        if in_place:  # as the hooks orthogonalize P
            ops.orthogonalize(x, lay, which, 0.0, backend="triton", config=cfg)
            sync()
            checks[which.upper() + " in place"] = (_rel(x, ref), FACTOR_TOL)
    finite = all(bool(torch.isfinite(t).all()) for t in (buf, p, q, err))
    ok = finite and all(path.values()) and all(v <= tol for v, tol in checks.values())
    return dict(case=case, dtype=str(dtype)[6:], **{RANK: rank}, matrices=lay.num_matrices, config=cfg, path=path,
                checks={k: v[0] for k, v in checks.items()}, tolerances={k: v[1] for k, v in checks.items()},
                finite=finite, ok=ok)


def section_paths():
    sec = section_open("paths")
    rows = sec.setdefault("cases", [])
    cap = time.time() + CAP["paths"]
    gen = generator()
    for i, (case, dtype, rank) in enumerate(CASES):
        key = f"{case} {str(dtype)[6:]} r{rank}"
        if time.time() > cap or left() < RESERVE["paths"]:
            sec.setdefault("skipped", []).extend(f"{c} {str(d)[6:]} r{r}" for c, d, r in CASES[i:])
            skip(f"paths: {len(CASES) - i} cases", "time")
            break
        t0 = time.time()
        try:
            r = check_path(case, dtype, rank, gen)
        except Exception as exc:  # noqa: BLE001
            item_error("paths", key, exc)
            rows.append(dict(case=case, dtype=str(dtype)[6:], **{RANK: rank}, ok=False,
                             error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            continue
        r["seconds"] = round(time.time() - t0, 2)
        rows.append(r)
        maybe_save()
        detail = ", ".join(f"{k}={v:.1e}" for k, v in r["checks"].items())
        taken = ", ".join(f"{k}: {v}" for k, v in r["path"].items())
        log(f"  {'ok  ' if r['ok'] else 'FAIL'} {key:36s} {taken}; {detail} ({r['seconds']}s)")
    n_ok = sum(1 for r in rows if r.get("ok"))
    sec.update(passed=n_ok, failed=len(rows) - n_ok, planned=len(CASES))
    log(f"  paths: {n_ok}/{len(rows)} passed ({len(CASES)} planned)")
