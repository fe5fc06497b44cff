"""PowerSGDState and the hooks' contract, in-process (no process group needed)."""

import ast
import inspect
import io
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

import powersgd_triton
from _dist import FakeBucket, bucket_numel
from powersgd_triton import PowerSGDState, batched_powerSGD_hook, hooks, powerSGD_hook
from powersgd_triton.hooks import driver as _step

pytestmark = pytest.mark.timeout(60)

SHAPES = [(40, 48), (12,), (16, 8, 3, 3), (16,)]


def test_public_names():
    for name in ("PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook"):
        assert name in powersgd_triton.__all__
        assert getattr(powersgd_triton, name) is not None


def test_defaults_and_attributes_match_pytorch():
    ours_sig = inspect.signature(PowerSGDState.__init__).parameters
    theirs_sig = inspect.signature(torch_psgd.PowerSGDState.__init__).parameters
    for name, p in theirs_sig.items():
        assert name in ours_sig, name
        assert ours_sig[name].default == p.default, name
    assert list(ours_sig)[: len(theirs_sig)] == list(theirs_sig)  # same positional order
    assert ours_sig["backend"].default == "auto"
    ours, theirs = PowerSGDState(None), torch_psgd.PowerSGDState(None)
    for attr in (
        "process_group",
        "matrix_approximation_rank",
        "start_powerSGD_iter",
        "min_compression_rate",
        "use_error_feedback",
        "warm_start",
        "orthogonalization_epsilon",
        "batch_tensors_with_same_shape",
        "iter",
        "total_numel_before_compression",
        "total_numel_after_compression",
        "compression_stats_logging_frequency",
        "next_stats_report",
    ):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert ours.compression_stats() == theirs.compression_stats()
    assert ours.rng.randint(1_000_000_000) == theirs.rng.randint(1_000_000_000)
    assert ours.error_dict == {} and ours.p_memory_dict == {} and ours.q_memory_dict == {}


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(start_powerSGD_iter=1), "start_powerSGD_iter"),
        (dict(start_powerSGD_iter=0, warm_start=False), "start_powerSGD_iter"),
        (dict(start_powerSGD_iter=1, use_error_feedback=False), "start_powerSGD_iter"),
        (dict(matrix_approximation_rank=0), "matrix_approximation_rank"),
        (dict(matrix_approximation_rank=-2), "matrix_approximation_rank"),
        (dict(matrix_approximation_rank=1.5), "matrix_approximation_rank"),
        (dict(min_compression_rate=0), "min_compression_rate"),
        (dict(min_compression_rate=-1.0), "min_compression_rate"),
        (dict(orthogonalization_epsilon=-1e-8), "orthogonalization_epsilon"),
        (dict(orthogonalization_epsilon=float("nan")), "orthogonalization_epsilon"),
        (dict(backend="cuda"), "backend"),
        (dict(backend=None), "backend"),
        (dict(use_error_feedback="no"), "use_error_feedback"),
        (dict(warm_start=2), "warm_start"),
        (dict(batch_tensors_with_same_shape=None), "batch_tensors_with_same_shape"),
        (dict(autotune="yes"), "autotune"),
    ],
)
def test_bad_arguments(kwargs, word):
    with pytest.raises(ValueError, match=word):
        PowerSGDState(None, **kwargs)


def test_valid_corner_arguments():
    s = PowerSGDState(None, start_powerSGD_iter=1, use_error_feedback=False, warm_start=False)
    assert s.start_powerSGD_iter == 1
    s = PowerSGDState(None, min_compression_rate=0.5, orthogonalization_epsilon=1e-8, backend="torch")
    assert s.min_compression_rate == 0.5 and s.backend == "torch"
    PowerSGDState(process_group=None, matrix_approximation_rank=np.int64(4), compression_stats_logging_frequency=0)
    s = PowerSGDState(None, use_error_feedback=0, warm_start=np.bool_(True), batch_tensors_with_same_shape=1)
    assert s.use_error_feedback is False and s.warm_start is True and s.batch_tensors_with_same_shape is True


