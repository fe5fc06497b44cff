"""PowerSGD as the all-reduce of FSDP2-based replicate() (powersgd_triton.fsdp_replicate), and FSDP2 modules with
several parameter groups (refused with one error).

The oracle is our DDP hook on ``DistributedDataParallel`` (``register_comm_hook(state, hook)``) on the same model,
data and seeds. At a lossy rank the first compressed step's gradients agree within 1e-5 only if both states draw the
same initial Q: the model registers its layers in the reverse of their use (``parameters()`` order = the order in
which DDP's rebuilt bucket receives the gradients), so the replicate() group and DDP's one bucket hold the compressed
matrices in the same order, which each run checks on the states' layouts before comparing numbers. Then 6 training
steps (SGD with momentum) agree within 1e-5 relative (float32 rounding: the uncompressed tensors are all-reduced in
another order, and gloo's reduction order follows the buffer's layout). The bytes over the replicate group are
counted by wrapping ``dist.all_reduce``: P, Q and the uncompressed tensors only, FSDP's native all-reduce going to
this rank's 1-rank group. Also: gradient accumulation (``set_requires_all_reduce(False)`` and
``set_requires_gradient_sync(False)`` against DDP's ``no_sync()``; two all-reduced backward passes per step against
DDP's with each pass's result kept apart, as FSDP2 accumulates), replicate() on submodules and the root (lossless rank
against DDP, replicas equal), the DDP-based replicate() with our DDP hook (every torch), and an FSDP2 module with two
parameter groups (refused with one error). Each multi-rank run (2 and 4 gloo ranks, the hooks' torch backend: the
kernels see the same ``BucketLayout`` as for DDP and are tested there) serves all its cases; refusals that one rank
can see run in-process on a world of one.
"""

import os
import re
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _dist import error_text as _error, run_ranks
from bucket_utils import rel_err64 as _rel

from powersgd_triton import PowerSGDState, alternating_powerSGD_hook, powerSGD_hook
from powersgd_triton.compat.versions import fsdp_all_reduce_hook_missing, replicate_with_fsdp_missing

REPLICATE_MISSING = replicate_with_fsdp_missing()
MULTI_GROUP_MISSING = None
try:
    import inspect

    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult  # noqa: F401
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    if "_fsdp_param_groups" not in inspect.getsource(FSDPState.__init__):
        MULTI_GROUP_MISSING = f"torch {torch.__version__}'s FSDP2 makes one parameter group per module"
except Exception as exc:  # noqa: BLE001
    MULTI_GROUP_MISSING = (f"torch {torch.__version__} has no per-parameter mesh for fully_shard "
                           f"(ShardPlacementResult / FSDPState._fsdp_param_groups: {type(exc).__name__})")


class Net(nn.Module):
    """Three linear layers registered in the reverse of their use (``c(b(a(x)))``): ``parameters()`` lists c, b, a,
    the order of the gradients in DDP's rebuilt bucket. At rank 2 all three weights are compressed (12x24, 24x40,
    40x16); the biases travel uncompressed."""

    def __init__(self):
        super().__init__()
        self.c = nn.Linear(24, 12)
        self.b = nn.Linear(40, 24)
        self.a = nn.Linear(16, 40)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _sequential():
    """The same three layers as an ordinary ``nn.Sequential``, registered in the order of their use."""
    return nn.Sequential(nn.Linear(16, 40), nn.Tanh(), nn.Linear(40, 24), nn.Tanh(), nn.Linear(24, 12))


def _batch(step, rank, seed):
    g = torch.Generator().manual_seed(seed + 1000 * step + rank)
    return torch.randn(16, 16, generator=g), torch.randn(16, 12, generator=g)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _grads(model):
    return {n.removeprefix("module."): _local(p.grad).detach().clone() for n, p in model.named_parameters()}


def _run(model, steps, rank, seed, lr=0.05):
    """``steps`` SGD steps (momentum 0.9); the gradients of each step and the final parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    grads = []
    for step in range(steps):
        opt.zero_grad()
        x, y = _batch(step, rank, seed)
        nn.functional.mse_loss(model(x), y).backward()
        grads.append(_grads(model))
        opt.step()
    return grads, {n.removeprefix("module."): _local(p).detach().clone() for n, p in model.named_parameters()}


def _run_with_losses(model, steps, rank, seed):
    """:func:`_run`'s steps; the gradients and the loss of each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    grads, losses = [], []
    for step in range(steps):
        opt.zero_grad()
        x, y = _batch(step, rank, seed)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        grads.append(_grads(model))
        losses.append(float(loss))
        opt.step()
    return grads, losses


