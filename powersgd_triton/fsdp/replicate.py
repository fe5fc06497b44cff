"""PowerSGD as the gradient all-reduce of FSDP2-based ``replicate()`` (data parallelism on FSDP2's machinery).

``torch.distributed._composable.replicate_with_fsdp.replicate(module, mesh=...)`` (torch > 2.8) keeps every
parameter whole on each rank (a ``Replicate()`` DTensor on a 1-D mesh) and, in each backward, hands each parameter
group's gradients to FSDP2's ``foreach_reduce``: with no shard dimension, the "reduce-scatter output" is the group's
whole flat gradient (its parameters back to back in the group's order, unpadded), which FSDP all-reduces (average)
over ``mesh_info.replicate_process_group``, *then* calls the all-reduce hook if one is set. So
``set_all_reduce_hook`` alone would all-reduce twice. :func:`register_replicate` makes the native all-reduce a no-op:

* it gives each replicate parameter group of the model a copy of its ``DDPMeshInfo`` whose ``replicate_process_group``
  is a 1-rank group of this rank (``dist.new_group([rank], use_local_synchronization=True)``: only this rank takes
  part in creating it). FSDP then all-reduces over that group (nothing is sent) and divides by a data-parallel size of
  1 (nothing: no pre/post divide, also for float16). Only the parameter group's copy changes: the parameters keep
  their mesh, their placements and their ``FSDPParam.mesh_info``; the group reads the copy only in
  ``_all_reduce_process_group`` (torch 2.11, 2.13 and 2.14 read);
* it sets the all-reduce hook to PowerSGD over ``state.process_group`` (the real replicate group), exactly as
  :func:`~powersgd_triton.fsdp.hsdp.register_fsdp` does for HSDP: the group's flat gradient is laid out as a
  :class:`~powersgd_triton.layout.BucketLayout` (one "bucket" per parameter group, bucket index = the order of the
  replicate modules in ``model.modules()``), each parameter a matrix ``dim0 x numel/dim0``, and
  :func:`~powersgd_triton.powerSGD_hook` or another of our layer-wise hooks
  (:data:`~powersgd_triton.fsdp.checks.HOOKS`) runs on it (error feedback, warm start, the compression test, the
  uncompressed tensors, the average over the replicas, the state's iteration counted once per backward). The result
  is what our DDP hook gives on a DDP bucket holding the same gradients in the same order (tested against
  ``DistributedDataParallel`` + ``register_comm_hook``, gloo, 2 and 4 ranks).

``set_requires_all_reduce(False)`` works as with native replicate(): FSDP accumulates the group's gradient and calls
no hook; the next backward with all-reduce compresses the sum. Checked when registering (before the first backward,
nothing changed on a refusal): a torch that has FSDP2-based replicate() and the internals read here
(``RuntimeError`` naming the version otherwise: torch 2.8); every FSDP2 module of the model is a replicate() module
(a ``fully_shard`` one: use :func:`~powersgd_triton.fsdp.hsdp.register_fsdp`); each group's replicate group is
``state.process_group`` (``None``: the default group) and holds several ranks; replicated ``Replicate()`` DTensors on
a 1-D mesh, every replicate() module of the model on the same one; a reduce dtype the hooks take; no gradient divide
factor and no other all-reduce hook; a state no other live model (or DDP model) holds; the replicas' layouts agree
(one ``all_gather_object`` over the group). Checked on every call (cheap): the buffer against the layout, that the
group still all-reduces over the 1-rank group, and that the call is not inside a nested (re-entrant) backward
(``RuntimeError`` naming the module otherwise). The iteration counts once per backward, also with replicate() on
submodules only (several FSDP roots).
"""

import copy
import math
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

