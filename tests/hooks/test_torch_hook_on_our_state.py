"""Drop-in both ways: PyTorch's own ``powerSGD_hook`` runs on our :class:`PowerSGDState` exactly as on its own state.

PyTorch's hook keeps its memory in ``state.error_dict`` / ``p_memory_dict`` / ``q_memory_dict`` and writes them itself;
ours are live mappings that keep what it writes (:mod:`powersgd_triton.state.torch_interop`). On 2 gloo ranks, 32 steps
(30 compressed) of PyTorch's hook on each state give bitwise the same gradients at every step, and a state dict
(or a pickle) of ours taken mid-run resumes PyTorch's hook bitwise too.
"""

import pickle

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_ranks
from powersgd_triton import PowerSGDState

pytestmark = pytest.mark.timeout(180)

STEPS, START, SAVE_AT = 32, 2, 17


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 4))


def _hook(holder, bucket):
    """PyTorch's hook on ``holder["state"]`` (DDP takes one register_comm_hook per model: the resumed state is
    swapped in behind it)."""
    return torch_psgd.powerSGD_hook(holder["state"], bucket)


def _run(rank, seed, make_state, resume=None):
    """Gradients after each of STEPS backward passes of PyTorch's powerSGD_hook on ``make_state()``'s state (one
    DDP bucket); with ``resume`` ("state_dict" or "pickle"), the state is saved after SAVE_AT steps and the
    rest runs on a fresh state loaded from it."""
    ddp = DDP(_model(seed))  # one bucket: PyTorch's hook issues collectives from gloo callbacks, out of order with two
    holder = {"state": make_state()}
    ddp.register_comm_hook(holder, _hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    grads = []
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    for step in range(STEPS):
        if resume is not None and step == SAVE_AT:
            if resume == "pickle":
                holder["state"] = pickle.loads(pickle.dumps(holder["state"]))
            else:
                saved = holder["state"].state_dict()
                holder["state"] = make_state()
                holder["state"].load_state_dict(saved)
        opt.zero_grad()
        x = torch.randn(6, 12, generator=gen)
        ddp(x).pow(2).sum().backward()
        grads.append([p.grad.detach().clone() for p in ddp.parameters()])
        opt.step()
    return grads, holder["state"]


def _worker(rank, world_size, seed, resume):
    kw = dict(matrix_approximation_rank=2, start_powerSGD_iter=START, min_compression_rate=1.5, random_seed=seed)
    theirs, _ = _run(rank, seed, lambda: torch_psgd.PowerSGDState(None, **kw))
    ours, state = _run(rank, seed, lambda: PowerSGDState(None, backend="torch", **kw), resume)
    return {
        "steps_equal": [all(torch.equal(a, b) for a, b in zip(g, h)) for g, h in zip(theirs, ours)],
        "written": {kind: sorted(d.written) for kind, d in state._memory_dicts.items()},
        "iter": state.iter,
        "stats": state.compression_stats(),
        "any_nonzero_error": any(bool(t.abs().sum() > 0) for t in state.error_dict.values()),
    }


@pytest.mark.parametrize("resume", [None, "state_dict", "pickle"])
def test_pytorch_hook_on_our_state_gives_its_own_gradients(tmp_path, resume):
    seed = int(torch.randint(0, 10_000, ()).item())
    print("seed", seed)
    for r in run_ranks(_worker, 2, tmp_path, seed, resume, timeout=150):
        assert all(r["steps_equal"]), [i for i, ok in enumerate(r["steps_equal"]) if not ok]
        assert r["iter"] == STEPS
        # PyTorch's hook wrote its memory into our dicts, and error feedback is live
        assert r["written"]["error"] == [0] and r["written"]["q"] == [0]
        assert r["any_nonzero_error"]
        assert r["stats"][0] > 1  # the steps really were compressed