def _run_accumulating(model, steps, rank, seed, mode):
    """``steps`` SGD steps of two micro-batches each; the gradients of each step. ``mode``: the first micro-batch
    without gradient sync (DDP: ``"no_sync"``; replicate(): ``"set_requires_all_reduce"`` or
    ``"set_requires_gradient_sync"``), or ``"both"``: both backward passes all-reduced (two hook calls per step).
    ``"both_apart"`` (DDP): both all-reduced, the first pass's result set aside and added after the second: what
    FSDP2 does (it all-reduces each pass's new gradient and adds it to what it holds; DDP's reducer puts the
    accumulated ``.grad`` in the bucket, so the second hook call compresses the first result plus the new local
    gradient: the same sum for a lossless all-reduce, another one at a lossy rank)."""
    import contextlib

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads = []
    for step in range(steps):
        opt.zero_grad()
        x, y = _batch(step, rank, seed)
        with model.no_sync() if mode == "no_sync" else contextlib.nullcontext():
            if mode.startswith("set_"):
                getattr(model, mode)(False)
            nn.functional.mse_loss(model(x[:8]), y[:8]).backward()
        if mode.startswith("set_"):
            getattr(model, mode)(True)
        if mode == "both_apart":
            first = [p.grad.clone() for p in model.parameters()]
            opt.zero_grad()
        nn.functional.mse_loss(model(x[8:]), y[8:]).backward()
        if mode == "both_apart":
            for p, g in zip(model.parameters(), first):
                p.grad.add_(g)
        grads.append(_grads(model))
        opt.step()
    return grads


def _layout(state):
    return {i: ([(s.n, s.m, s.rank) for s in m.layout.matrices], m.layout.uncompressed_numel)
            for i, m in sorted(state.buckets.items()) if m.layout is not None}


def _state(rank_, **kw):
    return PowerSGDState(None, matrix_approximation_rank=rank_, start_powerSGD_iter=2, backend="torch",
                         random_seed=7, **kw)


def _ddp_run(hook, rank_, steps, rank, seed, module=None):
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(module or Net())
    state = _state(rank_)
    ddp.register_comm_hook(state, hook)
    grads, params = _run(ddp, steps, rank, seed)
    return grads, params, state


def _compare(a, b):
    """Max relative difference per step over the parameters (names matched)."""
    return [max(_rel(gb[n], ga[n]) for n in ga) for ga, gb in zip(a, b)]


