#!/usr/bin/env python3
"""ONE command for a GPU run of powersgd_triton, under 5 minutes: correctness, bandwidth, hook step, counts.

    PYTHONPATH=. python bench/gpu_check.py              # on the GPU machine, from the repository root
    PYTHONPATH=. python bench/gpu_check.py --dry-run    # CPU + Triton interpreter, tiny shapes (the CI smoke test)

Sections (each one catches and records its own failures, then the run goes on; every item checks the time left):

1. ``env``: versions, GPU name, SMs, L2, driver and clocks.
2. ``copy``: the device's copy bandwidth, a large ``copy_`` timed with ``triton.testing.do_bench`` (median),
   counting bytes read + written.
3. ``correctness``: every compiled kernel variant against a float64 torch oracle on fresh random inputs, outputs
   poisoned with NaN before the launch (every element must be written), regions outside the compressed matrices
   checked untouched; real ResNet-50 and GPT-2 buckets, ragged shapes (with an all-zero layer) and the batched view;
   ranks 1/4/16; fp32, bf16, fp16; also the local-residual reconstruct (alternating hook) and the one-launch
   pack/unpack of the uncompressed gradients.
4. ``kernels``: each kernel's achieved bandwidth (byte model: bytes read + written, once each) on the 25 MB buckets
   of ResNet-50 and GPT-2, as a fraction of the measured copy bandwidth; PyTorch's hook's code for the same step
   beside it (rank 4).
5. ``hooks``: the whole hook step (every bucket of the model) of PyTorch's ``powerSGD_hook`` against ours (Triton
   backend), ResNet-50 and GPT-2, ranks 1 and 4, fp32 then bf16: ``do_bench`` median over two rotating copies of
   the buckets, device kernels per step (``torch.profiler``), Triton launches, ATen ops, all-reduce calls and bytes,
   memory held per bucket and peak extra memory of a step.

Prints progress as it goes and a markdown summary at the end; writes ``gpu_check.json`` and ``gpu_check.md`` into
``$OUT`` (or ``--out``) after every section, so a run cut short still leaves its results. Targets (not asserted):
hook step >= 5x faster than PyTorch's on an H100/H200; each kernel >= 60 % of the copy bandwidth on 25 MB buckets.
"""

import argparse
import faulthandler
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", "--cpu", dest="dry_run", action="store_true",
                    help="run on CPU with the Triton interpreter and tiny shapes (checks the script, not the GPU)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run (default 255 on a GPU, 150 dry)")
    ap.add_argument("--sections", default="env,copy,correctness,kernels,hooks,kernels-extra,hooks-extra",
                    help="comma list of sections to run (default: all)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json/.md (default $OUT)")
    return ap.parse_args(argv)


ARGS = parse_args()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
T0 = time.time()
BUDGET = ARGS.budget if ARGS.budget is not None else (150.0 if ARGS.dry_run else 255.0)
# Hard stop a little after the budget, whatever hangs: prints every thread's stack and exits.
faulthandler.dump_traceback_later(BUDGET + 30, exit=True)

import torch  # noqa: E402

from powersgd_triton import benchmarking as B  # noqa: E402
from powersgd_triton import ops  # noqa: E402
from powersgd_triton.kernels import reference  # noqa: E402
from powersgd_triton.layout import BucketLayout  # noqa: E402
from powersgd_triton.shapes import numel  # noqa: E402

DEVICE = torch.device("cpu" if ARGS.dry_run else "cuda")
DRY = ARGS.dry_run
# The dry run only walks every code path once: channel dims / SHRINK, buckets of BUCKET_MB, one of each case.
SHRINK = 32 if DRY else 1
BUCKET_MB = 0.05 if DRY else 25.0
FIRST_BUCKET_MB = 0.005 if DRY else B.DDP_FIRST_BUCKET_MB
ROTATE = 1 if DRY else 2  # copies of the buckets used in turn by the hook timing
MAX_KERNEL_BUCKETS = 1 if DRY else None

RESULTS = {"script": "bench/gpu_check.py", "argv": sys.argv[1:], "dry_run": DRY, "budget_s": BUDGET,
           "sections": {}, "errors": {}, "skipped": []}


