"""Section ``streams``: the hooks' cross-stream lifetimes under delay. On a world of 1 NCCL the hook runs the rest of a
step in ``then()`` callbacks on a pool stream, and orthogonalizes the next step's Q on a side stream; here
``torch.cuda._sleep`` is injected at the top of every callback and of every side-stream orthogonalization
(:mod:`gpucheck.inject`) while the caller goes on allocating and scribbling NaN on the default stream (what the next
bucket and backward do). Outputs of every step of every bucket must equal, by value, the torch backend's on the same
inputs (relative error per bucket at most :data:`TOL`), and bitwise the same hook without injection. It runs with the
checks, before the timed sections.

The delay reaches the side stream's orthogonalization on both backends (``ops.orthogonalize`` for the torch
backend, ``TritonSteps.orthogonalize`` for the Triton backend's launchers); every row must have delayed at least one
callback and one side-stream orthogonalization.

In the dry run (CPU: no streams, no NCCL) the same rows (both hooks, fp32 and bf16, the Triton backend against the
torch backend) run on tiny buckets on gloo with the ``then()`` chain forced, a ``sleep`` that only counts, and "inside
``_step.orthogonalize_next_q``" standing in for "on a side stream" (:func:`gpucheck.inject.next_q_orthogonalizations`:
the call that runs on the side stream on CUDA runs inline on CPU); the GPU check itself is listed as skipped.
"""

import contextlib
import inspect
import time

import torch

from powersgd_triton import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from powersgd_triton.hooks import driver as _step
from powersgd_triton import benchmarking as B

from .common import CAP, DEVICE, DRY, RESERVE, left, log, section_open, skip
from .hooks import _pg_backend
from .inject import (Injected, _on_a_side_stream, cuda_sleep, next_q_orthogonalizations, sleep_in_callbacks,
                     sleep_on_side_stream)

RANK = 4  # PowerSGD's matrix approximation rank of every row
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # Triton against the torch backend, per bucket, 4 compressed steps
SLEEP_CYCLES = 20_000_000  # ~10 ms at 2 GHz: far longer than any kernel of these buckets
STEPS = 4 if DRY else 6  # 2 uncompressed, then compressed steps (error feedback, warm start)
# three buckets with 1-D gradients besides the matrices (they are packed for their all-reduce: the `packed` buffer)
BUCKETS = [[(256, 512), (512,), (128, 64, 3, 3), (128,)], [(1024, 256), (256,), (64,), (300, 40)],
           [(64, 1000), (1000,)]]
DRY_BUCKETS = [[(24, 32), (32,), (8, 4, 3, 3), (8,)], [(40, 30), (30,), (7,)]]
HOOKS = {"powerSGD": powerSGD_hook, "batched": batched_powerSGD_hook}
DTYPES = (torch.float32, torch.bfloat16)
# the first-use check off: it is the verify section's; here it would replay steps on the torch backend inside the
# injection and could move a bucket to the torch backend (and write a verdict file)
VERIFY_OFF = {"verify": "off"} if "verify" in inspect.signature(PowerSGDState.__init__).parameters else {}


def warm(name, dtype):
    """The section's Triton-backend run of one row, uninjected (the compile phase's workers: the same launches)."""
    saved = _step.OPTIONS.callback_chain
    _step.OPTIONS.callback_chain = True if DEVICE.type != "cuda" else None
    try:
        _run(HOOKS[name], "triton", dtype, buckets(), None)
    finally:
        _step.OPTIONS.callback_chain = saved


def plan():
    """(hook name, dtype) of the section's rows, in order (the compile phase warms the same)."""
    return [(name, dtype) for dtype in DTYPES for name in HOOKS]


def buckets():
    """The bucket shapes of the section (tiny in the dry run)."""
    return DRY_BUCKETS if DRY else BUCKETS


def _data(shapes, dtype, step, index):
    g = torch.Generator().manual_seed(1009 * step + index)
    n = sum(int(torch.Size(s).numel()) for s in shapes)
    return torch.randn(n, generator=g).to(dtype)