def test_process_group_must_be_a_group_and_load_state_dict_a_dict():
    with pytest.raises(TypeError, match="process_group.*str"):
        PowerSGDState("x")
    state = PowerSGDState(None)
    with pytest.raises(TypeError, match="got NoneType"):
        state.load_state_dict(None)
    with pytest.raises(ValueError, match="version"):
        state.load_state_dict({"version": -1})


def test_hooks_module_has_no_postponed_annotations():
    tree = ast.parse(inspect.getsource(hooks))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            assert all(a.name != "annotations" for a in node.names)


@pytest.mark.parametrize("hook", [powerSGD_hook, batched_powerSGD_hook])
def test_hook_signature_passes_ddp_checks(hook):
    sig = inspect.signature(hook)
    assert list(sig.parameters) == ["state", "bucket"]
    assert sig.parameters["bucket"].annotation is dist.GradBucket
    assert sig.return_annotation == torch.futures.Future[torch.Tensor]
    assert hook.__qualname__ == hook.__name__  # module-level function
    assert pickle.loads(pickle.dumps(hook)) is hook


@pytest.mark.parametrize("hook", [powerSGD_hook, batched_powerSGD_hook])
@pytest.mark.parametrize("dtype", [torch.complex64, torch.int32, torch.int64, torch.bool])
@pytest.mark.parametrize("compressing", [False, True])
def test_bad_gradient_dtype_raises_before_any_change(hook, dtype, compressing):
    state = PowerSGDState(None, start_powerSGD_iter=2, backend="torch")
    if compressing:
        state.iter = 5
    before = state.state_dict()
    data = (torch.arange(bucket_numel(SHAPES)) % 3).to(dtype)
    bucket = FakeBucket(data.clone(), SHAPES)
    with pytest.raises(TypeError, match=str(dtype).replace("torch.", "")):
        hook(state, bucket)
    assert torch.equal(bucket.buffer(), data)
    after = state.state_dict()
    assert after["iter"] == before["iter"] and after["buckets"] == {} and after["rng"] == before["rng"]
    assert state.compression_stats() == (0, 0, 0)


def test_hook_without_process_group_explains():
    state = PowerSGDState(None, start_powerSGD_iter=2, backend="torch")
    bucket = FakeBucket(torch.ones(bucket_numel(SHAPES)), SHAPES)
    with pytest.raises(RuntimeError, match="init_process_group"):
        powerSGD_hook(state, bucket)


def _populated_state(**kwargs):
    """A state whose bucket memory was built and filled without communication (torch backend, no group)."""
    state = PowerSGDState(None, start_powerSGD_iter=2, backend="torch", **kwargs)
    state.iter = 7
    for index in (0, 3):
        bucket = FakeBucket(torch.randn(bucket_numel(SHAPES)), SHAPES, index=index)
        mem = _step.prepare_bucket(state, bucket, bucket.buffer(), False, None)
        _step.draw_q(state, mem, torch.float32)
        if mem.error is not None:
            mem.error.normal_()
        mem.p.normal_()
    state.rng.randint(10)
    return state


def _same(a: PowerSGDState, b: PowerSGDState):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        if key != "buckets":
            assert sa[key] == sb[key], key
    assert sa["buckets"].keys() == sb["buckets"].keys()
    for index in sa["buckets"]:
        x, y = sa["buckets"][index], sb["buckets"][index]
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert torch.equal(x[k], y[k]), (index, k)
            else:
                assert x[k] == y[k], (index, k)


@pytest.mark.parametrize("use_error_feedback", [True, False])
def test_state_dict_round_trip_weights_only(use_error_feedback):
    state = _populated_state(use_error_feedback=use_error_feedback, matrix_approximation_rank=2)
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    fresh = PowerSGDState(None, start_powerSGD_iter=2, backend="torch", use_error_feedback=use_error_feedback,
                          matrix_approximation_rank=2)
    fresh.load_state_dict(loaded)
    _same(state, fresh)
    assert fresh.rng.randint(1_000_000_000) == state.rng.randint(1_000_000_000)
    # Loaded tensors are copies: the loaded state does not alias the dict it was loaded from.
    assert fresh.buckets[0].q.data_ptr() != loaded["buckets"][0]["q"].data_ptr()


