"""Which model a state's buckets belong to: a bucket's parameters, the DDP objects a state is registered on, and the
refusal of a second DDP model on one state.

A state's error-feedback and warm-start memory belongs to one model's parameters. :func:`check_one_model` (warm-up
calls, through :func:`powersgd_triton.hooks.driver.warm_up`) and :func:`refuse_second_model` (compressed calls, from
:func:`powersgd_triton.state.buckets.prepare_bucket`) raise ``RuntimeError`` at the second model's first hook call;
:func:`registered_module` finds the module whose parameter names a loaded memory follows
(:func:`powersgd_triton.state.buckets.name_params`).
"""

import itertools
import weakref
from typing import Optional, Tuple

import torch


def bucket_params(bucket) -> Optional[Tuple[torch.Tensor, ...]]:
    """``bucket.parameters()`` when they are ``nn.Parameter`` objects (a real DDP bucket), else None."""
    try:
        params = tuple(bucket.parameters())
    except Exception:  # noqa: BLE001 - duck-typed buckets
        return None
    if not params or not all(map(isinstance, params, itertools.repeat(torch.nn.Parameter))):
        return None
    return params


def registered_module(state, params) -> Optional[torch.nn.Module]:
    """The module of the DistributedDataParallel that ``state`` is registered on as a comm hook state (DDP keeps the
    ``(hook, state)`` pairs of ``register_comm_hook`` in ``_comm_hooks``) and that holds ``params``; None when there
    is not exactly one (a state registered on an old DDP and on a fresh one is resolved by the parameters)."""
    ddp = registered_ddp(state, params)
    return None if ddp is None else ddp.module


def registered_ddp(state, params):
    """The DistributedDataParallel that ``state`` is registered on and that holds ``params``, or None when there is
    not exactly one (:func:`registered_module`)."""
    found = _holders(_registered_ddps(state), params)
    return found[0] if len(found) == 1 else None


def _holders(ddps, params) -> list:
    """The DDP objects among ``ddps`` whose module holds every one of ``params``."""
    wanted = {id(p) for p in params}
    return [d for d in ddps if wanted <= {id(p) for p in d.module.parameters()}]


def _registered_ddps(state) -> list:
    """The live DistributedDataParallel objects (and subclasses) ``state`` is registered on (one scan of the garbage
    collector's objects)."""
    import gc

    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return []
    classes, todo = set(), [DistributedDataParallel]
    while todo:  # DDP and its subclasses: a set lookup per object is several times cheaper than issubclass
        cls = todo.pop()
        if cls not in classes:
            classes.add(cls)
            todo.extend(cls.__subclasses__())
    found = []
    for obj in gc.get_objects():
        if type(obj) in classes:
            hooks = obj.__dict__.get("_comm_hooks") or ()
            if any(isinstance(h, tuple) and len(h) == 2 and h[1] is state for h in hooks):
                found.append(obj)
    return found


def check_one_model(state, bucket) -> None:
    """Warm-up calls: remember which parameters each bucket index holds (weakly) and refuse a second DDP model on
    the same state at its first hook call (:func:`refuse_second_model`). A few microseconds per call: the
    parameters are compared by identity."""
    params = bucket_params(bucket)
    if params is None:
        return
    index = bucket.index()
    held = state.buckets.index_params.get(index)
    if held is not None and len(held) == len(params) and all(r() is p for r, p in zip(held, params)):
        return
    if held is not None:
        refuse_second_model(state, index, [p for p in (r() for r in held) if p is not None], params)
    state.buckets.index_params[index] = tuple(weakref.ref(p) for p in params)


