"""Stream lifetimes on the then() chain (NCCL's schedule), checked on CPU with a test double.

On NCCL each ``then()`` callback runs on a stream from PyTorch's pool, and the caching allocator hands a freed block
back to the stream that allocated it at once: a tensor the hook body allocated and a callback reads must be owned
across the step (the state's memory, the bucket) or recorded on the callback's stream (``record_stream``, or as the
value of the future the callback is chained from), else the next allocation on the default stream may overwrite it
before the callback's kernels ran (the stream rule of ``powersgd_triton.hooks.driver``).

The double: ``dist.all_reduce`` returns a work whose future runs ``then()`` callbacks inline, as NCCL's completed
futures do, each callback its own "stream"; a dispatch mode sees every tensor allocation and which "stream" made
it; the ``ops`` calls and the hook-level torch ops of a callback are its reads; ``_step.keep_for_current_stream`` and
the parent future's value are its records. Every read of a callback must be of a tensor the state or the bucket
holds (before or after the step), made by that callback, or recorded for it.
"""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from _dist import FakeBucket, backend_params, bucket_numel, run_ranks
from powersgd_triton import PowerSGDState, alternating_powerSGD_hook, batched_powerSGD_hook, powerSGD_hook
from powersgd_triton.hooks import driver as _step
from powersgd_triton import ops
from powersgd_triton.layout import BucketLayout

pytestmark = pytest.mark.timeout(180)