def _replicate_worker(rank, world_size, seed, cases):
    warnings.simplefilter("ignore")
    out = {}
    if "ddp_replicate" in cases:
        # --- the DDP-based torch.distributed._composable.replicate: our DDP hook through its register_comm_hook
        from torch.distributed._composable import replicate as ddp_replicate

        d_grads, _, _ = _ddp_run(powerSGD_hook, 2, 4, rank, seed)
        torch.manual_seed(0)
        model = ddp_replicate(Net())
        model.register_comm_hook(_state(2), powerSGD_hook)
        r_grads, _ = _run(model, 4, rank, seed)
        out["ddp_replicate"] = _compare(d_grads, r_grads)
        out["ddp_replicate_ranks"] = [int(torch.linalg.matrix_rank(g["c.weight"])) for g in r_grads[2:]]

    if REPLICATE_MISSING:
        return out
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from powersgd_triton.fsdp_replicate import register_replicate

    if "sequential" in cases:
        # --- a plain nn.Sequential (registered in the order of use): DDP's rebuilt bucket holds the matrices last
        # layer first, the replicate() group in parameters() order, so the two states draw different initial Qs
        from torch.nn.parallel import DistributedDataParallel

        out["sequential"] = {}
        for hook in (powerSGD_hook, alternating_powerSGD_hook):
            torch.manual_seed(0)
            ddp = DistributedDataParallel(_sequential())
            d_state = _state(2)
            ddp.register_comm_hook(d_state, hook)
            d_grads, d_losses = _run_with_losses(ddp, 8, rank, seed)
            torch.manual_seed(0)
            model = replicate(_sequential())
            state = _state(2)
            register_replicate(model, state, hook)
            r_grads, r_losses = _run_with_losses(model, 8, rank, seed)
            out["sequential"][hook.__name__] = {
                "layouts": (_layout(d_state), _layout(state)),
                "grad_errors": _compare(d_grads, r_grads),
                "loss_errors": [abs(a - b) / abs(a) for a, b in zip(d_losses, r_losses)],
                "ranks": [int(torch.linalg.matrix_rank(g["4.weight"])) for g in (d_grads[2], r_grads[2])],
            }

    from powersgd_triton.compat import versions as _compat
    from powersgd_triton.train.counting import AllReduceCounter

    steps = 6
    # --- one replicate() group against DDP's one bucket, lossy (rank 2), both hooks
    for hook in (powerSGD_hook, alternating_powerSGD_hook):
        name = hook.__name__
        d_grads, d_params, d_state = _ddp_run(hook, 2, steps, rank, seed)
        torch.manual_seed(0)
        model = replicate(Net())
        state = _state(2)
        handle = register_replicate(model, state, hook)
        with AllReduceCounter(handle.replicate_ranks) as wire, AllReduceCounter([rank]) as solo:
            r_grads, r_params = _run(model, steps, rank, seed)
        out[name] = {
            "ranks": [int(torch.linalg.matrix_rank(r_grads[i]["c.weight"])) for i in (1, 2)],
            "grad_errors": _compare(d_grads, r_grads),
            "param_error": max(_rel(r_params[n], d_params[n]) for n in d_params),
            "layouts": (_layout(d_state), _layout(state)),
            "iter": (d_state.iter, state.iter),
            "wire": (wire.bytes, wire.calls),
            "solo": (solo.bytes, solo.calls),
            "uncompressed": sum(p.numel() for p in model.parameters() if p.dim() == 1),
            "numel": sum(p.numel() for p in model.parameters()),
        }
        if name == "powerSGD_hook":
            sd = handle.state_dict()
            torch.manual_seed(0)
            other = replicate(Net())
            h2 = register_replicate(other, _state(2))
            h2.load_state_dict(sd)
            out["reload_ok"] = h2.state.iter == state.iter
            out["other_rank_load_error"] = _error(lambda: h2.load_state_dict({**sd, "rank": (rank + 1) % world_size}))

    if "multi" in cases:
        # --- replicate() on submodules and the root: three groups, lossless rank against DDP; replicas agree
        d_grads, d_params, _ = _ddp_run(powerSGD_hook, 64, 4, rank, seed)
        torch.manual_seed(0)
        model = Net()
        replicate(model.a)
        replicate(model.b)
        replicate(model)
        state = PowerSGDState(None, matrix_approximation_rank=64, start_powerSGD_iter=2, min_compression_rate=1e-9,
                              backend="torch")
        handle = register_replicate(model, state)
        r_grads, r_params = _run(model, 4, rank, seed)
        out["multi"] = {"modules": [g.module_name for g in handle.groups], "grad_errors": _compare(d_grads, r_grads),
                        "compressed": sorted((i, m.layout.num_matrices) for i, m in state.buckets.items())}
        mine = torch.cat([p.reshape(-1) for p in r_params.values()])
        everyone = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(everyone, mine)
        out["multi"]["replicas_equal"] = all(torch.equal(everyone[0], t) for t in everyone[1:])

    # --- gradient accumulation against DDP, lossy rank 2: set_requires_all_reduce(False) or
    # set_requires_gradient_sync(False) against no_sync(); two all-reduced backward passes per step against DDP's
    # with the first pass's result set aside (FSDP2's accumulation: see _run_accumulating)
    from torch.nn.parallel import DistributedDataParallel

    def accumulate(ddp_mode, mode):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(Net())
        d_state = _state(2)
        ddp.register_comm_hook(d_state, powerSGD_hook)
        d_grads = _run_accumulating(ddp, 4, rank, seed, ddp_mode)
        torch.manual_seed(0)
        model = replicate(Net())
        state = _state(2)
        register_replicate(model, state)
        r_grads = _run_accumulating(model, 4, rank, seed, mode)
        return (_compare(d_grads, r_grads), d_state.iter, state.iter,
                int(torch.linalg.matrix_rank(r_grads[2]["c.weight"])))

    out["accumulate"] = {mode: accumulate("no_sync", mode)
                         for mode in ("set_requires_all_reduce", "set_requires_gradient_sync")}
    out["accumulate"]["both"] = accumulate("both_apart", "both")

    # --- a group that is not the modules' replicate group: refused on every rank, nothing changed
    singles = [dist.new_group([r]) for r in range(world_size)]
    torch.manual_seed(0)
    model = replicate(Net())
    fg = _compat.fsdp_param_groups(model._get_fsdp_state())[0]
    info = fg.mesh_info
    out["subgroup_error"] = _error(lambda: register_replicate(model, PowerSGDState(singles[rank],
                                                                                   start_powerSGD_iter=2)))
    out["untouched"] = fg._all_reduce_hook is None and fg.mesh_info is info

    if "multi_group" in cases and not MULTI_GROUP_MISSING:
        # --- fully_shard with a per-parameter mesh (two parameter groups): one clear error, nothing registered
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
        from torch.distributed.tensor import Shard

        from powersgd_triton.fsdp import register_fsdp

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        wide = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        wide_info = FSDPMeshInfo(wide, shard_mesh_dim=0)
        torch.manual_seed(0)
        model = Net()
        fully_shard(model, mesh=mesh["shard"],
                    shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), wide_info) if p is model.b.weight
                    else None)
        groups = model._get_fsdp_state()._fsdp_param_groups
        out["multi_group"] = {
            "groups": len(groups),
            "error": _error(lambda: register_fsdp(model, PowerSGDState(mesh["replicate"].get_group(),
                                                                       start_powerSGD_iter=2))),
            "hooks": [g._all_reduce_hook is not None for g in groups],
            "fsdp_error": _error(lambda: model.set_all_reduce_hook(lambda t: None)),
        }
    return out


