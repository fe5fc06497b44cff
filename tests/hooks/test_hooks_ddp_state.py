"""Real 2-rank DDP (gloo) checks of the hook state: PyTorch's resume recipe, sparse gradients, damaged state dicts,
``backend="triton"`` where Triton cannot run.

* PyTorch's documented recipe (``state.state_dict()`` or pickling the state, a fresh DDP on a fresh model, then
  ``ddp.register_comm_hook(loaded_state, hook)``, no call of ours) must resume bitwise like an uninterrupted run, for
  the three hooks. A fresh DDP puts its first buckets in registration order, a trained one in gradient-ready order:
  the memory has to follow its parameters.
* A model with ``nn.Embedding(..., sparse=True)``: DDP gives the sparse gradient a bucket of its own; the hooks
  average it as DDP does without a hook, bitwise, and compress the dense buckets.
* A state dict with a NaN warm-start Q is refused by ``load_state_dict`` with a ``ValueError`` (the state stays
  usable), instead of poisoning every later step.
* ``backend="triton"`` where the kernels cannot run on the bucket's device fails at the first backward (step 0,
  during the warm-up), not at ``start_powerSGD_iter``.
"""

import copy
import io
import os
import pickle

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_ranks
from _resume import continue_and_report
from _resume import train_steps as _steps
from powersgd_triton import PowerSGDState, alternating_powerSGD_hook, batched_powerSGD_hook, powerSGD_hook

pytestmark = pytest.mark.timeout(180)

HOOKS = {"powerSGD_hook": powerSGD_hook, "batched_powerSGD_hook": batched_powerSGD_hook,
         "alternating_powerSGD_hook": alternating_powerSGD_hook}
TOTAL, STOP = 9, 5


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _state():
    return PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, backend="torch")


def _recipe_worker(rank, world_size, hook_name, how):
    """Uninterrupted run vs PyTorch's recipe: stop, save (state_dict or pickle, with the model and optimizer), rebuild
    model, DDP, optimizer and state from the saved bytes, register_comm_hook(loaded_state, hook), continue."""
    hook = HOOKS[hook_name]
    ddp = DDP(_mlp())
    state = _state()
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    _steps(ddp, opt, rank, 0, TOTAL)
    reference = [p.detach().clone() for p in ddp.parameters()]

    ddp = DDP(_mlp())
    state = _state()
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    _steps(ddp, opt, rank, 0, STOP)
    saved = io.BytesIO()
    hook_state = state.state_dict() if how == "state_dict" else state
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "hook": hook_state}, saved)
    del ddp, state, opt

    saved.seek(0)
    ckpt = torch.load(saved, weights_only=(how == "state_dict"))
    model = _mlp()
    model.load_state_dict(ckpt["model"])
    ddp = DDP(model)
    if how == "state_dict":
        state = _state()
        state.load_state_dict(ckpt["hook"])
    else:
        state = ckpt["hook"]
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    opt.load_state_dict(ckpt["opt"])
    return continue_and_report(ddp, opt, state, rank, STOP, TOTAL, reference)


def _recipes_worker(rank, world_size):
    return {(hook, how): _recipe_worker(rank, world_size, hook, how) for hook in HOOKS for how in ("state_dict", "pickle")}


def test_pytorch_resume_recipe_is_bitwise_equal_to_uninterrupted(tmp_path):
    """The three hooks, through state_dict() and through pickling (one 2-rank run for all six)."""
    for rank, results in enumerate(run_ranks(_recipes_worker, 2, tmp_path)):
        for key, r in results.items():
            assert r["warnings"] == [], (rank, key, r["warnings"])
            assert r["equal"], (rank, key, r["max_diff"])
            assert r["iter"] == TOTAL, (rank, key)


class _SparseModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8, sparse=True)
        self.fc = nn.Linear(8, 16)

    def forward(self, idx):
        return self.fc(self.emb(idx)).sum(1)


def _sparse_worker(rank, world_size, hook_name):
    """Every step, the hook DDP and a hook-less DDP start from the same parameters and data: the sparse embedding
    gradient must be DDP's average bitwise; the dense bucket is compressed (finite, lossy, the same on both ranks)."""
    torch.manual_seed(0)
    ours, plain = DDP(_SparseModel()), DDP(_SparseModel())
    plain.module.load_state_dict(ours.module.state_dict())
    state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2, backend="torch")
    ours.register_comm_hook(state, HOOKS[hook_name])
    opt = torch.optim.SGD(ours.parameters(), lr=0.05)
    out = {"sparse_equal": [], "dense_equal": [], "finite": []}
    for step in range(5):
        idx = torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(10 * step + rank))
        for ddp in (ours, plain):
            ddp.zero_grad()
            ddp(idx).pow(2).sum().backward()
        g_ours, g_plain = ours.module.emb.weight.grad, plain.module.emb.weight.grad
        out["sparse_equal"].append(g_ours.is_sparse and torch.equal(g_ours.to_dense(), g_plain.to_dense()))
        out["dense_equal"].append(torch.equal(ours.module.fc.weight.grad, plain.module.fc.weight.grad))
        out["finite"].append(bool(torch.isfinite(ours.module.fc.weight.grad).all()))
        opt.step()
        plain.module.load_state_dict(ours.module.state_dict())
    out["iter"] = state.iter
    out["compressed"] = sum(m.layout.num_matrices for m in state.buckets.values())
    out["fc"] = ours.module.fc.weight.grad.clone()
    return out