def test_load_state_dict_warns_on_other_hyperparameters():
    state = _populated_state()
    other = PowerSGDState(None, start_powerSGD_iter=2, matrix_approximation_rank=4, backend="torch")
    with pytest.warns(RuntimeWarning, match="matrix_approximation_rank"):
        other.load_state_dict(state.state_dict())


def test_pickle_round_trip_without_process_group():
    assert not dist.is_initialized()
    state = _populated_state(matrix_approximation_rank=2, random_seed=5, orthogonalization_epsilon=1e-8)
    state.process_group = object()  # not picklable, and not pickled
    clone = pickle.loads(pickle.dumps(state))
    assert clone.process_group is None  # resolved to the default group when a hook runs
    for attr in ("matrix_approximation_rank", "random_seed", "orthogonalization_epsilon", "backend", "iter"):
        assert getattr(clone, attr) == getattr(state, attr)
    state.process_group = None
    _same(state, clone)
    buf = io.BytesIO()
    torch.save(state, buf)  # the PyTorch docs' checkpoint recipe
    buf.seek(0)
    _same(state, torch.load(buf, weights_only=False))


def test_pickle_fresh_state_before_init_process_group():
    state = PowerSGDState(None, start_powerSGD_iter=10)
    clone = pickle.loads(pickle.dumps(state))
    assert clone.iter == 0 and clone.buckets == {} and clone.start_powerSGD_iter == 10


def test_memory_is_only_for_compressed_gradients():
    state = _populated_state(matrix_approximation_rank=2)
    mem = state.buckets[0]
    layout = mem.layout
    # (40, 48) and (16, 72) are compressed at rank 2; the two biases are not.
    assert layout.e_numel == 40 * 48 + 16 * 72
    assert mem.error.numel() == layout.e_numel and mem.error.dtype == torch.float32
    assert mem.p.numel() == (40 + 16) * 2 and mem.q.numel() == (48 + 72) * 2
    assert state.error_dict[0] is mem.error and state.q_memory_dict[3] is state.buckets[3].q


def test_layout_mismatch_rebuilds_with_warning():
    state = _populated_state()
    other = [(10, 30), (30, 10)]
    bucket = FakeBucket(torch.randn(bucket_numel(other)), other, index=0)
    with pytest.warns(RuntimeWarning, match="bucket 0 no longer matches"):
        mem = _step.prepare_bucket(state, bucket, bucket.buffer(), False, None)
    assert mem.layout.e_numel == 600 and not mem.q_initialized and torch.count_nonzero(mem.error) == 0
    # Same bucket again: reused, no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _step.prepare_bucket(state, bucket, bucket.buffer(), False, None) is mem
    # A dtype swapped in by fp16_compress_wrapper is a different layout.
    half = FakeBucket(bucket.buffer().half(), other, index=0)
    with pytest.warns(RuntimeWarning, match="no longer matches"):
        _step.prepare_bucket(state, half, half.buffer(), False, None)


