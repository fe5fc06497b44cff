"""``state.error_dict`` / ``p_memory_dict`` / ``q_memory_dict`` as live mappings (powersgd_triton.state.torch_interop): our
hooks' memory read through them, PyTorch-style resets (``del``, ``clear()``, assignment) act on it or raise, and what
PyTorch's hook writes is kept, saved and checked on load. In-process, torch backend."""

import warnings

import numpy as np
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

from _dist import FakeBucket, bucket_numel
from powersgd_triton import PowerSGDState, powerSGD_hook
from powersgd_triton.hooks import driver as _step

pytestmark = pytest.mark.timeout(60)

SHAPES = [(40, 48), (12,), (16, 8, 3, 3), (16,)]


def _state(rng, **kwargs):
    state = PowerSGDState(None, start_powerSGD_iter=2, backend="torch", matrix_approximation_rank=2, **kwargs)
    state.iter = 7
    for index in (0, 3):
        bucket = FakeBucket(torch.randn(bucket_numel(SHAPES), generator=rng), SHAPES, index=index)
        mem = _step.prepare_bucket(state, bucket, bucket.buffer(), False, None)
        _step.draw_q(state, mem, torch.float32)
        mem.error.normal_(generator=rng)
        mem.p.normal_(generator=rng)
    return state


def test_our_memory_reads_through_and_deletes_reset_it(rng):
    state = _state(rng)
    m0, m3 = state.buckets[0], state.buckets[3]
    assert state.error_dict[0] is m0.error and state.p_memory_dict[3] is m3.p and state.q_memory_dict[0] is m0.q
    assert sorted(state.error_dict) == [0, 3] and len(state.q_memory_dict) == 2 and 3 in state.p_memory_dict
    del state.error_dict[0]  # error feedback restarts from zero, as PyTorch's hook re-creates a zero error
    assert torch.count_nonzero(m0.error) == 0 and torch.count_nonzero(m3.error) > 0
    q_before = m3.q.clone()
    del state.q_memory_dict[3]  # a fresh random initial Q at the next compressed step
    assert not m3.q_initialized and m0.q_initialized and torch.equal(m3.q, q_before)
    state.p_memory_dict.clear()  # PyTorch's hook without warm start: every bucket draws a new Q
    assert not m0.q_initialized
    state.error_dict = {}  # PyTorch-style reset by assignment
    assert torch.count_nonzero(m3.error) == 0
    with pytest.raises(KeyError):
        del state.error_dict[5]


def test_a_deleted_q_is_drawn_again_at_the_next_step(rng, world1):
    """After ``del state.q_memory_dict[i]`` the bucket's next compressed step consumes one seed of ``state.rng`` (the
    fresh initial Q, as PyTorch's hook draws one when its memory lacks the bucket); an untouched bucket does not."""
    state = _state(rng)
    data = torch.randn(bucket_numel(SHAPES), generator=rng)

    def seeds_used(index):
        before = state.rng.get_state()[2]
        powerSGD_hook(state, FakeBucket(data.clone(), SHAPES, index=index, is_last=False)).wait()
        return state.rng.get_state()[2] - before

    assert seeds_used(0) == 0
    del state.q_memory_dict[0]
    assert seeds_used(0) == 1 and seeds_used(0) == 0


def test_assignment_copies_in_or_raises_and_changes_nothing(rng):
    state = _state(rng)
    mem = state.buckets[0]
    new_q = torch.randn(mem.q.numel(), generator=rng)
    state.q_memory_dict[0] = new_q
    assert state.q_memory_dict[0] is mem.q and torch.equal(mem.q, new_q)
    before = mem.error.clone()
    with pytest.raises(ValueError, match="holds .* elements"):
        state.error_dict[0] = torch.zeros(bucket_numel(SHAPES))  # PyTorch's size: the whole bucket
    with pytest.raises(TypeError, match="torch.Tensor"):
        state.error_dict[0] = [1.0]
    with pytest.raises(TypeError, match="must be set to a dict"):
        state.error_dict = None
    assert torch.equal(mem.error, before)


def test_written_entries_are_kept_saved_and_checked(rng):
    state = PowerSGDState(None, start_powerSGD_iter=2)
    e = torch.randn(50, generator=rng)
    state.error_dict[1] = e
    assert state.error_dict[1] is e and dict(state.error_dict) == {1: e} and state.p_memory_dict == {}
    sd = state.state_dict()
    other = PowerSGDState(None, start_powerSGD_iter=2)
    other.load_state_dict(sd)
    assert torch.equal(other.error_dict[1], e) and other.error_dict[1] is not e
    bad = dict(sd, torch_hook_memory={"error": {1: torch.tensor([1.0, float("nan")])}})
    fresh = PowerSGDState(None, start_powerSGD_iter=2)
    with pytest.raises(ValueError, match=r"torch_hook_memory.*NaN"):
        fresh.load_state_dict(bad)
    assert fresh.error_dict == {}
    state.error_dict.clear()
    assert "torch_hook_memory" not in state.state_dict()