HOOKS = {"layerwise": powerSGD_hook, "batched": batched_powerSGD_hook, "alternating": alternating_powerSGD_hook}
# two uncompressed gradients apart: the layer-wise hooks pack them into one buffer for their all-reduce
SHAPES = [(24, 32), (8,), (32, 24), (5,), (16, 4, 3, 3)]


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensors(obj, depth=0, layouts=True):
    """Tensors in ``obj``: itself, in tuples/lists/dicts, and in the attributes of powersgd_triton objects (step
    flags; layouts unless ``layouts`` is False)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 4:
        return
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, depth + 1, layouts)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth + 1, layouts)
    elif type(obj).__module__.startswith("powersgd_triton") and (layouts or not isinstance(obj, BucketLayout)):
        names = list(getattr(type(obj), "__slots__", ())) + list(getattr(obj, "__dict__", {}))
        for name in names:
            yield from _tensors(getattr(obj, name, None), depth + 1, layouts)


def _owned(state, bucket) -> set:
    """Storages the state (every bucket memory, its layout and the layout's kernel caches) and the bucket hold."""
    from powersgd_triton.ops import orthogonalization

    found = {_ptr(bucket.buffer())}
    for mem in list(state.buckets.values()):
        for name in type(mem).__slots__:
            value = getattr(mem, name, None)
            if isinstance(value, torch.Tensor):
                found.add(_ptr(value))
        layout = mem.layout
        if layout is not None:
            for t in _tensors([vars(layout), orthogonalization._ORTHO_PLANS.get(layout, {})]):
                found.add(_ptr(t))
    return found


class Tracker(TorchDispatchMode):
    """Contexts: 0 is the hook body (the default stream), 1, 2, ... one per callback (a pool stream each)."""

    def __init__(self):
        super().__init__()
        self.ctx = [0]
        self.next_ctx = 1
        self.depth = 0  # nesting of ops.* calls (only the outermost one's arguments are reads)
        self.allocated = {}  # storage -> context that allocated it
        self.recorded = {}  # context -> storages recorded for it
        self.reads = []  # (context, storage, what)
        self.keep = []  # everything allocated stays alive: no address is reused during the check

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        seen = {_ptr(t) for t in inputs}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and _ptr(t) not in seen:
                self.allocated[_ptr(t)] = self.ctx[-1]
                self.keep.append(t)
        if self.ctx[-1]:  # in a callback: the hook's own torch ops and those inside ops.* (the torch backend's)
            for t in inputs:
                self.reads.append((self.ctx[-1], _ptr(t), f"{func} {tuple(t.shape)} {t.dtype}"))
        return out

    def record(self, ctx, tensors):
        self.recorded.setdefault(ctx, set()).update(_ptr(t) for t in _tensors(tensors) if t.numel())

    def run_callback(self, callback, parent):
        ctx = self.next_ctx
        self.next_ctx += 1
        self.record(ctx, parent._value)  # PyTorch records the parent future's value storages on the callback stream
        self.ctx.append(ctx)
        try:
            return callback(parent)
        finally:
            self.ctx.pop()

    def wrap_op(self, name, fn):
        def wrapped(*args, **kwargs):
            if self.ctx[-1] and self.depth == 0:  # its tensor arguments (the layout's tables: what the call reads
                # of them is seen by the dispatch mode on the torch backend; they are the state's anyway)
                for t in _tensors((args, kwargs), layouts=False):
                    self.reads.append((self.ctx[-1], _ptr(t), f"ops.{name} {tuple(t.shape)} {t.dtype}"))
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
        return wrapped

    def violations(self, owned):
        bad = []
        for ctx, ptr, what in self.reads:
            if ptr in owned or self.allocated.get(ptr, ctx) == ctx or ptr in self.recorded.get(ctx, ()):
                continue
            where = "the hook body" if self.allocated[ptr] == 0 else f"callback {self.allocated[ptr]}"
            bad.append(f"callback {ctx} reads {what}, allocated in {where}, neither owned nor recorded")
        return sorted(set(bad))


class FakeFuture:
    """A future that runs ``then()`` callbacks inline (NCCL's futures are complete when the collective is queued)."""

    def __init__(self, tracker, value):
        self.tracker, self._value = tracker, value

    def then(self, callback):
        return FakeFuture(self.tracker, self.tracker.run_callback(callback, self))

    def wait(self):
        return self._value

    def value(self):
        return self._value

    def done(self):
        return True


class FakeWork:
    """``wait()`` records nothing: NCCL drops its reference to the input there."""

    def __init__(self, tracker, tensor):
        self.tracker, self.tensor = tracker, tensor

    def wait(self, timeout=None):
        return True

    def get_future(self):
        return FakeFuture(self.tracker, [self.tensor])


def _patched(tracker, record: bool):
    """Install the double; returns the undo function."""
    real_all_reduce = dist.all_reduce
    saved = {"all_reduce": real_all_reduce, "keep": getattr(_step, "keep_for_current_stream", None),
             "chain": _step.OPTIONS.callback_chain,
             "ops": {n: f for n, f in vars(ops).items() if callable(f) and getattr(f, "__module__", "") == ops.__name__
                     and not n.startswith("_") and not isinstance(f, type)}}

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        real_all_reduce(tensor, op=op, group=group)
        return FakeWork(tracker, tensor) if async_op else None

    def keep(*tensors):
        if record:
            tracker.record(tracker.ctx[-1], [t for t in tensors if t is not None])

    dist.all_reduce = all_reduce
    _step.keep_for_current_stream = keep
    _step.OPTIONS.callback_chain = True
    for n, f in saved["ops"].items():
        setattr(ops, n, tracker.wrap_op(n, f))

    def undo():
        dist.all_reduce = saved["all_reduce"]
        if saved["keep"] is None:
            del _step.keep_for_current_stream
        else:
            _step.keep_for_current_stream = saved["keep"]
        _step.OPTIONS.callback_chain = saved["chain"]
        for n, f in saved["ops"].items():
            setattr(ops, n, f)

    return undo


def _streams_worker(rank, world_size, backend, hook_name, communication_dtype, record):
    hook = HOOKS[hook_name]
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, backend=backend,
                          communication_dtype=communication_dtype)
    tracker = Tracker()
    undo = _patched(tracker, record)
    results, bad, callback_reads = [], [], 0
    try:
        for step in range(5):
            g = torch.Generator().manual_seed(101 * step + rank)
            bucket = FakeBucket(torch.randn(bucket_numel(SHAPES), generator=g), SHAPES)
            before = _owned(state, bucket)
            tracker.reads.clear()
            with tracker:
                out = hook(state, bucket).wait()
            bad += tracker.violations(before | _owned(state, bucket))
            callback_reads += len(tracker.reads)
            results.append(out.clone())
    finally:
        undo()
    # the same steps in the hook body (gloo's schedule, no double): the double did not change the numbers
    plain = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, backend=backend,
                          communication_dtype=communication_dtype)
    same = []
    for step in range(5):
        g = torch.Generator().manual_seed(101 * step + rank)
        bucket = FakeBucket(torch.randn(bucket_numel(SHAPES), generator=g), SHAPES)
        same.append(torch.equal(hook(plain, bucket).wait(), results[step]))
    return {"violations": sorted(set(bad)), "callback_reads": callback_reads, "same": same}


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("hook_name", ["layerwise", "batched", "alternating"])
@pytest.mark.parametrize("communication_dtype", [None, torch.bfloat16], ids=["wire-float32", "wire-bfloat16"])
def test_callbacks_read_only_owned_or_recorded_tensors(tmp_path, backend, hook_name, communication_dtype):
    """Every tensor a then() callback of the hooks reads is the state's, the bucket's, its own, or recorded on its
    stream. Before the fix the layer-wise hook's packed uncompressed gradients (allocated in the hook body, read by
    ``ops.average`` in the last callback after NCCL's ``wait()`` dropped its reference) were none of these."""
    (res,) = run_ranks(_streams_worker, 1, tmp_path, backend, hook_name, communication_dtype, True, timeout=120)
    assert res["violations"] == []
    assert res["callback_reads"] > 0 and res["same"] == [True] * 5


def test_the_check_flags_an_unrecorded_packed_buffer(tmp_path):
    """The double is not blind: with ``keep_for_current_stream`` recording nothing, it names the packed buffer of the
    two uncompressed gradients (8 + 5 elements) that ``ops.average`` reads in the last callback."""
    (res,) = run_ranks(_streams_worker, 1, tmp_path, "torch", "layerwise", None, False, timeout=120)
    assert res["violations"] and all("(13,)" in v and "allocated in the hook body" in v for v in res["violations"])
    assert any("ops.average" in v for v in res["violations"])


def test_keep_for_current_stream_records_cuda_tensors_on_the_current_stream(monkeypatch):
    """The helper calls ``record_stream(torch.cuda.current_stream(device))`` for CUDA tensors only (a double of a CUDA
    tensor here: no GPU needed), and skips None and CPU tensors."""
    calls = []

    class FakeCuda:
        is_cuda = True
        device = torch.device("cuda", 1)

        def record_stream(self, stream):
            calls.append(stream)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    _step.keep_for_current_stream(None, torch.zeros(3), FakeCuda())
    assert calls == [("stream of", torch.device("cuda", 1))]