def test_same_parameters_in_the_same_buffer_skip_the_per_gradient_check(monkeypatch):
    """A real DDP bucket (nn.Parameters) is checked gradient by gradient once; later calls with the same parameters,
    buffer, rank and min_compression_rate reuse the result; any of them changing is checked (and rebuilt) again."""
    from powersgd_triton.benchmarking import FakeGradBucket
    from powersgd_triton.layout import BucketLayout

    calls = []
    original = BucketLayout.matches_gradients
    monkeypatch.setattr(BucketLayout, "matches_gradients",
                        lambda self, *a: calls.append(1) or original(self, *a))
    state = PowerSGDState(None, start_powerSGD_iter=2, matrix_approximation_rank=2, backend="torch")
    bucket = FakeGradBucket(torch.randn(bucket_numel(SHAPES)), SHAPES)
    mem = _step.prepare_bucket(state, bucket, bucket.buffer(), False, None)
    for _ in range(5):
        assert _step.prepare_bucket(state, bucket, bucket.buffer(), False, None) is mem
    assert len(calls) == 1
    # a new buffer of the same layout (fp16_compress_wrapper's set_buffer): checked once more, same memory
    keep = torch.randn(bucket_numel(SHAPES))
    bucket.set_buffer(keep)
    assert _step.prepare_bucket(state, bucket, bucket.buffer(), False, None) is mem and len(calls) == 2
    assert _step.prepare_bucket(state, bucket, bucket.buffer(), False, None) is mem and len(calls) == 2
    # another rank in the same parameters: rebuilt with a warning naming it (the error memory is kept)
    state.matrix_approximation_rank = 1
    with pytest.warns(RuntimeWarning, match="matrix_approximation_rank changed from 2 to 1"):
        new = _step.prepare_bucket(state, bucket, bucket.buffer(), False, None)
    assert new is not mem and new.layout.matrices[0].rank == 1
    # a parameter reshaped in place (same object, same numel) in a bucket whose buffer keeps its address
    params = [torch.nn.Parameter(torch.empty(s)) for s in SHAPES]
    same = torch.randn(bucket_numel(SHAPES))
    state.matrix_approximation_rank = 2
    before = FakeGradBucket(same, SHAPES, index=5, num_buckets=6, parameters=params)
    first = _step.prepare_bucket(state, before, same, False, None)
    assert _step.prepare_bucket(state, before, same, False, None) is first  # checked in full once: the key is set
    params[0].data = params[0].data.reshape(SHAPES[0][1], SHAPES[0][0])
    after = FakeGradBucket(same, [params[0].shape] + SHAPES[1:], index=5, num_buckets=6, parameters=params)
    checks = len(calls)
    reshaped = _step.prepare_bucket(state, after, same, False, None)
    assert len(calls) == checks + 1 and reshaped.layout.signature != first.layout.signature
    bucket.set_buffer(keep.half())
    checks = len(calls)
    half = _step.prepare_bucket(state, bucket, bucket.buffer(), False, None)  # memory follows the parameters
    assert len(calls) == checks + 1 and half is not new and torch.float16 in half.layout.signature


