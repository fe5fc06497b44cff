"""Test setup: Triton's interpreter on CPU (must be set before triton is imported), one thread, fresh seeds."""

import os

if not os.environ.get("POWERSGD_TRITON_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The hooks' first-use verification (powersgd_triton.ops.verify) writes its verdicts next to the autotune cache: a
# folder of this test session's, never the user's (tests that look at the files set their own).
if not os.environ.get("POWERSGD_TRITON_CACHE_DIR"):
    import tempfile

    os.environ["POWERSGD_TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="powersgd-test-cache-")

import sys  # noqa: E402

# The tests mirror the code (tests/ops, tests/hooks, tests/state, tests/fsdp; the rest here): a test module imports the
# helpers here (_dist, bucket_utils, ...) and, for a shared oracle, another test module by its name, wherever it is.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _sub in ("", "ops", "hooks", "state", "fsdp"):
    _path = os.path.join(_HERE, _sub) if _sub else _HERE
    if _path not in sys.path:
        sys.path.append(_path)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------ poisoned allocations
from _poison import poisoned_factories  # noqa: E402


@pytest.fixture(autouse=True)
def _poisoned_empty(request, monkeypatch):
    """Every ``torch.empty``/``empty_like``/``empty_strided`` and ``Tensor.new_empty(_strided)`` called from Python while
    a test runs (ours and torch's Python code alike: workspaces, ``q_work``/``p_work``, packed buffers, kernel outputs)
    returns a poisoned tensor (``_poison.poison_``), so an element a kernel or hook fails to write shows as NaN instead of
    whatever memory held. The ranks of ``_dist.run_ranks`` get it too. ``@pytest.mark.no_poison`` turns it off for a test."""
    if request.node.get_closest_marker("no_poison"):
        yield
        return
    for owner, name, poisoned in poisoned_factories():
        monkeypatch.setattr(owner, name, poisoned)
    yield


@pytest.fixture
def rng():
    """A torch.Generator with a fresh seed per test (printed on failure), so inputs differ from run to run."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def isolated_autotune(tmp_path, monkeypatch):
    """The autotuner's tests: a cache folder of the test's own (``POWERSGD_TRITON_CACHE_DIR``), no shipped-config
    folder or GPU name from the environment, no process-wide tuner before or after."""
    from powersgd_triton import autotune

    monkeypatch.setenv("POWERSGD_TRITON_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.delenv("POWERSGD_TRITON_CONFIG_DIR", raising=False)
    monkeypatch.delenv("POWERSGD_TRITON_GPU_NAME", raising=False)
    autotune.set_tuner(None)
    yield
    autotune.set_tuner(None)


@pytest.fixture
def world1():
    """An in-process gloo world of size 1, torn down afterwards unless someone else made it."""
    import torch.distributed as dist

    from powersgd_triton import benchmarking as B, teardown

    mine = not dist.is_initialized()
    B.ensure_process_group("gloo")
    yield
    if mine:  # not dist.destroy_process_group(): a gloo worker thread may hold the group's last reference (teardown)
        teardown.destroy_process_group()


# ---------------------------------------------------------------------------------------- parallel runs (xdist)
# README's test command runs the suite on pytest-xdist workers (one per core, at most 4). Tests that share a
# module-scoped fixture (one multi-rank launch for many tests) stay on one worker (``--dist loadgroup``).
_GROUPED_MODULES = ("test_hooks_ddp.py", "test_integrations_torchrun.py", "test_comm_dtype_ddp.py",
                     "test_fsdp_replicate.py", "test_compiled_ddp.py", "test_fsdp_replicate_edges.py")

# Hang detectors (``@pytest.mark.timeout`` and the ``timeout`` ini value, the multi-rank harness's deadline, the
# subprocess timeouts) are sized for one test on a quiet machine and scale with the load, in each process that sets
# one (tests/_deadline.py: load / cores, xdist workers / cores; ``POWERSGD_TEST_TIMEOUT_SCALE`` overrides,
# ``POWERSGD_TEST_TIMEOUT_FACTOR`` multiplies). Nothing is exported here: an xdist worker or a rank reads its own.
from _deadline import pytest_timeout_set_timer  # noqa: E402,F401 - pytest-timeout's timer, load-scaled


# ------------------------------------------------------------------------------------------------- test tiers
# README's test command deselects ``slow`` tests (``-m "not aot_matrix and not slow"``); the slow tier (docs/development.md:
# ``-m slow`` plus the notebooks) runs after it in CI. Besides the tests marked ``@pytest.mark.slow`` where
# they are written, these parametrized cases, each 20-50 s here, whose code paths quicker cases of the same test cover:
_SLOW_CASES = {
    # world size 4 through the Triton interpreter: world size 2 runs the same kernels on 2 ranks, torch on 4 ranks
    "test_hooks_equivalence.py::test_layerwise_matches_pytorch[4-triton]",
    # the register prefetch at rank 4 and the small tiles at rank 1: the other rank of each stays in the quick tier
    "test_kernels.py::test_full_step_with_other_configs[4-prefetch_split]",
    "test_kernels.py::test_full_step_with_other_configs[1-small_tiles_split]",
    # issue 34 (the quick tier's time): repeats of a Triton-backend path for another hook or world size, 6-16 s each
    # in the interpreter; kept in the quick tier: the same test on the other hook (or world sizes) on the Triton
    # backend and this hook on the torch backend (.ci/compat leaves the same cases out for its older Tritons)
    "test_kernels.py::test_full_step_with_other_configs[1-carry_split]",  # [4-carry_split] stays
    "test_hooks_equivalence.py::test_batched_matches_float64_oracle[2-triton]",  # [1-triton], [4-triton] stay
    "test_orthogonalize.py::test_huge_and_tiny_gradients_scale_exactly[alternating-triton]",  # [powerSGD-triton],
    "test_orthogonalize.py::test_huge_and_tiny_gradients_scale_exactly[batched-triton]",  # [*-torch] stay
    "test_hooks_steps.py::test_resume_is_bitwise[batched-triton]",  # [layerwise-triton], [batched-torch] stay
    "test_hooks_steps.py::test_next_q_orthogonalized_ahead_is_bitwise_the_same[batched-triton]",  # the same
    "test_hooks_steps.py::test_callback_chain_schedule_gives_the_same_numbers[batched-triton]",  # the same
    # [True-layerwise-compressed-triton] and [True-layerwise-uncompressed-torch] stay
    "test_hooks_steps.py::test_nonfinite_step_does_not_poison_state[True-layerwise-uncompressed-triton]",
}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the xdist_group marks into the node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.fspath.basename in _GROUPED_MODULES:
            item.add_marker(pytest.mark.xdist_group(item.fspath.basename))
        if f"{item.fspath.basename}::{item.name}" in _SLOW_CASES:
            item.add_marker(pytest.mark.slow)
