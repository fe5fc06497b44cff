"""Per-rank hook-state checkpoints (powersgd_triton.checkpoint) and the memory following its parameters.

A fresh DistributedDataParallel puts the parameters of its first buckets in registration order and rebuilds them in
gradient-ready order after its first iteration; a state saved from a trained DDP therefore meets other bucket layouts
on resume, twice. These tests resume on 2 gloo ranks and require the parameters to equal an uninterrupted run's
bitwise, with one bucket and with several, and check every refusal of ``load_hook_state``.
"""

import copy
import os
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_ranks
from _resume import continue_and_report
from _resume import train_steps as _steps
from powersgd_triton import PowerSGDState, alternating_powerSGD_hook, batched_powerSGD_hook, powerSGD_hook
from powersgd_triton.hooks import driver as _step
from powersgd_triton.checkpoint import hook_state_path, load_hook_state, load_hook_state_if_saved, save_hook_state
from powersgd_triton.integrations import register

pytestmark = pytest.mark.timeout(120)

TOTAL, STOP = 10, 5


def _model(frozen: bool = False):
    torch.manual_seed(0)
    # Two 32x32 layers: same shapes, so a swap of their memory would go unseen by the layout signature alone.
    m = nn.Sequential(
        nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    if frozen:
        m[2].weight.requires_grad_(False)
    return m


def _state(**kw):
    kw.setdefault("matrix_approximation_rank", 2)
    return PowerSGDState(None, start_powerSGD_iter=2, backend="torch", **kw)


def _setup(model, cap, hook=powerSGD_hook, **state_kw):
    ddp = DDP(model, **({"bucket_cap_mb": cap} if cap else {}))
    state = _state(**state_kw)
    register(ddp, state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    return ddp, state, opt


def _resume_worker(rank, world_size, folder, cap, how, hook=powerSGD_hook, stop=STOP, **state_kw):
    """Uninterrupted run vs stop at ``stop``, save, rebuild everything, load, continue. Returns what differs."""
    ddp, state, opt = _setup(_model(), cap, hook, **state_kw)
    _steps(ddp, opt, rank, 0, TOTAL)
    reference = [p.detach().clone() for p in ddp.parameters()]
    buckets_uninterrupted = len(state.buckets)

    ddp, state, opt = _setup(_model(), cap, hook, **state_kw)
    _steps(ddp, opt, rank, 0, stop)
    model_sd = copy.deepcopy(ddp.module.state_dict())
    opt_sd = copy.deepcopy(opt.state_dict())
    if how == "files":
        file = save_hook_state(state, ddp, folder)
    else:  # state_dict(), as Lightning callbacks / Accelerate would: the names come from register()
        hook_sd = copy.deepcopy(state.state_dict())
    errors = {i: e.clone() for i, e in state.error_dict.items()}

    model = _model()
    model.load_state_dict(model_sd)
    ddp, state, opt = _setup(model, cap, hook, **state_kw)
    opt.load_state_dict(opt_sd)
    if how == "files":
        load_hook_state(state, ddp, folder)
    else:
        state.load_state_dict(hook_sd)
    return {
        **continue_and_report(ddp, opt, state, rank, stop, TOTAL, reference),
        "buckets": (buckets_uninterrupted, len(state.buckets)),
        "errors": errors,
        "file": file if how == "files" else None,
    }


@pytest.mark.parametrize("cap", [None, 0.002], ids=["one_bucket", "three_buckets"])
def test_resume_is_bitwise_equal_to_uninterrupted(tmp_path, cap):
    results = run_ranks(_resume_worker, 2, tmp_path, str(tmp_path / "ckpt"), cap, "files")
    for rank, r in enumerate(results):
        assert r["equal"], (rank, r["max_diff"])
        assert r["warnings"] == []
        assert r["iter"] == TOTAL
        assert r["buckets"][0] == r["buckets"][1] == (1 if cap is None else 3)
        assert r["file"] == hook_state_path(str(tmp_path / "ckpt"), rank)
        assert os.path.basename(r["file"]) == f"hook_state.rank{rank}.pt"
    # The error memory really is per rank: rank 1's is not rank 0's.
    e0, e1 = results[0]["errors"], results[1]["errors"]
    assert e0.keys() == e1.keys() and not all(torch.equal(e0[i], e1[i]) for i in e0)


@pytest.mark.parametrize("hook, cap, how", [
    (powerSGD_hook, None, "files"), (powerSGD_hook, 0.002, "state_dict"), (alternating_powerSGD_hook, 0.002, "files"),
    (batched_powerSGD_hook, None, "files")], ids=["layerwise-one_bucket", "layerwise-three_buckets-state_dict",
                                                 "alternating-three_buckets", "batched-one_bucket"])
def test_resume_at_the_first_compressed_step_is_bitwise(tmp_path, hook, cap, how):
    """Saved at iter == start_powerSGD_iter (no memory yet): the resumed run's first compressed step meets the fresh
    DDP's first buckets, the uninterrupted run's the rebuilt ones; the state dict carries the first step's Qs drawn
    for the rebuilt buckets (powersgd_triton.state.predraw), so the runs stay bitwise equal."""
    for r in run_ranks(_resume_worker, 2, tmp_path, str(tmp_path / "ckpt") if how == "files" else None, cap, how,
                       hook, 2):
        assert r["equal"] and r["warnings"] == [] and r["iter"] == TOTAL, r["max_diff"]


@pytest.mark.parametrize("hook, cap, stop", [(powerSGD_hook, None, 2), (powerSGD_hook, 0.002, 5),
                                             (batched_powerSGD_hook, None, 3)])
def test_resume_without_warm_start_is_bitwise(tmp_path, hook, cap, stop):
    """Without warm start every compressed step draws a fresh Q per bucket: the state dict carries the next step's
    draws for the trained DDP's buckets (``predrawn``), taken by the resumed step in the fresh DDP's buckets."""
    for r in run_ranks(_resume_worker, 2, tmp_path, str(tmp_path / "ckpt"), cap, "files", hook, stop,
                       warm_start=False):
        assert r["equal"] and r["warnings"] == [] and r["iter"] == TOTAL, r["max_diff"]


def test_alternating_hook_resumes_exactly(tmp_path):
    """The alternating hook's kept factors, local residuals and phase follow their parameters too (STOP is odd:
    the resumed buckets take a Q half-step first)."""
    for r in run_ranks(_resume_worker, 2, tmp_path, str(tmp_path / "ckpt"), 0.002, "files", alternating_powerSGD_hook):
        assert r["equal"] and r["warnings"] == [] and r["iter"] == TOTAL, r["max_diff"]


def test_resume_through_state_dict_after_register(tmp_path):
    """state_dict()/load_state_dict() (no files) is exact too once register() named the parameters."""
    for r in run_ranks(_resume_worker, 2, tmp_path, None, 0.002, "state_dict"):
        assert r["equal"] and r["warnings"] == [] and r["iter"] == TOTAL


def _load_refusals_worker(rank, world_size, folder):
    out = {}
    ddp, state, opt = _setup(_model(), None)
    _steps(ddp, opt, rank, 0, 4)
    save_hook_state(state, ddp, folder)
    dist.barrier()

    def attempt(fn):
        try:
            fn()
        except (ValueError, FileNotFoundError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    # Another rank's file, another world size, a missing file, another model, other compression settings.
    swapped = os.path.join(folder, "swapped")  # each rank finds the other rank's file under its own name
    os.makedirs(swapped, exist_ok=True)
    shutil.copy(hook_state_path(folder, 1 - rank), hook_state_path(swapped, rank))
    out["rank"] = attempt(lambda: load_hook_state(_state(), ddp, swapped))
    out["world"] = attempt(lambda: load_hook_state(_state(), ddp, folder, world_size=4))
    out["missing"] = attempt(lambda: load_hook_state(_state(), ddp, folder, rank=3, world_size=2))
    other = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 32),
                          nn.ReLU(), nn.Linear(32, 4))
    out["model"] = attempt(lambda: load_hook_state(_state(), other, folder))
    out["settings"] = attempt(lambda: load_hook_state(_state(matrix_approximation_rank=4), ddp, folder))
    out["ok"] = attempt(lambda: load_hook_state(_state(), ddp, folder))
    # What the Lightning and Accelerate integrations call: load when saved, else warn and start afresh.
    out["if_saved"] = load_hook_state_if_saved(_state(), ddp, folder, rank=rank, world_size=world_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_hook_state_if_saved(_state(), ddp, os.path.join(folder, "none"), rank=rank,
                                          world_size=world_size, checkpoint="epoch=1.ckpt")
    out["if_missing"] = (loaded, [str(w.message) for w in caught])

    # Same parameter names and shapes, but a layer frozen when the state was saved is trained now: the bucket has a
    # compressed parameter without saved memory. Detected when the hook first sees the bucket, from backward().
    frozen_ddp, frozen_state, frozen_opt = _setup(_model(frozen=True), None)
    _steps(frozen_ddp, frozen_opt, rank, 0, 4)
    save_hook_state(frozen_state, frozen_ddp, os.path.join(folder, "frozen"))
    ddp2, state2, opt2 = _setup(_model(), None)
    load_hook_state(state2, ddp2, os.path.join(folder, "frozen"))
    try:
        _steps(ddp2, opt2, rank, 4, 5)
        out["first_sight"] = None
    except Exception as exc:  # noqa: BLE001 - DDP may re-wrap the hook's error
        out["first_sight"] = f"{type(exc).__name__}: {exc}"
    return out


def test_load_refuses_what_does_not_match(tmp_path):
    results = run_ranks(_load_refusals_worker, 2, tmp_path, str(tmp_path / "ckpt"))
    for rank, r in enumerate(results):
        assert r["ok"] is None and r["if_saved"] is True
        loaded, messages = r["if_missing"]
        assert loaded is False and len(messages) == 1 and messages[0].startswith("epoch=1.ckpt has no PowerSGD hook")
        assert f"hook_state.rank{rank}.pt" in messages[0] and "starts afresh" in messages[0]
        assert r["rank"].startswith("ValueError") and f"rank {1 - rank}" in r["rank"]
        assert r["world"].startswith("ValueError") and "world of 2 ranks" in r["world"] and "has 4" in r["world"]
        assert r["missing"].startswith("FileNotFoundError") and "hook_state.rank0.pt" in r["missing"]
        assert r["model"].startswith("ValueError") and "2.weight" in r["model"] and "(32, 32)" in r["model"]
        assert r["settings"].startswith("ValueError") and "matrix_approximation_rank" in r["settings"]
        assert r["first_sight"] is not None and "2.weight" in r["first_sight"], r["first_sight"]
        assert "no saved memory" in r["first_sight"]


def _pytorch_recipe_worker(rank, world_size, folder):
    """PyTorch's recipe (rank 0's state loaded on every rank) is an approximate resume: it says so."""
    ddp, state, opt = _setup(_model(), None)
    _steps(ddp, opt, rank, 0, 4)
    sd = state.state_dict()
    obj = [sd if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    ddp2, state2, opt2 = _setup(_model(), None)
    state2.load_state_dict(obj[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(ddp2, opt2, rank, 4, 5)
    return [str(w.message) for w in caught if "PowerSGD" in str(w.message)]


def test_rank0_state_on_every_rank_warns(tmp_path):
    r0, r1 = run_ranks(_pytorch_recipe_worker, 2, tmp_path, None)
    assert r0 == []
    assert any("rank 1 resumes from the hook state of rank 0" in m for m in r1), r1


def test_batched_hook_follows_a_reordered_bucket_and_warns_when_split(tmp_path):
    """The batched hook's memory spans the whole bucket, in the order of its parameters when it was built. One bucket:
    the fresh DDP holds the same parameters in another order, then rebuilds it in the saved order; the memory is
    kept in its order both times, exactly (main reset it with two warnings). Three buckets partitioned differently
    by the fresh DDP: the memory of a bucket whose parameters are now split cannot follow, and says so (twice: the
    fresh DDP's first buckets, then the rebuilt ones); never a silent reuse of memory in another order."""
    for r in run_ranks(_resume_worker, 2, tmp_path, str(tmp_path / "one"), None, "files", batched_powerSGD_hook):
        assert r["equal"] and r["warnings"] == [] and r["iter"] == TOTAL, (r["max_diff"], r["warnings"])
    for r in run_ranks(_resume_worker, 2, tmp_path, str(tmp_path / "three"), 0.002, "files", batched_powerSGD_hook):
        assert not r["equal"] and r["iter"] == TOTAL
        assert len(r["warnings"]) == 2 and all("batched hook holds other parameters" in w for w in r["warnings"])


def test_hook_state_file_loads_weights_only(tmp_path):
    state = _state()
    model = _model()
    file = save_hook_state(state, model, str(tmp_path / "x" / "r{rank}.pt"), rank=1, world_size=3)
    assert file == str(tmp_path / "x" / "r1.pt")
    payload = torch.load(file, weights_only=True)
    assert payload["rank"] == 1 and payload["world_size"] == 3
    assert payload["parameters"]["0.weight"] == [32, 20]
    meta = load_hook_state(_state(), model, str(tmp_path / "x" / "r{rank}.pt"), rank=1, world_size=3)
    assert meta["format"] == "powersgd_triton.hook_state" and "hook_state" not in meta
    with pytest.raises(RuntimeError, match="init_process_group"):
        save_hook_state(state, model, str(tmp_path))
    with pytest.raises(TypeError, match="PowerSGDState"):
        save_hook_state(object(), model, str(tmp_path), rank=0, world_size=1)


def test_hook_state_path_names_a_stray_placeholder(tmp_path):
    """A path with ``{rank}`` and another placeholder (or a lone brace) is a ValueError naming the path and the one
    placeholder accepted, before any file is written; ``{rank:03d}`` and doubled braces are formatted; braces in a
    folder without ``{rank}`` are its name."""
    base = str(tmp_path / "ckpt")
    assert hook_state_path(base + "/r{rank:03d}.pt", 7) == base + "/r007.pt"
    assert hook_state_path(base + "/{{x}}.r{rank}.pt", 2) == base + "/{x}.r2.pt"
    assert hook_state_path(base + "/{epoch}", 1) == os.path.join(base + "/{epoch}", "hook_state.rank1.pt")
    for bad, what in (("/{epoch}/r{rank}.pt", "{epoch}"), ("/r{rank}.{}.pt", "{}"), ("/r{rank}{0}.pt", "{0}"),
                      ("/r{rank}.pt{", "malformed"), ("/r{rank:{width}}.pt", "malformed")):
        path = base + bad
        with pytest.raises(ValueError) as info:
            hook_state_path(path, 0)
        message = str(info.value)
        assert repr(path) in message and what in message and "only placeholder it accepts is {rank}" in message
        with pytest.raises(ValueError, match="only placeholder"):
            save_hook_state(_state(), _model(), path, rank=0, world_size=1)
    assert not os.path.exists(base)


class _ParamBucket:
    """A duck-typed bucket whose parameters() are the same nn.Parameters on every call, as DDP's are."""

    def __init__(self, params, index, is_last):
        self._params = params
        self._buffer = torch.cat([p.detach().reshape(-1) for p in params]).clone()
        self._index, self._is_last = index, is_last

    def buffer(self):
        return self._buffer

    def gradients(self):
        out, off = [], 0
        for p in self._params:
            out.append(self._buffer[off : off + p.numel()].view(p.shape))
            off += p.numel()
        return out

    def parameters(self):
        return self._params

    def index(self):
        return self._index

    def is_last(self):
        return self._is_last


def test_first_seen_bucket_without_compressed_matrices_draws_its_seed():
    """A new bucket that compresses nothing is not 'migrated' from other buckets: it consumes its initial-Q seed,
    as PyTorch's hook does, so the RNG stream (and every later Q) stays PyTorch's."""
    model = _model()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    state = _state()
    b0, b1 = _ParamBucket(weights, 0, False), _ParamBucket(biases, 1, True)
    mem0 = _step.prepare_bucket(state, b0, b0.buffer(), False, None)
    _step.draw_q(state, mem0, torch.float32)
    mem1 = _step.prepare_bucket(state, b1, b1.buffer(), False, None)
    assert mem1.layout.num_matrices == 0 and not mem1.q_initialized  # the hook will draw (and consume a seed)


def test_memory_follows_parameters_into_fewer_buckets():
    """Three buckets become two (DDP's rebuild): every matrix keeps its memory, the third bucket is dropped."""
    model = _model()
    params = list(model.parameters())  # 0.w 0.b 2.w 2.b 4.w 4.b 6.w 6.b
    state = _state()
    first = [_ParamBucket(params[6:], 0, False), _ParamBucket(params[3:6], 1, False), _ParamBucket(params[:3], 2, True)]
    for b in first:
        mem = _step.prepare_bucket(state, b, b.buffer(), False, None)
        _step.draw_q(state, mem, torch.float32)
        mem.error.normal_()
        mem.p.normal_()
    before = {}
    for mem in state.buckets.values():
        for s in mem.layout.matrices:
            before[id(mem.params[s.grad_index])] = (
                mem.error[s.e_offset : s.e_offset + s.numel].clone(), mem.q[s.q_offset : s.q_offset + s.m * s.rank].clone()
            )
    second = [_ParamBucket(params[4:][::-1], 0, False), _ParamBucket(params[:4][::-1], 1, True)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mems = [_step.prepare_bucket(state, b, b.buffer(), False, None) for b in second]
    assert sorted(state.buckets) == [0, 1] and not state.buckets.retired
    for mem in mems:
        assert mem.q_initialized
        for s in mem.layout.matrices:
            e, q = before[id(mem.params[s.grad_index])]
            assert torch.equal(mem.error[s.e_offset : s.e_offset + s.numel], e)
            assert torch.equal(mem.q[s.q_offset : s.q_offset + s.m * s.rank], q)
    assert sum(m.layout.num_matrices for m in mems) == len(before) == 3  # 6.weight (4x32) is too small at rank 2