def test_q_draw_matches_pytorch_random_numbers():
    """The initial Q consumes state.rng and the forked CPU RNG exactly as PyTorch's hook does."""
    for batch in (False, True):
        state = PowerSGDState(None, start_powerSGD_iter=2, matrix_approximation_rank=2, backend="torch",
                              batch_tensors_with_same_shape=batch)
        shapes = [(40, 48), (12,), (40, 48), (64, 36)]
        bucket = FakeBucket(torch.randn(bucket_numel(shapes)), shapes)
        mem = _step.prepare_bucket(state, bucket, bucket.buffer(), False, None)
        global_before = torch.random.get_rng_state()
        _step.draw_q(state, mem, torch.float32)
        assert torch.equal(torch.random.get_rng_state(), global_before)  # the global RNG is untouched
        rng = np.random.RandomState(0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(rng.randint(1_000_000_000))
            if batch:
                want = [torch.randn(2, 48, 2), torch.randn(1, 36, 2)]
            else:
                want = [torch.randn(1, 48, 2), torch.randn(1, 48, 2), torch.randn(1, 36, 2)]
        assert torch.equal(mem.q, torch.cat([w.reshape(-1) for w in want]))


def test_backend_resolution():
    from _dist import triton_backend_skip_reason
    from powersgd_triton.ops import resolve_backend

    cpu = torch.zeros(4)
    assert resolve_backend("torch", cpu) == "torch"
    if triton_backend_skip_reason() is None:
        assert resolve_backend("triton", cpu) == "triton"
        assert resolve_backend("auto", cpu) == "triton"
    else:
        with pytest.raises(RuntimeError, match="triton"):
            resolve_backend("triton", cpu)
        assert resolve_backend("auto", cpu) == "torch"


@pytest.mark.parametrize("hook", [powerSGD_hook, batched_powerSGD_hook, powersgd_triton.alternating_powerSGD_hook])
def test_pytorch_state_is_refused_before_any_change(hook):
    """Swapping only the hook import leaves PyTorch's state: a TypeError that names the fix, nothing changed."""
    theirs = torch_psgd.PowerSGDState(None, start_powerSGD_iter=2, matrix_approximation_rank=2)
    theirs.iter = 5
    rng_before = theirs.rng.get_state()[1].copy()
    data = torch.randn(bucket_numel(SHAPES))
    bucket = FakeBucket(data.clone(), SHAPES)
    with pytest.raises(TypeError, match=r"PyTorch's.*from_torch"):
        hook(theirs, bucket)
    assert torch.equal(bucket.buffer(), data)
    assert theirs.iter == 5 and np.array_equal(theirs.rng.get_state()[1], rng_before)
    assert theirs.p_memory_dict == {} and theirs.error_dict == {}
    with pytest.raises(TypeError, match="powersgd_triton.PowerSGDState.*dict"):
        hook({"matrix_approximation_rank": 2}, bucket)


def test_from_torch_copies_settings_and_rng_without_changing_theirs():
    theirs = torch_psgd.PowerSGDState(
        None, matrix_approximation_rank=3, start_powerSGD_iter=7, min_compression_rate=1.5,
        use_error_feedback=False, warm_start=False, orthogonalization_epsilon=1e-8, random_seed=int(np.random.randint(1000)),
        compression_stats_logging_frequency=50, batch_tensors_with_same_shape=True,
    )
    theirs.iter = 4
    theirs.rng.randint(10)  # an RNG that has moved on from its seed
    before = theirs.rng.get_state()
    ours = PowerSGDState.from_torch(theirs, backend="torch")
    for name in PowerSGDState._TORCH_ARGUMENTS + ("process_group", "iter"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.backend == "torch" and ours.random_seed is None
    after = theirs.rng.get_state()
    assert np.array_equal(after[1], before[1]) and after[2] == before[2]  # theirs did not advance
    assert ours.rng.randint(1_000_000_000, size=5).tolist() == theirs.rng.randint(1_000_000_000, size=5).tolist()
    with pytest.raises(TypeError, match="lacks"):
        PowerSGDState.from_torch(object())
    # a converted state still round-trips through state_dict/pickle
    again = pickle.loads(pickle.dumps(ours))
    assert again.matrix_approximation_rank == 3 and again.random_seed is None
    # and loads into a state built the usual way without a hyper-parameter warning: its RNG state is what counts
    converted = PowerSGDState.from_torch(torch_psgd.PowerSGDState(None), backend="torch")
    plain = PowerSGDState(None, backend="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain.load_state_dict(converted.state_dict())
    assert plain.rng.randint(1000, size=4).tolist() == converted.rng.randint(1000, size=4).tolist()


def _converted_continues_worker(rank, world_size):
    assert PowerSGDState(dist.group.WORLD).process_group is dist.group.WORLD  # a real group is accepted
    shapes = [(40, 48), (12,), (16, 8, 3, 3), (64, 36)]
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    theirs = torch_psgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=3, random_seed=11)
    ours = None
    worst = 0.0
    for step in range(6):
        data = torch.randn(bucket_numel(shapes), generator=g)
        if step == 2:  # swap hooks mid-run, before the first compressed step
            ours = PowerSGDState.from_torch(theirs, backend="torch")
            mirror = torch_psgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=3)
            mirror.iter, mirror.rng = theirs.iter, np.random.RandomState()
            mirror.rng.set_state(theirs.rng.get_state())
        if ours is None:
            torch_psgd.powerSGD_hook(theirs, FakeBucket(data.clone(), shapes)).wait()
            continue
        got = powerSGD_hook(ours, FakeBucket(data.clone(), shapes)).wait()
        want = torch_psgd.powerSGD_hook(mirror, FakeBucket(data.clone(), shapes)).wait()
        for x, y in zip(FakeBucket(got, shapes).gradients(), FakeBucket(want, shapes).gradients()):
            worst = max(worst, float((x.double() - y.double()).norm() / y.double().norm()))
    return worst


def test_converted_state_continues_like_pytorchs_hook(tmp_path):
    """After from_torch at a warm-up step, our hook's compressed steps match PyTorch's hook from the same RNG."""
    from _dist import run_ranks

    worst = max(run_ranks(_converted_continues_worker, 1, tmp_path))
    assert worst < 1e-5, worst
