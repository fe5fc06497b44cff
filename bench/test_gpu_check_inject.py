"""The sleep injection of bench/gpu_check.py's ``streams`` section (``bench/gpucheck/inject.py``), on CPU: a world of 1
gloo with the ``then()`` chain forced (NCCL's schedule) and test doubles for ``torch.cuda._sleep`` and for "the current
stream is a side stream", on both backends (the Triton backend in the interpreter: its hooks reach orthogonalize
through ``powersgd_triton.ops.backend.TritonSteps``, not ``ops``). The GPU check itself needs CUDA and NCCL (run by
``gpu_check.py``)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpucheck.inject import (Injected, next_q_orthogonalizations, sleep_in_callbacks,  # noqa: E402
                             sleep_on_side_stream)

from powersgd_triton import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from powersgd_triton.hooks import driver as _step
from powersgd_triton import ops  # noqa: E402
from powersgd_triton.ops import reference  # noqa: E402
from powersgd_triton import benchmarking as B  # noqa: E402

BUCKETS = [[(24, 32), (32,), (8, 4, 3, 3), (8,)], [(40, 30), (30,), (7,)]]  # packed 1-D gradients in both
STEPS = 4  # 2 uncompressed, 2 compressed
# a memory reset (the warning that the bucket's parameters changed) would make the compressed steps trivial
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


@pytest.fixture
def chain_world(monkeypatch):
    """A world of 1 gloo, kept for the process (destroyed and made again per test, with the Triton backend's
    callbacks on gloo's worker thread, the interpreter aborted at exit in 2 of 4 runs: std::system_error "Resource
    deadlock avoided"), the then() chain forced."""
    B.ensure_process_group("gloo")
    monkeypatch.setattr(_step.OPTIONS, "callback_chain", True)
    yield


def _run(hook, events=None, inject=None, seed=0, backend="torch"):
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, backend=backend, verify="off")
    params = [[torch.empty(s, device="meta") for s in shapes] for shapes in BUCKETS]  # the same model every step
    outs, counts = [], Injected()
    for step in range(STEPS):
        for index, shapes in enumerate(BUCKETS):
            g = torch.Generator().manual_seed(seed + 101 * step + index)
            data = torch.randn(sum(torch.Size(s).numel() for s in shapes), generator=g)
            bucket = B.FakeGradBucket(data, shapes, index=index, num_buckets=len(BUCKETS), parameters=params[index])
            if inject is None:
                outs.append(hook(state, bucket).wait().clone())
            else:
                with sleep_in_callbacks(inject, counts):
                    outs.append(hook(state, bucket).wait().clone())
    return outs, counts


@pytest.mark.parametrize("hook", [powerSGD_hook, batched_powerSGD_hook], ids=["powerSGD", "batched"])
def test_every_then_callback_sleeps_first(hook, chain_world, monkeypatch):
    """Each callback of the chain sleeps before its body: the bucket's last step (``ops.average``, in the final
    callback) comes right after a sleep, every time; at least one delayed callback per bucket and step; the outputs
    are bitwise those without injection (the double does not sleep: the numbers cannot change)."""
    seed = int(torch.randint(0, 2**20, (1,)))
    want, _ = _run(hook, seed=seed)
    events = []
    original = ops.average

    def average(*args, **kwargs):
        events.append("average")
        return original(*args, **kwargs)

    monkeypatch.setattr(ops, "average", average)
    got, counts = _run(hook, inject=lambda: events.append("sleep"), seed=seed)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert counts.callbacks == events.count("sleep") >= STEPS * len(BUCKETS)
    averages = [i for i, e in enumerate(events) if e == "average"]
    assert averages and all(i > 0 and events[i - 1] == "sleep" for i in averages), events


