"""No silent wrong answers from the state, in one process: damaged state dicts and checkpoint files, non-finite
settings, ``backend="triton"`` where Triton cannot run, float64 buckets computed in float64.

Multi-rank versions (real DDP on 2 gloo ranks) of the state-dict and backend checks are in
``test_hooks_ddp_state.py``.
"""

import copy
import os
import pickle
import warnings

import numpy as np
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

from _dist import FakeBucket, backend_params, bucket_numel, triton_backend_skip_reason
from bucket_utils import Worst, add_per_gradient, rel_err64
from powersgd_triton import PowerSGDState, alternating_powerSGD_hook, batched_powerSGD_hook, powerSGD_hook
from powersgd_triton.state import buckets as _buckets
from powersgd_triton.compat import env as _env
from powersgd_triton import ops
from powersgd_triton.checkpoint import load_hook_state, save_hook_state
from powersgd_triton.layout import BucketLayout

pytestmark = pytest.mark.timeout(120)

# (bucket index, is_last, gradient shapes): two buckets, compressed matrices of two shapes, uncompressed gradients.
BUCKETS = [(1, False, [(24, 20), (20,), (16, 3, 2, 2)]), (0, True, [(24, 20), (10,), (30, 12)])]
START = 2


def _state(**kw):
    kw.setdefault("matrix_approximation_rank", 2)
    kw.setdefault("backend", "torch")
    return PowerSGDState(None, start_powerSGD_iter=START, **kw)


def _run(state, hook, steps, gen, dtype=torch.float32, buckets=BUCKETS, scale=1.0):
    """``steps`` iterations of ``hook`` on fresh random data; returns the inputs and outputs of the last one."""
    last = []
    for _ in range(steps):
        last = []
        for index, is_last, shapes in buckets:
            data = (torch.randn(bucket_numel(shapes), generator=gen, dtype=torch.float64) * scale).to(dtype)
            out = hook(state, FakeBucket(data.clone(), shapes, index, is_last)).wait()
            last.append((data, out.clone()))
    return last


