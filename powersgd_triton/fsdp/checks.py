"""Checks shared by :func:`powersgd_triton.fsdp.hsdp.register_fsdp` (HSDP) and
:func:`powersgd_triton.fsdp.replicate.register_replicate` (FSDP2-based ``replicate()``): which hooks may run on an
FSDP2 parameter group's flat gradient buffer, the one error for an FSDP2 module with several parameter groups, one
state per live model (:func:`check_state_free`, :func:`claim_state`), and the count of one iteration per backward
(:class:`BackwardCounter`).

Nothing here reads FSDP's shard layout (that stays in the two registering modules); this module imports neither of
them, so both import it without a cycle.
"""

import gc
import sys
import threading
import weakref
from typing import Callable, Dict, List, Optional

import torch

from powersgd_triton.hooks import driver as _step
from powersgd_triton.variants import VARIANTS

__all__ = ["HOOKS", "check_hook", "several_groups_error", "check_state_free", "claim_state", "BackwardCounter",
           "nested_backward"]

# the hooks that run per FSDP2 parameter group: our layer-wise variants (powersgd_triton.variants, ``fsdp``)
FSDP_VARIANTS = tuple(v for v in VARIANTS if v.fsdp)
HOOKS = {v.hook_name: v.load() for v in FSDP_VARIANTS}


def check_hook(hook: Callable, state, caller: str) -> str:
    """The name of ``hook`` after checking that ``caller`` (``"register_fsdp"`` / ``"register_replicate"``) can run
    it with ``state``; raises ``ValueError`` (another hook; settings the hook refuses, e.g. no warm start where its
    kept factors need it) or ``TypeError`` (``state`` is not a :class:`~powersgd_triton.PowerSGDState`)."""
    variant = next((v for v in FSDP_VARIANTS if v.load() is hook), None)
    if variant is None:
        raise ValueError(
            f"{caller} runs powersgd_triton's {' or '.join(HOOKS)}, got "
            f"{getattr(hook, '__qualname__', hook)!r} ({' or '.join(v.hook_name for v in VARIANTS if not v.fsdp)} "
            "would mix the parameters of a group and FSDP's padding; for low-precision messages use "
            "MixedPrecisionPolicy(reduce_dtype=...))"
        )
    name = variant.hook_name
    _step.check_state(state, name)
    variant.check_settings(state)  # the hook's own check, as its DDP calls make it
    return name


def _mesh_text(fsdp_group) -> str:
    """``"mesh ('dp',) of shape (2,) over ranks [0, 2]"`` for an FSDP parameter group (its parameters' mesh)."""
    mesh = None
    params = getattr(fsdp_group, "fsdp_params", None) or []
    if params:
        mesh = getattr(getattr(params[0], "sharded_param", None), "device_mesh", None)
    if mesh is None:
        mesh = getattr(getattr(fsdp_group, "mesh_info", None), "mesh", None)
    if mesh is None:
        return "an unknown mesh"
    try:
        ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
        return f"mesh {mesh.mesh_dim_names} of shape {tuple(mesh.mesh.shape)} over ranks {ranks}"
    except Exception:  # noqa: BLE001 - a mesh of another layout: its repr
        return f"mesh {mesh!r}"


def group_reduce_dtype(label: str, dtypes: set) -> torch.dtype:
    """The one reduce dtype of an FSDP parameter group's parameters (``label``: the module, for messages); raises
    ``ValueError`` for several, ``TypeError`` for one PowerSGD cannot compress (``layout.check_gradient_dtype``)."""
    from powersgd_triton.layout import check_gradient_dtype

    if len(dtypes) > 1:
        raise ValueError(f"{label}: parameters with different reduce dtypes {sorted(map(str, dtypes))}")
    dtype = next(iter(dtypes))
    try:
        check_gradient_dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{label}: its gradients are reduced in {dtype} (MixedPrecisionPolicy.reduce_dtype or the "
                        f"parameter dtype), which PowerSGD cannot compress: {exc}") from None
    return dtype


