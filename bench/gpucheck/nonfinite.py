"""Section ``nonfinite``: every kernel variant on inputs holding inf and the NaN payloads GPUs produce."""

import time

import torch

from powersgd_triton import benchmarking as B
from powersgd_triton import ops
from powersgd_triton.ops import reference

from .common import CAP, DEVICE, RANK, RESERVE, RESULTS, generator, item_error, left, log, maybe_save, sync
from .correctness import CORR_VARIANTS, _bucket_from_shapes, _rel, _slices, _tol

# =============================================================================================== 5. nonfinite
# Bit patterns of the special values put into the inputs, per dtype: the NaNs NVIDIA arithmetic produces (all ones
# after the sign: 0x7FFFFFFF from inf - inf, and the same with the sign bit), the canonical quiet NaN the interpreter
# and x86 produce, and the infinities.
SPECIAL_BITS = {
    torch.float32: [("nan 0x7FFFFFFF", 0x7FFFFFFF), ("nan 0xFFFFFFFF", 0xFFFFFFFF), ("+inf", 0x7F800000),
                    ("-inf", 0xFF800000), ("nan 0x7FC00000", 0x7FC00000)],
    torch.bfloat16: [("nan 0x7FFF", 0x7FFF), ("nan 0xFFFF", 0xFFFF), ("+inf", 0x7F80), ("-inf", 0xFF80),
                     ("nan 0x7FC0", 0x7FC0)],
    torch.float16: [("nan 0x7FFF", 0x7FFF), ("nan 0xFFFF", 0xFFFF), ("+inf", 0x7C00), ("-inf", 0xFC00),
                    ("nan 0x7E00", 0x7E00)],
}
# A bucket with 4 compressed matrices and 2 uncompressed vectors (min_compression_rate 1).
SPECIAL_SHAPES = [(33, 20), (7,), (16, 4, 3, 3), (40, 9), (3,), (25, 30)]


def special_value(dtype, i):
    """(label, 0-d tensor of ``dtype``) of the i-th special value of that dtype (cycling), from its bit pattern."""
    label, bits = SPECIAL_BITS[dtype][i % len(SPECIAL_BITS[dtype])]
    width = torch.finfo(dtype).bits
    signed = bits - (1 << width) if bits >= 1 << (width - 1) else bits
    ints = torch.tensor([signed], dtype=torch.int32 if width == 32 else torch.int16)
    return label, ints.view(dtype)[0]


def _poke(t, start, count, which, gen, placed, name):
    """Put special value ``which`` (of t's dtype) at a random element of ``t[start:start+count]``."""
    label, v = special_value(t.dtype, which)
    i = start + int(torch.randint(0, count, (1,), generator=gen))
    t[i] = v.to(t.device)
    placed.append(f"{name}[{i}]={label}")


def _finite_match(out, ref, layout=None, which=None):
    """Compare where ``out`` and the oracle ``ref`` are non-finite. Returns ``missed`` (non-finite in the oracle,
    finite here: a finite wrong answer, which GradScaler would apply), ``spurious`` (non-finite here, finite in the
    oracle, in a matrix the oracle keeps entirely finite: a NaN leaking into a healthy layer), ``spurious_within``
    (the same inside a matrix the oracle already makes non-finite: that matrix's step is non-finite either way;
    reported, not a failure) and the relative error on the elements finite in both. ``which`` ("m", "e", "p", "q")
    says how ``out`` is laid out per matrix; without it every spurious element counts."""
    fo, fr = torch.isfinite(out), torch.isfinite(ref)
    missed = int((fo & ~fr).sum())
    spur = ~fo & fr
    within = 0
    if which is not None and bool(spur.any()):
        for sp in layout.matrices:
            sl = _slices(sp)[which]
            if not bool(fr[sl].all()):
                within += int(spur[sl].sum())
    both = fo & fr
    err = _rel(out[both], ref[both]) if bool(both.any()) else 0.0
    return dict(missed=missed, spurious=int(spur.sum()) - within, spurious_within=within, finite_rel_err=err)


