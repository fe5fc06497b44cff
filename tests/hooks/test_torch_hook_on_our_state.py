"""Drop-in both ways: PyTorch's own ``powerSGD_hook`` runs on our :class:`PowerSGDState` exactly as on its own state.

PyTorch's hook keeps its memory in ``state.error_dict`` / ``p_memory_dict`` / ``q_memory_dict`` and writes them itself;
ours are live mappings that keep what it writes (:mod:`powersgd_triton.state.torch_interop`). On 2 gloo ranks, 32 steps
(30 compressed) of PyTorch's hook on each state give bitwise the same gradients at every step, and a state dict
(or a pickle) of ours taken mid-run resumes PyTorch's hook bitwise too.
"""

import pickle
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_ranks
from powersgd_triton import PowerSGDState, powerSGD_hook

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


# ---------------------------------------------------------------- PyTorch's hook on memory of ours (issue 40 item 1)
KW = dict(matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=1.5)
OURS_STEPS, THEIR_STEPS = 5, 4


def _biased_model(seed):
    """Biases (uncompressed) between matrices of two shapes: our error memory covers the matrices only."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 20), nn.ReLU(), nn.Linear(20, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def _either(holder, bucket):
    return holder["hook"](holder["state"], bucket)


def _ddp(model, state, hook):
    holder = {"state": state, "hook": hook}
    ddp = DDP(model)  # one bucket (PyTorch's hook on gloo needs one)
    ddp.register_comm_hook(holder, _either)
    return ddp, holder


def _step(ddp, x):
    ddp.zero_grad()
    ddp(x).pow(2).sum().backward()
    return [p.grad.detach().clone() for p in ddp.parameters()]


def _their_state(ours, seed, error, p, q):
    """PyTorch's own state at ``ours``' iteration and RNG position, holding the given memory of bucket 0."""
    theirs = torch_psgd.PowerSGDState(None, random_seed=seed, **KW)
    theirs.iter = ours.iter
    theirs.rng.set_state(ours.rng.get_state())
    if error is not None:
        theirs.error_dict[0] = error
    if p is not None:
        theirs.p_memory_dict[0], theirs.q_memory_dict[0] = p, q
    return theirs


def _whole_bucket_error(mem, numel):
    """The oracle's expansion: zeros, each compressed matrix's error at its offset in the flat bucket."""
    error = torch.zeros(numel)
    for s in mem.layout.matrices:
        error[s.offset : s.offset + s.numel] = mem.error[s.e_offset : s.e_offset + s.numel]
    return error


def _live_switch_worker(rank, world_size, seed):
    """Two identical DDP models trained in lockstep with our hook; then one goes on with PyTorch's hook on OUR state
    (the switch), the other with PyTorch's hook on PyTorch's own state given our memory in its form (the oracle)."""
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    xs = [torch.randn(6, 12, generator=gen) for _ in range(OURS_STEPS + THEIR_STEPS)]
    a_ddp, a = _ddp(_biased_model(seed), PowerSGDState(None, backend="torch", random_seed=seed, **KW), powerSGD_hook)
    b_ddp, b = _ddp(_biased_model(seed), PowerSGDState(None, backend="torch", random_seed=seed, **KW), powerSGD_hook)
    before = [(_step(a_ddp, x), _step(b_ddp, x)) for x in xs[:OURS_STEPS]]
    mem = b["state"].buckets[0]
    numel = sum(p.numel() for p in b_ddp.parameters())
    b["state"] = _their_state(b["state"], seed, _whole_bucket_error(mem, numel), mem.p.clone(), mem.q.clone())
    a["hook"] = b["hook"] = torch_psgd.powerSGD_hook
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: the memory maps
        after = [(_step(a_ddp, x), _step(b_ddp, x)) for x in xs[OURS_STEPS:]]
    return {"before": all(torch.equal(g, h) for ga, gb in before for g, h in zip(ga, gb)),
            "after": [all(torch.equal(g, h) for g, h in zip(ga, gb)) for ga, gb in after],
            "uncompressed": numel - mem.layout.e_numel, "error_nonzero": bool(mem.error.abs().sum() > 0),
            "compressed": a["state"].compression_stats()[0]}


def test_pytorch_hook_after_ours_continues_from_our_memory(tmp_path):
    """A live switch from our hook to PyTorch's on our state (a model with biases: before, a size error inside
    backward) gives bitwise PyTorch's hook on its own state holding our memory in its whole-bucket form, at every
    step after the switch."""
    seed = int(torch.randint(0, 10_000, ()).item())
    print("seed", seed)
    for r in run_ranks(_live_switch_worker, 2, tmp_path, seed, timeout=150):
        assert r["before"] and r["error_nonzero"] and r["uncompressed"] > 0
        assert all(r["after"]), r["after"]
        assert r["compressed"] > 1


def _fresh_bucket_forms(model, names, saved_mem):
    """The oracle's memory for a fresh DDP's first bucket (every parameter, in registration order), from our memory
    of each named parameter: the whole-bucket error, and P, Q in PyTorch's packing (matrices grouped by shape in
    order of first appearance), written here from the definition rather than through the library."""
    by_name = {}
    for s in saved_mem.layout.matrices:
        by_name[names[id(saved_mem.params[s.grad_index])]] = (
            saved_mem.error[s.e_offset : s.e_offset + s.numel], saved_mem.p[s.p_offset : s.p_offset + s.n * s.rank],
            saved_mem.q[s.q_offset : s.q_offset + s.m * s.rank])
    error, groups, offset = torch.zeros(sum(p.numel() for p in model.parameters())), {}, 0
    for name, p in model.named_parameters():
        if name in by_name:
            error[offset : offset + p.numel()] = by_name[name][0]
            groups.setdefault(tuple(p.shape), []).append(name)
        offset += p.numel()
    order = [name for group in groups.values() for name in group]
    return error, torch.cat([by_name[n][1] for n in order]), torch.cat([by_name[n][2] for n in order])


def _loaded_worker(rank, world_size, seed, other_rank):
    """Our hook trains, its state_dict() is loaded into a fresh state on a fresh DDP that runs PyTorch's hook
    (registered directly: PyTorch's recipe), against a fresh DDP running PyTorch's hook on PyTorch's own state given
    our memory in its form (or, ``other_rank``: memory saved at another rank cannot map; PyTorch's own state given
    none, after one warning)."""
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    xs = [torch.randn(6, 12, generator=gen) for _ in range(OURS_STEPS + THEIR_STEPS)]
    model = _biased_model(seed)
    state = PowerSGDState(None, backend="torch", random_seed=seed, **KW)
    ddp = DDP(model)
    ddp.register_comm_hook(state, powerSGD_hook)
    for x in xs[:OURS_STEPS]:
        _step(ddp, x)
    saved, weights = state.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    mem = state.buckets[0]

    def fresh():
        m = _biased_model(seed)
        m.load_state_dict(weights)
        return m

    loaded = PowerSGDState(None, backend="torch", random_seed=seed,
                           **dict(KW, matrix_approximation_rank=3 if other_rank else 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded.load_state_dict(saved)
        a_ddp = DDP(fresh())
        a_ddp.register_comm_hook(loaded, torch_psgd.powerSGD_hook)
        a_first = _step(a_ddp, xs[OURS_STEPS])
    forms = (None, None, None) if other_rank else _fresh_bucket_forms(a_ddp.module, names, mem)
    theirs = _their_state(loaded, seed, *forms)
    theirs.iter = saved["iter"]
    theirs.rng.set_state(state.rng.get_state())
    if other_rank:
        theirs.matrix_approximation_rank = 3
    b_ddp = DDP(fresh())
    b_ddp.register_comm_hook(theirs, torch_psgd.powerSGD_hook)
    b_first = _step(b_ddp, xs[OURS_STEPS])
    steps = [(a_first, b_first)] + [(_step(a_ddp, x), _step(b_ddp, x)) for x in xs[OURS_STEPS + 1:]]
    return {"equal": [all(torch.equal(g, h) for g, h in zip(ga, gb)) for ga, gb in steps],
            "warnings": [str(w.message) for w in caught if "powerSGD_hook on bucket" in str(w.message)],
            "forms_differ": other_rank or not torch.equal(forms[0], _whole_bucket_error(mem, forms[0].numel()))}


@pytest.mark.parametrize("other_rank", [False, True], ids=["maps", "cannot_map"])
def test_pytorch_hook_on_our_loaded_state_dict(tmp_path, other_rank):
    """Our ``state_dict()`` loaded into a fresh DDP run with PyTorch's hook (before: a size error inside backward):
    our memory follows its parameters (by name) into the fresh DDP's first bucket, whose order differs from the saved
    one, and PyTorch's hook computes bitwise what it computes on its own state holding that memory, at every step.
    Memory that cannot map (saved at rank 2, run at rank 3): one warning, and bitwise PyTorch's hook starting its own
    memory."""
    seed = int(torch.randint(0, 10_000, ()).item())
    print("seed", seed)
    for r in run_ranks(_loaded_worker, 2, tmp_path, seed, other_rank, timeout=150):
        assert all(r["equal"]), r["equal"]
        assert r["forms_differ"]  # the fresh bucket's order is not the saved one: a mapping really happened
        if other_rank:
            assert len(r["warnings"]) == 1 and "does not cover its compressed gradients" in r["warnings"][0]
        else:
            assert r["warnings"] == []


def _reverse_worker(rank, world_size, seed):
    """PyTorch's hook on our state, then our hook (the reverse direction), against PyTorch's hook on its own state
    converted with PowerSGDState.from_torch for our hook: our hook starts its own memory, as today."""
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    xs = [torch.randn(6, 12, generator=gen) for _ in range(OURS_STEPS + THEIR_STEPS)]
    a_ddp, a = _ddp(_biased_model(seed), PowerSGDState(None, backend="torch", random_seed=seed, **KW),
                    torch_psgd.powerSGD_hook)
    b_ddp, b = _ddp(_biased_model(seed), torch_psgd.PowerSGDState(None, random_seed=seed, **KW),
                    torch_psgd.powerSGD_hook)
    steps = [(_step(a_ddp, x), _step(b_ddp, x)) for x in xs[:OURS_STEPS]]
    b["state"] = PowerSGDState.from_torch(b["state"], backend="torch")
    a["hook"] = b["hook"] = powerSGD_hook
    steps += [(_step(a_ddp, x), _step(b_ddp, x)) for x in xs[OURS_STEPS:]]
    return [all(torch.equal(g, h) for g, h in zip(ga, gb)) for ga, gb in steps]


def test_our_hook_after_pytorchs_starts_its_own_memory(tmp_path):
    seed = int(torch.randint(0, 10_000, ()).item())
    print("seed", seed)
    for r in run_ranks(_reverse_worker, 2, tmp_path, seed, timeout=150):
        assert all(r), r