def fsdp_modules(model, names: Dict[int, str], none_message: str, unknown: Callable[[str], Exception]) -> List[tuple]:
    """``[(name, module, parameter groups)]`` for every FSDP2 module of ``model`` (``fully_shard`` or FSDP2-based
    ``replicate()``), in ``model.named_modules()`` order; ``names``: parameter names by ``id``. Raises ``TypeError``
    (``none_message``) when there is none, :func:`several_groups_error` for a module with several parameter groups,
    ``unknown(what)`` when this torch's FSDP state has no parameter groups to read."""
    from torch.distributed.fsdp import FSDPModule

    from powersgd_triton.compat import versions as _compat

    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise TypeError(none_message)
    out = []
    for mname, module in modules:
        try:
            fsdp_groups = _compat.fsdp_param_groups(module._get_fsdp_state())
        except AttributeError:
            raise unknown("FSDPModule._get_fsdp_state()'s parameter groups") from None
        if len(fsdp_groups) > 1:
            raise several_groups_error(mname, fsdp_groups, names)
        out.append((mname, module, fsdp_groups))
    return out


def several_groups_error(module_name: str, fsdp_groups: List, names: Dict[int, str]) -> ValueError:
    """The error for an FSDP2 module whose ``fully_shard(..., shard_placement_fn=...)`` gave its parameters different
    meshes, so that FSDP made several parameter groups for it (torch > 2.11; ``fsdp_groups``: what
    :func:`powersgd_triton.compat.versions.fsdp_param_groups` returns).

    ``names``: ``id(parameter) -> name`` in the model. The message names the module, each group's mesh and
    parameters, why PowerSGD does not compress them, and what works instead."""
    label = f"FSDP module {module_name or '<root>'!r}"
    parts = []
    for i, fg in enumerate(fsdp_groups):
        params = [names.get(id(getattr(fp, "sharded_param", None)), "<unnamed>")
                  for fp in (getattr(fg, "fsdp_params", None) or [])]
        parts.append(f"group {i} on {_mesh_text(fg)}: {params}")
    return ValueError(
        f"{label} has {len(fsdp_groups)} FSDP parameter groups (shard_placement_fn put its parameters on different "
        f"meshes): {'; '.join(parts)}. Each group would have its own replicate group, and FSDP2 takes no all-reduce "
        "hook for such a module (set_all_reduce_hook raises), so PowerSGD cannot be registered on it. What works: "
        "shard every parameter of the model on the one shard mesh (a shard_placement_fn returning Shard(dim) or None, "
        "not a ShardPlacementResult with another mesh) and register PowerSGD; or keep the per-parameter meshes and "
        "train that model with native HSDP (a 2-D mesh given to fully_shard), without PowerSGD"
    )


def check_state_free(state, model, caller: str) -> None:
    """``ValueError`` when ``state`` is already registered (:func:`claim_state`) on another model that is still alive,
    or on a live ``DistributedDataParallel`` model (``register_comm_hook``; one scan of the garbage collector's objects).

    A state's iteration count, error-feedback and warm-start memory belong to one model: shared by two (a GAN's
    generator and discriminator), their parameter groups share bucket indices (the second model's bucket 0 takes the
    first's memory) and each model's backward counts an iteration, silently changing both models' gradients; DDP's
    hooks refuse the same at their first call. A model that was dropped (garbage) frees the state. Changes nothing."""
    from powersgd_triton.state.models import _registered_ddps

    if _registered_ddps(state):
        gc.collect()  # a dropped DDP model does not count
        ddps = _registered_ddps(state)
        if ddps:
            raise ValueError(
                f"{caller}: this PowerSGDState is registered (register_comm_hook) on a live DistributedDataParallel "
                f"model of a {type(ddps[0].module).__name__}: its memory belongs to that model's buckets; give this "
                "model its own PowerSGDState (to continue DDP's compression, load the DDP state's state_dict() into "
                "it with load_state_dict before registering)")
    ref = getattr(state.buckets, "fsdp_model", None)
    other = ref() if ref is not None else None
    if other is None or other is model:
        return
    del other
    gc.collect()  # a dropped model held only by reference cycles (its hooks hold our handle) does not count
    other = ref()
    if other is not None and other is not model:
        raise ValueError(
            f"{caller}: this PowerSGDState is already registered on another model (a {type(other).__name__} at "
            f"0x{id(other):x}, still alive): its iteration count and its error-feedback and warm-start memory belong "
            "to one model (shared, both models' parameter groups would use bucket 0 on and each backward of either would "
            "count an iteration); give each model its own PowerSGDState"
        )


