#!/usr/bin/env python3
"""ONE command for a GPU run of powersgd_triton: compiles, correctness, non-finite inputs, bandwidth, hook step.

    PYTHONPATH=. python bench/gpu_check.py --quick      # on the GPU machine, from a bare checkout: < 3 min on an H200
    PYTHONPATH=. python bench/gpu_check.py              # the full run, < 5 min
    PYTHONPATH=. python bench/gpu_check.py --dry-run    # CPU + Triton interpreter, tiny shapes (the CI smoke test)

Needs only torch, triton and numpy (nothing to install; platformdirs, filelock, tqdm are used when present).
Sections (each one catches and records its own failures, then the run goes on; every item checks the time left):

1. ``env``: versions, GPU name, SMs, L2, driver and clocks.
2. ``compile``: every kernel variant the later sections launch is compiled first, under its own budget, so the timed
   sections start warm. On a GPU: worker processes (one per CPU core, up to 16) each run a share of the later
   sections' items once (same shapes, dtypes, ranks and configs), which fills Triton's on-disk cache; then per
   compiled binary its compile seconds, registers, spills, shared memory, warps/stages and blocks per SM
   (``autotune.aot.resource_usage``: ``ptxas -v``) beside the loaded kernel's ``n_regs``/``n_spills``. In the dry
   run: the same kernels are compiled ahead of time for sm_90 (``python -m powersgd_triton.autotune.aot --plan``) for
   the same tables; the interpreter runs the checks.
3. ``copy``: the device's copy bandwidth, a large ``copy_`` timed with ``triton.testing.do_bench`` (median),
   counting bytes read + written.
4. ``correctness``: every kernel variant against a float64 torch oracle on fresh random inputs, outputs poisoned with
   NaN before the launch (every element must be written), regions outside the compressed matrices checked untouched;
   real ResNet-50 and GPT-2 buckets, ragged shapes (with an all-zero layer) and the batched view; ranks 1/4/16; fp32,
   bf16, fp16; also the local-residual reconstruct (alternating hook) and the pack/unpack of uncompressed gradients.
5. ``nonfinite``: every kernel variant in every gradient dtype on inputs holding +-inf and NaNs with the payloads
   GPUs produce (``0x7FFFFFFF``, ``0xFFFFFFFF`` as float32; ``0x7FFF``, ``0xFFFF`` as bf16/fp16) besides the
   canonical one: each output must be non-finite exactly where the float64 oracle's is, and finite elements right.
6. ``kernels``: each kernel's achieved bandwidth (byte model: bytes read + written, once each) on the 25 MB buckets
   of ResNet-50 (and GPT-2 in the full run), as a fraction of the measured copy bandwidth; PyTorch's hook's code for
   the same step beside it (rank 4).
7. ``hooks``: the whole hook step (every bucket of the model) of PyTorch's ``powerSGD_hook`` against ours (Triton
   backend), rank 4 fp32 and bf16 (full run: also rank 1/16 and GPT-2): ``do_bench`` median over two rotating copies
   of the buckets, device kernels per step (``torch.profiler``), Triton launches, ATen ops, all-reduce calls and
   bytes, memory held per bucket and peak extra memory of a step.

``--quick`` keeps what matters (every kernel's correctness and non-finite checks, ResNet-50 25 MB bucket bandwidth at
rank 4 fp32, the ResNet-50 hook step at rank 4 fp32 and bf16). Prints progress as it goes and a markdown summary at
the end; writes ``gpu_check.json`` and ``gpu_check.md`` into ``$OUT`` (or ``--out``) after every section, so a run cut
short still leaves its results; every skipped item is listed with its reason. Targets (not asserted): hook step >= 5x
faster than PyTorch's on an H100/H200; each kernel >= 60 % of the copy bandwidth on 25 MB buckets. Exit status 1 when
a check failed or a section raised.
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
RANK = "matrix_approximation_rank"  # the key of PowerSGD's r in every row (not a process rank)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", "--cpu", dest="dry_run", action="store_true",
                    help="run on CPU with the Triton interpreter and tiny shapes (checks the script, not the GPU)")
    ap.add_argument("--quick", action="store_true",
                    help="only the numbers that matter (see the module docstring); < 3 min on an H200")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run (default: 170 with --quick, 285 full, 150 dry)")
    ap.add_argument("--compile-budget", type=float, default=None,
                    help="seconds for the compile phase (default: 70 with --quick, 90 full, 30 dry)")
    ap.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPU cores, at most 16)")
    ap.add_argument("--compile-mode", choices=("auto", "aot", "workers"), default="auto",
                    help="auto: JIT warm-up workers on a GPU, ahead-of-time sm_90 compiles in the dry run; "
                         "'workers' in the dry run runs the workers in the interpreter (tests their plumbing)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma list of sections to run (default: all)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json/.md (default $OUT)")
    ap.add_argument("--history", default=None, metavar="PATH",
                    help="benchmark history to append the kernel and hook timings to when every correctness and "
                         "non-finite case passed (default: bench/history.jsonl of this checkout on a GPU; none in the "
                         "dry run); a copy of the lines always goes to history.jsonl in --out")
    ap.add_argument("--warm-worker", default=None, help=argparse.SUPPRESS)  # "i/N": compile-phase worker (GPU)
    ap.add_argument("--warm-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warm-deadline", type=float, default=None, help=argparse.SUPPRESS)  # time.time() to stop
    return ap.parse_args(argv)


SECTIONS = ("env", "compile", "copy", "correctness", "nonfinite", "kernels", "hooks", "kernels-extra", "hooks-extra")
ARGS = parse_args()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
WORKER = ARGS.warm_worker is not None
QUICK = ARGS.quick
T0 = time.time()
BUDGET = ARGS.budget if ARGS.budget is not None else (150.0 if ARGS.dry_run else 170.0 if QUICK else 285.0)
COMPILE_BUDGET = ARGS.compile_budget if ARGS.compile_budget is not None else (
    30.0 if ARGS.dry_run else 70.0 if QUICK else 90.0)
if not WORKER:  # hard stop a little after the budget, whatever hangs: prints every thread's stack and exits
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
MAX_KERNEL_BUCKETS = 1 if (DRY or QUICK) else None
MAX_HOOK_BUCKETS = 1 if DRY else None  # the interpreter: the first bucket of the model walks every code path

RESULTS = {"script": "bench/gpu_check.py", "argv": sys.argv[1:], "dry_run": DRY, "quick": QUICK, "budget_s": BUDGET,
           "compile_budget_s": COMPILE_BUDGET, "sections": {}, "errors": {}, "skipped": []}


# Seconds each section leaves for the ones after it (compile -> correctness -> nonfinite -> kernels -> hooks).
if DRY:
    RESERVE = {"compile": 70.0, "correctness": 50.0, "nonfinite": 25.0, "kernels": 15.0, "hooks": 5.0}
elif QUICK:
    RESERVE = {"compile": 80.0, "correctness": 75.0, "nonfinite": 65.0, "kernels": 50.0, "hooks": 5.0}
else:
    RESERVE = {"compile": 180.0, "correctness": 140.0, "nonfinite": 125.0, "kernels": 85.0, "hooks": 8.0}
# Longest each section may take (it stops there and lists what it skipped).
CAP = {"correctness": 45.0 if DRY else 30.0 if QUICK else 60.0, "nonfinite": 40.0 if DRY else 15.0 if QUICK else 20.0,
       "kernels": 25.0 if DRY else 25.0 if QUICK else 45.0, "kernels-extra": 15.0 if DRY else 20.0,
       "hooks": 40.0 if DRY else 60.0, "hooks-extra": 35.0}


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
                if impl == "ours":  # PERFORMANCE MODEL: its prediction beside the measurement (None without it)
                    row["model_ms"] = perf_prediction("kernel", kernel=kernel, layout=kb.layout, dtype=dtype,
                                                      rank=rank)
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
    orthogonalizing it at the start of each step (``_step.ORTHOGONALIZE_AHEAD = False``), over 4 compressed steps
    of the same buckets."""
    from powersgd_triton import _step

    outs = []
    for ahead in (True, False):
        _step.ORTHOGONALIZE_AHEAD = ahead
        try:
            buckets = _hook_buckets(model, dtype, generator(1234))
            s = B.HookStep("ours", buckets, rank, backend="triton").warmup(1)
            for _ in range(3):
                s()
            sync()
            outs.append([b.buffer().clone() for b in buckets])
        finally:
            _step.ORTHOGONALIZE_AHEAD = True
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
                row["model_ms"] = perf_prediction("hook", model=model, rank=rank, dtype=dtype, buckets=s0.buckets)
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