def _check_common(out):
    for name in ("powerSGD_hook", "alternating_powerSGD_hook"):
        r = out[name]
        ddp_layout, ours = r["layouts"]
        # the premise of the lossy comparison: one bucket, the same compressed matrices in the same order
        assert list(ours) == [0] and ddp_layout == ours, (name, ddp_layout, ours)
        assert [m[:2] for m in ours[0][0]] == [(12, 24), (24, 40), (40, 16)], ours
        # lossy: the averaged 12x24 gradient has rank >= 10 at step 1 (plain averaging), 2 at step 2 (compressed)
        assert r["ranks"][0] >= 10 and r["ranks"][1] == 2, (name, r["ranks"])
        errs = r["grad_errors"]  # steps 0-1: plain averaging; step 2: the first compressed step
        assert max(errs[:3]) <= 1e-5, (name, errs)
        assert max(errs) <= 1e-5 and r["param_error"] <= 1e-5, (name, errs, r["param_error"])
        assert r["iter"] == (6, 6)
        # the wire (the replicate group): 2 warm-up steps of whole gradients, then P + Q (+ the biases)
        numel = r["numel"]
        pq = sum(n * k + m * k for n, m, k in ours[0][0])
        if name == "powerSGD_hook":  # per compressed step: the biases, P, Q (3 all-reduces)
            assert r["wire"] == (4 * (2 * numel + 4 * (pq + ours[0][1])), 2 + 4 * 3), (r["wire"], numel, pq)
        else:  # one all-reduce a compressed step: P (P steps) or Q (Q steps), with the biases
            assert r["wire"][1] == 2 + 4, r["wire"]
            assert 4 * (2 * numel + 4 * ours[0][1]) < r["wire"][0] < 4 * (2 * numel + 4 * (pq + ours[0][1]))
        # FSDP's own all-reduce: one per step and group, over this rank's 1-rank group (nothing on the wire)
        assert r["solo"] == (4 * numel * 6, 6), r["solo"]
    assert out["reload_ok"]
    assert "ValueError" in out["other_rank_load_error"] and "rank" in out["other_rank_load_error"]
    assert "ValueError" in out["subgroup_error"] and "all-reduces over ranks" in out["subgroup_error"], out
    assert out["untouched"], "a refused registration changed the model"