def _same(a, b) -> bool:
    """Structural equality of two state dicts (tensors bitwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# ------------------------------------------------------------------------------------------------ item 6: settings
@pytest.mark.parametrize("name", ["min_compression_rate", "orthogonalization_epsilon"])
@pytest.mark.parametrize("value", [float("inf"), -float("inf"), float("nan"), np.float64("inf"), np.float32("nan")])
def test_non_finite_settings_are_refused(name, value):
    with pytest.raises(ValueError, match=f"`{name}` must be"):
        PowerSGDState(None, **{name: value})


@pytest.mark.parametrize("offset", [-1, 2**32])  # just outside numpy.random.RandomState's seed range
def test_random_seed_out_of_range_names_the_argument(offset):
    extra = int.from_bytes(os.urandom(2), "little")  # a fresh distance beyond the end each run
    seed = offset - extra if offset < 0 else offset + extra
    with pytest.raises(ValueError, match=r"`random_seed` must be in \[0, 2\*\*32 - 1\].*got " + str(seed)):
        PowerSGDState(None, random_seed=seed)
    for edge in (0, 2**32 - 1, np.uint32(2**32 - 1)):  # the range's ends are accepted, as numpy accepts them
        assert PowerSGDState(None, random_seed=edge).rng.randint(2**31) == np.random.RandomState(edge).randint(2**31)


# ------------------------------------------------------------------------------------------------ item 7: backend
def test_triton_backend_refused_at_construction_when_it_cannot_run_anywhere(monkeypatch):
    monkeypatch.setattr(_env, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    with pytest.raises(RuntimeError, match="backend='triton' cannot run in this process.*TRITON_INTERPRET=1"):
        PowerSGDState(None, backend="triton")
    monkeypatch.setattr(_env, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="triton is not installed"):
        PowerSGDState(None, backend="triton")
    PowerSGDState(None, backend="auto")  # auto picks what runs


@pytest.mark.parametrize("hook", [powerSGD_hook, batched_powerSGD_hook, alternating_powerSGD_hook])
def test_triton_backend_refused_at_the_first_warm_up_step(world1, monkeypatch, rng, hook):
    """A CUDA build (construction cannot know the device) and CPU buckets without the interpreter: the first hook call
    raises, at step 0, before it changes anything; ``backend="auto"`` trains on the torch backend."""
    if not _env.triton_available():
        pytest.skip("triton is not installed")
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    state = PowerSGDState(None, start_powerSGD_iter=1000, backend="triton")
    monkeypatch.setattr(_env, "interpreter_enabled", lambda: False)
    shapes = BUCKETS[0][2]
    for dtype in (torch.float64, torch.float32):  # a float64 bucket would run on torch, but triton was asked for
        data = torch.randn(bucket_numel(shapes), generator=rng).to(dtype)
        bucket = FakeBucket(data.clone(), shapes, 0, True)
        with pytest.raises(RuntimeError, match="backend='triton' cannot run on cpu tensors here.*TRITON_INTERPRET"):
            hook(state, bucket)
        assert state.iter == 0 and torch.equal(bucket.buffer(), data)
    auto = PowerSGDState(None, start_powerSGD_iter=1000, backend="auto")
    assert torch.equal(hook(auto, FakeBucket(data.clone(), shapes, 0, True)).wait(), data)  # averaged, world size 1
    assert auto.iter == 1


# ------------------------------------------------------------------------------------------------ item 4: state dict
def _trained(rng, hook=powerSGD_hook):
    state = _state()
    _run(state, hook, START + 2, rng)
    return state


def _damage(sd, what):
    sd = copy.deepcopy(sd)
    b = sd["buckets"][0]
    if what == "nan_q":
        b["q"][3] = float("nan")
    elif what == "inf_error":
        b["error"][-1] = float("inf")
    elif what == "nan_kept_p":  # the alternating hook's next step (phase "q") reads the kept P
        b["p"][0] = float("nan")
        b["phase"] = "q"
    elif what == "short_error":
        b["error"] = b["error"][:-5].clone()
    elif what == "long_q":
        b["q"] = torch.cat([b["q"], b["q"][:2]])
    elif what == "half_p":
        b["p"] = b["p"].half()
    elif what == "matrix_q":
        b["q"] = b["q"].view(-1, 2)
    elif what == "table":
        b["matrices"][0][4] += 1
    elif what == "signature":
        b["signature"] = "('layerwise', 1060, torch.float32, 2, 2, (os.system('x'),))"
    elif what == "shape_swap":
        b["signature"] = b["signature"].replace("(24, 20)", "(20, 24)")
    elif what == "names":
        b["param_names"] = ["a"]
    elif what == "missing_q":
        del b["q"]
    elif what == "phase":
        b["phase"] = "x"
    elif what == "rng":
        sd["rng"]["keys"] = sd["rng"]["keys"][:10]
    elif what == "iter":
        sd["iter"] = -3
    elif what == "index":
        sd["buckets"]["zero"] = sd["buckets"].pop(0)
    return sd


DAMAGE = {  # damage -> words the ValueError must contain
    "nan_q": ("bucket 0", "'q'", "non-finite"),
    "inf_error": ("bucket 0", "'error'", "non-finite"),
    "nan_kept_p": ("bucket 0", "'p'", "non-finite"),
    "short_error": ("bucket 0", "'error'", "elements"),
    "long_q": ("bucket 0", "'q'", "elements"),
    "half_p": ("bucket 0", "'p'", "torch.float32"),
    "matrix_q": ("bucket 0", "'q'", "flat tensor"),
    "table": ("bucket 0", "'matrices'"),
    "signature": ("bucket 0", "'signature'", "is not a bucket layout signature"),
    "shape_swap": ("bucket 0", "'p'", "elements for its layout"),
    "names": ("bucket 0", "'param_names'"),
    "missing_q": ("bucket 0", "['q']"),
    "phase": ("bucket 0", "'phase'"),
    "rng": ("'rng'",),
    "iter": ("'iter'",),
    "index": ("bucket 'zero'",),
}


@pytest.mark.parametrize("what", list(DAMAGE))
def test_damaged_state_dict_is_refused_and_changes_nothing(world1, rng, what):
    good = _trained(rng).state_dict()
    target = _trained(rng)  # a state in use: the failed load must leave it as it was
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError) as info:
        target.load_state_dict(_damage(good, what))
    for word in DAMAGE[what]:
        assert word in str(info.value), (word, str(info.value))
    assert _same(target.state_dict(), before)


def test_state_saved_after_a_skipped_step_resumes(world1, rng):
    """A non-finite step (GradScaler skips it) leaves powerSGD_hook's P non-finite, a P the next step does not read:
    a state dict saved then loads (that P as zeros, as fresh memory) and resumes bitwise like the state it came
    from. (It was refused as damaged: a checkpoint taken at a skipped step could not be resumed.)"""
    state = _trained(rng)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    _run(state, powerSGD_hook, 1, gen, scale=float("inf"))  # every gradient inf: a non-finite step
    saved = copy.deepcopy(state.state_dict())
    assert not torch.isfinite(saved["buckets"][0]["p"]).all() and saved["buckets"][0]["phase"] == "p"
    fresh = _state()
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.state_dict()["buckets"][0]["p"], torch.zeros_like(saved["buckets"][0]["p"]))
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    want = _run(state, powerSGD_hook, 3, torch.Generator().manual_seed(seed))
    got = _run(fresh, powerSGD_hook, 3, torch.Generator().manual_seed(seed))
    for (_, a), (_, b) in zip(want, got):
        assert torch.isfinite(b).all() and torch.equal(a, b)


def test_nan_q_would_have_poisoned_every_later_step(world1, rng):
    """Main adopted the NaN Q, then every step was non-finite for good (the finite-step guard never commits a new
    Q); now the load is refused and the undamaged state dict resumes exactly like an uninterrupted run."""
    state = _trained(rng)
    good = copy.deepcopy(state.state_dict())
    fresh = _state()
    with pytest.raises(ValueError, match="non-finite"):
        fresh.load_state_dict(_damage(good, "nan_q"))
    fresh.load_state_dict(good)
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    want = _run(state, powerSGD_hook, 3, torch.Generator().manual_seed(seed))
    got = _run(fresh, powerSGD_hook, 3, torch.Generator().manual_seed(seed))
    for (_, a), (_, b) in zip(want, got):
        assert torch.isfinite(b).all() and torch.equal(a, b)


def test_valid_state_dicts_still_load(world1, rng):
    """Every hook's state dict, float64 memory, legacy entries without the newer keys, numpy scalar settings."""
    for hook in (powerSGD_hook, batched_powerSGD_hook, alternating_powerSGD_hook):
        sd = _trained(rng, hook).state_dict()
        _state().load_state_dict(sd)
        legacy = copy.deepcopy(sd)
        for b in legacy["buckets"].values():
            for key in ("param_names", "matrices", "phase", "shapes"):
                b.pop(key, None)
        _state().load_state_dict(legacy)
    state = _state(min_compression_rate=np.float64(2.0))
    _run(state, powerSGD_hook, START + 1, rng, dtype=torch.float64)
    sd = state.state_dict()
    assert sd["buckets"][0]["q"].dtype == torch.float64
    _state(min_compression_rate=np.float64(2.0)).load_state_dict(sd)


