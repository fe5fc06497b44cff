"""Both hooks on a model's buckets: :func:`compare_hooks` (timed in turn, with counts: what ``powersgd-triton bench``
prints) and :func:`check_against_pytorch` (ours against PyTorch's ``powerSGD_hook``: a benchmark record's
correctness gate).
"""

from typing import List, Sequence

import torch

from powersgd_triton.benchmarking.buckets import DDP_FIRST_BUCKET_MB, _dtype, model_buckets
from powersgd_triton.benchmarking.counts import count_step
from powersgd_triton.benchmarking.collectives import synchronous_collectives
from powersgd_triton.benchmarking.hooks import IMPLS, HookStep
from powersgd_triton.benchmarking.memory import peak_extra_bytes
from powersgd_triton.benchmarking.timing import time_interleaved


def compare_hooks(model: str, rank: int, dtype="fp32", device="cpu", *, backend: str = "auto", rounds: int = 5,
                  counts: bool = True, shrink: int = 1, bucket_cap_mb: float = 25.0,
                  first_bucket_mb: float = DDP_FIRST_BUCKET_MB, seed: int = 0,
                  impls: Sequence[str] = IMPLS) -> List[dict]:
    """PyTorch's hook against ours on ``model``'s buckets, timed in turn (:func:`time_interleaved`), with counts.

    Each hook gets its own copy of the buckets (same random numbers). On CPU the timing includes no device work;
    on CUDA each call is followed by a synchronisation (wall clock; ``bench/gpu_check.py`` uses ``do_bench``).
    Returns one row per implementation of ``impls`` (``impl``, ``variant``, ``matrix_approximation_rank``, times,
    counts, memory; "pytorch" first), ``speedup`` on every other row: PyTorch's median over that row's. With
    ``counts``: ``aten_compute`` (data-touching ATen ops of one step: PyTorch's hook, or our torch backend's where
    ours runs it), ``triton_launches`` and ``ops_backend`` ("torch" or "triton": which of our backends ran, told
    by the launches counted; "pytorch" for PyTorch's hook). Needs a process group (:func:`ensure_process_group`).
    """
    impls = ["pytorch"] + [i for i in impls if i != "pytorch"]
    device = torch.device(device)
    steps = {}
    for impl in impls:
        gen = torch.Generator(device=device).manual_seed(seed)
        buckets = model_buckets(model, dtype, device, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb,
                                shrink=shrink, generator=gen)
        steps[impl] = HookStep(impl, buckets, rank, backend=backend).warmup(1)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    stats = time_interleaved(steps, rounds=rounds, sync=sync)
    rows = []
    for impl, st in steps.items():
        row = dict(model=model, matrix_approximation_rank=rank, dtype=str(_dtype(dtype)).replace("torch.", ""), impl=impl,
                   variant=st.impl, buckets=len(st.buckets), grad_bytes=st.nbytes, **stats[impl])
        if counts:
            c = count_step(st, hook_step=st if isinstance(st, HookStep) else None)
            held = st.memory()
            with synchronous_collectives(st if isinstance(st, HookStep) else None):
                peak = peak_extra_bytes(st, device)
            row.update(aten_compute=c.aten_compute, triton_launches=c.triton_launches or 0,
                       ops_backend="pytorch" if impl == "pytorch" else ("triton" if c.triton_launches else "torch"),
                       allreduce_calls=c.allreduce_calls,
                       allreduce_bytes=c.allreduce_bytes, held_bytes=sum(held.values()), peak_extra_bytes=peak)
        rows.append(row)
    for row in rows[1:]:
        row["speedup"] = rows[0]["median_ms"] / row["median_ms"]
    return rows


AGREEMENT_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


def check_against_pytorch(model: str, rank: int, dtype="fp32", device="cpu", *, backend: str = "auto",
                          compressed_steps: int = 2, shrink: int = 1, bucket_cap_mb: float = 25.0,
                          first_bucket_mb: float = DDP_FIRST_BUCKET_MB, seed: int = 1) -> dict:
    """Ours against PyTorch's ``powerSGD_hook`` on the same buckets: the correctness gate of a benchmark record.

    Each hook gets fresh copies of the same random buckets (``seed``) and the same state arguments (same
    ``random_seed``, so the same initial Q), runs the plain all-reduce steps and ``compressed_steps`` compressed ones;
    then each bucket's contents are compared. Returns ``{"max_rel_diff", "tolerance", "finite", "ok", "steps"}``:
    ``max_rel_diff`` is the largest ``||ours - theirs|| / ||theirs||`` (float64) over the buckets, ``tolerance``
    :data:`AGREEMENT_TOL` of the dtype (float32 1e-4; bfloat16/float16 5e-2: PyTorch's hook keeps P and Q in the
    bucket's dtype there, ours in float32). A few steps only: over many steps two runs drift apart as PyTorch's hook
    does from itself after a one-ulp change. Needs a process group (:func:`ensure_process_group`).
    """
    device = torch.device(device)
    out = {}
    for impl in ("pytorch", "ours"):
        gen = torch.Generator(device=device).manual_seed(seed)
        buckets = model_buckets(model, dtype, device, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb,
                                shrink=shrink, generator=gen)
        HookStep(impl, buckets, rank, backend=backend).warmup(compressed_steps)
        out[impl] = [b.buffer() for b in buckets]
    worst, finite = 0.0, True
    for mine, theirs in zip(out["ours"], out["pytorch"]):
        finite = finite and bool(torch.isfinite(mine).all())
        a, b = mine.double(), theirs.double()
        diff = float((a - b).norm() / b.norm().clamp_min(1e-30))
        worst = diff if diff != diff else max(worst, diff)  # NaN stays
    tol = AGREEMENT_TOL[_dtype(dtype)]
    return {"max_rel_diff": worst, "tolerance": tol, "finite": finite, "ok": bool(finite and worst < tol),
            "steps": compressed_steps}