def _run(hook, backend, dtype, buckets, inject):
    """Outputs (host copies) of every bucket of every step; ``inject``: (sleep, on_side) or None."""
    state = PowerSGDState(None, matrix_approximation_rank=RANK, start_powerSGD_iter=2, backend=backend, **VERIFY_OFF)
    params = [[torch.empty(s, device="meta") for s in shapes] for shapes in buckets]  # one model: memory kept
    counts = Injected()
    outs = []
    for step in range(STEPS):
        futs = []
        with contextlib.ExitStack() as injected:
            if inject is not None:  # the whole step, waits included: a callback that runs late is delayed too
                sleep, on_side = inject
                injected.enter_context(sleep_in_callbacks(sleep, counts))
                injected.enter_context(sleep_on_side_stream(sleep, counts, on_side))
            for index, shapes in enumerate(buckets):
                data = _data(shapes, dtype, step, index).to(DEVICE)
                bucket = B.FakeGradBucket(data, shapes, index=index, num_buckets=len(buckets),
                                          parameters=params[index])
                futs.append(hook(state, bucket))
                if DEVICE.type != "cuda":  # gloo runs the then() callbacks on its worker thread, which a callback's
                    futs[-1].wait()  # own all-reduce needs: one bucket at a time (as tests/hooks/test_hooks_steps.py)
                del data, bucket
                for _ in range(3):  # the next bucket's and backward's allocations, written at once
                    torch.empty(sum(int(torch.Size(s).numel()) for s in shapes), dtype=dtype,
                                device=DEVICE).fill_(float("nan"))
            outs += [f.wait().detach().to("cpu", copy=True) for f in futs]
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return outs, counts


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def section_streams():
    sec = section_open("streams")
    rows = sec.setdefault("rows", [])
    stand_in = contextlib.nullcontext(None)
    if DRY or DEVICE.type != "cuda":
        skip("streams: sleep injection on a world of 1 NCCL", "dry run: no CUDA streams and no NCCL; the plumbing "
             "runs on gloo with the then() chain forced, a counting sleep, and the next-Q orthogonalization standing "
             "in for the side stream")
        pg = _pg_backend()
        sleep_calls = [0]

        def sleep():
            sleep_calls[0] += 1

        stand_in = next_q_orthogonalizations()
        forced = True
    else:
        pg = _pg_backend()
        if pg != "nccl":
            skip("streams: sleep injection", f"process group is {pg}, not NCCL: the then() chain does not run")
            return
        forced = None
        sleep = cuda_sleep(SLEEP_CYCLES)
    shapes = buckets()
    sec.update(process_group=pg, buckets=len(shapes), steps=STEPS, sleep_cycles=None if DRY else SLEEP_CYCLES,
               tolerance={str(k)[6:]: v for k, v in TOL.items()})
    cap = time.time() + CAP["streams"]
    saved = _step.OPTIONS.callback_chain
    _step.OPTIONS.callback_chain = forced
    try:
        with stand_in as on_side:
            inject = (sleep, on_side) if on_side is not None else (sleep, _on_a_side_stream)
            for name, dtype in plan():
                hook = HOOKS[name]
                if time.time() > cap or left() < RESERVE["streams"]:
                    skip(f"streams: {name} {str(dtype)[6:]}", "time")
                    continue
                t0 = time.time()
                want, _ = _run(hook, "torch", dtype, shapes, None)
                plain, _ = _run(hook, "triton", dtype, shapes, None)
                got, counts = _run(hook, "triton", dtype, shapes, inject)
                worst = max(_rel(g, w) for g, w in zip(got, want))
                bitwise = all(torch.equal(g, p) for g, p in zip(got, plain))
                finite = all(bool(torch.isfinite(g).all()) for g in got)
                injected = counts.callbacks > 0 and counts.side > 0
                ok = finite and worst <= TOL[dtype] and bitwise and injected
                rows.append(dict(hook=name, dtype=str(dtype)[6:], callbacks_delayed=counts.callbacks,
                                 side_stream_delayed=counts.side, worst_rel_vs_torch=worst,
                                 bitwise_vs_no_injection=bitwise, finite=finite, ok=ok,
                                 seconds=round(time.time() - t0, 1)))
                log(f"  {'ok  ' if ok else 'FAIL'} {name} {str(dtype)[6:]}: {len(shapes)} buckets x {STEPS} steps, "
                    f"{counts.callbacks} callbacks and {counts.side} side-stream orthogonalizations delayed; worst "
                    f"rel. error vs torch backend {worst:.2e} (tol {TOL[dtype]:.0e}); bitwise vs no injection "
                    f"{bitwise}")
    finally:
        _step.OPTIONS.callback_chain = saved
    n_ok = sum(1 for r in rows if r["ok"])
    sec.update(passed=n_ok, failed=len(rows) - n_ok)