# =============================================================================================== 2b. compile
def _dn(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dt(name: str):
    return getattr(torch, name)


def warm_items():
    """Every item the later sections will run, as JSON lists, in their order: what the compile phase warms."""
    chosen = ARGS.sections.split(",")
    items = []
    if "correctness" in chosen:
        items += [["correctness", v, kind, _dn(dt), r] for v, kind, dt, r in correctness_plan()]
    if "nonfinite" in chosen:
        items += [["nonfinite", v, _dn(dt), r] for v, dt, r in special_plan()]
    for sec, extra in (("kernels", False), ("kernels-extra", True)):
        if sec in chosen:
            items += [["kernels", m, _dn(dt), r] for m, dt, r, _ in kernel_plan(extra)]
    for sec, extra in (("hooks", False), ("hooks-extra", True)):
        if sec in chosen:
            items += [["hooks", m, _dn(dt), r] for m, r, dt in hook_plan(extra)]
    out = []
    for it in items:  # the same item twice (e.g. kernels and kernels-extra) is warmed once
        if it not in out:
            out.append(it)
    return out


def run_item(item, gen):
    """Run one item of a later section once, untimed (the compile phase's workers)."""
    kind = item[0]
    if kind == "correctness":
        _, v, lay, dt, r = item
        return check_kernel(v, lay, _dt(dt), r, gen)
    if kind == "nonfinite":
        _, v, dt, r = item
        return check_special(v, _dt(dt), r, gen)
    if kind == "kernels":
        _, model, dt, r = item
        for d in _kernel_buckets(model, _dt(dt)):
            _, kb = _kernel_bench(d, _dt(dt), r, gen)
            for kernel in B.KERNELS:
                kb.ours(kernel, backend="triton")()
            sync()
        return None
    if kind == "hooks":
        _, model, dt, r = item
        _pg_backend()
        B.HookStep("ours", _hook_buckets(model, _dt(dt), gen), r, backend="triton").warmup(1)
        sync()
        return None
    raise ValueError(item)


def _group_key(item):
    """Items that launch the same binaries go to the same worker (it compiles them once)."""
    if item[0] in ("correctness", "nonfinite"):
        v = item[1]
        dt = None if v.startswith("orthogonalize") else item[-2]  # the factors are float32 whatever the bucket
        return (v, dt, item[-1])
    return tuple(item)


def _assign(items, n):
    """Split items into n lists: groups of the same binaries kept together, biggest groups first, least loaded."""
    groups = {}
    for it in items:
        groups.setdefault(_group_key(it), []).append(it)
    cost = lambda g: len(g) + (g[0][-1] ** 2 / 8.0 if str(g[0][1]).startswith("orthogonalize") else 0)  # noqa
    loads = [[0.0, []] for _ in range(n)]
    for g in sorted(groups.values(), key=lambda g: (g[0][0] == "hooks", -cost(g))):
        slot = min(loads, key=lambda x: x[0])
        slot[0] += cost(g)
        slot[1].extend(g)
    return [x[1] for x in loads]


def _jit_binaries():
    """``{(kernel name, hash): compiled kernel}`` of everything Triton's JIT compiled (or loaded) in this process."""
    from powersgd_triton.kernels import triton_ops as T

    out = {}
    for name, fn in T.KERNEL_FUNCTIONS.items():
        jit = fn if hasattr(fn, "device_caches") else getattr(fn, "fn", None)  # a JITFunction, maybe wrapped
        for caches in getattr(jit, "device_caches", {}).values():
            for k in list(caches[0].values()):
                if hasattr(k, "metadata") and hasattr(k, "asm"):
                    out[(name, getattr(k, "hash", id(k)))] = k
    return out


def _describe(name, k):
    """Constexprs, gradient dtype, warps/stages of a JIT-compiled binary (best effort across Triton versions)."""
    from powersgd_triton.kernels import triton_ops as T

    fn = T.KERNEL_FUNCTIONS[name]
    names = list(getattr(fn, "arg_names", []))

    def arg(key):
        if isinstance(key, tuple) and len(key) == 1:
            key = key[0]
        return names[key] if isinstance(key, int) and key < len(names) else str(key)

    src = getattr(k, "src", None)
    consts = getattr(src, "constexprs", None) or getattr(src, "constants", None) or {}
    sig = getattr(src, "signature", None) or {}
    first = sig.get(names[0], sig.get(0)) if names else None
    md = k.metadata
    return dict(kernel=name, hash=str(getattr(k, "hash", ""))[:16],
                constexprs={arg(a): v for a, v in consts.items() if isinstance(v, (bool, int, float, str))},
                dtype=str(first).lstrip("*") if first else None, num_warps=getattr(md, "num_warps", None),
                num_stages=getattr(md, "num_stages", None))


def _usage(name, k):
    from powersgd_triton.autotune.aot import resource_usage

    row = {}
    if getattr(k, "function", None) is None:
        try:
            k._init_handles()
        except Exception:  # noqa: BLE001
            pass
    row["n_regs"], row["n_spills"] = getattr(k, "n_regs", None), getattr(k, "n_spills", None)
    try:
        row["usage"] = resource_usage(k, int(k.metadata.target.arch))
    except Exception as exc:  # noqa: BLE001
        row["usage_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return row


def warm_worker() -> int:
    """Compile-phase worker (GPU): run my share of the items once; record every binary compiled on the way."""
    i, _ = (int(x) for x in ARGS.warm_worker.split("/"))
    out = Path(ARGS.warm_out)
    mine = json.loads((out.parent / "items.json").read_text())[i]
    report = {"worker": i, "items": [], "binaries": []}
    gen = generator()

    def write():
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, default=str))
        os.replace(tmp, out)

    known = _jit_binaries()
    parent = os.getppid()
    for item in mine:
        if os.getppid() != parent or (ARGS.warm_deadline and time.time() > ARGS.warm_deadline):
            break  # the run went on without us (or ended): stop, leave no orphan on the GPU
        t0 = time.time()
        err = None
        try:
            run_item(item, gen)
        except Exception as exc:  # noqa: BLE001 - the section itself reports it again
            err = f"{type(exc).__name__}: {str(exc)[:300]}"
        dt = time.time() - t0
        now = _jit_binaries()
        new = [key for key in now if key not in known]
        known = now
        report["items"].append(dict(item=item, seconds=round(dt, 2), compiled=len(new), error=err))
        for key in new:  # the item's time is its compiles' (a launch on these shapes takes microseconds)
            row = dict(_describe(key[0], now[key]), compile_s=round(dt / len(new), 2), item=" ".join(map(str, item)))
            row.update(_usage(key[0], now[key]))
            report["binaries"].append(row)
        write()
    report["done"] = True
    write()
    return 0


