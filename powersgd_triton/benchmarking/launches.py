"""Counting kernel launches: :func:`count_triton_launches` (a launch hook on Triton's ``run``, interpreted or
compiled) and :func:`count_cuda_kernels` (``torch.profiler`` device events: kernels, memcpys, memsets).
"""

import contextlib
from collections import Counter
from typing import Callable

import torch

from powersgd_triton.benchmarking.profiler import quiet_profiler


@contextlib.contextmanager
def count_triton_launches(execute: bool = True):
    """Count Triton kernel launches (interpreted or compiled) inside the block; yields ``{"n": count, "by": {}}``.

    ``execute=False`` (interpreter only) counts without running the kernels: for launch counts of big shapes on a
    CPU. That is valid for our hooks because nothing they do depends on the numbers (no host synchronisation); the
    outputs are then garbage, so the first-use verification checks no step meanwhile (``verify.PAUSED``).
    """
    from powersgd_triton.ops import verify

    count = {"n": 0, "by": Counter()}
    patches = []
    if not execute:
        verify.PAUSED += 1
    try:
        # every interpreted launch runs through GridExecutor.__call__ (triton 3.4: kernel[grid] builds it directly,
        # InterpretedFunction has no run; 3.6 to 3.9: through InterpretedFunction.run)
        from triton.runtime.interpreter import GridExecutor

        orig_i = GridExecutor.__call__

        def run_i(self, *args, **kwargs):
            count["n"] += 1
            count["by"][getattr(self.fn, "__name__", "?")] += 1
            if execute:
                return orig_i(self, *args, **kwargs)
            return None

        patches.append((GridExecutor, "__call__", orig_i))
        GridExecutor.__call__ = run_i
    except Exception:  # pragma: no cover - no triton
        pass
    try:
        from triton.runtime.jit import JITFunction

        orig_j = JITFunction.run

        def run_j(self, *args, **kwargs):
            # warmup=True compiles without launching
            if not kwargs.get("warmup", False):
                count["n"] += 1
                count["by"][getattr(self.fn, "__name__", "?")] += 1
            return orig_j(self, *args, **kwargs)

        patches.append((JITFunction, "run", orig_j))
        JITFunction.run = run_j
    except Exception:  # pragma: no cover
        pass
    try:
        yield count
    finally:
        for cls, name, orig in patches:
            setattr(cls, name, orig)
        if not execute:
            verify.PAUSED -= 1


def count_cuda_kernels(step: Callable[[], None]) -> dict:
    """Device-side activity of one ``step()`` from ``torch.profiler`` (CUDA): kernels, memcpys, memsets.

    Counts every device event whatever thread launched it. Raises ``RuntimeError`` without CUDA.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("count_cuda_kernels needs CUDA")
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels, memcpy, memset, launches_api = 0, 0, 0, 0
    names: Counter = Counter()
    for e in prof.events():
        dev = str(getattr(e, "device_type", "")).split(".")[-1]
        name = e.name
        if dev == "CUDA":
            low = name.lower()
            if low.startswith("memcpy"):
                memcpy += 1
            elif low.startswith("memset"):
                memset += 1
            else:
                kernels += 1
                names[name[:60]] += 1
        elif name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"):
            launches_api += 1
    return {"kernels": kernels, "memcpy": memcpy, "memset": memset, "launch_api_calls": launches_api,
            "top_kernels": dict(names.most_common(8))}