def refuse_second_model(state, index: int, before, params) -> None:
    """``RuntimeError`` when bucket ``index``, which held the parameters ``before`` (of one DDP model), now holds
    ``params`` of another DDP model, both registered with ``state``: a state's memory belongs to one model's
    parameters (PyTorch's hook resets it at every such call, losing error feedback without a word).

    Told apart from DDP rebuilding its buckets (which regroups the same model's parameters: some of ``params`` are
    known to the state) and from a fresh model replacing a discarded one (only one live DDP holds the state):
    only when none of ``params`` is known does it scan for the DDP objects the state is registered on, and it
    raises when one holds ``before`` and another one holds ``params``."""
    if not before or not params:
        return
    known = {id(p) for p in before}
    for mem in list(state.buckets.values()) + list(state.buckets.retired):
        if mem.params is not None:
            known.update(id(p) for p in mem.params)
    for refs in state.buckets.index_params.values():
        known.update(id(r()) for r in refs if r() is not None)
    if any(id(p) in known for p in params):
        return
    import gc

    for attempt in range(2):
        ddps = _registered_ddps(state)
        old, new = _holders(ddps, before), _holders(ddps, params)
        if not (len(old) == 1 and len(new) == 1 and old[0] is not new[0]):
            return
        if attempt == 0:
            del ddps, old, new
            gc.collect()  # a DDP that was dropped but not yet collected does not count

    def describe(ddp, ps) -> str:
        names = {id(p): n for n, p in ddp.module.named_parameters()}
        shown = [names.get(id(p), "?") for p in ps[:3]] + (["..."] if len(ps) > 3 else [])
        return (f"{type(ddp).__name__} at 0x{id(ddp):x} of a {type(ddp.module).__name__} (parameters "
                f"{', '.join(shown)})")

    raise RuntimeError(
        f"PowerSGD: one PowerSGDState is registered on two DDP models: bucket {index} held the parameters of "
        f"{describe(old[0], list(before))}, and this call brings those of {describe(new[0], list(params))}. A state's "
        "error-feedback and warm-start memory belongs to one model's parameters (sharing it would reset it at every "
        "call): give each model its own PowerSGDState"
    )


def _ranks(group) -> list:
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group))


def _describe_group(group, world) -> str:
    ranks = _ranks(group)
    shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
    count = f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}"
    return f"{'the default group (WORLD)' if group is world else 'a group'} of {count} [{shown}]"


def check_group(state, ddp, group) -> None:
    """``ValueError`` when ``group`` (the state's process group, resolved: None is WORLD) holds other ranks than the
    process group DDP ``ddp`` all-reduces in (``DDP(..., process_group=...)`` or a device mesh): the hook would
    average every gradient over the wrong ranks, a silently wrong gradient (PyTorch's hook does exactly that)."""
    import torch.distributed as dist

    theirs = getattr(ddp, "process_group", None)
    if theirs is None or theirs is group or _ranks(theirs) == _ranks(group):
        return
    world = dist.group.WORLD
    mine = _describe_group(group, world)
    if state.process_group is None:
        mine += " (PowerSGDState(process_group=None))"
    raise ValueError(
        f"PowerSGD: the state's process group is {mine}, but the DistributedDataParallel model it is registered on "
        f"all-reduces in {_describe_group(theirs, world)}: the hook would average the gradients over other ranks "
        "than DDP. Give the state DDP's group: PowerSGDState(process_group=<the group passed to "
        "DistributedDataParallel>, ...)"
    )


def check_bucket_group(state, bucket, group) -> None:
    """At the first hook call, and again at the first call after ``state.process_group`` changed (a new group object;
    the hooks compare identities, ``state.buckets.group_checked``): :func:`check_group` against the DDP model the state
    is registered on (found from the bucket's parameters: one scan of the garbage collector's objects). ``group`` is
    remembered only when it passes, so a refused group is refused at every call (nothing changes). Buckets without
    ``nn.Parameter`` objects, and states registered through a wrapper, are not checked."""
    params = bucket_params(bucket)
    if params is not None:
        found = _holders(_registered_ddps(state), params)
        if len(found) == 1:
            check_group(state, found[0], group)
    state.buckets.group_checked = group
