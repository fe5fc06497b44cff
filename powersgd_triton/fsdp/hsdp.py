"""PowerSGD across the replicate dimension of HSDP with FSDP2 (``fully_shard``): compress the cross-replica all-reduce.

HSDP shards every parameter inside a group of ``S`` ranks (a node) and replicates the shards across ``R`` groups;
each backward reduce-scatters the gradients inside the shard group, then all-reduces each rank's gradient shard
across the ``R`` replicas: the slow inter-node links PowerSGD is for. FSDP2 lets a user take over that second
collective: when a module is sharded on a **1-D shard mesh** (``fully_shard(module, mesh=mesh["shard"])``),
``FSDPModule.set_all_reduce_hook(hook)`` calls ``hook(reduce_output)`` after the reduce-scatter, and the hook must
leave the replicate all-reduce's result in ``reduce_output`` (in place). :func:`register_fsdp` registers PowerSGD
there on every FSDP module of a model.

The reduce-scatter output of one FSDP parameter group is a flat buffer holding, for each parameter with a gradient in
the group's order, the rows of this rank's dim-0 shard, padded to ``ceil(dim0 / S)`` rows. Each parameter's real
rows (``rows_on_this_rank x numel/dim0``: a ``Linear`` weight's row block, a conv weight as rows x the rest) are a
matrix of a :class:`~powersgd_triton.layout.BucketLayout` exactly like a gradient of a DDP bucket, so the layer-wise
hooks run unchanged on it: :func:`~powersgd_triton.powerSGD_hook` (all-reduce of the uncompressed shards, of P, of Q)
or another of :data:`~powersgd_triton.fsdp.checks.HOOKS` (e.g. one all-reduce of P or Q in turn), over the
replicate group, with the same
kernels, error feedback and warm start per shard matrix, compression test (``min_compression_rate``) and
:class:`~powersgd_triton.PowerSGDState`. 1-D shards (biases, norms) and shards too small to gain travel
uncompressed. The padding rows are zero on every rank and FSDP never reads them: they are not sent (native HSDP
sends them). One FSDP parameter group is one "bucket" of the state (bucket index = the order of the FSDP modules in
``model.modules()``).

Scale: FSDP's reduce-scatter leaves the shard-group average in ``reduce_output`` (or the sum divided by a pre-factor
for float16 reductions, divided by the rest afterwards); the hook averages over the replicas (divides by ``R``), so
the result is the average over all ``R x S`` ranks as with native HSDP. PowerSGD is scale-equivariant, so the
float16 pre/post split changes nothing.

Collective order: FSDP calls the hook from its post-backward, in the thread that runs the backward (on CPU the
caller's thread; on CUDA the autograd device thread, inside FSDP's all-reduce stream), once per parameter group in
the same order on every rank of a replicate group, and the hook returns only when ``reduce_output`` holds the result:
all collectives are issued from the hook body (on gloo each is waited for there; on NCCL the hook's ``then()`` chain
runs inline, and waiting on its future orders FSDP's stream after it). A backward's iteration is counted once, at
its end, as PowerSGD's DDP hooks count it (``start_powerSGD_iter``), behind every final autograd callback (FSDP
reduces some groups in its own: one per FSDP root, several when only submodules are wrapped;
:class:`~powersgd_triton.fsdp.checks.BackwardCounter`). A hook call inside a nested (re-entrant) backward, e.g.
``torch.utils.checkpoint(..., use_reentrant=True)``, raises: its end is not the step's (``use_reentrant=False``).

Checked when registering (``ValueError`` / ``TypeError`` / ``RuntimeError`` before the first backward, nothing
registered): the model has FSDP2 modules; every parameter is a ``Shard(0)`` DTensor on one 1-D mesh (a 2-D HSDP mesh
given to ``fully_shard``, tensor-parallel parameters and a custom ``shard_placement_fn`` are refused); the reduce
dtype is a floating-point dtype the hooks handle; no custom gradient divide factor and no other all-reduce hook;
``state.process_group`` is a group of several ranks that holds this rank and none of its shard peers, and whose
ranks all hold the same shard index of equally laid out modules (one ``all_gather_object`` over that group; every
member raises the same error); the FSDP internals read here exist (else: this torch version is refused).
Checked on every call (cheap, no device sync): the buffer's dtype, device and size against the layout read at
registration (``RuntimeError`` naming the module on a mismatch: e.g. a parameter that got no gradient; call
``module.set_reduce_scatter_unused_params(True)``), and ``set_requires_all_reduce(False)``, which FSDP does not apply
to an all-reduce hook on a 1-D mesh (refused).

Torch versions: FSDP2's all-reduce hook and the internals read here differ between releases; each difference goes
through :mod:`powersgd_triton.compat.versions` (the ``fsdp_*`` gates, with the release each appeared in). The shard
metadata read (``sharded_size``, ``padded_sharded_param_size``, ``fsdp_placement``, ``mp_policy``) is checked against
the layout computed from the public DTensor shape and mesh, so a version that lays shards out differently is
refused, never silently misread. Tested with torch 2.8, 2.11, 2.13 and 2.14 (CPU, gloo).
"""

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from powersgd_triton.compat import versions as _compat
from powersgd_triton.hooks import driver as _step
from powersgd_triton.fsdp.checks import (
    HOOKS, BackwardCounter, check_hook, check_state_free, claim_state, fsdp_modules, group_reduce_dtype,
)
from powersgd_triton.hooks.layerwise import powerSGD_hook
from powersgd_triton.state.powersgd_state import PowerSGDState

