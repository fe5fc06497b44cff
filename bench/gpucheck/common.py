"""The run's shared state: arguments, budgets, the results dict, logging, saving, timing (every room imports it)."""

import argparse
import faulthandler
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "bench" / "gpu_check.py"  # the script (the compile phase's workers run it again)
RANK = "matrix_approximation_rank"  # the key of PowerSGD's r in every row (not a process rank)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    doc = sys.modules[__package__].__doc__ or "gpu_check"
    ap = argparse.ArgumentParser(description=doc.strip().split("\n")[0])
    ap.add_argument("--dry-run", "--cpu", dest="dry_run", action="store_true",
                    help="run on CPU with the Triton interpreter and tiny shapes (checks the script, not the GPU)")
    ap.add_argument("--quick", action="store_true",
                    help="only the numbers that matter (see the module docstring); budgeted to end within 4 min "
                         "(hard stop at 245 s) on an H200")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run (default: 215 with --quick, 330 full, 220 dry); the run is stopped "
                         "30 s after it whatever hangs")
    ap.add_argument("--compile-budget", type=float, default=None,
                    help="seconds for the compile phase (default: 80 with --quick, 90 full, 30 dry)")
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


SECTIONS = ("env", "compile", "model", "copy", "correctness", "paths", "verify", "streams", "nonfinite", "kernels",
            "hooks", "kernels-extra", "hooks-extra")
ARGS = parse_args()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
WORKER = ARGS.warm_worker is not None
QUICK = ARGS.quick
T0 = time.time()
# --quick on a GPU: 215 s, stopped at 245 s whatever hangs (results are saved after every section): with Python's and
# CUDA's start, within the 5 minutes a first GPU run is given
BUDGET = ARGS.budget if ARGS.budget is not None else (220.0 if ARGS.dry_run else 215.0 if QUICK else 330.0)
COMPILE_BUDGET = ARGS.compile_budget if ARGS.compile_budget is not None else (
    30.0 if ARGS.dry_run else 80.0 if QUICK else 90.0)
if not WORKER:  # hard stop a little after the budget, whatever hangs: prints every thread's stack and exits
    faulthandler.dump_traceback_later(BUDGET + 30, exit=True)

import torch  # noqa: E402

from powersgd_triton import benchmarking as B  # noqa: E402

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


# Seconds each section leaves for the ones after it (compile -> model -> correctness -> paths -> verify -> streams ->
# nonfinite -> kernels -> hooks).
if DRY:
    RESERVE = {"compile": 150.0, "model": 148.0, "correctness": 110.0, "paths": 85.0, "verify": 75.0, "streams": 60.0,
               "nonfinite": 45.0, "kernels": 35.0, "hooks": 5.0}
elif QUICK:
    RESERVE = {"compile": 125.0, "model": 120.0, "correctness": 95.0, "paths": 85.0, "verify": 80.0, "streams": 72.0,
               "nonfinite": 62.0, "kernels": 50.0, "hooks": 5.0}
else:
    RESERVE = {"compile": 230.0, "model": 215.0, "correctness": 160.0, "paths": 145.0, "verify": 138.0,
               "streams": 128.0, "nonfinite": 118.0, "kernels": 80.0, "hooks": 8.0}
# Longest each section may take (it stops there and lists what it skipped).
CAP = {"correctness": 45.0 if DRY else 30.0 if QUICK else 60.0, "nonfinite": 40.0 if DRY else 15.0 if QUICK else 20.0,
       "kernels": 25.0 if DRY else 25.0 if QUICK else 45.0, "kernels-extra": 15.0 if DRY else 20.0,
       "hooks": 40.0 if DRY else 60.0, "hooks-extra": 35.0, "model": 5.0 if DRY else 10.0 if QUICK else 30.0,
       "paths": 45.0 if DRY else 15.0 if QUICK else 25.0, "verify": 15.0 if DRY else 8.0,
       "streams": 25.0 if DRY else 15.0}


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
        tmp.write_text(_SUMMARY[0]() if _SUMMARY[0] else "")
        os.replace(tmp, out / "gpu_check.md")
    except Exception as exc:  # never let reporting kill the run
        print(f"(could not write results: {exc})", flush=True)


_LAST_SAVE = [0.0]
_SUMMARY = [None]  # the markdown summary's function (summary.summary, set by main: no import circle)


def set_summary(fn) -> None:
    _SUMMARY[0] = fn


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



def copy_gbs():
    c = RESULTS["sections"].get("copy")
    return c["gb_s"] if c else None


def _dn(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dt(name: str):
    return getattr(torch, name)


def _fmt(v, spec=".3g"):
    return "-" if v is None else format(v, spec)


def _fmt_consts(c) -> str:
    if not c:
        return "-"
    short = {"BLOCK_N": "N", "BLOCK_M": "M", "BLOCK_K": "K", "BLOCK": "B", "USE_DOT": "dot", "num_warps": "w",
             "num_stages": "s", "HAS_ERROR": "err", "HAS_FLAG": "flag", "LOCAL_ERR": "local", "SPLIT_ROWS": "split"}
    return " ".join(f"{short.get(k, k)}={int(v) if isinstance(v, bool) else v}" for k, v in c.items())


def skip(what: str, why: str) -> None:
    """List ``what`` as skipped, with the reason."""
    RESULTS["skipped"].append(f"{what} ({why})")
    log(f"  SKIP {what} ({why})")


def section_open(name: str) -> dict:
    """The results dict of section ``name`` (made on first use)."""
    return RESULTS["sections"].setdefault(name, {})