def claim_state(state, model) -> None:
    """Record that ``state`` is registered on ``model`` (weakly; :func:`check_state_free` reads it)."""
    state.buckets.fsdp_model = weakref.ref(model)


def nested_backward() -> bool:
    """Whether the caller runs inside a backward that a node of another backward started (a re-entrant backward:
    ``torch.utils.checkpoint(..., use_reentrant=True)``, a custom ``Function`` whose backward calls autograd): some
    frame of an autograd ``Function``'s backward lies outside the innermost ``_engine_run_backward`` frame. On CUDA
    the outer backward runs on the device thread without such a frame, and a nested one still has both. A few
    microseconds (one walk up the stack)."""
    from torch.autograd import function, graph

    engine = getattr(getattr(graph, "_engine_run_backward", None), "__code__", None)
    node = getattr(getattr(getattr(function, "BackwardCFunction", None), "apply", None), "__code__", None)
    frame, inside = sys._getframe(1), False
    while frame is not None:
        if frame.f_code is engine:
            inside = True
        elif inside and frame.f_code is node:
            return True
        frame = frame.f_back
    return False


class BackwardCounter:
    """Calls ``end()`` once per backward in which :meth:`enter` was called, after every final autograd callback of
    that backward: FSDP reduces some parameter groups in its own final callback (one per FSDP root, queued during the
    backward; several roots when only submodules are wrapped), so the first :meth:`enter` of a backward queues a
    callback that queues ``end`` behind them. This is when PowerSGD's DDP hooks count an iteration."""

    def __init__(self, end: Callable[[], None]):
        self._end = end
        self._task: Optional[int] = None  # the graph task (backward) whose end is queued
        self._counted: Optional[int] = None  # the graph task whose end was counted last
        self._lock = threading.Lock()

    def enter(self, label: str) -> None:
        """Called by each hook call, before it reduces anything. Raises ``RuntimeError`` (``label``: the module) outside
        a backward, inside a nested (re-entrant) backward (its end is not the outer backward's, and counting there
        counted one iteration per checkpointed block), or after this backward's end was counted."""
        engine = torch.autograd.Variable._execution_engine
        gid = int(torch._C._current_graph_task_id())
        if gid == -1:
            raise RuntimeError(f"{label}: the PowerSGD all-reduce hook ran outside a backward pass; it counts "
                               "iterations per backward and must be called by FSDP's post-backward")
        if nested_backward():
            raise RuntimeError(
                f"{label}: FSDP reduced its gradients inside a nested (re-entrant) backward, e.g. of "
                "torch.utils.checkpoint(..., use_reentrant=True); PowerSGD counts one iteration per backward "
                "(start_powerSGD_iter) and cannot see where the outer one ends: use torch.utils.checkpoint(..., "
                "use_reentrant=False) (or checkpoint_wrapper with CheckpointImpl.NO_REENTRANT)")
        with self._lock:
            if gid == self._counted:
                raise RuntimeError(f"{label}: FSDP reduced it after this backward's end was counted; refusing to "
                                   "count one backward twice (start_powerSGD_iter)")
            if gid != self._task:
                engine.queue_callback(lambda: engine.queue_callback(self._run))
                self._task = gid

    def _run(self) -> None:
        with self._lock:
            self._counted, self._task = self._task, None
        self._end()