__all__ = ["register_fsdp", "FSDPPowerSGD", "ShardParam", "ShardGroup", "FORMAT"]

FORMAT = "powersgd_triton.fsdp_hook_state"
_VERSION = 1


def _fsdp_api():
    """``(FSDPModule, Shard)`` of this torch, or ``RuntimeError`` naming the version when FSDP2's hook is missing."""
    missing = _compat.fsdp_all_reduce_hook_missing()
    if missing:
        raise RuntimeError(missing)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Shard

    return FSDPModule, Shard


@dataclass(frozen=True)
class ShardParam:
    """One parameter of an FSDP parameter group, as it lies in the group's reduce-scatter output on this rank.

    ``shape``: this rank's rows of the parameter (``rows x dims[1:]``, rows may be 0); ``padded_numel``: the elements
    of its padded shard in the buffer (``ceil(dim0 / S) * numel / dim0``; the shards of the parameters with a
    gradient lie back to back in FSDP's order); ``rows``/``cols``: the matrix PowerSGD sees (``cols = numel / dim0``;
    a 1-D parameter is ``rows x 1``).
    """

    name: str
    global_shape: Tuple[int, ...]
    shape: Tuple[int, ...]
    padded_numel: int
    rows: int
    cols: int


class ShardGroup:
    """The shard layout of one FSDP parameter group on this rank (read once, at registration).

    Attributes:
        index: the state's bucket index of this group.
        module_name: the module's name in the model (``""`` for the root).
        params: :class:`ShardParam` per parameter, in FSDP's order.
        dtype: the reduce dtype (``reduce_output``'s dtype).
        shard_rank, shard_size: this rank's index in the shard group, and ``S``.
    """

    def __init__(self, index: int, module_name: str, module, fsdp_group, params: List[ShardParam], sharded: list,
                 dtype: torch.dtype, device: torch.device, shard_rank: int, shard_size: int):
        self.index = index
        self.module_name = module_name
        self.module = module
        self._fsdp_group = fsdp_group
        self.params = params
        self._sharded = sharded  # FSDPParam per entry of params (their sharded nn.Parameters are read per call)
        self.dtype = dtype
        self.device = device
        self.shard_rank = shard_rank
        self.shard_size = shard_size

    @property
    def label(self) -> str:
        return f"FSDP module {self.module_name or '<root>'!r}"

    def with_grad(self) -> List[int]:
        """Indices of the parameters FSDP reduce-scatters (those that require grad), in the buffer's order."""
        return [i for i, fp in enumerate(self._sharded) if fp.sharded_param.requires_grad]

    def signature(self) -> tuple:
        """What must be equal across the replicas: names, shapes and padded sizes of the shards, dtype."""
        return (self.module_name, str(self.dtype),
                tuple((p.name, p.global_shape, p.shape, p.padded_numel) for p in self.params))