# ------------------------------------------------------------------------------------------------ item 5: files
class _NotPlain:
    pass


def _files(tmp_path, rng):
    state = _trained(rng)
    model = torch.nn.Linear(3, 2)
    good = save_hook_state(state, model, str(tmp_path / "good"), rank=0, world_size=1)
    raw = open(good, "rb").read()
    files = {}

    def put(name, data):
        path = tmp_path / name / "hook_state.rank0.pt"
        path.parent.mkdir()
        path.write_bytes(data)
        files[name] = str(tmp_path / name)

    put("empty", b"")
    put("truncated", raw[: len(raw) // 2])
    put("cut_end", raw[:-30])
    put("garbage", bytes(torch.randint(0, 256, (512,), generator=rng, dtype=torch.uint8).tolist()))
    put("text", b"hook state\n")
    for name, obj in (("object", {"x": _NotPlain()}), ("not_dict", [1, 2]), ("keys", {"format": "powersgd_triton.hook_state", "version": 1})):
        path = tmp_path / name / "hook_state.rank0.pt"
        path.parent.mkdir()
        torch.save(obj, str(path))
        files[name] = str(tmp_path / name)
    payload = torch.load(good, weights_only=True)
    payload["hook_state"]["buckets"][0]["q"][0] = float("nan")
    (tmp_path / "nan_q").mkdir()
    torch.save(payload, str(tmp_path / "nan_q" / "hook_state.rank0.pt"))
    files["nan_q"] = str(tmp_path / "nan_q")
    return model, files


def test_damaged_checkpoint_files_raise_value_error_naming_the_file(world1, tmp_path, rng):
    model, files = _files(tmp_path, rng)
    for name, folder in files.items():
        target = _trained(rng)
        before = copy.deepcopy(target.state_dict())
        with pytest.raises(ValueError) as info:
            load_hook_state(target, model, folder, rank=0, world_size=1)
        msg = str(info.value)
        assert os.path.join(folder, "hook_state.rank0.pt") in msg, (name, msg)
        assert "weights_only=False" not in msg, (name, msg)
        assert _same(target.state_dict(), before), name
        if name == "empty":
            assert "empty" in msg
        if name == "nan_q":
            assert "bucket 0" in msg and "'q'" in msg and "non-finite" in msg


# ------------------------------------------------------------------------------------------------ item 12: float64
def _vs_pytorch_float64(rank, steps=5):
    """Max relative error of our powerSGD_hook against PyTorch's on float64 buckets (world size 1)."""
    ours = _state(matrix_approximation_rank=rank)
    theirs = torch_psgd.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=START)
    gen = torch.Generator().manual_seed(rank)
    worst = Worst()
    for step in range(START + steps):
        for index, is_last, shapes in BUCKETS:
            data = torch.randn(bucket_numel(shapes), generator=gen, dtype=torch.float64)
            got = powerSGD_hook(ours, FakeBucket(data.clone(), shapes, index, is_last)).wait()
            want = torch_psgd.powerSGD_hook(theirs, FakeBucket(data.clone(), shapes, index, is_last)).wait()
            assert got.dtype == want.dtype == torch.float64
            add_per_gradient(worst, got, want, shapes, step=step, bucket=index)
    return worst, ours


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_float64_buckets_match_pytorch_in_float64(world1, rank):
    """PyTorch's hook keeps float64 buckets in float64 (~1e-16); main computed them in float32 (~1e-7)."""
    worst, state = _vs_pytorch_float64(rank)
    assert worst.value < 1e-12, str(worst)
    for mem in state.buckets.values():
        assert mem.error.dtype == mem.p.dtype == mem.q.dtype == torch.float64


def test_float64_batched_and_alternating_hooks_compute_in_float64(world1, rng):
    """Against the float64 oracles of the batched and the alternating algorithms (world size 1)."""
    from test_alternating_hook import AlternatingOracle
    from test_hooks_equivalence import BatchedOracle

    for hook, oracle in ((batched_powerSGD_hook, BatchedOracle(1, 2)), (alternating_powerSGD_hook,
                                                                         AlternatingOracle(1, 2))):
        state = _state()
        worst = Worst()
        for step in range(START + 4):
            for index, is_last, shapes in BUCKETS:
                data = torch.randn(bucket_numel(shapes), generator=rng, dtype=torch.float64)
                if hook is batched_powerSGD_hook:
                    want = oracle.step(index, [data], step >= START)
                else:
                    want = oracle.step(index, shapes, [data], step >= START)
                got = hook(state, FakeBucket(data.clone(), shapes, index, is_last)).wait()
                assert got.dtype == torch.float64
                if hook is batched_powerSGD_hook:  # one matrix: the whole bucket
                    worst.add(rel_err64(got, want), step=step, bucket=index, dtype=got.dtype)
                else:
                    add_per_gradient(worst, got, want, shapes, step=step, bucket=index)
        assert worst.value < 1e-12, (hook.__name__, str(worst))
        assert all(m.q.dtype == torch.float64 for m in state.buckets.values())


@pytest.mark.parametrize("backend", [p for p in backend_params() if p.id == "triton"])
def test_triton_kernels_decline_float64(world1, rng, backend):
    """backend="triton": a float64 bucket runs on the torch backend, in float64, with a RuntimeWarning that says so
    (bitwise the torch backend's result); "auto" falls back without a warning; ops refuse float64 on Triton."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    want = _run(_state(backend="torch"), powerSGD_hook, START + 2, torch.Generator().manual_seed(seed),
                torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = _state(backend="triton")
        got = _run(state, powerSGD_hook, START + 2, torch.Generator().manual_seed(seed), torch.float64)
    messages = [str(w.message) for w in caught if "float64" in str(w.message)]
    assert len(messages) == len(BUCKETS) and all("torch backend" in m for m in messages), messages
    assert all(m.backend == "torch" for m in state.buckets.values())
    for (_, a), (_, b) in zip(want, got):
        assert torch.equal(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(_state(backend="auto"), powerSGD_hook, START + 1, rng, torch.float64)
    buf = torch.randn(24 * 20, dtype=torch.float64, generator=rng)
    layout = BucketLayout.from_gradients(buf, [buf.view(24, 20)], 2, 2)
    p = torch.zeros(layout.p_numel, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64"):
        ops.project(buf, layout, torch.randn(layout.q_numel, dtype=torch.float64), p, backend="triton")
    ops.project(buf, layout, torch.randn(layout.q_numel, dtype=torch.float64), p, backend="auto")
    assert triton_backend_skip_reason() is None


# ------------------------------------------------------------------------------------------------ item 8 (unit)
def test_state_finds_the_ddp_it_is_registered_on(world1):
    """What lets PyTorch's recipe keep the memory without a call of ours: the state names the bucket's parameters
    through the DDP it is registered on; registered on two, the one holding the parameters; none: None."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from powersgd_triton.state.buckets import registered_module

    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    state = _state()
    ddp_a, ddp_b = DDP(a), DDP(b)
    assert registered_module(state, list(a.parameters())) is None
    ddp_a.register_comm_hook(state, powerSGD_hook)
    ddp_b.register_comm_hook(state, powerSGD_hook)
    assert registered_module(state, list(a.parameters())) is a
    assert registered_module(state, list(b.parameters())) is b
    assert registered_module(_state(), list(a.parameters())) is None
    _buckets.name_params(state, tuple(b.parameters()))
    assert [_buckets.param_name(state, p) for p in b.parameters()] == ["weight", "bias"]


def test_ops_orthogonalize_refuses_infinite_epsilon():
    buf = torch.randn(24 * 20)
    layout = BucketLayout.from_gradients(buf, [buf.view(24, 20)], 2, 2)
    q = torch.randn(layout.q_numel)
    for eps in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="finite and >= 0"):
            ops.orthogonalize(q.clone(), layout, "q", eps, backend="torch")