def test_pytorch_pickled_state_loads_into_ours(rng):
    """What PyTorch's ``PowerSGDState.__getstate__`` returns unpickles into ours: its settings, RNG, counters and
    memory (kept for PyTorch's hook); something else is a TypeError naming from_torch."""
    theirs = torch_psgd.PowerSGDState(None, matrix_approximation_rank=3, start_powerSGD_iter=5, random_seed=11,
                                      warm_start=False, min_compression_rate=1.5)
    theirs.iter = 9
    theirs.rng.randint(10)
    theirs.error_dict[0] = torch.randn(20, generator=rng)
    theirs.q_memory_dict[0] = torch.randn(6, generator=rng)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pickled = theirs.__getstate__()
    ours = PowerSGDState.__new__(PowerSGDState)
    ours.__setstate__(pickled)
    assert (ours.matrix_approximation_rank, ours.start_powerSGD_iter, ours.warm_start, ours.min_compression_rate,
            ours.iter) == (3, 5, False, 1.5, 9)
    assert ours.rng.randint(1_000_000_000) == theirs.rng.randint(1_000_000_000)
    assert ours.error_dict[0] is theirs.error_dict[0] and ours.q_memory_dict[0] is theirs.q_memory_dict[0]
    with pytest.raises(TypeError, match="from_torch"):
        PowerSGDState.__new__(PowerSGDState).__setstate__({"rng": np.random.RandomState(0)})


def test_misspelt_attribute_raises_as_on_pytorchs_state():
    """Both states have ``__slots__``: ``state.warmstart = False`` would otherwise change nothing, silently."""
    for state in (PowerSGDState(None), torch_psgd.PowerSGDState(None)):
        with pytest.raises(AttributeError):
            state.warmstart = False


# ------------------------------------------------ putting memory back through the dicts (issue 40 item 2), 2 ranks
def _put_back(state, how):
    """Each way of putting a state's memory back through its dicts, as a PyTorch user would."""
    if how == "assign_error":
        state.error_dict = dict(state.error_dict)
    elif how == "assign_q_copies":
        state.q_memory_dict = {i: q.clone() for i, q in state.q_memory_dict.items()}
    elif how == "assign_p":
        state.p_memory_dict = dict(state.p_memory_dict)
    elif how == "items":
        for i in list(state.q_memory_dict):
            state.q_memory_dict[i] = state.q_memory_dict[i].clone()
            state.error_dict[i] = state.error_dict[i].clone()
    elif how == "update":
        state.error_dict.update({i: e.clone() for i, e in state.error_dict.items()})
        state.q_memory_dict.update(dict(state.q_memory_dict))


PUT_BACK = ["assign_error", "assign_q_copies", "assign_p", "items", "update"]


def _put_back_worker(rank, world_size, seed, hook_name):
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    hook = powerSGD_hook if hook_name == "ours" else torch_psgd.powerSGD_hook
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    xs = [torch.randn(5, 10, generator=gen) for _ in range(8)]

    def run(how):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
        ddp = DDP(model)
        state = PowerSGDState(None, backend="torch", matrix_approximation_rank=2, start_powerSGD_iter=2,
                              min_compression_rate=1.5, random_seed=seed)
        ddp.register_comm_hook(state, hook)
        grads = []
        for step, x in enumerate(xs):
            if step == 5 and how is not None:
                _put_back(state, how)
            ddp.zero_grad()
            ddp(x).pow(2).sum().backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        return grads

    oracle = run(None)
    return {how: [float((g - h).norm() / h.norm()) for g, h in zip(run(how)[5:], oracle[5:])] for how in PUT_BACK}


@pytest.mark.parametrize("hook_name", ["ours", "pytorch"])
def test_memory_put_back_through_the_dicts_changes_nothing(tmp_path, hook_name):
    """``state.error_dict = dict(state.error_dict)`` (before: the error memory zeroed, 0.22 relative change in the next
    gradients), ``state.q_memory_dict = {i: q.clone() ...}`` (before: fresh random Qs drawn, 0.43), and the same through
    ``p_memory_dict``, item assignment and ``update()``: the next gradients are bitwise those of the run that did not
    do it (relative change 0.0), under our hook and under PyTorch's hook on our state (as on PyTorch's own state)."""
    from _dist import run_ranks

    seed = int(torch.randint(0, 10_000, ()).item())
    print("seed", seed)
    for r in run_ranks(_put_back_worker, 2, tmp_path, seed, hook_name, timeout=150):
        assert all(change == 0.0 for changes in r.values() for change in changes), r


def test_assignment_is_checked_first_and_sets_what_it_is_given(rng):
    """``state.error_dict = d``: every value is checked before anything changes; afterwards the mapping holds what
    ``d`` holds (entries ``d`` lacks are deleted: a zero error, a fresh Q), and an assigned Q is the warm start."""
    state = _state(rng)
    m0, m3 = state.buckets[0], state.buckets[3]
    before = m0.error.clone()
    with pytest.raises(ValueError, match="holds .* elements"):
        state.error_dict = {0: torch.randn(m0.error.numel(), generator=rng), 3: torch.zeros(5)}
    assert torch.equal(m0.error, before)  # the valid entry was not applied either
    new_e = torch.randn(m0.error.numel(), generator=rng)
    state.error_dict = {0: new_e}
    assert torch.equal(m0.error, new_e) and torch.count_nonzero(m3.error) == 0
    del state.q_memory_dict[3]
    assert 3 not in state.q_memory_dict and 3 not in state.p_memory_dict  # as PyTorch's dicts after the delete
    new_q = torch.randn(m3.q.numel(), generator=rng)
    state.q_memory_dict[3] = new_q
    assert m3.q_initialized and torch.equal(m3.q, new_q) and 3 in state.p_memory_dict
    kept = state.q_memory_dict[0]
    state.q_memory_dict = {5: kept}  # a new entry holding our bucket 0's Q: a copy, not our tensor
    assert not m0.q_initialized and state.q_memory_dict[5] is not kept and torch.equal(state.q_memory_dict[5], kept)