class _ShardBucket:
    """The reduce-scatter output of one FSDP group as a ``dist.GradBucket`` for the layer-wise hooks: ``gradients()``
    are this rank's rows of each parameter (views of the buffer at FSDP's offsets), ``parameters()`` the sharded
    ``nn.Parameter`` objects (keys of the per-parameter memory); ``is_last()`` is False: the iteration is counted at
    the end of the backward (:meth:`FSDPPowerSGD._end_of_backward`)."""

    __slots__ = ("_index", "_buffer", "_views", "_params")

    def __init__(self, index: int, buffer: torch.Tensor, views: List[torch.Tensor], params: List[torch.Tensor]):
        self._index = index
        self._buffer = buffer
        self._views = views
        self._params = params

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> List[torch.Tensor]:
        return self._views

    def parameters(self) -> List[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return False


class _EndOfBackward:
    """The ``bucket`` argument of the state's once-per-iteration calls (``maybe_increase_iter``, stats)."""

    @staticmethod
    def is_last() -> bool:
        return True


def _group_ranks(group) -> List[int]:
    return [int(r) for r in dist.get_process_group_ranks(group)]


def _unknown(what: str) -> RuntimeError:
    return RuntimeError(
        f"torch {torch.__version__}: FSDP2's internals differ from what powersgd_triton.fsdp.hsdp knows ({what}); "
        "refusing rather than misreading the shard layout (tested with torch 2.8-2.14)"
    )


def _reduce_dtype(fp, fsdp_group, orig: torch.dtype) -> torch.dtype:
    """The dtype FSDP reduce-scatters this parameter's gradient in: FSDP's own rule (``FSDPParam.init_dtype_attrs``)
    applied to the module's ``MixedPrecisionPolicy`` (FSDP sets the attributes only at its lazy init)."""
    policy = getattr(fp, "mp_policy", None) or getattr(fsdp_group, "mp_policy", None)
    if policy is None or not hasattr(policy, "param_dtype") or not hasattr(policy, "reduce_dtype"):
        raise _unknown("FSDPParam.mp_policy")
    param_dtype, reduce_dtype = policy.param_dtype, policy.reduce_dtype
    if reduce_dtype == param_dtype:
        reduce_dtype = None
    if param_dtype == orig or not orig.is_floating_point:
        param_dtype = None
    return reduce_dtype or param_dtype or orig


def _read_group(index: int, name: str, module, fsdp_group, names: Dict[int, str], Shard) -> ShardGroup:
    """The :class:`ShardGroup` of one FSDP parameter group, after the configuration checks (raises)."""
    label = f"FSDP module {name or '<root>'!r}"
    try:
        fsdp_params = list(fsdp_group.fsdp_params)
    except AttributeError:
        raise _unknown("FSDPParamGroup.fsdp_params") from None
    from torch.distributed.tensor import DTensor

    if getattr(fsdp_group, "_all_reduce_hook", None) is not None:
        raise ValueError(f"{label} already has an all-reduce hook (set_all_reduce_hook): register PowerSGD once, on "
                         "a model with no other all-reduce hook")
    if _compat.fsdp_divide_factor_set(fsdp_group):
        raise ValueError(
            f"{label} has a custom gradient divide factor (set_gradient_divide_factor, or "
            "set_reduce_scatter_divide_factor before torch 2.8): PowerSGD averages over the replicate group, which that "
            "factor is meant to replace; leave the factor unset"
        )
    params, sharded, dtypes = [], [], set()
    mesh = None
    for fp in fsdp_params:
        p = getattr(fp, "sharded_param", None)
        if not isinstance(p, DTensor):
            raise _unknown("FSDPParam.sharded_param is not a DTensor")
        pname = names.get(id(p), f"{name}.<parameter {len(params)}>")
        if p.device_mesh.ndim != 1:
            raise ValueError(
                f"{label}: parameter {pname!r} is a DTensor on a {p.device_mesh.ndim}-D mesh "
                f"(placements {tuple(p.placements)}). A 2-D mesh given to fully_shard is native HSDP, which does its "
                "own replicate all-reduce (tensor parallelism is not supported either): shard with "
                "fully_shard(module, mesh=mesh['shard']) and give PowerSGDState(process_group="
                "mesh['replicate'].get_group())"
            )
        if tuple(p.placements) != (Shard(0),):
            raise ValueError(
                f"{label}: parameter {pname!r} is placed as {tuple(p.placements)}, not Shard(0) (a custom "
                "shard_placement_fn): PowerSGD reads FSDP's dim-0 row shards only; drop shard_placement_fn"
            )
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            raise ValueError(f"{label}: its parameters lie on different meshes (a per-parameter mesh from "
                             "shard_placement_fn); PowerSGD needs one shard mesh")
        # FSDP's layout: dim 0 padded to a multiple of S, split in S chunks of c rows; rank k holds rows
        # [k*c, min((k+1)*c, dim0)) (torch.chunk) at the start of its padded chunk.
        size = mesh.size()
        k = mesh.get_local_rank()
        shape = tuple(int(d) for d in p.shape)
        if len(shape) == 0:
            raise ValueError(f"{label}: parameter {pname!r} is a 0-d tensor; FSDP2 shards dim 0")
        dim0 = shape[0]
        inner = math.prod(shape[1:])
        c = -(-dim0 // size)
        rows = max(0, min(c, dim0 - k * c))
        local = (rows,) + shape[1:]
        padded = c * inner
        f_size = getattr(fp, "sharded_size", None)
        f_padded = getattr(fp, "padded_sharded_param_size", None)
        placement = getattr(fp, "fsdp_placement", None)
        if f_size is None or f_padded is None or placement is None:
            raise _unknown("FSDPParam.sharded_size / padded_sharded_param_size / fsdp_placement")
        if tuple(f_size) != local or math.prod(f_padded) != padded or placement != Shard(0) or (
            tuple(p.to_local().shape) != local
        ):
            raise _unknown(
                f"parameter {pname!r} of shape {shape}: expected local shard {local} padded to {padded} elements, "
                f"FSDP has {tuple(f_size)} padded to {tuple(f_padded)}"
            )
        dtypes.add(_reduce_dtype(fp, fsdp_group, p.dtype))
        params.append(ShardParam(pname, shape, local, padded, rows, inner))
        sharded.append(fp)
    dtype = group_reduce_dtype(label, dtypes)
    device = getattr(fsdp_group, "device", None)
    if device is None:
        raise _unknown("FSDPParamGroup.device")
    return ShardGroup(index, name, module, fsdp_group, params, sharded, dtype, torch.device(device),
                      mesh.get_local_rank(), mesh.size())


class FSDPPowerSGD:
    """PowerSGD registered on the FSDP2 modules of a model (made by :func:`register_fsdp`).

    Attributes:
        state: the :class:`~powersgd_triton.PowerSGDState` (its ``process_group`` is the replicate group).
        hook: the DDP hook run on each group's reduce-scatter output.
        groups: the :class:`ShardGroup` of each FSDP parameter group (index = the state's bucket index).
        replicate_rank, replicate_size: this rank in the replicate group, ``R``.
        shard_rank, shard_size: this rank's shard index, ``S``.
    """

    def __init__(self, model, state: PowerSGDState, hook: Callable, groups: List[ShardGroup], shard_ranks: List[int]):
        self.model = model
        self.state = state
        self.hook = hook
        self.groups = groups
        self.shard_ranks = shard_ranks
        group = state.process_group
        self.replicate_ranks = _group_ranks(group)
        self.replicate_rank = dist.get_rank(group)
        self.replicate_size = dist.get_world_size(group)
        self.shard_rank = groups[0].shard_rank
        self.shard_size = groups[0].shard_size
        self._backwards = BackwardCounter(self._end_of_backward)  # one iteration per backward
        self.calls = 0

    # ------------------------------------------------------------------ the hook FSDP calls
    def _make_hook(self, group: ShardGroup) -> Callable[[torch.Tensor], None]:
        def all_reduce_hook(reduce_output: torch.Tensor) -> None:
            self._reduce(group, reduce_output)

        all_reduce_hook.__qualname__ = f"FSDPPowerSGD.{self.hook.__name__}[{group.module_name or '<root>'}]"
        return all_reduce_hook

    def _check_call(self, group: ShardGroup, output: torch.Tensor) -> List[int]:
        fsdp_group = group._fsdp_group
        if not getattr(fsdp_group, "all_reduce_grads", True):
            raise RuntimeError(
                f"{group.label}: set_requires_all_reduce(False) is not applied by FSDP to an all-reduce hook on a 1-D "
                "mesh (it calls the hook on every reduce-scatter); for gradient accumulation use "
                "set_requires_gradient_sync(False), which skips the reduce-scatter too"
            )
        if _compat.fsdp_divide_factor_set(fsdp_group):
            raise RuntimeError(f"{group.label}: a gradient divide factor was set after registering PowerSGD; "
                               "PowerSGD averages over the replicate group: leave it unset")
        if output.dim() != 1 or not output.is_contiguous():
            raise RuntimeError(f"{group.label}: FSDP passed a {tuple(output.shape)} tensor (strides {output.stride()}) "
                               "to the all-reduce hook, expected a contiguous flat buffer")
        if output.dtype != group.dtype or output.device != group.device:
            raise RuntimeError(f"{group.label}: FSDP reduced its gradients in {output.dtype} on {output.device}; the "
                               f"layout read at registration has {group.dtype} on {group.device}")
        live = group.with_grad()
        expected = sum(group.params[i].padded_numel for i in live)
        if output.numel() != expected:
            remedy = ("call module.set_reduce_scatter_unused_params(True) on it (zero gradients for unused parameters)"
                      if _compat.fsdp_unused_params_option(group.module) else
                      "use every parameter in the forward, or set requires_grad=False on the unused ones")
            raise RuntimeError(
                f"{group.label}: the reduce-scatter output has {output.numel()} elements, the shards of its "
                f"{len(live)} parameters that require grad have {expected}: some parameter got no gradient in this "
                f"backward (unused in the forward). PowerSGD needs every shard in its place: {remedy}"
            )
        return live

    def _reduce(self, group: ShardGroup, output: torch.Tensor) -> None:
        live = self._check_call(group, output)
        self._backwards.enter(group.label)
        views, params, offset = [], [], 0
        base = output.storage_offset()
        for i in live:
            sp = group.params[i]
            shape = sp.shape
            stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
            views.append(torch.as_strided(output, shape, stride, base + offset))
            params.append(group._sharded[i].sharded_param)
            offset += sp.padded_numel
        bucket = _ShardBucket(group.index, output, views, params)
        result = self.hook(self.state, bucket).wait()
        if isinstance(result, (list, tuple)):
            result = result[0]
        if result.data_ptr() != output.data_ptr():  # our hooks return the buffer itself; a copy otherwise
            output.copy_(result)
        self.calls += 1

    def _end_of_backward(self) -> None:
        """Once per backward that reduced at least one group: the state's end-of-iteration bookkeeping, then
        ``iter += 1`` (as DDP's last bucket does)."""
        state = self.state
        if state.iter >= state.start_powerSGD_iter:
            _step.report_compression_stats(state, _EndOfBackward)
        _step.end_of_iteration(state)
        state.maybe_increase_iter(_EndOfBackward)

    # ------------------------------------------------------------------ persistence
    def _identity(self) -> Dict[str, Any]:
        return {
            "rank": dist.get_rank(),
            "world_size": dist.get_world_size(),
            "replicate_rank": self.replicate_rank,
            "replicate_size": self.replicate_size,
            "shard_rank": self.shard_rank,
            "shard_size": self.shard_size,
            "hook": self.hook.__name__,
            "groups": [
                {"module": g.module_name, "dtype": str(g.dtype),
                 "parameters": [[p.name, list(p.global_shape), list(p.shape), p.padded_numel] for p in g.params]}
                for g in self.groups
            ],
        }

    def state_dict(self) -> Dict[str, Any]:
        """This rank's hook state (``PowerSGDState.state_dict()``: iteration, RNG, error memory, P, Q per shard
        matrix) with where it belongs: global rank and world size, replicate and shard rank and size, the hook,
        and each group's parameters and shard layout. Only tensors and plain Python types (``torch.load(...,
        weights_only=True)`` reads it). Save one per rank: the error memory is the rank's own."""
        _step.bind_model(self.state, self.model)
        return {"format": FORMAT, "version": _VERSION, **self._identity(), "hook_state": self.state.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load what :meth:`state_dict` saved on this rank of an identical job; before the next backward.

        The memory is adopted by each group on its next compressed step (a group whose layout differs raises then).

        Raises:
            TypeError: not such a dict.
            ValueError: a dict of another format or version; saved by another rank, world size, mesh shape, shard
                index or hook; for other modules, parameters, shard layouts or dtypes; or with other compression
                settings (rank, ``min_compression_rate``, error feedback, warm start). Nothing is changed then.
        """
        if not isinstance(state_dict, dict) or state_dict.get("format") != FORMAT:
            raise (TypeError if not isinstance(state_dict, dict) else ValueError)(
                "load_state_dict needs the dict FSDPPowerSGD.state_dict() returned")
        if state_dict.get("version") != _VERSION:
            raise ValueError(f"unsupported FSDP hook state version {state_dict.get('version')!r}")
        mine = self._identity()
        differing = [f"{k}: saved {state_dict.get(k)!r}, here {v!r}" for k, v in mine.items()
                     if k != "groups" and state_dict.get(k) != v]
        if state_dict.get("groups") != mine["groups"]:
            saved = state_dict.get("groups") or []
            if len(saved) != len(mine["groups"]):
                differing.append(f"{len(saved)} FSDP groups saved, {len(mine['groups'])} here")
            for a, b in zip(saved, mine["groups"]):
                if a != b:
                    differing.append(f"FSDP module {b['module']!r}: saved {a}, here {b}")
                    break
        hook_state = state_dict.get("hook_state")
        if not isinstance(hook_state, dict):
            differing.append("no hook_state")
        else:
            from powersgd_triton.checkpoint import MUST_MATCH

            config = hook_state.get("config", {})
            differing += [f"{k}: saved {config[k]!r}, state {getattr(self.state, k)!r}" for k in MUST_MATCH
                          if k in config and config[k] != getattr(self.state, k)]
        if differing:
            raise ValueError("this FSDP PowerSGD hook state was saved by another rank or job: " + "; ".join(differing))
        self.state.load_state_dict(hook_state)
        for mem in self.state.buckets.values():
            mem.strict = True
        _step.bind_model(self.state, self.model)


def _exchange(group, payload) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, payload, group=group)
    return out


def register_fsdp(model, state: PowerSGDState, hook: Callable = powerSGD_hook) -> FSDPPowerSGD:
    r"""Register PowerSGD as the replicate all-reduce of every FSDP2 module of ``model`` (HSDP with a 1-D shard mesh).

    Call on every rank after ``fully_shard`` and before the first backward. Collective over
    ``state.process_group`` (one ``all_gather_object`` to check that its ranks are replicas of each other).

    Args:
        model: the root module; each FSDP2 module in ``model.modules()`` (``fully_shard(m, mesh=mesh["shard"])``) gets
            the hook. Parameters: ``Shard(0)`` DTensors on one 1-D shard mesh, reduced in float32, bfloat16, float16
            or float64.
        state: a :class:`~powersgd_triton.PowerSGDState` whose ``process_group`` is this rank's replicate group,
            e.g. ``mesh["replicate"].get_group()`` of ``init_device_mesh(dev, (R, S), mesh_dim_names=("replicate",
            "shard"))``. Its arguments mean what they mean for DDP (``matrix_approximation_rank``,
            ``start_powerSGD_iter``: plain averaging all-reduces for the first backward passes, ...).
        hook: :func:`~powersgd_triton.powerSGD_hook` (P and Q all-reduces) or another of our layer-wise hooks
            (:data:`~powersgd_triton.fsdp.checks.HOOKS`).

    Returns:
        An :class:`FSDPPowerSGD` (``state_dict()`` / ``load_state_dict()`` per rank, ``groups``: the shard layouts).

    Raises:
        TypeError: ``state`` is not our state; a reduce dtype PowerSGD cannot compress; ``model`` has no FSDP2 module
            with parameters; a ``replicate()`` module (use :func:`~powersgd_triton.fsdp.replicate.register_replicate`).
        ValueError: another hook; settings the hook refuses (its DDP call would); no replicate group (``None``: the
            default group holds this rank's shard peers), a group of one rank, or a group that is not the replicas;
            a 2-D mesh given to ``fully_shard`` (native HSDP), tensor-parallel parameters, a custom
            ``shard_placement_fn`` (a module with several parameter groups: one error naming each group's mesh and
            parameters, and what works), a gradient divide factor, an all-reduce hook already set, ``state`` already
            registered on another live model or on a live DDP model.
        RuntimeError: a torch whose FSDP2 has no ``set_all_reduce_hook`` or lays shards out differently.

    Example::

        mesh = init_device_mesh("cuda", (num_nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        state = PowerSGDState(mesh["replicate"].get_group(), matrix_approximation_rank=4, start_powerSGD_iter=100)
        powersgd = register_fsdp(model, state)   # then train as usual
    """
    _, Shard = _fsdp_api()
    check_hook(hook, state, "register_fsdp")
    check_state_free(state, model, "register_fsdp")
    if state.process_group is None:
        raise ValueError(
            "PowerSGDState.process_group is None (the default group): with FSDP it must be the replicate group, the "
            "ranks that hold the same shards, e.g. mesh['replicate'].get_group(); the default group also holds this "
            "rank's shard peers"
        )
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized")
    group = state.process_group
    if dist.get_rank(group) < 0:
        raise ValueError(f"rank {dist.get_rank()} is not a member of PowerSGDState.process_group "
                         f"(ranks {_group_ranks(group)})")

    names = {id(p): n for n, p in model.named_parameters()}
    groups: List[ShardGroup] = []
    none = f"{type(model).__name__} has no FSDP2 module: apply fully_shard(module, mesh=mesh['shard']) first"
    for mname, module, fsdp_groups in fsdp_modules(model, names, none, _unknown):
        if any(type(getattr(fg, "mesh_info", None)).__name__ == "DDPMeshInfo" for fg in fsdp_groups):
            raise TypeError(f"module {mname or '<root>'!r} is replicated with replicate(), not sharded: use "
                            "powersgd_triton.fsdp.replicate.register_replicate")
        for fg in fsdp_groups:
            if not getattr(fg, "fsdp_params", None):
                continue
            groups.append(_read_group(len(groups), mname, module, fg, names, Shard))
    if not groups:
        raise TypeError(f"{type(model).__name__}'s FSDP2 modules hold no parameters")
    shard_groups = {g._sharded[0].sharded_param.device_mesh for g in groups}
    if len(shard_groups) != 1:
        raise ValueError("the FSDP modules of the model are sharded on different meshes; PowerSGD needs one shard mesh")
    shard_mesh = shard_groups.pop()
    shard_ranks = [int(r) for r in shard_mesh.mesh.flatten().tolist()]
    replicas = _group_ranks(group)
    me = dist.get_rank()
    if len(replicas) < 2:
        raise ValueError(
            f"PowerSGDState.process_group has {len(replicas)} rank: there is no replicate all-reduce to compress "
            "(the model is sharded over all its ranks); give the replicate group of an HSDP mesh"
        )

    # What must hold across the group: one collective, every member gets the same verdict.
    local_error = None
    peers = sorted(set(replicas) & set(shard_ranks) - {me})
    if peers:
        local_error = (f"rank {me}: PowerSGDState.process_group (ranks {replicas}) is not the replicate group: it "
                       f"holds ranks {peers} of this rank's shard group {shard_ranks}; use mesh['replicate'].get_group()")
    payload = (me, groups[0].shard_rank, groups[0].shard_size, shard_ranks, [g.signature() for g in groups],
               local_error)
    everyone = _exchange(group, payload)
    errors = [e[5] for e in everyone if e[5]]
    if not errors:
        ref = everyone[0]
        for other in everyone[1:]:
            if (other[1], other[2]) != (ref[1], ref[2]):
                errors.append(
                    f"PowerSGDState.process_group (ranks {replicas}) is not the replicate group: rank {ref[0]} holds "
                    f"shard {ref[1]} of {ref[2]}, rank {other[0]} shard {other[1]} of {other[2]}; use "
                    "mesh['replicate'].get_group()")
                break
            if set(other[3]) & set(ref[3]):
                errors.append(f"PowerSGDState.process_group (ranks {replicas}) is not the replicate group: ranks "
                              f"{ref[0]} and {other[0]} are in the same shard group")
                break
            if other[4] != ref[4]:
                errors.append(f"the replicas differ: rank {ref[0]} and rank {other[0]} have differently laid out FSDP "
                              "modules (other models, meshes or mixed-precision policies)")
                break
    if errors:
        raise ValueError(errors[0])

    handle = FSDPPowerSGD(model, state, hook, groups, shard_ranks)
    _step.bind_model(state, model)
    claim_state(state, model)
    for g in groups:
        g.module.set_all_reduce_hook(handle._make_hook(g))
    return handle
