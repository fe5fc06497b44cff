"""Section ``correctness``: every kernel variant against a float64 torch oracle on fresh random inputs."""

import time

import torch

from powersgd_triton import benchmarking as B
from powersgd_triton import ops
from powersgd_triton.ops import reference
from powersgd_triton.layout import BucketLayout
from powersgd_triton.shapes import numel

from .common import (BUCKET_MB, CAP, DEVICE, DRY, FIRST_BUCKET_MB, QUICK, RANK, RESERVE, RESULTS, SHRINK, generator,
                     item_error, left, log, maybe_save, sync)

# =============================================================================================== 3. correctness
def _bucket_from_shapes(shapes, dtype, gen, zero_index=None):
    buf = B.random_buffer(sum(numel(s) for s in shapes), dtype, DEVICE, gen)
    bucket = B.FakeGradBucket(buf, shapes)
    if zero_index is not None:
        bucket.gradients()[zero_index].zero_()  # an all-zero layer: its P column must stay 0, not NaN
    return bucket


def _ragged_shapes(gen_cpu):
    shapes = []
    for i in range(10 if DRY else 40):  # the interpreter runs one program per matrix, ~0.5 s each
        kind = i % 5
        a = int(torch.randint(1, 300, (1,), generator=gen_cpu))
        b = int(torch.randint(1, 300, (1,), generator=gen_cpu))
        if kind == 0:
            shapes.append((a,))  # vector: never compressed
        elif kind == 1:
            shapes.append((a, b))
        elif kind == 2:
            shapes.append((max(1, a // 8), max(1, b // 16), 3, 3))
        elif kind == 3:
            shapes.append((2, b))  # fewer rows than the rank
        else:
            shapes.append((a, 3))  # fewer columns than the rank
    if DRY:
        shapes = [tuple(max(1, d // 4) if j < 2 else d for j, d in enumerate(s)) for s in shapes]
    return shapes


def _layout_case(kind, dtype, rank, gen):
    """(bucket, layout) for a correctness case."""
    if kind == "resnet50":
        groups = B.model_bucket_shapes("resnet50", dtype, BUCKET_MB, FIRST_BUCKET_MB, SHRINK)
        shapes = max(groups, key=len)  # the 25 MB bucket with the most gradients
        bucket = _bucket_from_shapes(shapes, dtype, gen)
        return bucket, B.bucket_layout(bucket, rank)
    if kind == "gpt2":
        groups = B.model_bucket_shapes("gpt2", dtype, BUCKET_MB, FIRST_BUCKET_MB, SHRINK * (2 if DRY else 1))
        shapes = max(groups, key=lambda g: sum(numel(s) for s in g))  # the big one: wte 50257 x 768
        bucket = _bucket_from_shapes(shapes, dtype, gen)
        return bucket, B.bucket_layout(bucket, rank)
    if kind == "ragged":
        gcpu = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen, device=DEVICE)))
        shapes = _ragged_shapes(gcpu)
        bucket = _bucket_from_shapes(shapes, dtype, gen, zero_index=1)
        return bucket, B.bucket_layout(bucket, rank, min_compression_rate=0.5)
    if kind == "batched":
        n = 1_000_003 if not DRY else 20_011  # not a square: the padding of the s x s view is masked
        bucket = B.FakeGradBucket(B.random_buffer(n, dtype, DEVICE, gen), [(n,)])
        return bucket, BucketLayout.batched(n, rank, DEVICE, dtype)
    raise ValueError(kind)


def _rel(a, b):
    a, b = a.double(), b.double()
    d = b.norm().item()
    return (a - b).norm().item() / (d if d > 0 else 1.0)


def _slices(s):
    return dict(m=slice(s.offset, s.offset + s.numel), e=slice(s.e_offset, s.e_offset + s.numel),
                p=slice(s.p_offset, s.p_offset + s.n * s.rank), q=slice(s.q_offset, s.q_offset + s.m * s.rank))


def _per_matrix(out, ref, layout, which, scale_fn):
    """Worst per-matrix error ||out_i - ref_i|| / scale_i, where scale_i bounds the product's size (e.g.
    ||M_i||·||Q_i|| for P_i = M_i·Q_i): catches a wrong matrix among many big ones, and unlike ||ref_i|| cannot
    blow up when a small result cancels (a 16x1 bias gives a one-element Q)."""
    worst = 0.0
    for s in layout.matrices:
        sl = _slices(s)[which]
        d = (out[sl].double() - ref[sl].double()).norm().item()
        sc = scale_fn(s)
        worst = max(worst, d / sc if sc > 0 else d)
    return worst


def _norm(x, s, which):
    return x[_slices(s)[which]].double().norm().item()


def _outside_mask(layout):
    """Bool mask of the bucket elements that are not in any compressed matrix (must never change)."""
    mask = torch.ones(layout.numel, dtype=torch.bool, device=DEVICE)
    for s in layout.matrices:
        mask[s.offset : s.offset + s.numel] = False
    return mask


def _tol(dtype):
    return 1e-4 if dtype == torch.float32 else 1e-2


def check_kernel(variant, kind, dtype, rank, gen):
    """Run one kernel variant on fresh inputs, compare with the float64 oracle. Returns a result dict."""
    bucket, lay = _layout_case(kind, dtype, rank, gen)
    buf = bucket.buffer()
    f32, f64 = torch.float32, torch.float64
    nan = float("nan")
    q = B.random_buffer(lay.q_numel, f32, DEVICE, gen)
    p = B.random_buffer(lay.p_numel, f32, DEVICE, gen)
    err = B.random_buffer(lay.e_numel, f32, DEVICE, gen, scale=0.1)
    outside = _outside_mask(lay)
    before = buf.clone()
    res = dict(variant=variant, layout=kind, dtype=str(dtype).replace("torch.", ""), **{RANK: rank},
               matrices=lay.num_matrices, numel=lay.numel)
    checks = {}  # name -> (rel err, tolerance)
    nonfinite = 0

    def finite(t):
        nonlocal nonfinite
        nonfinite += int((~torch.isfinite(t)).sum())

    if variant in ("project", "project+error"):
        use_err = variant == "project+error"
        p_out = torch.full_like(p, nan)
        ops.project(buf, lay, q, p_out, err if use_err else None, backend="triton")
        sync()
        ref_buf = before.clone()
        ref_p = torch.empty(lay.p_numel, dtype=f64, device=DEVICE)
        reference.project(ref_buf, lay, q.double(), ref_p, err.double() if use_err else None, compute_dtype=f64)
        finite(p_out)
        checks["P"] = (_rel(p_out, ref_p), 1e-4)
        x = ref_buf if use_err else before
        checks["P per matrix"] = (_per_matrix(p_out, ref_p, lay, "p", lambda s: _norm(x, s, "m") * _norm(q, s, "q")),
                                  1e-4)
        checks["bucket"] = (_rel(buf, ref_buf), _tol(dtype) if use_err else 0.0)
    elif variant in ("orthogonalize-p", "orthogonalize-q"):
        which = variant[-1]
        x = p if which == "p" else q
        x_in = x.clone()
        out = torch.full_like(x, nan)
        ops.orthogonalize(x, lay, which, 0.0, out=out, backend="triton")
        sync()
        ref = torch.empty(x.numel(), dtype=f64, device=DEVICE)
        reference.orthogonalize(x.double(), lay, which, 0.0, out=ref, compute_dtype=f64)
        finite(out)
        checks[which.upper()] = (_rel(out, ref), 1e-3)  # Gram-Schmidt amplifies by the columns' conditioning
        checks["input untouched"] = (_rel(x, x_in), 0.0)
        # in place, as the hook does for P
        ops.orthogonalize(x, lay, which, 0.0, backend="triton")
        sync()
        checks[which.upper() + " in place"] = (_rel(x, ref), 1e-3)
    elif variant == "project_t":
        q_out = torch.full_like(q, nan)
        ops.project_t(buf, lay, p, q_out, backend="triton")
        sync()
        ref_q = torch.empty(lay.q_numel, dtype=f64, device=DEVICE)
        reference.project_t(before, lay, p.double(), ref_q, compute_dtype=f64)
        finite(q_out)
        checks["Q"] = (_rel(q_out, ref_q), 1e-4)
        checks["Q per matrix"] = (_per_matrix(q_out, ref_q, lay, "q",
                                              lambda s: _norm(before, s, "m") * _norm(p, s, "p")), 1e-4)
        checks["bucket untouched"] = (_rel(buf, before), 0.0)
    elif variant.startswith("reconstruct"):
        scale = 0.5  # 1 / world size
        has_err = variant != "reconstruct"
        keep = variant != "reconstruct+error,flag=0"
        local = {"reconstruct+error,local_p": "p", "reconstruct+error,local_q": "q"}.get(variant)
        loc = None
        if local is not None:  # the alternating hook's local residual
            loc = B.random_buffer(lay.p_numel if local == "p" else lay.q_numel, f32, DEVICE, gen)
        lkw = {} if local is None else {f"local_{local}": loc}
        lkw64 = {} if local is None else {f"local_{local}": loc.double()}
        flag = torch.tensor(keep, device=DEVICE)
        e_in = err.clone()
        e_out = err
        if has_err and keep:  # E_i's first numel elements must be written (poisoned here); anything after them in
            e_out = err.clone()  # E (a batched view's padding error, where the layout keeps one) is input as well
            for sp in lay.matrices:
                e_out[sp.e_offset : sp.e_offset + sp.numel] = nan
        if not has_err:  # the kernel only writes M: poison the compressed regions
            buf.masked_fill_(~outside, nan)
        ops.reconstruct(buf, lay, p, q, scale, e_out if has_err else None, flag if has_err else None,
                        backend="triton", **lkw)
        sync()
        ref_buf = before.clone()
        ref_e = e_in.double().clone()
        reference.reconstruct(ref_buf, lay, p.double(), q.double(), scale, ref_e if has_err else None,
                              flag if has_err else None, compute_dtype=f64, **lkw64)
        finite(buf[~outside])
        checks["bucket"] = (_rel(buf[~outside], ref_buf[~outside]), _tol(dtype))
        pq = lambda s: scale * _norm(p, s, "p") * _norm(q, s, "q")  # noqa: E731
        checks["bucket per matrix"] = (_per_matrix(buf, ref_buf, lay, "m", pq), 10 * _tol(dtype))
        if has_err:
            finite(e_out)
            checks["E"] = (_rel(e_out, ref_e), 1e-4) if keep else (_rel(e_out, e_in), 0.0)
            if keep:
                lp = (lambda s: _norm(loc, s, "p") * _norm(q, s, "q")) if local == "p" else \
                     (lambda s: _norm(p, s, "p") * _norm(loc, s, "q")) if local == "q" else pq
                checks["E per matrix"] = (_per_matrix(e_out, ref_e, lay, "e",
                                                      lambda s: _norm(before, s, "m") + lp(s)), 1e-4)
    elif variant in ("pack", "unpack"):
        res["uncompressed_numel"] = un = lay.uncompressed_numel
        if un:
            idx = torch.cat([torch.arange(o, o + n, device=DEVICE) for o, n in lay.uncompressed])
            if variant == "pack":
                dst = torch.full((un,), nan, dtype=f32, device=DEVICE)
                ops.pack_uncompressed(buf, lay, dst, backend="triton")
                sync()
                finite(dst)
                checks["packed"] = (_rel(dst, before[idx]), 0.0)  # a copy: exact
                checks["bucket untouched"] = (_rel(buf, before), 0.0)
            else:
                src = B.random_buffer(un, f32, DEVICE, gen)
                buf.index_fill_(0, idx, nan)  # poison the destination
                ops.unpack_uncompressed(src, lay, buf, 0.5, backend="triton")
                sync()
                finite(buf[idx])
                checks["unpacked"] = (_rel(buf[idx], src.double() * 0.5), 0.0 if dtype == f32 else _tol(dtype))
                checks["matrices untouched"] = (float((buf[~outside] != before[~outside]).sum()), 0.0)
                outside = outside & False  # the uncompressed part was written on purpose
    else:
        raise ValueError(variant)
    if bool(outside.any()):
        checks["outside matrices untouched"] = (float((buf[outside] != before[outside]).sum()), 0.0)
    res["checks"] = {k: v[0] for k, v in checks.items()}
    res["nonfinite"] = nonfinite
    res["ok"] = nonfinite == 0 and all(v <= tol for v, tol in checks.values())
    return res


CORR_VARIANTS = ("project+error", "project", "orthogonalize-q", "orthogonalize-p", "project_t",
                 "reconstruct+error", "reconstruct+error,flag=0", "reconstruct", "reconstruct+error,local_p",
                 "reconstruct+error,local_q", "pack", "unpack")


def correctness_plan():
    """Cases in order of importance (the time cap cuts the tail): real buckets first, then ragged/batched, ranks."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    every = lambda kind, dtype, rank: [(v, kind, dtype, rank) for v in CORR_VARIANTS]  # noqa: E731
    plan = every("resnet50", f32, 4) + every("resnet50", bf16, 4)
    plan += [(v, "gpt2", dtype, 4) for dtype in (f32, bf16)
             for v in ("project+error", "project_t", "reconstruct+error", "pack", "unpack")]
    plan += every("ragged", f32, 4) + every("batched", f32, 4) + every("batched", bf16, 1)
    plan += every("ragged", f32, 1) + every("ragged", f32, 16) + every("resnet50", f32, 16)
    plan += every("ragged", bf16, 4) + every("ragged", bf16, 1) + every("ragged", bf16, 16)
    plan += every("ragged", f16, 4)
    if QUICK:  # every variant on the real bucket in fp32 and bf16, then one case of each other layout kind
        plan = every("resnet50", f32, 4) + every("resnet50", bf16, 4) + [
            ("project+error", "ragged", f32, 16), ("orthogonalize-p", "ragged", f32, 16),
            ("reconstruct+error", "batched", bf16, 1), ("project_t", "gpt2", f32, 4),
            ("reconstruct+error", "ragged", f16, 4)]
    if DRY:  # the interpreter is slow: every variant once, then one case of each other layout kind
        plan = [(v, "resnet50", f32, 4) for v in CORR_VARIANTS] + [
            ("project+error", "ragged", f32, 16), ("orthogonalize-p", "ragged", f32, 4),
            ("reconstruct+error", "batched", bf16, 1), ("project_t", "gpt2", f32, 4)]
    return plan


def section_correctness():
    rows = []
    RESULTS["sections"]["correctness"] = {"cases": rows}
    cap = time.time() + CAP["correctness"]
    plan = correctness_plan()
    gen = generator()
    RESULTS["sections"]["correctness"]["seed_note"] = "fresh random seed per run (os.urandom)"
    for i, (variant, kind, dtype, rank) in enumerate(plan):
        if time.time() > cap or left() < RESERVE["correctness"]:
            RESULTS["skipped"].append(f"correctness: {len(plan) - i} cases (time)")
            log(f"  correctness: time cap, {len(plan) - i} cases skipped")
            break
        key = f"{variant} {kind} {str(dtype)[6:]} r{rank}"
        t0 = time.time()
        try:
            r = check_kernel(variant, kind, dtype, rank, gen)
        except Exception as exc:
            item_error("correctness", key, exc)
            rows.append(dict(variant=variant, layout=kind, dtype=str(dtype)[6:], **{RANK: rank}, ok=False,
                             error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            continue
        r["seconds"] = round(time.time() - t0, 2)
        rows.append(r)
        maybe_save()
        worst = max(r["checks"].items(), key=lambda kv: kv[1])
        log(f"  {'ok  ' if r['ok'] else 'FAIL'} {key:48s} worst {worst[0]}={worst[1]:.2e} "
            f"nonfinite={r['nonfinite']} ({r['seconds']}s)")
    n_ok = sum(1 for r in rows if r.get("ok"))
    RESULTS["sections"]["correctness"].update(passed=n_ok, failed=len(rows) - n_ok, planned=len(plan))
    log(f"  correctness: {n_ok}/{len(rows)} passed ({len(plan)} planned)")
