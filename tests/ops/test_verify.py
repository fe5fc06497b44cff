"""First-use verification (``PowerSGDState(verify=...)``, :mod:`powersgd_triton.ops.verify`) on CPU, Triton's interpreter.

Oracle: the torch backend. A correct kernel: no warning, one check, outputs bitwise those of ``verify="off"``. A wrong
one (a launcher made to perturb its output, or to do nothing): one warning, the step recomputed on the torch backend,
outputs bitwise those of a ``backend="torch"`` state from there on, the bucket on the torch backend on every rank.
"""

import json
import os
import warnings

import pytest
import torch

from _dist import FakeBucket, bucket_numel, run_ranks, triton_backend_skip_reason
from powersgd_triton import PowerSGDState, alternating_powerSGD_hook, batched_powerSGD_hook, powerSGD_hook
from powersgd_triton.ops import verify
from powersgd_triton.autotune.cache import CacheWarning
from powersgd_triton.ops import projection, projection_t, reconstruction

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(triton_backend_skip_reason() is not None, reason=str(triton_backend_skip_reason()))]

HOOKS = {"layerwise": powerSGD_hook, "batched": batched_powerSGD_hook, "alternating": alternating_powerSGD_hook}
# two uncompressed ranges ((8,) and (5,)): the layer-wise hook packs them (copy_segments) and checks that too
SHAPES = [(24, 32), (8,), (16, 4, 3, 3), (5,), (32, 24)]
NUMEL = bucket_numel(SHAPES)


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("POWERSGD_TRITON_CACHE_DIR", str(tmp_path / "cache"))
    verify.forget()
    yield
    verify.forget()


def _grad(step, rank, seed):
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed + 1000 * step + 17 * rank))


def _steps(state, hook, steps, rank=0, seed=0, poison=None):
    outs = []
    for step in steps:
        data = _grad(step, rank, seed)
        if poison is not None:
            poison(step, data)
        outs.append(hook(state, FakeBucket(data, SHAPES, 0, True)).wait().clone())
    return outs


def _state(backend="triton", **kw):
    return PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, backend=backend, **kw)


def _same(a, b):
    """Bitwise equal (NaN too) float32 outputs."""
    return len(a) == len(b) and all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))


# the module of each launcher, where the Triton steps look it up (and the tests patch it)
_LAUNCHERS = {"project": projection, "project_t": projection_t, "reconstruct": reconstruction}


def _perturb(name, how="perturb"):
    """A replacement of the launcher ``<name>`` (in its module, :data:`_LAUNCHERS`) that computes wrong numbers: its first output off by 1 (``perturb``)
    or nothing launched at all (``noop``); ``calls`` counts its calls."""
    real = getattr(_LAUNCHERS[name], name)
    calls = []

    def wrong(*args, **kwargs):
        calls.append(1)
        if how == "noop":
            return None
        out = real(*args, **kwargs)
        target = {"project": args[3], "project_t": args[3], "reconstruct": args[0]}[name]
        target.view(-1)[0] += 1.0
        return out

    wrong.calls = calls
    return wrong


# ------------------------------------------------------------------------------------------------------- settings
def test_verify_setting_is_checked():
    assert _state().verify == "first"
    for good in ("first", "always", "off"):
        assert _state(verify=good).verify == good
    for bad in ("sometimes", "", None, 1, True, "FIRST"):
        with pytest.raises(ValueError, match="`verify` must be one of"):
            _state(verify=bad)
    st = _state(verify="off")
    with pytest.raises(ValueError, match="`verify`"):
        st.verify = "maybe"
    assert st.verify == "off"  # unchanged by the refused value
    st.verify = "always"
    assert st.verify == "always" and st.state_dict()["config"]["verify"] == "always"