def test_futures_keep_their_interface(chain_world):
    """The proxies answer ``wait``/``value``/``done``/``then`` as the futures they wrap."""
    import torch.distributed as dist

    with sleep_in_callbacks(lambda: None) as counts:
        x = torch.ones(3)
        fut = dist.all_reduce(x, async_op=True).get_future()
        doubled = fut.then(lambda f: f.value()[0] * 2)
        assert torch.equal(doubled.wait(), torch.full((3,), 2.0)) and doubled.done()
        assert torch.equal(fut.value()[0], x)
        assert dist.all_reduce(torch.ones(1)) is None  # synchronous: nothing to wrap
    assert counts.callbacks == 1


def _kernel_layer(backend, monkeypatch, events):
    """Record every orthogonalization where it computes, below both ways the hooks reach it: the torch backend's
    ``reference.orthogonalize``, the Triton backend's launcher ``orthogonalization.orthogonalize``."""
    if backend == "torch":
        module = reference
    else:
        from powersgd_triton.ops import orthogonalization as module
    original = module.orthogonalize

    def orthogonalize(*args, **kwargs):
        events.append("orthogonalize")
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "orthogonalize", orthogonalize)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_side_stream_orthogonalizations_sleep_first(backend, chain_world, monkeypatch):
    """Every orthogonalization the hooks make while ``on_side()`` holds sleeps right before it computes, on both
    backends (the Triton backend's hooks call ``TritonSteps.orthogonalize``, the torch backend's ``ops.orthogonalize``);
    both functions are restored after the block; with the default predicate on CPU (no side streams) none sleeps."""
    from powersgd_triton.ops.backend import TritonSteps as _hook_ops

    events = []
    _kernel_layer(backend, monkeypatch, events)
    before = (ops.orthogonalize, _hook_ops.orthogonalize)
    with sleep_on_side_stream(lambda: events.append("sleep"), on_side=lambda: True) as counts:
        _run(powerSGD_hook, backend=backend)
    calls = [i for i, e in enumerate(events) if e == "orthogonalize"]
    sleeps = [i for i, e in enumerate(events) if e == "sleep"]
    assert sleeps and counts.side == len(sleeps)
    assert all(events[i + 1] == "orthogonalize" for i in sleeps), events  # each sleep right before a computation
    if backend == "triton":  # every launch goes through one of the two wrapped functions
        assert len(calls) == len(sleeps), events
    assert (ops.orthogonalize, _hook_ops.orthogonalize) == before  # restored
    events.clear()
    with sleep_on_side_stream(lambda: events.append("sleep")) as counts:
        _run(powerSGD_hook, backend=backend)
    assert counts.side == 0 and "sleep" not in events and "orthogonalize" in events


@pytest.mark.parametrize("hook", [powerSGD_hook, batched_powerSGD_hook], ids=["powerSGD", "batched"])
def test_next_q_stand_in_delays_the_side_stream_call(hook, chain_world, monkeypatch):
    """The CPU stand-in for "on a side stream" (the dry run's): true exactly inside
    ``_step.orthogonalize_next_q``, so the calls that run on the side stream on CUDA sleep first, on the Triton
    backend (the one the streams section injects; on CPU the torch backend makes the next Q inside ``reconstruct``)
    for both hooks: one per bucket and compressed step, none outside it, the outputs bitwise those without
    injection."""
    backend = "triton"
    seed = int(torch.randint(0, 2**20, (1,)))
    want, _ = _run(hook, seed=seed, backend=backend)
    events = []
    original = _step.orthogonalize_next_q

    def next_q(*args, **kwargs):
        events.append("next_q")
        original(*args, **kwargs)
        events.append("next_q done")

    monkeypatch.setattr(_step, "orthogonalize_next_q", next_q)
    with next_q_orthogonalizations() as on_side:
        assert not on_side()
        with sleep_on_side_stream(lambda: events.append("sleep"), on_side=on_side) as counts:
            got, _ = _run(hook, seed=seed, backend=backend)
    assert _step.orthogonalize_next_q is next_q  # restored
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert counts.side == events.count("sleep") == (STEPS - 2) * len(BUCKETS), events  # one per bucket and step
    depth = 0
    for e in events:  # every sleep inside an orthogonalize_next_q call
        depth += {"next_q": 1, "next_q done": -1}.get(e, 0)
        assert e != "sleep" or depth == 1, events