def _aot_cases(items):
    """The bucket cases (shapes, dtype, rank) of the items, for ``autotune.aot --plan`` (dry run)."""
    from powersgd_triton.autotune.keys import dtype_name

    cases, seen = [], set()

    def add(label, dt, rank, shapes=None, numel_=None, rate=2.0):
        key = (dt, rank, json.dumps(shapes), numel_, rate)
        if key in seen:
            return
        seen.add(key)
        c = dict(label=label, dtype=dtype_name(_dt(dt)), rank=rank, min_compression_rate=rate)
        c.update(dict(batched=True, numel=numel_) if numel_ else dict(shapes=[list(x) for x in shapes]))
        cases.append(c)

    gcpu = torch.Generator().manual_seed(0)
    for it in items:
        if it[0] == "correctness":
            _, v, kind, dt, r = it
            if kind == "batched":
                add(f"batched {dt} r{r}", dt, r, numel_=20_011 if DRY else 1_000_003)
            elif kind == "ragged":
                add(f"ragged {dt} r{r}", dt, r, _ragged_shapes(gcpu), rate=0.5)
            else:
                groups = B.model_bucket_shapes(kind, _dt(dt), BUCKET_MB, FIRST_BUCKET_MB,
                                               SHRINK * (2 if (DRY and kind == "gpt2") else 1))
                shapes = max(groups, key=len) if kind == "resnet50" else max(
                    groups, key=lambda g: sum(numel(x) for x in g))
                add(f"{kind} {dt} r{r}", dt, r, shapes)
        elif it[0] == "nonfinite":
            add(f"nonfinite {it[2]} r{it[3]}", it[2], it[3], SPECIAL_SHAPES, rate=1.0)
        elif it[0] == "kernels":
            _, model, dt, r = it
            for d in _kernel_buckets(model, _dt(dt)):
                add(f"{model} b{d['index']} {dt} r{r}", dt, r, d["shapes"])
        elif it[0] == "hooks":
            _, model, dt, r = it
            groups = B.model_bucket_shapes(model, _dt(dt), BUCKET_MB, FIRST_BUCKET_MB, SHRINK)
            for bi, shapes in enumerate(groups[:MAX_HOOK_BUCKETS] if MAX_HOOK_BUCKETS else groups):
                add(f"hook {model} b{bi} {dt} r{r}", dt, r, shapes)
    return cases


