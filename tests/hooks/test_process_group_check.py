"""A state on another process group than its DDP model's is refused (issue 33): DDP all-reducing in a sub-group
while the state (``process_group=None``: WORLD) would average the compressed gradients over every rank is a silently
wrong gradient (PyTorch's hook computes it). Our hooks raise ``ValueError`` at the first call, naming both groups;
``integrations.register`` at registration. The state given DDP's group runs, and its gradients are that group's
average (checked against the float64 average of the group's local gradients)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_ranks
from powersgd_triton import PowerSGDState, alternating_powerSGD_hook, powerSGD_hook
from powersgd_triton.integrations import register

pytestmark = pytest.mark.timeout(120)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _first_error(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _worker(rank, world_size, seed):
    # world 4 split into two sub-groups {0, 1} and {2, 3}; each pair trains its own DDP model
    sub, _ = dist.new_subgroups(group_size=2)
    out = {}
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed + rank))
    for name, hook in (("layerwise", powerSGD_hook), ("alternating", alternating_powerSGD_hook)):
        ddp = DDP(_model(), process_group=sub)
        ddp.register_comm_hook(PowerSGDState(None, start_powerSGD_iter=2, backend="torch"), hook)
        out[name] = _first_error(lambda: ddp(x).sum().backward())
    out["register"] = _first_error(lambda: register(DDP(_model(), process_group=sub),
                                                    PowerSGDState(None, start_powerSGD_iter=2)))
    # WORLD given explicitly to a sub-group DDP: refused too
    ddp = DDP(_model(), process_group=sub)
    ddp.register_comm_hook(PowerSGDState(dist.group.WORLD, start_powerSGD_iter=2, backend="torch"), powerSGD_hook)
    out["explicit_world"] = _first_error(lambda: ddp(x).sum().backward())

    # The right group: 3 steps (the last one compressed) average over the pair only: the uncompressed bias gradient
    # is the float64 average of the pair's local ones, and the compressed weights agree within the pair (the test).
    model = _model()
    ddp = DDP(model, process_group=sub)
    state = PowerSGDState(sub, start_powerSGD_iter=2, backend="torch", matrix_approximation_rank=2)
    register(ddp, state)
    for _ in range(3):
        ddp.zero_grad()
        ddp(x).sum().backward()
    local = _model()
    local.load_state_dict(model.state_dict())
    local(x).sum().backward()
    bias = local[2].bias.grad.double()
    gathered = [torch.zeros_like(bias) for _ in range(2)]
    dist.all_gather(gathered, bias, group=sub)
    out["bias_error"] = float((model[2].bias.grad.double() - sum(gathered) / 2).abs().max())
    out["weights"] = [p.grad.clone() for p in model.parameters()]
    out["iter"] = state.iter
    return out


def test_state_on_another_group_than_ddp_is_refused(tmp_path):
    seed = int(torch.randint(0, 10_000, ()).item())
    results = run_ranks(_worker, 4, tmp_path, seed, timeout=100)
    for rank, r in enumerate(results):
        for key in ("layerwise", "alternating", "register", "explicit_world"):
            assert r[key] is not None, (rank, key)
            assert "of 4 ranks [0, 1, 2, 3]" in r[key] and f"of 2 ranks [{rank // 2 * 2}, {rank // 2 * 2 + 1}]" in \
                r[key], r[key]
        assert "process_group=None" in r["layerwise"] and "process_group=None" not in r["explicit_world"]
        assert r["iter"] == 3 and r["bias_error"] < 1e-6
    # the pairs' compressed gradients agree within each pair, and differ between the pairs (other data)
    for a, b in ((0, 1), (2, 3)):
        assert all(torch.equal(g, h) for g, h in zip(results[a]["weights"], results[b]["weights"]))
    assert not torch.equal(results[0]["weights"][0], results[2]["weights"][0])



def _changed_group_worker(rank, world_size, seed, steps=5, switch_at=3):
    """Refused: a DDP model of each rank alone (a group of 1 inside the world of 2), its state on that group; after
    ``switch_at`` steps the state's group is set to WORLD and the next call refuses it (the hook would average over
    both ranks), changing nothing (iteration, error memory; DDP cannot run on after an exception in its hook).
    Accepted: a DDP pair on WORLD whose state's group becomes a new group object of the same ranks after ``switch_at``
    steps: checked again and accepted; gradients per step, with the same run without the switch (the oracle)."""
    mine, _ = dist.new_subgroups(group_size=1)
    same_ranks = dist.new_group([0, 1])
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(seed + rank))
    kw = dict(start_powerSGD_iter=2, backend="torch", matrix_approximation_rank=2, min_compression_rate=1.1,
              random_seed=seed)

    model = _model()
    ddp = DDP(model, process_group=mine)
    state = PowerSGDState(mine, **kw)
    ddp.register_comm_hook(state, powerSGD_hook)
    for _ in range(switch_at):
        ddp.zero_grad()
        ddp(x).pow(2).sum().backward()
    state.process_group = dist.group.WORLD
    iter_before, error_before = state.iter, state.buckets[0].error.clone()
    refused = _first_error(lambda: ddp(x).pow(2).sum().backward())
    unchanged = state.iter == iter_before and torch.equal(state.buckets[0].error, error_before) and \
        torch.count_nonzero(error_before) > 0

    def train(switch: bool):
        model = _model()
        ddp = DDP(model)
        state = PowerSGDState(None, **kw)
        ddp.register_comm_hook(state, powerSGD_hook)
        grads = []
        for step in range(steps):
            if switch and step == switch_at:
                state.process_group = same_ranks
            ddp.zero_grad()
            ddp(x).pow(2).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        return grads, state.buckets.group_checked is same_ranks

    oracle, _ = train(False)
    switched, rechecked = train(True)
    return {"refused": refused, "unchanged": unchanged, "rechecked": rechecked,
            "equal": [all(torch.equal(a, b) for a, b in zip(g, h)) for g, h in zip(oracle, switched)]}


def test_process_group_changed_on_a_live_state_is_checked_again(tmp_path):
    """Issue 40 item 4: ``state.process_group`` set to WORLD after the first steps of a DDP model on a smaller group is
    refused at the next call, naming both groups (before: averaged over every rank, silently), and the refusal changes
    nothing in the state; a new group object with DDP's ranks is checked and accepted, and that run is bitwise the run
    without the switch."""
    seed = int(torch.randint(0, 10_000, ()).item())
    for rank, r in enumerate(run_ranks(_changed_group_worker, 2, tmp_path, seed, timeout=100)):
        msg = r["refused"]
        assert msg is not None and "of 2 ranks [0, 1]" in msg and f"of 1 rank [{rank}]" in msg, msg
        assert r["unchanged"]
        assert r["rechecked"] and all(r["equal"]), r["equal"]
