"""Section ``streams``: the hooks' cross-stream lifetimes under delay. On a world of 1 NCCL the hook runs the rest of a
step in ``then()`` callbacks on a pool stream, and orthogonalizes the next step's Q on a side stream; here
``torch.cuda._sleep`` is injected at the top of every callback and of every side-stream orthogonalization
(:mod:`gpucheck.inject`) while the caller goes on allocating and scribbling NaN on the default stream (what the next
bucket and backward do). Outputs of every step of every bucket must equal, by value, the torch backend's on the same
inputs (relative error per bucket at most :data:`TOL`), and bitwise the same hook without injection. It runs with the
checks, before the timed sections.

In the dry run (CPU: no streams, no NCCL) the same comparison runs on gloo with the ``then()`` chain forced and a
``sleep`` that only counts (the plumbing); the GPU check itself is listed as skipped.
"""

import time

import torch

from powersgd_triton import PowerSGDState, _step, batched_powerSGD_hook, powerSGD_hook
from powersgd_triton import benchmarking as B

from .common import CAP, DEVICE, DRY, RESERVE, left, log, section_open, skip
from .hooks import _pg_backend
from .inject import Injected, cuda_sleep, sleep_in_callbacks, sleep_on_side_stream

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # Triton against the torch backend, per bucket, 4 compressed steps
SLEEP_CYCLES = 20_000_000  # ~10 ms at 2 GHz: far longer than any kernel of these buckets
STEPS = 4 if DRY else 6  # 2 uncompressed, then compressed steps (error feedback, warm start)
# three buckets with 1-D gradients besides the matrices (they are packed for their all-reduce: the `packed` buffer)
BUCKETS = [[(256, 512), (512,), (128, 64, 3, 3), (128,)], [(1024, 256), (256,), (64,), (300, 40)],
           [(64, 1000), (1000,)]]
DRY_BUCKETS = [[(24, 32), (32,), (8, 4, 3, 3), (8,)], [(40, 30), (30,), (7,)]]
HOOKS = {"powerSGD": powerSGD_hook} if DRY else {"powerSGD": powerSGD_hook, "batched": batched_powerSGD_hook}


def _data(shapes, dtype, step, index):
    g = torch.Generator().manual_seed(1009 * step + index)
    n = sum(int(torch.Size(s).numel()) for s in shapes)
    return torch.randn(n, generator=g).to(dtype)


def _run(hook, backend, dtype, buckets, inject):
    """Outputs (host copies) of every bucket of every step; ``inject``: (sleep, on_side) or None."""
    state = PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2, backend=backend)
    params = [[torch.empty(s, device="meta") for s in shapes] for shapes in buckets]  # one model: memory kept
    counts = Injected()
    outs = []
    for step in range(STEPS):
        futs = []
        for index, shapes in enumerate(buckets):
            data = _data(shapes, dtype, step, index).to(DEVICE)
            bucket = B.FakeGradBucket(data, shapes, index=index, num_buckets=len(buckets), parameters=params[index])
            if inject is None:
                futs.append(hook(state, bucket))
            else:
                sleep, on_side = inject
                kw = {} if on_side is None else {"on_side": on_side}
                with sleep_in_callbacks(sleep, counts), sleep_on_side_stream(sleep, counts, **kw):
                    futs.append(hook(state, bucket))
            if DEVICE.type != "cuda":  # gloo runs the then() callbacks on its worker thread, which a callback's
                futs[-1].wait()  # own all-reduce needs: one bucket at a time (as tests/test_hooks_steps.py)
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
    if DRY or DEVICE.type != "cuda":
        skip("streams: sleep injection on a world of 1 NCCL", "dry run: no CUDA streams and no NCCL; the plumbing "
             "runs on gloo with the then() chain forced and a counting sleep")
        pg, buckets, dtypes = _pg_backend(), DRY_BUCKETS, (torch.float32,)
        sleep_calls = [0]

        def sleep():
            sleep_calls[0] += 1

        inject = (sleep, None)
        forced = True
    else:
        pg = _pg_backend()
        if pg != "nccl":
            skip("streams: sleep injection", f"process group is {pg}, not NCCL: the then() chain does not run")
            return
        buckets, dtypes, forced = BUCKETS, (torch.float32, torch.bfloat16), None
        inject = (cuda_sleep(SLEEP_CYCLES), None)
    sec.update(process_group=pg, buckets=len(buckets), steps=STEPS, sleep_cycles=None if DRY else SLEEP_CYCLES,
               tolerance={str(k)[6:]: v for k, v in TOL.items()})
    cap = time.time() + CAP["streams"]
    saved = _step.FORCE_CALLBACK_CHAIN
    _step.FORCE_CALLBACK_CHAIN = forced
    try:
        for dtype in dtypes:
            for name, hook in HOOKS.items():
                if time.time() > cap or left() < RESERVE["streams"]:
                    skip(f"streams: {name} {str(dtype)[6:]}", "time")
                    continue
                t0 = time.time()
                want, _ = _run(hook, "torch", dtype, buckets, None)
                plain, _ = _run(hook, "triton", dtype, buckets, None)
                got, counts = _run(hook, "triton", dtype, buckets, inject)
                worst = max(_rel(g, w) for g, w in zip(got, want))
                bitwise = all(torch.equal(g, p) for g, p in zip(got, plain))
                finite = all(bool(torch.isfinite(g).all()) for g in got)
                injected = counts.callbacks > 0 and (DRY or counts.side > 0)
                ok = finite and worst <= TOL[dtype] and bitwise and injected
                rows.append(dict(hook=name, dtype=str(dtype)[6:], callbacks_delayed=counts.callbacks,
                                 side_stream_delayed=counts.side, worst_rel_vs_torch=worst,
                                 bitwise_vs_no_injection=bitwise, finite=finite, ok=ok,
                                 seconds=round(time.time() - t0, 1)))
                log(f"  {'ok  ' if ok else 'FAIL'} {name} {str(dtype)[6:]}: {len(buckets)} buckets x {STEPS} steps, "
                    f"{counts.callbacks} callbacks and {counts.side} side-stream orthogonalizations delayed; worst "
                    f"rel. error vs torch backend {worst:.2e} (tol {TOL[dtype]:.0e}); bitwise vs no injection "
                    f"{bitwise}")
    finally:
        _step.FORCE_CALLBACK_CHAIN = saved
    n_ok = sum(1 for r in rows if r["ok"])
    sec.update(passed=n_ok, failed=len(rows) - n_ok)