def check_special(variant, dtype, rank, gen):
    """One kernel variant on inputs holding inf and NaN payloads; the float64 oracle (the same special values, the
    same operations in float64 torch) says where the outputs must be non-finite. Returns a result dict."""
    f32, f64 = torch.float32, torch.float64
    gcpu = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen, device=DEVICE)))
    bucket = _bucket_from_shapes(SPECIAL_SHAPES, dtype, gen)
    lay = B.bucket_layout(bucket, rank, min_compression_rate=1.0)
    mats = lay.matrices
    if len(mats) < 4:
        raise RuntimeError(f"special layout has {len(mats)} compressed matrices, needs 4")
    buf = bucket.buffer()
    q = B.random_buffer(lay.q_numel, f32, DEVICE, gen)
    p = B.random_buffer(lay.p_numel, f32, DEVICE, gen)
    err = B.random_buffer(lay.e_numel, f32, DEVICE, gen, scale=0.1)
    placed = []

    def put(*specs):
        """Each (region, matrix i, value k[, tensor]): special value k at a random element of matrix i's region
        of the bucket (M), the error (E) or a factor tensor (P, Q: p, q or a local factor)."""
        for region, i, k, *t in specs:
            sp = mats[i]
            start, count, target = {"M": (sp.offset, sp.numel, buf), "E": (sp.e_offset, sp.numel, err),
                                    "P": (sp.p_offset, sp.n * sp.rank, t[0] if t else p),
                                    "Q": (sp.q_offset, sp.m * sp.rank, t[0] if t else q)}[region]
            _poke(target, start, count, k, gcpu, placed, f"{region}{i}")

    outs = {}  # output name -> (ours, float64 oracle)
    if variant in ("project", "project+error"):
        use_err = variant == "project+error"
        put(("M", 0, 0), ("M", 1, 2), ("Q", 2, 1), ("E", 3, 0) if use_err else ("M", 3, 1))
        before = buf.clone()
        p_out = torch.full_like(p, float("nan"))
        ops.project(buf, lay, q, p_out, err if use_err else None, backend="triton")
        sync()
        ref_buf, ref_p = before.clone(), torch.empty(lay.p_numel, dtype=f64, device=DEVICE)
        reference.project(ref_buf, lay, q.double(), ref_p, err.double() if use_err else None, compute_dtype=f64)
        outs["P"] = (p_out, ref_p)
        outs["bucket"] = (buf, ref_buf)
    elif variant in ("orthogonalize-p", "orthogonalize-q"):
        which = variant[-1]
        x = p if which == "p" else q
        put(*((which.upper(), i, k) for i, k in ((0, 1), (1, 2), (3, 0))))
        out = torch.full_like(x, float("nan"))
        ops.orthogonalize(x, lay, which, 0.0, out=out, backend="triton")
        sync()
        ref = torch.empty(x.numel(), dtype=f64, device=DEVICE)
        reference.orthogonalize(x.double(), lay, which, 0.0, out=ref, compute_dtype=f64)
        outs[which.upper()] = (out, ref)
    elif variant == "project_t":
        put(("M", 0, 1), ("M", 1, 3), ("P", 3, 1))
        q_out = torch.full_like(q, float("nan"))
        ops.project_t(buf, lay, p, q_out, backend="triton")
        sync()
        ref_q = torch.empty(lay.q_numel, dtype=f64, device=DEVICE)
        reference.project_t(buf.clone(), lay, p.double(), ref_q, compute_dtype=f64)
        outs["Q"] = (q_out, ref_q)
    elif variant.startswith("reconstruct"):
        has_err = variant != "reconstruct"
        keep = variant != "reconstruct+error,flag=0"
        local = {"reconstruct+error,local_p": "p", "reconstruct+error,local_q": "q"}.get(variant)
        put(("P", 0, 1), ("Q", 1, 0), ("M", 3, 1), ("E", 2, 3))
        lkw, lkw64 = {}, {}
        if local is not None:
            loc = B.random_buffer(lay.p_numel if local == "p" else lay.q_numel, f32, DEVICE, gen)
            put((local.upper(), 2, 0, loc))
            lkw, lkw64 = {f"local_{local}": loc}, {f"local_{local}": loc.double()}
        flag = torch.tensor(keep, device=DEVICE)
        before, e_in = buf.clone(), err.clone()
        ops.reconstruct(buf, lay, p, q, 0.5, err if has_err else None, flag if has_err else None,
                        backend="triton", **lkw)
        sync()
        ref_buf, ref_e = before.clone(), e_in.double()
        reference.reconstruct(ref_buf, lay, p.double(), q.double(), 0.5, ref_e if has_err else None,
                              flag if has_err else None, compute_dtype=f64, **lkw64)
        outs["bucket"] = (buf, ref_buf)
        if has_err:
            outs["E"] = (err, ref_e)
    elif variant in ("pack", "unpack"):
        spans = [(o, n) for o, n in lay.uncompressed]
        if not spans:
            raise RuntimeError("special layout has no uncompressed gradients")
        idx = torch.cat([torch.arange(o, o + n, device=DEVICE) for o, n in spans])
        if variant == "pack":
            for k, (o, n) in enumerate(spans):
                _poke(buf, o, n, k, gcpu, placed, "M")
            dst = torch.full((idx.numel(),), float("nan"), dtype=f32, device=DEVICE)
            ops.pack_uncompressed(buf, lay, dst, backend="triton")
            sync()
            outs["packed"] = (dst, buf[idx].double())
        else:
            src = B.random_buffer(idx.numel(), f32, DEVICE, gen)
            half = idx.numel() // 2  # two different elements
            _poke(src, 0, half, 0, gcpu, placed, "src")
            _poke(src, half, idx.numel() - half, 1, gcpu, placed, "src")
            buf.index_fill_(0, idx, float("nan"))
            ops.unpack_uncompressed(src, lay, buf, 0.5, backend="triton")
            sync()
            outs["unpacked"] = (buf[idx], src.double() * 0.5)
    else:
        raise ValueError(variant)
    res = dict(variant=variant, dtype=str(dtype).replace("torch.", ""), **{RANK: rank}, placed=placed, checks={})
    ok = True
    kinds = {"P": "p", "Q": "q", "E": "e", "bucket": "m"}
    for name, (ours, ref) in outs.items():
        c = _finite_match(ours, ref, lay, kinds.get(name))
        c["nonfinite_expected"] = int((~torch.isfinite(ref)).sum())
        res["checks"][name] = c
        tol = 1e-3 if "ortho" in variant else 1e-4 if dtype == f32 else _tol(dtype)
        ok &= c["missed"] == 0 and c["spurious"] == 0 and c["finite_rel_err"] <= tol
    res["ok"] = ok
    return res