# --------------------------------------------------------------------------------------------------- correct kernels
@pytest.mark.parametrize("hook_name", ["layerwise", "batched", "alternating"])
def test_correct_kernels_one_check_same_bits(world1, hook_name):
    hook = HOOKS[hook_name]
    # the alternating hook's P step runs no project_t: its first Q step checks that one
    checks = 2 if hook_name == "alternating" else 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checked = _steps(_state(verify="first"), hook, range(6))
        assert verify.stats["checks"] == checks and verify.stats["fallbacks"] == 0
        plain = _steps(_state(verify="off"), hook, range(6))
        assert _same(checked, plain)  # the check never changes a bit
        # a second state in the same process: the verdict is known, no second check
        again = _steps(_state(verify="first"), hook, range(6))
        assert verify.stats["checks"] == checks and _same(again, plain)
    path = os.path.join(os.environ["POWERSGD_TRITON_CACHE_DIR"], verify.VERDICT_FILENAME)
    (dev,) = json.load(open(path))["devices"].values()
    kernels = {e["kernel"] for e in dev["verdicts"].values()}
    want = {"project", "orthogonalize", "project_t", "reconstruct", "average"}
    # the layer-wise hook packs the uncompressed gradients in project's launch (checked with project: the packed
    # buffer is one of its compared outputs); the alternating hook with a pack of its own
    assert want <= kernels and ("copy_segments" in kernels) == (hook_name == "alternating")
    # that variant of project's kernel has a verdict of its own (a run of the alternating hook, whose project does
    # not pack, checks its own)
    packs = [k.endswith("|packs") for k, e in dev["verdicts"].items() if e["kernel"] == "project"]
    assert packs == [hook_name == "layerwise"]
    assert all(e["ok"] and e["worst"] < 1e-5 for e in dev["verdicts"].values())
    # a later run (this process forgets, the file remembers): no check with one rank
    verify.forget()
    assert _same(_steps(_state(), hook, range(6)), plain) and verify.stats["checks"] == 0


def test_always_checks_every_step_off_never(world1):
    _steps(_state(verify="always"), powerSGD_hook, range(5))
    assert verify.stats["checks"] == 3  # steps 2, 3, 4 are compressed
    verify.forget()
    _steps(_state(verify="off"), powerSGD_hook, range(5))
    assert verify.stats["checks"] == 0
    st = _state(verify="off")
    _steps(st, powerSGD_hook, range(3))
    st.verify = "always"  # a live change is read at the next step
    _steps(st, powerSGD_hook, range(3, 5))
    assert verify.stats["checks"] == 2


def test_nonfinite_step_defers_the_check(world1):
    """A NaN gradient at the first compressed step cannot be judged: checked again at the next (finite) step."""
    def nan_at_2(step, data):
        if step == 2:
            data[3] = float("nan")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _steps(_state(), powerSGD_hook, range(6), poison=nan_at_2)
    assert verify.stats["checks"] == 2 and verify.stats["fallbacks"] == 0
    assert _same(got, _steps(_state(verify="off"), powerSGD_hook, range(6), poison=nan_at_2))
    assert not torch.isfinite(got[2]).all() and torch.isfinite(got[3]).all()