# Seconds each section leaves for the ones after it (correctness -> kernels -> hooks -> extras).
RESERVE = {"correctness": 5.0, "kernels": 5.0, "hooks": 5.0} if DRY else {"correctness": 135.0, "kernels": 85.0,
                                                                         "hooks": 8.0}


def elapsed() -> float:
    return time.time() - T0


def left() -> float:
    return BUDGET - elapsed()


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def save() -> None:
    """Write gpu_check.json (and the markdown summary so far) into the output folder, atomically."""
    if not ARGS.out:
        return
    try:
        out = Path(ARGS.out)
        out.mkdir(parents=True, exist_ok=True)
        RESULTS["elapsed_s"] = round(elapsed(), 1)
        tmp = out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(RESULTS, indent=1, default=str))
        os.replace(tmp, out / "gpu_check.json")
        tmp = out / "gpu_check.md.tmp"
        tmp.write_text(summary())
        os.replace(tmp, out / "gpu_check.md")
    except Exception as exc:  # never let reporting kill the run
        print(f"(could not write results: {exc})", flush=True)


_LAST_SAVE = [0.0]


def maybe_save() -> None:
    """save() at most every 5 s: a run killed by the hard stop still leaves its items so far."""
    if time.time() - _LAST_SAVE[0] > 5.0:
        _LAST_SAVE[0] = time.time()
        save()


def run_section(name: str, fn, need_s: float) -> None:
    if name not in ARGS.sections.split(","):
        return
    if left() < need_s:
        RESULTS["skipped"].append(f"section {name}: {left():.0f}s left, needs ~{need_s:.0f}s")
        log(f"SKIP section {name} (time)")
        return
    log(f"== {name}")
    start = time.time()
    try:
        fn()
    except Exception as exc:
        RESULTS["errors"][name] = f"{type(exc).__name__}: {exc}\n" + traceback.format_exc()[-3000:]
        log(f"ERROR in section {name}: {type(exc).__name__}: {exc}")
    RESULTS.setdefault("section_seconds", {})[name] = round(time.time() - start, 1)
    save()


def item_error(section: str, key: str, exc: Exception) -> None:
    RESULTS["errors"][f"{section}:{key}"] = f"{type(exc).__name__}: {exc}\n" + traceback.format_exc()[-2000:]
    log(f"  ERROR {key}: {type(exc).__name__}: {str(exc)[:300]}")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, min_reps: int = 10, max_ms: float = 1500.0) -> dict:
    """Median time of fn: do_bench (events, L2 flushed before each call) on CUDA, a wall clock in the dry run."""
    if DEVICE.type != "cuda":
        return B.time_cpu(fn, reps=1, warmup=0)
    import triton.testing

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = max((time.perf_counter() - t0) * 1e3, 0.01)
    rep = min(max(50.0, min_reps * est), max_ms)
    med, p20, p80 = triton.testing.do_bench(fn, warmup=max(10.0, 2 * est), rep=rep, quantiles=[0.5, 0.2, 0.8])
    return {"median_ms": float(med), "p20_ms": float(p20), "p80_ms": float(p80)}


def generator(seed=None):
    g = torch.Generator(device=DEVICE)
    g.manual_seed(int.from_bytes(os.urandom(4), "little") if seed is None else seed)
    return g


# =============================================================================================== 1. env
def section_env():
    env = B.environment(DEVICE)
    try:
        import subprocess

        env["git"] = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %ad", "--date=short"],
                                    capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        pass
    RESULTS["sections"]["env"] = env
    for k, v in env.items():
        log(f"  {k}: {v}")


# =============================================================================================== 2. copy
def section_copy():
    n = (4 << 20) if DRY else (1 << 29)  # 2 GiB of fp32 on the GPU, far beyond L2
    src = torch.randn(n, device=DEVICE, generator=generator())
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src))
    moved = 2 * n * 4
    gbs = moved / t["median_ms"] / 1e6
    ok = torch.equal(dst, src)
    RESULTS["sections"]["copy"] = dict(bytes=moved, **t, gb_s=gbs, copy_correct=bool(ok))
    log(f"  copy_: {moved / 1e9:.2f} GB (read + written) in {t['median_ms']:.3f} ms = {gbs:.0f} GB/s")
    del src, dst


def copy_gbs():
    c = RESULTS["sections"].get("copy")
    return c["gb_s"] if c else None