def _wait(procs, deadline):
    """Wait for the processes until ``deadline``; kill (process group) the ones still running. Returns them."""
    import signal

    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    late = [p for p in procs if p.poll() is None]
    for p in late:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            p.kill()
        p.wait()
    return late


def _child_env(interpret: bool, aot: bool = False):
    """The environment of a compile-phase child. Workers keep this process's (Triton's cache key may include
    environment variables: a difference would make their binaries miss in this process)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    if aot:
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, without its warning
    return env


def section_compile():
    import subprocess
    import tempfile

    items = warm_items()
    sec = RESULTS["sections"]["compile"] = {"items": len(items), "budget_s": COMPILE_BUDGET, "binaries": []}
    budget = max(0.0, min(COMPILE_BUDGET, left() - RESERVE["compile"]))
    deadline = time.time() + budget
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_compile_"))
    jobs = max(1, ARGS.jobs or min(16, os.cpu_count() or 1))
    t0 = time.time()
    mode = ARGS.compile_mode if ARGS.compile_mode != "auto" else ("aot" if DRY else "workers")
    if mode == "aot":
        # The interpreter compiles nothing: compile for sm_90 ahead of time what a GPU run would launch.
        cases = _aot_cases(items)
        (tmp / "cases.json").write_text(json.dumps(cases))
        jsonl = tmp / "aot.jsonl"
        cmd = [sys.executable, "-m", "powersgd_triton.autotune.aot", "--plan", str(tmp / "cases.json"), "--jsonl",
               str(jsonl), "--archs", "90", "--jobs", str(min(jobs, 2)), "--usage"]
        sec.update(mode="ahead of time, sm_90 (dry run: the checks run in the interpreter)", cases=len(cases),
                   processes=min(jobs, 2))
        log(f"  AOT-compiling what {len(items)} items launch ({len(cases)} bucket cases) for sm_90, "
            f"{min(jobs, 2)} processes, {budget:.0f}s")
        with open(tmp / "aot.log", "w") as logf:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=_child_env(False, aot=True), stdout=logf,
                                    stderr=subprocess.STDOUT,
                                    start_new_session=True)
            late = _wait([proc], deadline)
        done = [json.loads(x) for x in jsonl.read_text().splitlines()] if jsonl.exists() else []
        planned_file = Path(str(jsonl) + ".planned")
        planned = json.loads(planned_file.read_text()) if planned_file.exists() else []
        for r in done:
            u = r.get("usage") or {}
            cfg = r.get("config_used", r["config"])
            sec["binaries"].append(dict(kernel=r["kernel"], constexprs=dict(cfg, R=r["R"], **r["variant"]),
                                        dtype=r["dtype"], arch=r["arch"], compile_s=r["seconds"], ok=r["ok"],
                                        error=r.get("error"), item=r.get("case"), usage=u or None,
                                        usage_error=r.get("usage_error"), num_warps=u.get("num_warps"),
                                        num_stages=u.get("num_stages")))
            if not r["ok"]:
                RESULTS["errors"][f"compile:{r['kernel']} {r['config']} {r['variant']}"] = r.get("error")
        key = lambda j: (j["kernel"], json.dumps(j["config"], sort_keys=True), j["R"], j["dtype"],  # noqa: E731
                         json.dumps(j["variant"], sort_keys=True))
        got = {key(r) for r in done}
        rest = [j for j in planned if key(j) not in got]
        if rest or late or not planned:
            by = {}
            for j in rest:
                by[j["kernel"]] = by.get(j["kernel"], 0) + 1
            why = f"compile budget {budget:.0f}s" if late else "the AOT run ended early (see its log)"
            RESULTS["skipped"].append(f"compile: {len(rest)} of {len(planned)} planned compilations not done "
                                      f"({why}): " + ", ".join(f"{k} x{n}" for k, n in by.items()))
            if not late and not planned:
                RESULTS["errors"]["compile"] = (tmp / "aot.log").read_text()[-3000:]
    else:
        n = min(jobs, len(items)) or 1
        shares = _assign(items, n)
        (tmp / "items.json").write_text(json.dumps(shares))
        sec.update(mode=f"JIT warm-up in {n} worker processes (Triton's on-disk cache)", processes=n)
        log(f"  warming {len(items)} items in {n} processes, {budget:.0f}s")
        procs, logs = [], []
        for i in range(n):
            logs.append(open(tmp / f"w{i}.log", "w"))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--warm-worker", f"{i}/{n}", "--warm-out",
                   str(tmp / f"w{i}.json"), "--sections", ARGS.sections, "--warm-deadline", str(deadline)] + (
                   ["--quick"] if QUICK else []) + (["--dry-run"] if DRY else [])
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_child_env(DRY), stdout=logs[-1],
                                          stderr=subprocess.STDOUT, start_new_session=True))
        late = _wait(procs, deadline)
        for f in logs:
            f.close()
        seen, unfinished, item_errors = set(), [], []
        for i in range(n):
            path = tmp / f"w{i}.json"
            rep = json.loads(path.read_text()) if path.exists() else {"items": [], "binaries": []}
            finished = [x["item"] for x in rep["items"]]
            unfinished += [it for it in shares[i] if it not in finished]
            item_errors += [f"{' '.join(map(str, x['item']))}: {x['error']}" for x in rep["items"] if x["error"]]
            for b in rep["binaries"]:
                if (b["kernel"], b["hash"]) in seen:
                    continue  # two workers compiled the same binary
                seen.add((b["kernel"], b["hash"]))
                sec["binaries"].append(b)
            if procs[i].returncode not in (0, None) and procs[i] not in late:
                tail = (tmp / f"w{i}.log").read_text()[-1500:]
                RESULTS["errors"][f"compile:worker {i}"] = f"exit {procs[i].returncode}: {tail}"
        sec["item_errors"] = item_errors
        sec["items_warmed"] = len(items) - len(unfinished)
        if unfinished:
            RESULTS["skipped"].append(f"compile: {len(unfinished)} of {len(items)} items not warmed (compile budget "
                                      f"{budget:.0f}s; they compile in their own section): "
                                      + "; ".join(" ".join(map(str, it)) for it in unfinished[:20]))
    sec["seconds"] = round(time.time() - t0, 1)
    per = {}
    for b in sec["binaries"]:
        d = per.setdefault(b["kernel"], dict(binaries=0, seconds=0.0, max_s=0.0))
        d["binaries"] += 1
        d["seconds"] = round(d["seconds"] + (b.get("compile_s") or 0.0), 2)
        d["max_s"] = max(d["max_s"], b.get("compile_s") or 0.0)
    sec["per_kernel"] = per
    for k, d in per.items():
        log(f"  {k:14s} {d['binaries']:3d} binaries, {d['seconds']:7.1f} s compiling, max {d['max_s']:5.1f} s")
    for b in sec["binaries"]:
        u = b.get("usage") or {}
        log(f"    {b['kernel']:14s} {_fmt_consts(b.get('constexprs'))[:60]:60s} {b.get('dtype') or '':8s} "
            f"regs {_fmt(u.get('registers'), 'd')} spill {_fmt(u.get('spill_bytes'), 'd')} "
            f"smem {_fmt(u.get('shared_bytes'), 'd')} blocks/SM {_fmt(u.get('blocks_per_sm'), 'd')}"
            + (f" n_regs {b.get('n_regs')} n_spills {b.get('n_spills')}" if b.get("n_regs") is not None else ""))
    log(f"  compile phase: {len(sec['binaries'])} binaries in {sec['seconds']} s")


def _fmt_consts(c) -> str:
    if not c:
        return "-"
    short = {"BLOCK_N": "N", "BLOCK_M": "M", "BLOCK_K": "K", "BLOCK": "B", "USE_DOT": "dot", "num_warps": "w",
             "num_stages": "s", "HAS_ERROR": "err", "HAS_FLAG": "flag", "LOCAL_ERR": "local", "SPLIT_ROWS": "split"}
    return " ".join(f"{short.get(k, k)}={int(v) if isinstance(v, bool) else v}" for k, v in c.items())


# ----------------------------------------------------------------------------------------------- performance model
def perf_prediction(what: str, **kw):
    """PERFORMANCE MODEL: its predicted ms for a measured item, printed beside the measurement; None without it.

    :func:`powersgd_triton.perfmodel.predict_measured` (``what``: "kernel" with kernel, layout, dtype, rank; "hook"
    with model, rank, dtype, buckets; ``device`` always; it compiles the kernels for the GPU, so it runs with
    TRITON_INTERPRET unset and returns None on a GPU other than an H100/H200): its float is shown as "model ms";
    any failure shows "-" and never stops the run (the dry run, under the interpreter, shows "-").
    """
    try:
        import importlib

        pm = importlib.import_module("powersgd_triton.perfmodel")
        fn = getattr(pm, "predict_measured", None)
        if fn is None:
            return None
        value = fn(what, device=DEVICE, **kw)
        return float(value) if value is not None else None
    except Exception:  # noqa: BLE001 - the model is an extra; the measurement stands alone
        return None


# =============================================================================================== summary
def _fmt(v, spec=".3g"):
    return "-" if v is None else format(v, spec)


def _sum_or_none(values, weights):
    if not values or any(v is None for v in values):
        return None
    return sum(v * w for v, w in zip(values, weights))


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
    comp = S.get("compile")
    if comp:
        lines += ["", f"## Compile phase: {len(comp.get('binaries', []))} binaries, {comp.get('seconds', '-')} s "
                      f"(budget {comp.get('budget_s', 0):.0f} s; {comp.get('mode', '')})", "",
                  "| kernel | binaries | compile s (total) | max s |", "| --- | --- | --- | --- |"]
        for k, d in comp.get("per_kernel", {}).items():
            lines.append(f"| {k} | {d['binaries']} | {d['seconds']:.1f} | {d['max_s']:.1f} |")
        rows = comp.get("binaries", [])
        if rows:
            gpu = any(b.get("n_regs") is not None for b in rows)
            lines += ["", "### Registers, spills, shared memory, occupancy per compiled binary"
                      + (" (ptxas -v; n_regs / n_spills: the loaded kernel, n_spills in 4-byte words)" if gpu
                         else " (ptxas -v on the sm_90 compile)"), "",
                      "| kernel | constexprs / config | dtype | warps | stages | registers | spill bytes | shared B | "
                      "blocks/SM (limit) |" + (" n_regs | n_spills |" if gpu else "") + " compile s |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if gpu else "")
                      + " --- |"]
            for b in rows:
                u = b.get("usage") or {}
                lim = ""
                if u:
                    limits = {k[3:]: u[k] for k in ("by_registers", "by_shared", "by_warps", "by_blocks")}
                    lim = f" ({min(limits, key=limits.get)})"
                lines.append(f"| {b['kernel']} | {_fmt_consts(b.get('constexprs'))} | {b.get('dtype') or '-'} | "
                             f"{_fmt(b.get('num_warps'), 'd')} | {_fmt(b.get('num_stages'), 'd')} | "
                             f"{_fmt(u.get('registers'), 'd')} | {_fmt(u.get('spill_bytes'), 'd')} | "
                             f"{_fmt(u.get('shared_bytes'), 'd')} | {_fmt(u.get('blocks_per_sm'), 'd')}{lim} |"
                             + (f" {_fmt(b.get('n_regs'), 'd')} | {_fmt(b.get('n_spills'), 'd')} |" if gpu else "")
                             + f" {_fmt(b.get('compile_s'), '.1f')} |"
                             + (f" {b['usage_error'][:80]}" if b.get("usage_error") else ""))
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
                lines.append(f"| {r['variant']} | {r['layout']} | {r['dtype']} | {r[RANK]} | {detail} |")
    nf = S.get("nonfinite")
    if nf:
        lines += ["", f"## Non-finite inputs (inf, NaN payloads): {nf.get('passed', 0)} passed, {nf.get('failed', 0)} "
                      f"failed of {len(nf.get('cases', []))} run ({nf.get('planned', '?')} planned)", "",
                  "Values put in: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in nf.get("values", {}).items()),
                  "Per output: elements non-finite in the float64 oracle / finite here where the oracle is not (missed: "
                  "a finite wrong answer) / non-finite here in a matrix the oracle keeps finite (spurious); (+n): "
                  "extra non-finite elements inside a matrix the oracle already makes non-finite (not a failure).",
                  "", "| variant | dtype | r | ok | output: non-finite expected / missed / spurious | inputs |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in nf.get("cases", []):
            if "error" in r:
                lines.append(f"| {r['variant']} | {r['dtype']} | {r[RANK]} | ERROR | {r['error'][:120]} | |")
                continue
            detail = "; ".join(f"{k} {c['nonfinite_expected']}/{c['missed']}/{c['spurious']}"
                               + (f" (+{c['spurious_within']})" if c.get("spurious_within") else "")
                               for k, c in r["checks"].items())
            lines.append(f"| {r['variant']} | {r['dtype']} | {r[RANK]} | {'ok' if r['ok'] else 'FAIL'} | {detail} | "
                         f"{', '.join(r.get('placed', []))[:160]} |")
    k = S.get("kernels", {}).get("rows")
    if k:
        lines += ["", "## Kernel bandwidth (byte model: bytes read + written once), 25 MB buckets", "",
                  "| model | dtype | r | kernel | ours GB/s | % of copy (all 25 MB buckets) | min % | PyTorch GB/s | "
                  "PyTorch/ours time | ours ms | model ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        keys = []
        for r in k:
            kk = (r["model"], r["dtype"], r[RANK], r["kernel"])
            if kk not in keys:
                keys.append(kk)
        for kk in keys:
            sel = [r for r in k if (r["model"], r["dtype"], r[RANK], r["kernel"]) == kk and r["is_25mb"]]
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
                         f"{_fmt(pt_t / ot if (pt_t and ot) else None, '.2f')} | {_fmt(ot, '.3f')} | "
                         f"{_fmt(_sum_or_none([r.get('model_ms') for r in ours], [r['occurs'] for r in ours]), '.3f')} |")
        big = [r for r in k if not r["is_25mb"] and r["impl"] == "ours" and r["bucket_bytes"] > 2 * BUCKET_MB * 2**20]
        if big:
            lines += ["", "Buckets larger than 25 MB (e.g. GPT-2's embedding bucket):", "",
                      "| model | bucket | MB | dtype | r | kernel | GB/s | % of copy |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
            for r in big:
                lines.append(f"| {r['model']} | {r['bucket']} | {r['bucket_bytes'] / 2**20:.0f} | {r['dtype']} | "
                             f"{r[RANK]} | {r['kernel']} | {r['gb_s']:.0f} | "
                             f"{_fmt(100 * r['frac_copy'] if r.get('frac_copy') else None, '.0f')} |")
    h = S.get("hooks", {}).get("rows")
    if h:
        lines += ["", "## Whole hook step (all buckets of the model), world size 1", "",
                  "| model | r | dtype | impl | ms/step (median) | model ms | PyTorch/ours | device kernels/step | "
                  "Triton launches | ATen compute ops | all-reduces (bytes) | held | peak extra |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in h:
            other = [x for x in h if (x["model"], x[RANK], x["dtype"]) == (r["model"], r[RANK], r["dtype"])
                     and x["impl"] == "pytorch"]
            ratio = other[0]["median_ms"] / r["median_ms"] if (other and r["impl"] == "ours") else None
            lines.append(f"| {r['model']} | {r[RANK]} | {r['dtype']} | {r['variant']} | {r['median_ms']:.3f} | "
                         f"{_fmt(r.get('model_ms'), '.3f')} | {_fmt(ratio, '.2f')} | {_fmt(r.get('kernels_per_step'), 'd')} | "
                         f"{_fmt(r.get('triton_launches'), 'd')} | {_fmt(r.get('aten_compute'), 'd')} | "
                         f"{_fmt(r.get('allreduce_calls'), 'd')} ({B.fmt_bytes(r.get('allreduce_bytes'))}) | "
                         f"{B.fmt_bytes(r.get('held_bytes'))} | {B.fmt_bytes(r.get('peak_extra_bytes'))} |")
    if RESULTS["errors"]:
        lines += ["", "## Errors", ""]
        for key, msg in RESULTS["errors"].items():
            lines.append(f"- `{key}`: {msg.splitlines()[0][:300]}")
    if RESULTS["skipped"]:
        lines += ["", "## Skipped (what, and why)", ""] + [f"- {s}" for s in RESULTS["skipped"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    if WORKER:
        return warm_worker()
    log(f"gpu_check: device {DEVICE}, {'quick, ' if QUICK else ''}budget {BUDGET:.0f}s (compile "
        f"{COMPILE_BUDGET:.0f}s), out {ARGS.out or '(none)'}")
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a machine without GPU", flush=True)
        RESULTS["errors"]["setup"] = "no CUDA device"
        save()
        return 2
    chosen = ARGS.sections.split(",")
    unknown = [x for x in chosen if x not in SECTIONS]
    if unknown:
        print(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}", flush=True)
        return 2
    RESULTS["skipped"] += [f"section {x}: not asked for (--sections)" for x in SECTIONS if x not in chosen]
    if QUICK:
        RESULTS["skipped"] += ["quick run: GPT-2 buckets, ranks 1 and 16 of the kernels and hooks sections, the "
                               "extra sections and most ragged/batched/fp16 correctness cases are the full run's"]
    run_section("env", section_env, 0)
    run_section("compile", section_compile, 10)
    run_section("copy", section_copy, 5)
    run_section("correctness", section_correctness, 10)
    run_section("nonfinite", section_nonfinite, 5)
    run_section("kernels", section_kernels, 10)
    run_section("hooks", section_hooks, 15)
    run_section("kernels-extra", section_kernels_extra, 15)
    run_section("hooks-extra", section_hooks_extra, 15)
    save()
    text = summary()
    print("\n" + text, flush=True)
    corr = RESULTS["sections"].get("correctness", {})
    nonfinite = RESULTS["sections"].get("nonfinite", {})
    failed = bool(corr.get("failed") or nonfinite.get("failed") or RESULTS["errors"])
    record_history(failed)
    return 1 if failed else 0


def record_history(failed: bool) -> None:
    """The kernel and hook timings as benchmark history lines (powersgd_triton.history), keyed by this checkout's
    commit and the GPU: into ``--history`` (default bench/history.jsonl on a GPU, none in the dry run) and a copy in
    ``$OUT/history.jsonl``. Correctness-gated: nothing is recorded unless the correctness and non-finite sections ran
    and every case passed, and no section raised."""
    from powersgd_triton import history as H

    secs = RESULTS["sections"]
    ran = "correctness" in secs and "nonfinite" in secs and "passed" in secs["correctness"]
    if failed or not ran:
        why = "a correctness or non-finite case failed, or a section raised" if failed else \
            "the correctness and non-finite sections did not both run"
        RESULTS["history"] = f"not recorded: {why}"
        log(f"history: {RESULTS['history']}")
        save()
        return
    commit, dirty = H.git_commit(str(ROOT))
    env = secs.get("env") or B.environment(DEVICE)
    records = []
    for name in ("kernels", "hooks"):  # the extra sections add their rows to these
        rows = (secs.get(name) or {}).get("rows") or []
        records += H.make_records(rows, source=f"gpu_check.{name}" + (".dry" if DRY else ""), env=env,
                                  commit=commit, dirty=dirty)
    targets = [] if not commit else [p for p in (ARGS.history or (None if DRY else str(ROOT / H.DEFAULT_PATH)),)
                                     if p]
    if ARGS.out:
        targets.append(str(Path(ARGS.out) / "history.jsonl"))
    done = []
    for path in targets:
        try:
            n = H.append(path, records, correct=True)
            done.append(f"{n} lines in {path}")
        except (OSError, ValueError) as exc:
            done.append(f"{path}: {exc}")
    RESULTS["history"] = "; ".join(done) if done else "not recorded: no git commit and no --out"
    log(f"history: {RESULTS['history']}")
    save()


if __name__ == "__main__":
    code = main()
    faulthandler.cancel_dump_traceback_later()
    sys.exit(code)