def _sparse_hooks_worker(rank, world_size):
    return {hook: _sparse_worker(rank, world_size, hook) for hook in HOOKS}


def test_sparse_embedding_is_averaged_like_ddp_and_dense_compressed(tmp_path):
    r0, r1 = run_ranks(_sparse_hooks_worker, 2, tmp_path)
    for hook in HOOKS:
        for r in (r0[hook], r1[hook]):
            assert r["sparse_equal"] == [True] * 5, hook
            assert r["dense_equal"][:2] == [True, True], hook  # warm-up: plain averaging
            assert not any(r["dense_equal"][2:]), hook  # compressed at rank 1: lossy
            assert all(r["finite"]) and r["iter"] == 5 and r["compressed"] == 1, hook
        assert torch.equal(r0[hook]["fc"], r1[hook]["fc"]), hook  # the compressed gradient is the same on both ranks


def _damaged_worker(rank, world_size):
    """A state dict with one NaN in a warm-start Q is refused, naming bucket and key, and changes nothing; the same
    state then loads the undamaged dict and trains with finite parameters."""
    ddp = DDP(_mlp())
    state = _state()
    ddp.register_comm_hook(state, powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    _steps(ddp, opt, rank, 0, 4)
    good = copy.deepcopy(state.state_dict())
    bad = copy.deepcopy(good)
    index = next(iter(bad["buckets"]))
    bad["buckets"][index]["q"][3] = float("nan")

    model = _mlp()
    model.load_state_dict(ddp.module.state_dict())
    ddp2, state2 = DDP(model), _state()
    ddp2.register_comm_hook(state2, powerSGD_hook)
    before = pickle.dumps(state2.state_dict())
    try:
        state2.load_state_dict(bad)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    unchanged = pickle.dumps(state2.state_dict()) == before
    state2.load_state_dict(good)
    opt2 = torch.optim.SGD(ddp2.parameters(), lr=0.01, momentum=0.9)
    _steps(ddp2, opt2, rank, 4, 8)
    return {"refused": refused, "index": index, "unchanged": unchanged, "iter": state2.iter,
            "finite": all(bool(torch.isfinite(p).all()) for p in ddp2.parameters())}


def test_nan_in_saved_q_is_refused_on_ddp(tmp_path):
    for r in run_ranks(_damaged_worker, 2, tmp_path):
        assert r["refused"] is not None, "a NaN warm-start Q was adopted"
        assert f"bucket {r['index']}" in r["refused"] and "'q'" in r["refused"] and "non-finite" in r["refused"]
        assert r["unchanged"] and r["iter"] == 8 and r["finite"]


def _triton_worker(rank, world_size):
    """Triton installed and a CUDA build (so construction cannot know), but the buckets are CPU tensors without
    Triton's interpreter: the first backward (step 0, warm-up) raises; nothing was counted."""
    from powersgd_triton.compat import env as _env

    os.environ["TRITON_INTERPRET"] = "0"  # what _env reads: CPU tensors cannot run the kernels now
    torch.backends.cuda.is_built = lambda: True
    if not _env.triton_available():
        return "no triton"
    out = {}
    for hook_name, hook in HOOKS.items():
        ddp = DDP(_mlp())
        state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=1000, backend="triton")
        ddp.register_comm_hook(state, hook)
        try:
            ddp(torch.randn(4, 20)).sum().backward()
            out[hook_name] = {"error": None, "iter": state.iter}
        except RuntimeError as exc:
            out[hook_name] = {"error": str(exc), "iter": state.iter}
    return out


def test_triton_backend_that_cannot_run_fails_at_step_0(tmp_path):
    for results in run_ranks(_triton_worker, 2, tmp_path):
        if results == "no triton":
            pytest.skip("triton is not installed")
        for hook, r in results.items():
            assert r["error"] is not None, f"{hook}: backend='triton' trained its warm-up where Triton cannot run"
            assert "backend='triton' cannot run on cpu" in r["error"] and "TRITON_INTERPRET" in r["error"], hook
            assert r["iter"] == 0, hook