def special_plan():
    """Every correctness variant in every gradient dtype (the factors are float32 in all of them)."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return [(v, dtype, 4) for dtype in dtypes for v in CORR_VARIANTS]


def section_nonfinite():
    rows = []
    RESULTS["sections"]["nonfinite"] = {"cases": rows, "values": {str(k)[6:]: [x[0] for x in v]
                                                                  for k, v in SPECIAL_BITS.items()}}
    cap = time.time() + CAP["nonfinite"]
    plan = special_plan()
    gen = generator()
    for i, (variant, dtype, rank) in enumerate(plan):
        if time.time() > cap or left() < RESERVE["nonfinite"]:
            RESULTS["skipped"].append(f"nonfinite: {len(plan) - i} cases (time): "
                                      + ", ".join(f"{v} {str(d)[6:]}" for v, d, _ in plan[i:]))
            break
        key = f"{variant} {str(dtype)[6:]} r{rank}"
        t0 = time.time()
        try:
            r = check_special(variant, dtype, rank, gen)
        except Exception as exc:
            item_error("nonfinite", key, exc)
            rows.append(dict(variant=variant, dtype=str(dtype)[6:], **{RANK: rank}, ok=False,
                             error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            continue
        r["seconds"] = round(time.time() - t0, 2)
        rows.append(r)
        maybe_save()
        detail = ", ".join(f"{k}: {c['nonfinite_expected']} expected, missed {c['missed']}, spurious {c['spurious']}"
                           + (f" (+{c['spurious_within']} in non-finite matrices)" if c["spurious_within"] else "")
                           for k, c in r["checks"].items())
        log(f"  {'ok  ' if r['ok'] else 'FAIL'} {key:40s} {detail} ({r['seconds']}s)")
    n_ok = sum(1 for r in rows if r.get("ok"))
    RESULTS["sections"]["nonfinite"].update(passed=n_ok, failed=len(rows) - n_ok, planned=len(plan))
    log(f"  nonfinite: {n_ok}/{len(rows)} passed ({len(plan)} planned)")
