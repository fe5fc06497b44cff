"""Section ``verify``: the first-use check (``PowerSGDState(..., verify="first")``, issue 24 item 2) on this device.

* correct kernels: the Triton backend with ``verify="first"`` on two buckets, 3 compressed steps: no
  ``RuntimeWarning``, every output within :data:`TOL` of the torch backend's on the same inputs;
* a wrong kernel (``project_t``'s Q perturbed after each launch, as a miscompiled config would): at least one
  ``RuntimeWarning``, and every output still within :data:`TOL` of the torch backend's (the step falls back and the
  bucket stays on the torch backend).

Runs when ``PowerSGDState`` accepts ``verify``; otherwise the section is listed as skipped with the reason.
"""

import importlib
import inspect
import os
import tempfile
import time
import warnings

import torch

from powersgd_triton import PowerSGDState, powerSGD_hook
from powersgd_triton import benchmarking as B

from .common import DEVICE, DRY, generator, item_error, log, section_open, skip
from .hooks import _pg_backend

RANK = 4  # PowerSGD's matrix approximation rank
TOL = 1e-4  # float32 gradients: Triton against the torch backend, per bucket
STEPS = 5  # 2 uncompressed, 3 compressed
BUCKETS = ([[(24, 32), (32,), (8, 4, 3, 3)], [(40, 30), (30,)]] if DRY else
           [[(512, 1024), (1024,), (256, 128, 3, 3)], [(2048, 512), (512,)]])


def _run(backend, data, verify=None):
    kw = {} if verify is None else {"verify": verify}
    state = PowerSGDState(None, matrix_approximation_rank=RANK, start_powerSGD_iter=2, backend=backend, **kw)
    params = [[torch.empty(s, device="meta") for s in shapes] for shapes in BUCKETS]  # one model: memory kept
    outs = []
    for step in range(STEPS):
        for index, shapes in enumerate(BUCKETS):
            bucket = B.FakeGradBucket(data[step][index].clone(), shapes, index=index, num_buckets=len(BUCKETS),
                                      parameters=params[index])
            outs.append(powerSGD_hook(state, bucket).wait().detach().to("cpu", copy=True))
    return outs


def available() -> bool:
    """Whether ``PowerSGDState`` takes ``verify`` in this checkout (else the section is skipped)."""
    return "verify" in inspect.signature(PowerSGDState.__init__).parameters


def warm(gen) -> None:
    """The section's Triton-backend steps once, unverified (the compile phase's workers: the same launches)."""
    data = [[B.random_buffer(sum(int(torch.Size(s).numel()) for s in shapes), torch.float32, DEVICE, gen)
             for shapes in BUCKETS] for _ in range(STEPS)]
    _run("triton", data, verify="off")


def _forget() -> None:
    """``powersgd_triton.ops.verify.forget()`` where it exists (the verdicts agreed in this process)."""
    try:
        mod = importlib.import_module("powersgd_triton.ops.verify")
    except ImportError:
        return
    if hasattr(mod, "forget"):
        mod.forget()


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def section_verify():
    sec = section_open("verify")
    if not available():
        skip("verify: the first-use check", "PowerSGDState takes no `verify` argument in this checkout (issue 24 "
             "item 2 not merged)")
        return
    from powersgd_triton.ops import projection_t

    _pg_backend()
    gen = generator()
    data = [[B.random_buffer(sum(int(torch.Size(s).numel()) for s in shapes), torch.float32, DEVICE, gen)
             for shapes in BUCKETS] for _ in range(STEPS)]
    rows = sec.setdefault("cases", [])
    want = _run("torch", data)
    original = projection_t.project_t

    def wrong_project_t(buffer, layout, p, q, *args, **kwargs):
        original(buffer, layout, p, q, *args, **kwargs)
        q.add_(0.25)  # a kernel that computes wrong numbers

    for case in ("correct", "wrong project_t"):
        t0 = time.time()
        saved_dir = os.environ.get("POWERSGD_TRITON_CACHE_DIR")
        try:
            # no verdict from an earlier case or run: a fresh verdict file, the process's verdicts forgotten
            os.environ["POWERSGD_TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="gpu_check_verify_")
            _forget()
            if case != "correct":
                projection_t.project_t = wrong_project_t
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = _run("triton", data, verify="first")
        except Exception as exc:  # noqa: BLE001
            item_error("verify", case, exc)
            rows.append(dict(case=case, ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            continue
        finally:
            projection_t.project_t = original
            if saved_dir is None:
                os.environ.pop("POWERSGD_TRITON_CACHE_DIR", None)
            else:
                os.environ["POWERSGD_TRITON_CACHE_DIR"] = saved_dir
            _forget()
        warned = [str(w.message)[:300] for w in caught if issubclass(w.category, RuntimeWarning)]
        worst = max(_rel(g, w) for g, w in zip(got, want))
        ok = worst <= TOL and (not warned if case == "correct" else bool(warned))
        rows.append(dict(case=case, runtime_warnings=warned, worst_rel_vs_torch=worst, tolerance=TOL, ok=ok,
                         seconds=round(time.time() - t0, 1)))
        log(f"  {'ok  ' if ok else 'FAIL'} verify='first', {case}: {len(warned)} RuntimeWarning(s), worst rel. error vs "
            f"torch backend {worst:.2e} (tol {TOL:.0e})")
    n_ok = sum(1 for r in rows if r.get("ok"))
    sec.update(passed=n_ok, failed=len(rows) - n_ok)