_CASES = {2: ("ddp_replicate", "sequential"), 4: ("multi", "multi_group")}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``launched(world_size)``: the ranks' results of one run of :func:`_replicate_worker` (made once per module)."""
    cache = {}

    def get(world_size):
        if world_size not in cache:
            seed = int.from_bytes(os.urandom(4), "little") % 2**30
            print(f"data seed of the {world_size}-rank run: {seed}")
            try:
                cache[world_size] = run_ranks(_replicate_worker, world_size,
                                              tmp_path_factory.mktemp(f"replicate{world_size}"), seed,
                                              _CASES[world_size], timeout=300)
            except Exception as exc:  # noqa: BLE001 - every test of this run reports it
                cache[world_size] = exc
        if isinstance(cache[world_size], Exception):
            raise cache[world_size]
        return cache[world_size]

    return get


needs_replicate = pytest.mark.skipif(bool(REPLICATE_MISSING), reason=REPLICATE_MISSING or "")


@needs_replicate
@pytest.mark.parametrize("world_size", [2, 4])
def test_replicate_matches_ddp_hook(launched, world_size):
    for out in launched(world_size):
        _check_common(out)


@needs_replicate
@pytest.mark.parametrize("world_size", [2, 4])
def test_replicate_gradient_accumulation_matches_ddp_no_sync(launched, world_size):
    """One iteration per synchronized backward, as DDP counts: 4 steps without sync on the first micro-batch, 8 with
    both backward passes all-reduced (the last three steps compressed twice each: iterations 2-7)."""
    for out in launched(world_size):
        for mode, iters, lossy in (("set_requires_all_reduce", 4, 2), ("set_requires_gradient_sync", 4, 2),
                                   ("both", 8, 4)):  # both: the sum of two rank-2 all-reduces
            errs, ddp_iter, our_iter, rank_ = out["accumulate"][mode]
            assert max(errs) <= 1e-5 and ddp_iter == our_iter == iters and rank_ == lossy, (mode, out["accumulate"])


@needs_replicate
def test_replicate_on_submodules_and_root(launched):
    for out in launched(4):
        m = out["multi"]
        assert m["modules"] == ["", "b", "a"], m  # model.modules() order: the root's group holds c
        assert max(m["grad_errors"]) <= 1e-5 and m["replicas_equal"], m
        assert m["compressed"] == [(0, 2), (1, 2), (2, 2)], m  # weight and bias (min_compression_rate 1e-9)


@needs_replicate
def test_plain_sequential_draws_another_initial_q(launched):
    """What docs/guides/replicate.md claims for an ordinary ``nn.Sequential`` (layers registered in the order of
    their use), DDP + our hook against replicate() + register_replicate, rank 2, 8 steps, 2 ranks: the same
    compressed matrices in opposite orders (DDP's rebuilt bucket: last layer first; the replicate() group:
    ``parameters()`` order), so each state draws another initial Q from the same seed. Equal: the gradients of the
    warm-up steps (bitwise) and the losses up to the first compressed step's (bitwise). Not equal: the first
    compressed step's gradients (two rank-2 approximations from different Qs: 0.86-1.6 relative in the runs measured)
    and every loss after it (1e-5 to 1.4e-3 relative measured; within 1e-2 here: the same method, another draw)."""
    for out in launched(2):
        for name, r in out["sequential"].items():
            ddp_layout, ours = r["layouts"]
            shapes = [(12, 24, 2), (24, 40, 2), (40, 16, 2)]
            assert ddp_layout == {0: (shapes, 76)} and ours == {0: (shapes[::-1], 76)}, (name, r["layouts"])
            errs, losses = r["grad_errors"], r["loss_errors"]
            assert errs[:2] == [0.0, 0.0] and losses[:3] == [0.0, 0.0, 0.0], (name, errs, losses)
            assert min(errs[2:]) > 0.1, (name, errs)  # another initial Q: another rank-2 approximation
            assert r["ranks"] == [2, 2], (name, r["ranks"])  # the last layer, lossy in both
            assert all(0 < e <= 1e-2 for e in losses[3:]), (name, losses)


def test_ddp_based_replicate_takes_our_ddp_hook(launched):
    """torch.distributed._composable.replicate (DDP-based, every torch): its register_comm_hook takes our DDP hook."""
    for out in launched(2):
        assert max(out["ddp_replicate"]) <= 1e-5, out["ddp_replicate"]
        assert out["ddp_replicate_ranks"] == [2, 2], out["ddp_replicate_ranks"]  # lossy steps 2 and 3


