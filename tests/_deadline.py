"""Hang detectors that scale with the machine's load, in every process that sets one.

The tests' deadlines (the multi-rank harness's, ``tests/_dist.py``; the per-test limits, ``@pytest.mark.timeout`` and
pytest-timeout's ``timeout`` ini default, through :func:`pytest_timeout_set_timer`; the subprocess timeouts, :func:`scaled`)
are hang detectors sized for one test on a quiet machine. Each is multiplied by :func:`scale`, read in the process
that sets the deadline (pytest-xdist's workers, the ranks ``run_ranks`` spawns and a test's subprocesses alike:
nothing is inherited from the process that started them)::

    scale = POWERSGD_TEST_TIMEOUT_SCALE                                  when set (a fixed factor: the override)
          = POWERSGD_TEST_TIMEOUT_FACTOR x max(1, load / cores, workers / cores)                        otherwise

``load``: the 1-minute load average (``os.getloadavg``); ``cores``: the CPUs this process may run on (its affinity,
capped by a cgroup CPU quota); ``workers``: pytest-xdist's worker count (``PYTEST_XDIST_WORKER_COUNT``, 1 without
xdist: the load average lags a run that has just started). ``POWERSGD_TEST_TIMEOUT_FACTOR`` (default 1) is for a
slower interpreter (``.ci/compat``: older Tritons), on top of the load.

A :class:`Deadline` re-reads the scale whenever it is checked and keeps the largest it has seen: it extends while the
machine is loaded and never shrinks. A real hang is still caught, later by the same factor.
"""

import math
import os
import signal
import threading
import time

import pytest

SCALE_ENV = "POWERSGD_TEST_TIMEOUT_SCALE"
FACTOR_ENV = "POWERSGD_TEST_TIMEOUT_FACTOR"


def _positive(name: str, default=None):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={raw!r}: expected a positive number (a factor on the tests' hang detectors)")
    return value


def usable_cores() -> float:
    """CPUs this process may run on (float, >= 1): its affinity mask, capped by a cgroup v2/v1 CPU quota if any."""
    try:
        cores = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cores = float(os.cpu_count() or 1)
    quota = None
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:  # cgroup v2: "max 100000" or "200000 100000"
            q, period = f.read().split()[:2]
            if q != "max":
                quota = int(q) / int(period)
    except (OSError, ValueError):
        try:
            with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f, open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as g:
                q, period = int(f.read()), int(g.read())
            if q > 0 and period > 0:
                quota = q / period
        except (OSError, ValueError):
            pass
    if quota is not None:
        cores = min(cores, quota)
    return max(1.0, cores)


def load_average() -> float:
    """The 1-minute load average (0 where the platform has none)."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return 0.0


def xdist_workers() -> int:
    """pytest-xdist's worker count in this process's environment (1 without xdist)."""
    try:
        return max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
    except ValueError:
        return 1


def scale() -> float:
    """The factor on every hang detector, read now (>= the factor's floor 1 unless the override says less).

    Raises ValueError when ``POWERSGD_TEST_TIMEOUT_SCALE`` or ``POWERSGD_TEST_TIMEOUT_FACTOR`` is not a positive number."""
    fixed = _positive(SCALE_ENV)
    if fixed is not None:
        return fixed
    cores = usable_cores()
    return _positive(FACTOR_ENV, 1.0) * max(1.0, load_average() / cores, xdist_workers() / cores)


def describe() -> str:
    """How the scale was made (for failure messages)."""
    if os.environ.get(SCALE_ENV, "").strip():
        return f"{SCALE_ENV}={os.environ[SCALE_ENV].strip()}"
    return (f"load {load_average():.1f} on {usable_cores():g} cores, {xdist_workers()} xdist worker(s), "
            f"{FACTOR_ENV}={_positive(FACTOR_ENV, 1.0):g}")


def scaled(seconds: float) -> float:
    """``seconds`` (a hang detector sized for a quiet machine) times :func:`scale` now: for a subprocess timeout."""
    return float(seconds) * scale()


class Deadline:
    """A hang detector of ``seconds`` (sized for a quiet machine) from now, times the largest :func:`scale` seen.

    :meth:`left` re-reads the scale (so the deadline extends while the machine is loaded) and returns the seconds
    left (<= 0: expired). ``clock`` and ``scale_fn`` are for tests."""

    def __init__(self, seconds: float, clock=time.monotonic, scale_fn=scale):
        self.base = float(seconds)
        self._clock, self._scale_fn = clock, scale_fn
        self.start = clock()
        self.scale = float(scale_fn())

    @property
    def limit(self) -> float:
        """The deadline in seconds after the start, at the largest scale seen so far."""
        return self.base * self.scale

    def elapsed(self) -> float:
        return self._clock() - self.start

    def left(self) -> float:
        self.scale = max(self.scale, float(self._scale_fn()))
        return self.limit - self.elapsed()

    def describe(self) -> str:
        return (f"{self.elapsed():.1f}s (hang detector {self.base:g}s x scale {self.scale:.2f}, the largest seen; now "
                f"{describe()})")


# ------------------------------------------------------------------------------------------------ pytest-timeout
@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings) -> bool:
    """pytest-timeout's timer hook (imported by tests/conftest.py and bench/conftest.py; ``-p _deadline`` as a plugin):
    pytest-timeout's timer, with the limit (the marker's or the ``timeout`` ini value) a :class:`Deadline`. On the nominal expiry the deadline is
    re-checked; still loaded, the timer is set again for what is left; expired, pytest-timeout's own handler runs
    (stacks of the test process's threads, then the failure "Timeout (>N s)", N the scaled limit)."""
    import pytest_timeout

    deadline = Deadline(settings.timeout)

    def expired_settings():
        return settings._replace(timeout=round(deadline.limit, 1))

    if settings.method == "signal" and threading.current_thread() is threading.main_thread():
        def handler(signum, frame):
            __tracebackhide__ = True
            left = deadline.left()
            if left > 0:
                signal.setitimer(signal.ITIMER_REAL, left)
                return
            pytest_timeout.timeout_sigalrm(item, expired_settings())

        def cancel():
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)

        item.cancel_timeout = cancel
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, max(0.001, deadline.left()))
    else:
        done = threading.Event()

        def watch():
            while not done.wait(max(0.001, deadline.left())):
                if deadline.left() <= 0:
                    pytest_timeout.timeout_timer(item, expired_settings())
                    return

        watcher = threading.Thread(target=watch, name=f"powersgd-test-timeout {item.nodeid}", daemon=True)

        def cancel():
            done.set()
            watcher.join()

        item.cancel_timeout = cancel
        watcher.start()
    return True
