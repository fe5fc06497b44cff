"""Wall-clock timing: :func:`time_cpu` (one function) and :func:`time_interleaved` (several functions in turn: fair
on a machine whose load drifts); medians and quantiles in ms. Nothing here asserts a speed.
"""

import math
import time
from typing import Callable, Dict, List, Optional, Sequence


def _quantiles(times: Sequence[float]) -> dict:
    s = sorted(times)

    def q(f):
        if len(s) == 1:
            return s[0]
        pos = f * (len(s) - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return {"median_ms": q(0.5), "p20_ms": q(0.2), "p80_ms": q(0.8), "min_ms": s[0], "reps": len(s)}


def time_cpu(fn: Callable[[], None], reps: int = 5, warmup: int = 1, sync: Optional[Callable[[], None]] = None,
             max_seconds: Optional[float] = None) -> dict:
    """Wall-clock timing: ``warmup`` calls, then up to ``reps`` timed calls; median and quantiles in ms."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times = []
    start = time.perf_counter()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append((time.perf_counter() - t0) * 1e3)
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
    return _quantiles(times)


def time_interleaved(fns: Dict[str, Callable[[], None]], rounds: int = 5, warmup: int = 1,
                     sync: Optional[Callable[[], None]] = None) -> Dict[str, dict]:
    """Wall-clock medians of several functions timed in turn (order reversed every other round), so that a
    machine whose load drifts (a shared CPU) biases none of them. Returns :func:`time_cpu`-like stats per name."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    if sync:
        sync()
    times: Dict[str, List[float]] = {n: [] for n in names}
    for rnd in range(rounds):
        for n in (names if rnd % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            fns[n]()
            if sync:
                sync()
            times[n].append((time.perf_counter() - t0) * 1e3)
    return {n: _quantiles(v) for n, v in times.items()}