# =============================================================================================== 3. correctness
def _bucket_from_shapes(shapes, dtype, gen, zero_index=None):
    buf = B.random_buffer(sum(numel(s) for s in shapes), dtype, DEVICE, gen)
    bucket = B.FakeGradBucket(buf, shapes)
    if zero_index is not None:
        bucket.gradients()[zero_index].zero_()  # an all-zero layer: its P column must stay 0, not NaN
    return bucket


def _ragged_shapes(gen_cpu):
    shapes = []
    for i in range(40):
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
    res = dict(variant=variant, layout=kind, dtype=str(dtype).replace("torch.", ""), rank=rank,
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
        e_out = torch.full_like(err, nan) if (has_err and keep) else err
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
    if DRY:  # the interpreter is slow: every variant once, then one case of each other layout kind
        plan = [(v, "resnet50", f32, 4) for v in CORR_VARIANTS] + [
            ("project+error", "ragged", f32, 16), ("orthogonalize-p", "ragged", f32, 4),
            ("reconstruct+error", "batched", bf16, 1), ("project_t", "gpt2", f32, 4)]
    return plan


def section_correctness():
    rows = []
    RESULTS["sections"]["correctness"] = {"cases": rows}
    cap = time.time() + (95.0 if not DRY else 60.0)
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
            rows.append(dict(variant=variant, layout=kind, dtype=str(dtype)[6:], rank=rank, ok=False,
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


def kernel_rows(model, dtype, rank, with_pytorch, cap):
    rows = RESULTS["sections"].setdefault("kernels", {}).setdefault("rows", [])
    gen = generator()
    cbw = copy_gbs()
    done = 0
    for d in _distinct_buckets(model, dtype):
        if MAX_KERNEL_BUCKETS is not None and done >= MAX_KERNEL_BUCKETS:
            return
        if time.time() > cap or left() < RESERVE["kernels"]:
            RESULTS["skipped"].append(f"kernels {model} {dtype} r{rank} bucket {d['index']} and later (time)")
            return
        if not (_is_25mb(d["nbytes"]) or d["nbytes"] > 2 * BUCKET_MB * 2**20):
            continue  # DDP's small first and last buckets: launch-bound, not what the bandwidth target is about
        bucket = B.FakeGradBucket(B.random_buffer(sum(numel(s) for s in d["shapes"]), dtype, DEVICE, gen),
                                  d["shapes"], index=d["index"], num_buckets=d["index"] + 1)
        kb = B.KernelBench(bucket, rank, generator=gen)
        if kb.layout.num_matrices == 0:
            continue
        done += 1
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
                           is_25mb=_is_25mb(d["nbytes"]), dtype=str(dtype)[6:], rank=rank, kernel=kernel,
                           impl=impl, matrices=kb.layout.num_matrices, bytes=nbytes, **t, gb_s=gbs,
                           frac_copy=(gbs / cbw) if cbw else None)
                rows.append(row)
                maybe_save()
                frac = f"{100 * row['frac_copy']:.0f}% of copy" if cbw else ""
                log(f"  {key:50s} {t['median_ms']:8.3f} ms {gbs:8.1f} GB/s {frac}")
        del kb, bucket


def section_kernels():
    cap = time.time() + (50.0 if not DRY else 30.0)
    f32, bf16 = torch.float32, torch.bfloat16
    plan = [("resnet50", f32), ("resnet50", bf16), ("gpt2", f32), ("gpt2", bf16)]
    for model, dtype in plan[:1] if DRY else plan:
        kernel_rows(model, dtype, 4, with_pytorch=(dtype == f32), cap=cap)


def section_kernels_extra():
    cap = time.time() + (30.0 if not DRY else 15.0)
    for rank in (1,) if DRY else (1, 16):
        kernel_rows("resnet50", torch.float32, rank, with_pytorch=False, cap=cap)


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
            if dist.is_initialized():
                dist.destroy_process_group()
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


def hook_case(model, rank, dtype, cap):
    rows = RESULTS["sections"].setdefault("hooks", {}).setdefault("rows", [])
    pg = _pg_backend()
    gen = generator()
    case = dict(model=model, rank=rank, dtype=str(dtype)[6:], process_group=pg)
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
                buckets = B.model_buckets(model, dtype, DEVICE, bucket_cap_mb=BUCKET_MB,
                                          first_bucket_mb=FIRST_BUCKET_MB, shrink=SHRINK, generator=gen)
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
            rows.append(row)  # the time is kept even if a count below fails
            times[impl] = t["median_ms"]
            log(f"  {key:36s} [{s0.impl}] {t['median_ms']:9.3f} ms/step (median; p20 {t['p20_ms']:.3f}, "
                f"p80 {t['p80_ms']:.3f})")
            hs = s0 if isinstance(s0, B.HookStep) else None
            for what, fn in (("counts", lambda: _hook_counts(row, s0, hs)),
                             ("device kernels", lambda: _device_kernels(row, s0)),
                             ("memory", lambda: _hook_memory(row, s0, hs))):
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


def section_hooks():
    cap = time.time() + (80.0 if not DRY else 40.0)
    plan = [("resnet50", 4), ("resnet50", 1), ("gpt2", 4), ("gpt2", 1)]
    for model, rank in plan[:1] if DRY else plan:
        hook_case(model, rank, torch.float32, cap)


def section_hooks_extra():
    if DRY:
        return  # same code as section_hooks
    cap = time.time() + 40.0
    for model in ("resnet50", "gpt2"):
        hook_case(model, 4, torch.bfloat16, cap)
    hook_case("resnet50", 16, torch.float32, cap)


# =============================================================================================== summary
def _fmt(v, spec=".3g"):
    return "-" if v is None else format(v, spec)


def summary() -> str:
    S = RESULTS["sections"]
    lines = ["# powersgd_triton gpu_check" + (" (DRY RUN: CPU + interpreter, tiny shapes)" if DRY else ""), ""]
    env = S.get("env", {})
    lines.append(f"- date {env.get('date')}, GPU {env.get('gpu', '-')} (cc {env.get('capability', '-')}, "
                 f"{env.get('sms', '-')} SMs, L2 {env.get('l2_mib', '-')} MiB), driver/clocks "
                 f"{env.get('nvidia_smi', '-')}")
    lines.append(f"- python {env.get('python')}, torch {env.get('torch')}, triton {env.get('triton')}, "
                 f"CUDA {env.get('cuda', '-')}; checkout {env.get('git', '-')}; process group {RESULTS.get('pg', '-')}")
    lines.append("- command: `PYTHONPATH=. python bench/gpu_check.py" + (" --dry-run`" if DRY else "`")
                 + f"; elapsed {elapsed():.0f} s of {BUDGET:.0f} s budget")
    c = S.get("copy")
    if c:
        lines.append(f"- copy bandwidth (copy_ of {c['bytes'] / 2e9:.2f} GB, read + written): "
                     f"**{c['gb_s']:.0f} GB/s** (median {c['median_ms']:.3f} ms)")
    corr = S.get("correctness")
    if corr:
        lines += ["", f"## Correctness vs float64: {corr.get('passed', 0)} passed, {corr.get('failed', 0)} failed "
                      f"of {len(corr.get('cases', []))} run ({corr.get('planned', '?')} planned)", ""]
        bad = [r for r in corr.get("cases", []) if not r.get("ok")]
        if bad:
            lines.append("| variant | layout | dtype | r | checks / error |")
            lines.append("| --- | --- | --- | --- | --- |")
            for r in bad[:40]:
                detail = r.get("error") or ", ".join(f"{k}={v:.2e}" for k, v in r.get("checks", {}).items())
                detail += f", nonfinite={r.get('nonfinite')}" if "nonfinite" in r else ""
                lines.append(f"| {r['variant']} | {r['layout']} | {r['dtype']} | {r['rank']} | {detail} |")
    k = S.get("kernels", {}).get("rows")
    if k:
        lines += ["", "## Kernel bandwidth (byte model: bytes read + written once), 25 MB buckets", "",
                  "| model | dtype | r | kernel | ours GB/s | % of copy (all 25 MB buckets) | min % | PyTorch GB/s | "
                  "PyTorch/ours time |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        keys = []
        for r in k:
            kk = (r["model"], r["dtype"], r["rank"], r["kernel"])
            if kk not in keys:
                keys.append(kk)
        for kk in keys:
            sel = [r for r in k if (r["model"], r["dtype"], r["rank"], r["kernel"]) == kk and r["is_25mb"]]
            ours = [r for r in sel if r["impl"] == "ours"]
            pt = [r for r in sel if r["impl"] == "pytorch"]
            if not ours:
                continue

            def agg(rs):
                b = sum(r["bytes"] * r["occurs"] for r in rs)
                t = sum(r["median_ms"] * r["occurs"] for r in rs)
                return b / t / 1e6 if t else None, t

            og, ot = agg(ours)
            pg, pt_t = agg(pt) if pt else (None, None)
            cb = copy_gbs()
            fr = [r["frac_copy"] for r in ours if r.get("frac_copy") is not None]
            lines.append(f"| {kk[0]} | {kk[1]} | {kk[2]} | {kk[3]} | {_fmt(og, '.0f')} | "
                         f"{_fmt(100 * og / cb if (og and cb) else None, '.0f')} | "
                         f"{_fmt(100 * min(fr) if fr else None, '.0f')} | {_fmt(pg, '.0f')} | "
                         f"{_fmt(pt_t / ot if (pt_t and ot) else None, '.2f')} |")
        big = [r for r in k if not r["is_25mb"] and r["impl"] == "ours" and r["bucket_bytes"] > 2 * BUCKET_MB * 2**20]
        if big:
            lines += ["", "Buckets larger than 25 MB (e.g. GPT-2's embedding bucket):", "",
                      "| model | bucket | MB | dtype | r | kernel | GB/s | % of copy |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
            for r in big:
                lines.append(f"| {r['model']} | {r['bucket']} | {r['bucket_bytes'] / 2**20:.0f} | {r['dtype']} | "
                             f"{r['rank']} | {r['kernel']} | {r['gb_s']:.0f} | "
                             f"{_fmt(100 * r['frac_copy'] if r.get('frac_copy') else None, '.0f')} |")
    h = S.get("hooks", {}).get("rows")
    if h:
        lines += ["", "## Whole hook step (all buckets of the model), world size 1", "",
                  "| model | r | dtype | impl | ms/step (median) | PyTorch/ours | device kernels/step | Triton launches | "
                  "ATen compute ops | all-reduces (bytes) | held | peak extra |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in h:
            other = [x for x in h if (x["model"], x["rank"], x["dtype"]) == (r["model"], r["rank"], r["dtype"])
                     and x["impl"] == "pytorch"]
            ratio = other[0]["median_ms"] / r["median_ms"] if (other and r["impl"] == "ours") else None
            lines.append(f"| {r['model']} | {r['rank']} | {r['dtype']} | {r['variant']} | {r['median_ms']:.3f} | "
                         f"{_fmt(ratio, '.2f')} | {_fmt(r.get('kernels_per_step'), 'd')} | "
                         f"{_fmt(r.get('triton_launches'), 'd')} | {_fmt(r.get('aten_compute'), 'd')} | "
                         f"{_fmt(r.get('allreduce_calls'), 'd')} ({B.fmt_bytes(r.get('allreduce_bytes'))}) | "
                         f"{B.fmt_bytes(r.get('held_bytes'))} | {B.fmt_bytes(r.get('peak_extra_bytes'))} |")
    if RESULTS["errors"]:
        lines += ["", "## Errors", ""]
        for key, msg in RESULTS["errors"].items():
            lines.append(f"- `{key}`: {msg.splitlines()[0][:300]}")
    if RESULTS["skipped"]:
        lines += ["", "## Skipped (time budget)", ""] + [f"- {s}" for s in RESULTS["skipped"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    log(f"gpu_check: device {DEVICE}, budget {BUDGET:.0f}s, out {ARGS.out or '(none)'}")
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a machine without GPU", flush=True)
        RESULTS["errors"]["setup"] = "no CUDA device"
        save()
        return 2
    run_section("env", section_env, 0)
    run_section("copy", section_copy, 5)
    run_section("correctness", section_correctness, 20)
    run_section("kernels", section_kernels, 20)
    run_section("hooks", section_hooks, 25)
    run_section("kernels-extra", section_kernels_extra, 15)
    run_section("hooks-extra", section_hooks_extra, 15)
    save()
    text = summary()
    print("\n" + text, flush=True)
    corr = RESULTS["sections"].get("correctness", {})
    return 1 if (corr.get("failed") or RESULTS["errors"]) else 0


if __name__ == "__main__":
    code = main()
    faulthandler.cancel_dump_traceback_later()
    sys.exit(code)
