"""The tests' hang detectors: their load scale (tests/_deadline.py), the multi-rank harness's timeout message (each
living rank's Python stack, tests/_dist.py) and pytest-timeout's limits scaled in pytest-xdist's workers."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

import _deadline
from _dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def machine(monkeypatch):
    """Set the load, cores and xdist workers :func:`_deadline.scale` reads (no override, factor unset)."""
    monkeypatch.delenv(_deadline.SCALE_ENV, raising=False)
    monkeypatch.delenv(_deadline.FACTOR_ENV, raising=False)
    state = {}

    def set_(load, cores, workers=None):
        monkeypatch.setattr(_deadline, "load_average", lambda: float(load))
        monkeypatch.setattr(_deadline, "usable_cores", lambda: float(cores))
        if workers is None:
            monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
        else:
            monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
        state.update(load=load, cores=cores, workers=workers)

    return set_


@pytest.mark.parametrize("load, cores, workers, expected", [
    (0.3, 2, None, 1.0),   # quiet machine: the sizes as written
    (16.0, 2, None, 8.0),  # load 16 on 2 cores: 8 runnable processes a core
    (16.0, 2, 2, 8.0),
    (0.5, 2, 4, 2.0),      # a run just started: 4 workers on 2 cores, before the load average shows them
    (6.0, 4, 2, 1.5),
])
def test_scale_follows_load_cores_and_workers(machine, load, cores, workers, expected):
    machine(load, cores, workers)
    assert _deadline.scale() == pytest.approx(expected)
    assert _deadline.scaled(40) == pytest.approx(40 * expected)


def test_scale_override_and_factor(machine, monkeypatch):
    machine(16.0, 2)
    monkeypatch.setenv(_deadline.FACTOR_ENV, "3")
    assert _deadline.scale() == pytest.approx(24.0)  # the factor multiplies the load's
    monkeypatch.setenv(_deadline.SCALE_ENV, "1.5")
    assert _deadline.scale() == pytest.approx(1.5)  # the override replaces both
    assert _deadline.SCALE_ENV in _deadline.describe()
    for bad in ("0", "-2", "nan", "inf", "two"):
        monkeypatch.setenv(_deadline.SCALE_ENV, bad)
        with pytest.raises(ValueError, match=_deadline.SCALE_ENV):
            _deadline.scale()


def test_usable_cores_is_at_least_one_and_at_most_the_affinity():
    cores = _deadline.usable_cores()
    assert 1.0 <= cores <= len(os.sched_getaffinity(0))


def test_deadline_extends_while_loaded_and_never_shrinks():
    now = [100.0]
    scales = iter([1.0, 1.0, 4.0, 1.0, 1.0])
    d = _deadline.Deadline(10, clock=lambda: now[0], scale_fn=lambda: next(scales))
    now[0] = 105.0
    assert d.left() == pytest.approx(5.0)  # quiet: 10 s
    now[0] = 111.0
    assert d.left() == pytest.approx(29.0)  # the load rose to scale 4: 40 s from the start
    now[0] = 139.0
    assert d.left() == pytest.approx(1.0)  # the load fell back: the largest scale seen holds
    now[0] = 141.0
    assert d.left() <= 0
    assert "scale 4.00" in d.describe()


# --------------------------------------------------------------------------------- the harness's timeout message
def _sleep_forever():
    while True:
        time.sleep(3600)


def _rank1_sleeps(rank, world_size):
    if rank == 1:
        _sleep_forever()
    return rank


def test_run_ranks_timeout_names_each_rank_and_where_it_stopped(tmp_path):
    """Rank 0 returns (then waits in the harness's barrier), rank 1 sleeps forever: the TimeoutError names rank 1
    and carries both ranks' stacks: rank 1 in the sleeping function, rank 0 in the harness."""
    with pytest.raises(TimeoutError) as caught:
        run_ranks(_rank1_sleeps, 2, tmp_path, timeout=3)
    msg = str(caught.value)
    assert msg.startswith("ranks [1] timed out after")
    assert "hang detector 3s x scale" in msg
    sections = msg.split("--- rank ")[1:]
    assert [s.split(" ", 1)[0] for s in sections] == ["0", "1"]
    rank0, rank1 = sections
    assert "Python stack" in rank0 and "_child" in rank0 and "_sleep_forever" not in rank0
    assert "Python stack" in rank1 and "_sleep_forever" in rank1 and "_rank1_sleeps" in rank1


# ------------------------------------------------------------------------------ pytest-timeout in xdist workers
_TIMED_TESTS = '''
import os, time, pytest

@pytest.mark.timeout(0.5)
@pytest.mark.parametrize("i", [0, 1])
def test_sleeps_past_its_limit(i):
    assert os.environ.get("PYTEST_XDIST_WORKER")  # in a worker
    assert "POWERSGD_TEST_TIMEOUT_SCALE" not in os.environ  # nothing exported by the controller
    time.sleep(120)
'''


def test_conftests_register_the_scaled_timer(request):
    impls = request.config.pluginmanager.hook.pytest_timeout_set_timer.get_hookimpls()
    assert _deadline.pytest_timeout_set_timer in [impl.function for impl in impls]


def test_per_test_limits_scale_in_each_xdist_worker(tmp_path):
    """Two workers (``-p _deadline``: the timer tests/conftest.py registers), each test marked ``timeout(0.5)`` and
    sleeping 2 minutes, POWERSGD_TEST_TIMEOUT_FACTOR=2: each fails on its worker with a limit of at least 1 s (the
    factor times the worker's own load scale, >= 1), not 0.5 s."""
    (tmp_path / "test_timed.py").write_text(textwrap.dedent(_TIMED_TESTS))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
               POWERSGD_TEST_TIMEOUT_FACTOR="2")
    env.pop("POWERSGD_TEST_TIMEOUT_SCALE", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "_deadline", "-p", "no:cacheprovider", "-n", "2", "-q",
         "--rootdir", str(tmp_path), str(tmp_path / "test_timed.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=_deadline.scaled(240))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "2 failed" in out, out
    limits = [float(x.split("s)")[0]) for x in out.split("Timeout (>")[1:]]
    assert len(limits) >= 2 and all(limit >= 1 for limit in limits), out