from powersgd_triton.compat import versions as _compat
from powersgd_triton.hooks import driver as _step
from powersgd_triton.fsdp.checks import check_hook, check_state_free, claim_state, fsdp_modules, group_reduce_dtype
from powersgd_triton.fsdp.hsdp import FSDPPowerSGD, ShardGroup, ShardParam, _exchange, _group_ranks, _reduce_dtype
from powersgd_triton.hooks.layerwise import powerSGD_hook
from powersgd_triton.state.powersgd_state import PowerSGDState

__all__ = ["register_replicate", "ReplicatePowerSGD"]


def _unknown(what: str) -> RuntimeError:
    return RuntimeError(
        f"torch {torch.__version__}: FSDP2's replicate() internals differ from what powersgd_triton.fsdp.replicate "
        f"knows ({what}); refusing rather than all-reducing twice or misreading the gradient layout (tested with "
        "torch 2.11, 2.13 and 2.14)"
    )


def _read_group(index: int, name: str, module, fsdp_group, names: Dict[int, str]) -> ShardGroup:
    """The layout of one replicate() parameter group (every parameter whole, back to back), after the checks."""
    from torch.distributed.tensor import DTensor, Replicate

    label = f"replicate() module {name or '<root>'!r}"
    why = _compat.fsdp_replicate_group_unknown(fsdp_group)
    if why:
        raise _unknown(why)
    if getattr(fsdp_group, "_all_reduce_hook", None) is not None:
        raise ValueError(f"{label} already has an all-reduce hook (set_all_reduce_hook): register PowerSGD once, on "
                         "a model with no other all-reduce hook")
    if _compat.fsdp_divide_factor_set(fsdp_group):
        raise ValueError(f"{label} has a custom gradient divide factor (set_gradient_divide_factor): PowerSGD averages "
                         "over the replicate group; leave the factor unset")
    try:
        fsdp_params = list(fsdp_group.fsdp_params)
    except AttributeError:
        raise _unknown("FSDPParamGroup.fsdp_params") from None
    params: List[ShardParam] = []
    dtypes = set()
    for fp in fsdp_params:
        p = getattr(fp, "sharded_param", None)
        if not isinstance(p, DTensor):
            raise _unknown("FSDPParam.sharded_param is not a DTensor")
        pname = names.get(id(p), f"{name}.<parameter {len(params)}>")
        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Replicate(),):
            raise ValueError(f"{label}: parameter {pname!r} is placed as {tuple(p.placements)} on a "
                             f"{p.device_mesh.ndim}-D mesh; register_replicate takes the parameters of "
                             "replicate(module, mesh=<1-D mesh>) (Replicate() only; no tensor parallelism)")
        shape = tuple(int(d) for d in p.shape)
        numel = math.prod(shape)
        f_size = getattr(fp, "sharded_size", None)
        f_padded = getattr(fp, "padded_sharded_param_size", None)
        if f_size is None or f_padded is None:
            raise _unknown("FSDPParam.sharded_size / padded_sharded_param_size")
        if tuple(f_size) != shape or math.prod(f_padded) != numel or tuple(p.to_local().shape) != shape:
            raise _unknown(f"parameter {pname!r} of shape {shape}: FSDP has {tuple(f_size)} padded to "
                           f"{tuple(f_padded)}, expected the whole parameter, unpadded")
        rows = shape[0] if shape else 1
        params.append(ShardParam(pname, shape, shape, numel, rows, numel // rows if rows else 0))
        dtypes.add(_reduce_dtype(fp, fsdp_group, p.dtype))
    dtype = group_reduce_dtype(label, dtypes)
    device = getattr(fsdp_group, "device", None)
    if device is None:
        raise _unknown("FSDPParamGroup.device")
    return _ReplicateGroup(index, name, module, fsdp_group, params, list(fsdp_params), dtype, torch.device(device),
                           0, 1)


class _ReplicateGroup(ShardGroup):
    """A replicate() parameter group (whole parameters: ``shard_size`` 1), named as such in messages."""

    @property
    def label(self) -> str:
        return f"replicate() module {self.module_name or '<root>'!r}"


class ReplicatePowerSGD(FSDPPowerSGD):
    """PowerSGD registered on the replicate() modules of a model (made by :func:`register_replicate`).

    Attributes (as :class:`~powersgd_triton.fsdp.hsdp.FSDPPowerSGD`'s): ``state``, ``hook``, ``groups`` (one
    :class:`~powersgd_triton.fsdp.hsdp.ShardGroup` per parameter group: whole parameters, ``shard_size`` 1),
    ``replicate_ranks`` / ``replicate_rank`` / ``replicate_size`` (the group PowerSGD all-reduces over);
    ``solo_group``: the 1-rank group FSDP's native all-reduce now runs over. ``state_dict()`` / ``load_state_dict()``
    as for HSDP (a dict saved by :func:`~powersgd_triton.fsdp.hsdp.register_fsdp`'s handle is refused here).
    """

    def __init__(self, model, state: PowerSGDState, hook: Callable, groups: List[ShardGroup], group, solo_group):
        self.solo_group = solo_group
        self._group = group
        saved = state.process_group
        state.process_group = group  # FSDPPowerSGD reads the ranks of the state's group (None: WORLD)
        try:
            super().__init__(model, state, hook, groups, [dist.get_rank()])
        finally:
            state.process_group = saved

    def _check_call(self, group: ShardGroup, output: torch.Tensor) -> List[int]:
        info = getattr(group._fsdp_group, "mesh_info", None)
        if getattr(info, "replicate_process_group", None) is not self.solo_group:
            raise RuntimeError(f"{group.label}: FSDP no longer all-reduces this group over the 1-rank group "
                               "register_replicate gave it (its mesh_info was replaced), so the gradient was already "
                               "averaged by FSDP; register PowerSGD again after whatever rebuilt the module")
        return super()._check_call(group, output)

    def _identity(self) -> Dict[str, Any]:
        return {**super()._identity(), "replicate": True}


def register_replicate(model, state: PowerSGDState, hook: Callable = powerSGD_hook) -> ReplicatePowerSGD:
    r"""Run PowerSGD instead of the gradient all-reduce of every FSDP2-based ``replicate()`` module of ``model``.

    Call on every rank of the replicate group after ``replicate(...)`` and before the first backward. Collective over
    ``state.process_group`` (one ``all_gather_object``); creates one 1-rank process group per call (this rank only).

    Args:
        model: the root module; every FSDP2 module in ``model.modules()`` must come from
            ``torch.distributed._composable.replicate_with_fsdp.replicate`` (on submodules and/or the root: one
            parameter group each, one state "bucket" each, in ``model.modules()`` order). Parameters: ``Replicate()``
            DTensors on a 1-D mesh, reduced in float32, bfloat16, float16 or float64.
        state: a :class:`~powersgd_triton.PowerSGDState` whose ``process_group`` is the modules' replicate group
            (``mesh.get_group()``; ``None``: the default group, when the mesh spans every rank). Its arguments mean
            what they mean for DDP.
        hook: :func:`~powersgd_triton.powerSGD_hook` or another of :data:`~powersgd_triton.fsdp.checks.HOOKS`.

    Returns:
        A :class:`ReplicatePowerSGD` (``state_dict()`` / ``load_state_dict()`` per rank, ``groups``).

    Raises:
        RuntimeError: a torch without FSDP2-based replicate() (torch 2.8: use the DDP-based replicate's
            ``register_comm_hook``) or whose internals differ; torch.distributed not initialized.
        TypeError: ``state`` is not our state; ``model`` has no replicate() module with parameters, or also has
            ``fully_shard`` modules (use :func:`~powersgd_triton.fsdp.hsdp.register_fsdp`); a reduce dtype PowerSGD cannot
            compress.
        ValueError: another hook; settings the hook refuses (its DDP call would); ``state.process_group`` is not
            the modules' replicate group, holds one rank, or the replicas' layouts differ (every member raises);
            replicate() modules on different meshes; a module with several parameter groups; a gradient divide
            factor; an all-reduce hook already set; ``state`` already registered on another live model (by this
            function or ``register_fsdp``) or on a live DDP model.

    Example::

        from torch.distributed._composable.replicate_with_fsdp import replicate
        for block in model.blocks:
            replicate(block)
        replicate(model)
        state = PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=100)
        powersgd = register_replicate(model, state)   # then train as usual
    """
    missing = _compat.replicate_with_fsdp_missing()
    if missing:
        raise RuntimeError(missing)
    check_hook(hook, state, "register_replicate")
    check_state_free(state, model, "register_replicate")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized")
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    replicas = _group_ranks(group)
    me = dist.get_rank()
    if me not in replicas:
        raise ValueError(f"rank {me} is not a member of PowerSGDState.process_group (ranks {replicas})")

    names = {id(p): n for n, p in model.named_parameters()}
    none = (f"{type(model).__name__} has no replicate() module: apply "
            "torch.distributed._composable.replicate_with_fsdp.replicate(module) first")
    groups: List[ShardGroup] = []
    for mname, module, fsdp_groups in fsdp_modules(model, names, none, _unknown):
        for fg in fsdp_groups:
            if type(getattr(fg, "mesh_info", None)).__name__ != "DDPMeshInfo":
                raise TypeError(f"module {mname or '<root>'!r} is sharded with fully_shard (its parameter group's "
                                f"mesh is a {type(getattr(fg, 'mesh_info', None)).__name__}): register_replicate "
                                "takes a model of replicate() modules only; for HSDP use "
                                "powersgd_triton.fsdp.hsdp.register_fsdp")
            if getattr(fg, "fsdp_params", None):
                groups.append(_read_group(len(groups), mname, module, fg, names))
    if not groups:
        raise TypeError(f"{type(model).__name__}'s replicate() modules hold no parameters")
    ranks = {g.label: _group_ranks(g._fsdp_group.mesh_info.replicate_process_group) for g in groups}
    if len({tuple(sorted(r)) for r in ranks.values()}) > 1:
        raise ValueError("the replicate() modules of the model all-reduce over different ranks ("
                         + "; ".join(f"{k} over {v}" for k, v in ranks.items()) + "): PowerSGD compresses over one "
                         "replicate group; give every replicate() call of the model the same 1-D mesh")
    for g in groups:
        theirs = ranks[g.label]
        if sorted(theirs) != sorted(replicas):
            raise ValueError(f"{g.label} all-reduces over ranks {theirs}, PowerSGDState.process_group holds ranks "
                             f"{replicas}: give the replicate mesh's group (mesh.get_group())")
    if len(replicas) < 2:
        raise ValueError(f"PowerSGDState.process_group has {len(replicas)} rank: there is no all-reduce to compress")

    everyone = _exchange(group, (me, [g.signature() for g in groups]))
    for other in everyone[1:]:
        if other[1] != everyone[0][1]:
            raise ValueError(f"the replicas differ: rank {everyone[0][0]} and rank {other[0]} have differently laid "
                             "out replicate() modules (other models or mixed-precision policies)")

    solo = dist.new_group([me], use_local_synchronization=True)
    swapped = []
    try:
        for g in groups:
            fg = g._fsdp_group
            info = copy.copy(fg.mesh_info)
            info.replicate_process_group = solo
            swapped.append((fg, fg.mesh_info))
            fg.mesh_info = info
            if fg._all_reduce_process_group is not solo:
                raise _unknown("FSDPParamGroup._all_reduce_process_group does not follow mesh_info")
        handle = ReplicatePowerSGD(model, state, hook, groups, group, solo)
    except BaseException:
        for fg, info in swapped:
            fg.mesh_info = info
        raise
    _step.bind_model(state, model)
    claim_state(state, model)
    for g in groups:
        g.module.set_all_reduce_hook(handle._make_hook(g))
    return handle