# ----------------------------------------------------------------------------------------------------- wrong kernels
@pytest.mark.parametrize("hook_name,kernel,how", [
    ("layerwise", "reconstruct", "perturb"),
    ("layerwise", "project", "noop"),
    ("batched", "project_t", "perturb"),
    ("alternating", "project", "perturb"),
])
def test_wrong_kernel_falls_back_to_torch(world1, monkeypatch, hook_name, kernel, how):
    hook = HOOKS[hook_name]
    want = _steps(_state(backend="torch"), hook, range(6))
    wrong = _perturb(kernel, how)
    monkeypatch.setattr(_LAUNCHERS[kernel], kernel, wrong)
    st = _state()
    with pytest.warns(RuntimeWarning) as record:
        got = _steps(st, hook, range(6))
    msgs = [str(w.message) for w in record if "disagree" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert f"{kernel} with config" in msgs[0] and "bucket 0" in msgs[0] and "fp32" in msgs[0]
    assert "worst relative error" in msgs[0] and "24x32 r2" in msgs[0] or hook_name == "batched"
    assert _same(got, want)  # the checked step and every later one: the torch backend's bits
    assert st.buckets[0].backend == "torch" and verify.stats["fallbacks"] == 1
    calls = len(wrong.calls)
    _steps(st, hook, range(6, 8))
    assert len(wrong.calls) == calls  # later steps never launch the wrong kernel
    assert "the next run checks again" in msgs[0] and verify.CLEAR_COMMAND in msgs[0]
    # remembered: a new state in this process goes straight to torch
    st2 = _state()
    assert _same(_steps(st2, hook, range(6)), want) and len(wrong.calls) == calls
    # the next run (this process forgets, the file has one strike) checks again: a second disagreement sticks
    verify.forget()
    with pytest.warns(RuntimeWarning, match="found wrong in 2 runs") as record:
        assert _same(_steps(_state(), hook, range(6)), want)
    assert verify.stats["checks"] == 1 and verify.CLEAR_COMMAND in str(record[-1].message)
    calls = len(wrong.calls)
    # and the run after that goes straight to torch, naming the command that clears the verdicts
    verify.forget()
    st3 = _state()
    with pytest.warns(RuntimeWarning, match="records that") as record:
        assert _same(_steps(st3, hook, range(6)), want)
    assert len(wrong.calls) == calls and verify.stats["checks"] == 0
    assert verify.CLEAR_COMMAND in str(record[-1].message)


def _one_rank_wrong_worker(rank, world_size, cache_dir, hook_name):
    os.environ["POWERSGD_TRITON_CACHE_DIR"] = os.path.join(cache_dir, f"rank{rank}")
    verify.forget()
    hook = HOOKS[hook_name]
    want = _steps(_state(backend="torch"), hook, range(5), rank=rank)
    if rank == 1:
        reconstruction.reconstruct = _perturb("reconstruct")
    st = _state()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = _steps(st, hook, range(5), rank=rank)
    msgs = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    return dict(same=_same(got, want), backend=st.buckets[0].backend, msgs=msgs, stats=dict(verify.stats))


@pytest.mark.parametrize("hook_name", ["layerwise", "alternating"])
def test_one_rank_wrong_both_fall_back(tmp_path, hook_name):
    r0, r1 = run_ranks(_one_rank_wrong_worker, 2, tmp_path, str(tmp_path), hook_name, timeout=240)
    for r in (r0, r1):
        assert r["same"] and r["backend"] == "torch" and len(r["msgs"]) == 1, r
        assert r["stats"]["agreements"] == 1 and r["stats"]["fallbacks"] == 1
    assert "disagree" in r1["msgs"][0] and "reconstruct" in r1["msgs"][0]
    assert "another rank" in r0["msgs"][0] and "reconstruct" in r0["msgs"][0], r0["msgs"][0][100:600]


# ----------------------------------------------------------------------------------------------------- verdict file
def test_damaged_verdict_file_is_set_aside(world1):
    folder = os.environ["POWERSGD_TRITON_CACHE_DIR"]
    os.makedirs(folder)
    path = os.path.join(folder, verify.VERDICT_FILENAME)
    with open(path, "w") as f:
        f.write('{"format": 1, "devices": {"x": {"verdicts": [')
    with pytest.warns(CacheWarning, match="damaged"):
        got = _steps(_state(), powerSGD_hook, range(4))
    assert verify.stats["checks"] == 1 and any(n.startswith(verify.VERDICT_FILENAME + ".corrupt-")
                                               for n in os.listdir(folder))
    assert _same(got, _steps(_state(verify="off"), powerSGD_hook, range(4)))
    # an entry with a bad field: the file is set aside, its valid entries are kept
    data = json.load(open(path))
    (dev,) = data["devices"].values()
    good = len(dev["verdicts"])
    dev["verdicts"]["bogus"] = {"ok": "yes"}
    with open(path, "w") as f:
        json.dump(data, f)
    with pytest.warns(CacheWarning, match="1 invalid entries"):
        assert len(verify.VerdictStore().verdicts(verify._device_key(_layout()))) == good


def _layout():
    from powersgd_triton.layout import BucketLayout

    buf = torch.zeros(NUMEL)
    return BucketLayout.from_gradients(buf, FakeBucket(buf, SHAPES).gradients(), 2, 2.0)


def test_autotune_show_lists_verdicts(world1, monkeypatch, capsys):
    from powersgd_triton import cli

    monkeypatch.setattr(reconstruction, "reconstruct", _perturb("reconstruct"))
    with pytest.warns(RuntimeWarning):
        _steps(_state(), powerSGD_hook, range(3))
    assert cli.main(["autotune", "--show"]) == 0
    out = capsys.readouterr().out
    assert "first-use verdicts" in out and "WRONG" in out and "buffer: worst relative error" in out
    assert out.count("| ok ") >= 4