@needs_replicate
@pytest.mark.skipif(bool(MULTI_GROUP_MISSING), reason=MULTI_GROUP_MISSING or "")
def test_fsdp_module_with_several_param_groups_is_refused(launched):
    for out in launched(4):
        g = out["multi_group"]
        assert g["groups"] == 2 and not any(g["hooks"]), g
        err = g["error"]
        assert err.startswith("ValueError") and "'<root>' has 2 FSDP parameter groups" in err, err
        assert "'b.weight'" in err and "'c.weight'" in err and "('ep',)" in err and "'shard'" in err, err
        assert "native HSDP" in err and "Shard(dim)" in err, err
        assert g["fsdp_error"] and "multiple param groups" in g["fsdp_error"], g


# ----------------------------------------------------------------------------------- one rank: configuration errors
@pytest.fixture
def world(world1):
    return dist.group.WORLD


@pytest.mark.skipif(REPLICATE_MISSING is None, reason="this torch has FSDP2-based replicate()")
def test_torch_without_fsdp_replicate_is_refused(world):
    from powersgd_triton.fsdp_replicate import register_replicate

    expected = re.escape(f"torch {torch.__version__} has no FSDP2-based replicate()")
    with pytest.raises(RuntimeError, match=expected) as exc:
        register_replicate(nn.Linear(3, 3), PowerSGDState(None, start_powerSGD_iter=2))
    assert "model.register_comm_hook(state, powerSGD_hook)" in str(exc.value)


@pytest.mark.skipif(bool(REPLICATE_MISSING), reason=REPLICATE_MISSING or "")
def test_bad_replicate_setups_are_refused(world):
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    from powersgd_triton import batched_powerSGD_hook
    from powersgd_triton.fsdp import register_fsdp
    from powersgd_triton.fsdp_replicate import register_replicate

    def rep():
        torch.manual_seed(0)
        return replicate(Net())

    st = lambda **kw: PowerSGDState(None, start_powerSGD_iter=2, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="1 rank: there is no all-reduce"):
        register_replicate(rep(), st())
    with pytest.raises(TypeError, match="no replicate\\(\\) module"):
        register_replicate(Net(), st())
    with pytest.raises(ValueError, match="batched_powerSGD_hook"):
        register_replicate(rep(), st(), batched_powerSGD_hook)
    with pytest.raises(ValueError, match="warm_start=True"):
        register_replicate(rep(), st(warm_start=False), alternating_powerSGD_hook)
    model = rep()
    model.set_gradient_divide_factor(2.0)
    with pytest.raises(ValueError, match="gradient divide factor"):
        register_replicate(model, st())
    model = rep()
    model.set_all_reduce_hook(lambda t: None)
    with pytest.raises(ValueError, match="already has an all-reduce hook"):
        register_replicate(model, st())
    sharded = Net()
    fully_shard(sharded)
    with pytest.raises(TypeError, match="fully_shard.*register_fsdp"):
        register_replicate(sharded, st())
    with pytest.raises(TypeError, match="replicate\\(\\), not sharded.*register_replicate"):
        register_fsdp(rep(), PowerSGDState(world, start_powerSGD_iter=2))
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_hook

    with pytest.raises(TypeError, match="PowerSGDState"):
        register_replicate(rep(), torch_hook.PowerSGDState(None, start_powerSGD_iter=2))


@pytest.mark.skipif(bool(fsdp_all_reduce_hook_missing()), reason=fsdp_all_reduce_hook_missing() or "")
def test_fsdp_api_still_refuses_unknown_hooks(world):
    """register_fsdp's hook check moved to powersgd_triton.fsdp.checks: same errors."""
    from torch.distributed.fsdp import fully_shard

    from powersgd_triton import batched_powerSGD_hook
    from powersgd_triton.fsdp import register_fsdp

    model = Net()
    fully_shard(model)
    with pytest.raises(ValueError, match="register_fsdp runs powersgd_triton's powerSGD_hook"):
        register_fsdp(model, PowerSGDState(world, start_powerSGD_iter=2), batched_powerSGD_hook)
