"""Keeping each bucket's memory matched to DDP's buckets: layout checks, migration after a rebuild, resume.

:func:`prepare_bucket` is called by the hooks once per bucket and compressed step (through
:mod:`powersgd_triton.hooks.driver`) and returns the bucket's :class:`~powersgd_triton.state.memory.BucketMemory`, with a layout
that matches the bucket. The cheap path re-checks the layout (:class:`~powersgd_triton.layout.BucketLayout`) and
the parameters; when they no longer match (DDP rebuilt its buckets after the first iteration, a fresh DDP after a
resume, another model, a dtype swapped in by ``fp16_compress_wrapper``), the memory follows its parameters:

* layer-wise hooks: :func:`_migrate` assembles the new bucket's memory matrix by matrix from wherever each
  parameter's memory lies (live buckets, memories replaced in this iteration, a loaded state resolved by parameter
  names); exact, since PowerSGD treats the matrices of a bucket independently;
* batched hook: :func:`_follow_batched` keeps a whole memory when the bucket holds exactly its parameters, in any
  order (the memory is one matrix of all of them);
* a loaded memory (``load_state_dict``, unpickling) is adopted as it is by a bucket with the layout it was saved
  for, and its world size is checked (:func:`check_world`);
* what cannot follow is reset with a warning (``ValueError`` for a state loaded with strict checks).

Parameter names (:func:`bind_model`, :func:`name_params`) are what lets saved memory find its parameters in a fresh
DDP; :func:`end_of_iteration` forgets replaced memories and buckets DDP no longer has. The bookkeeping lives on
``state.buckets`` (:class:`~powersgd_triton.state.memory.BucketMemories`); the settings are the state's public
attributes.
"""

import logging
import operator
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from powersgd_triton.ops.backend import device_backend
from powersgd_triton.state.memory import BucketMemory, adopt_loaded, allocate, follow_error_feedback
from powersgd_triton.state.models import bucket_params, refuse_second_model, registered_module  # noqa: F401 - also the tests' names
from powersgd_triton.layout import BucketLayout, matrix_segment

logger = logging.getLogger("powersgd_triton.state")


def _segments(buffer: torch.Tensor, params, gradients) -> Optional[Dict[int, Tuple[int, int]]]:
    """``id(param) -> (offset, numel)`` of each gradient in the bucket buffer when the gradients lie back to back
    and fill it (as DDP's bucket views do); else None."""
    if params is None or gradients is None or len(params) != len(gradients):
        return None
    out: Dict[int, Tuple[int, int]] = {}
    pos = 0
    for p, g in zip(params, gradients):
        numel = g.numel()
        if numel:
            off = matrix_segment(g, buffer)
            if off != pos:
                return None
        out[id(p)] = (pos, numel)
        pos += numel
    return out if pos == buffer.numel() and len(out) == len(params) else None


_SHAPE = operator.attrgetter("shape")  # the bucket check's per-parameter read, as one C call per bucket


def _same_params(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return len(a) == len(b) and all(map(operator.is_, a, b))  # C-level: no Python call per parameter


def prepare_bucket(state, bucket, buffer: torch.Tensor, batched: bool, group) -> BucketMemory:
    """Memory of this bucket with a layout that matches ``buffer``; (re)built when it does not.

    A bucket matches its memory when it has the same gradient offsets, shapes and dtype (the layout signature)
    and, for real DDP buckets, the same parameters in the same order. When it does not (a fresh DDP instance
    after a resume orders its first buckets differently from the rebuilt ones the state was saved with, then
    rebuilds them), the layer-wise memory follows the parameters (:func:`_migrate`); what cannot be migrated is
    reset with a warning, or raises ``ValueError`` for a state loaded with strict checks.

    Called from the hook body only (building a layout may run the autotuner's collective on first use).
    """
    index = bucket.index()
    buckets = state.buckets
    if group is not None and (buckets.world_size is None or buckets.loaded_world_size is not None):
        check_world(state, group)  # nothing to do once the world is recorded and no loaded state waits
    buckets.seen.add(index)
    mem = buckets.get(index)
    rank = state.matrix_approximation_rank
    params = bucket_params(bucket)
    gradients = None
    same = mem is not None and _same_params(mem.params, params)
    if mem is not None and mem.params is not None and params is not None and not same:
        refuse_second_model(state, index, mem.params, params)
    if same and mem.layout is not None:
        layout = mem.layout
        if layout.device == buffer.device:
            if batched:
                ok = layout.batched and layout.signature == ("batched", buffer.numel(), buffer.dtype, rank)
            else:
                key = (buffer.data_ptr(), buffer.numel(), buffer.dtype, rank, state.min_compression_rate,
                       tuple(map(_SHAPE, params)) if params is not None else None)
                ok = params is not None and mem.verified == key
                if not ok:
                    gradients = bucket.gradients()
                    ok = layout.matches_gradients(buffer, gradients, rank, state.min_compression_rate)
                    mem.verified = key if ok and params is not None else None
            if ok:
                if (mem.error is None) == state.use_error_feedback:  # the flag changed since the last step
                    follow_error_feedback(mem, state.use_error_feedback)
                if bucket.is_last():
                    end_of_iteration(state)
                return mem
    if gradients is None:
        gradients = bucket.gradients()
    if batched:
        layout = BucketLayout.batched(buffer.numel(), rank, buffer.device, buffer.dtype)
    else:
        layout = BucketLayout.from_gradients(buffer, gradients, rank, state.min_compression_rate)
    signature = repr(layout.signature)
    if any(m.layout is None and m.param_names is not None for m in state.buckets.values()):
        name_params(state, params)  # loaded memory that may have to follow its parameters by name
    segments = _segments(buffer, params, gradients) if batched else None
    if (
        mem is not None
        and mem.layout is None
        and mem.signature == signature
        and _loaded_names_match(state, mem, params)
        and (mem.shapes is None or params is None or mem.shapes == tuple(tuple(p.shape) for p in params))
    ):
        adopt_loaded(mem, layout, buffer, state.use_error_feedback)  # first step after load_state_dict / unpickling
        mem.order_params = params if segments is not None else None
        mem.order = None
    else:
        new = _new_settings(state, index, mem, layout, params, buffer)
        if new is None:
            new = (_follow_batched(state, layout, params, segments, buffer) if batched
                   else _migrate(state, index, layout, params, buffer))
        if new is None:
            if mem is not None and batched:
                warnings.warn(
                    f"PowerSGD: bucket {index} of the batched hook holds other parameters than its memory was "
                    "built for (DDP partitioned its buckets differently: a fresh DDP's first buckets after a "
                    "resume with several buckets, or another model); the batched hook's memory spans a whole "
                    "bucket and cannot be split between buckets: resetting its error-feedback and warm-start "
                    "memory (use powerSGD_hook for exact resumes with several buckets)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            elif mem is not None:
                warnings.warn(
                    f"PowerSGD: bucket {index} no longer matches the layout its memory was built for "
                    f"({_what_changed(mem, layout, params)}); rebuilding it "
                    f"and resetting its error-feedback and warm-start memory. New layout: {layout}",
                    RuntimeWarning,
                    stacklevel=3,
                )
            new = BucketMemory()
            allocate(new, layout, buffer, state.use_error_feedback)
            new.order_params = params if segments is not None else None
        if mem is not None:
            state.buckets.retired.append(mem)  # other buckets of this iteration may migrate from it
        state.buckets[index] = new
        state.buckets.layout_changed = True
        mem = new
    mem.layout = layout
    mem.signature = signature
    mem.params = params
    mem.param_names = None
    mem.matrices = None
    mem.shapes = None
    mem.strict = False
    backend = device_backend(state.backend, buffer.device)
    if backend == "triton" and buffer.dtype == torch.float64:
        # The Triton kernels compute in float32: a float64 bucket runs on the torch backend, in float64.
        message = (
            f"PowerSGD: bucket {index} holds float64 gradients; the Triton kernels compute in float32, so this "
            "bucket runs on the torch backend, in float64 (error memory, P and Q in float64)"
        )
        if state.backend == "triton":
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        else:
            logger.info(message)
        backend = "torch"
    mem.verify_pending = True  # new kernels or configs: powersgd_triton.ops.verify decides at the next step
    configs = {}
    if backend == "triton":
        from powersgd_triton.autotune import configs_for_layout
        from powersgd_triton.ops.verify import candidate_gate  # the tuner's correctness gate (it does not import verify)

        configs = configs_for_layout(layout, buffer.dtype, buffer.device, group, autotune=state.autotune,
                                     gate=candidate_gate)
    mem.use(backend, configs)  # the bucket's numeric steps (mem.steps), made once here
    if bucket.is_last():
        end_of_iteration(state)
    return mem


def _what_changed(mem: BucketMemory, layout: BucketLayout, params) -> str:
    """What differs between the bucket ``mem``'s memory was built for and the bucket now (for the reset warning)."""
    if mem.layout is None:  # a loaded memory
        return "the hook state was saved for another bucket layout"
    old, new = mem.layout.signature, layout.signature
    what = []
    if not _same_params(mem.params, params):
        what.append("it holds other parameters: DDP rebuilt its buckets, or another model")
    if old[0] != new[0]:
        what.append(f"the memory is the {old[0]} hook's, this is the {new[0]} hook")
        old = new = (None,) * 6
    if old[1] != new[1]:
        what.append(f"its gradients changed from {old[1]} to {new[1]} elements")
    elif not layout.batched and old[5] != new[5]:
        what.append(f"its gradients changed shapes or offsets ({new[1]} elements, as before)")
    if old[2] != new[2]:
        what.append(f"the gradient dtype changed from {old[2]} to {new[2]}")
    if old[3] != new[3]:
        what.append(f"matrix_approximation_rank changed from {old[3]} to {new[3]}")
    if not layout.batched and old[4] != new[4]:
        what.append(f"min_compression_rate changed from {old[4]} to {new[4]}")
    if mem.layout.device != layout.device:
        what.append(f"the device changed from {mem.layout.device} to {layout.device}")
    return "; ".join(what) or "its layout changed"


def _new_settings(state, index: int, mem: Optional[BucketMemory], layout: BucketLayout, params,
                  buffer: torch.Tensor) -> Optional[BucketMemory]:
    """New memory for a bucket whose compression settings changed on the live state (``matrix_approximation_rank``,
    ``min_compression_rate``) while its gradients did not (same parameters, offsets, shapes, dtype, device); None
    otherwise. The error memory does not depend on the rank: each matrix compressed before and after keeps its own
    (a newly compressed one starts from zero, one no longer compressed drops it). P and Q are kept where a matrix
    keeps its rank; when any rank changed the bucket draws a fresh initial Q on its next step (warm start restarts,
    a hook of half-steps with a P step). Warns once per bucket, naming what changed."""
    if mem is None or mem.layout is None or mem.layout.device != buffer.device or mem.p is None:
        return None
    old, new_sig = mem.layout.signature, layout.signature
    if old[0] != new_sig[0] or old[1:3] != new_sig[1:3] or not _same_params(mem.params, params):
        return None
    if not layout.batched and old[5] != new_sig[5]:
        return None
    before = {s.grad_index: s for s in mem.layout.matrices}
    new = BucketMemory()
    allocate(new, layout, buffer, state.use_error_feedback)
    kept = 0
    warm = mem.q_initialized
    for s in layout.matrices:
        o = before.get(s.grad_index)
        if o is None or (o.n, o.m) != (s.n, s.m):
            warm = False
            continue
        if new.error is not None and mem.error is not None:
            new.error[s.e_offset : s.e_offset + s.n * s.m].copy_(mem.error[o.e_offset : o.e_offset + o.n * o.m])
            kept += 1
        if o.rank == s.rank:
            new.p[s.p_offset : s.p_offset + s.n * s.rank].copy_(mem.p[o.p_offset : o.p_offset + o.n * o.rank])
            new.q[s.q_offset : s.q_offset + s.m * s.rank].copy_(mem.q[o.q_offset : o.q_offset + o.m * o.rank])
        else:
            warm = False
    new.q_initialized = warm
    new.phase = mem.phase if warm else "p"
    new.order_params, new.order = mem.order_params, mem.order
    memory = (f"the error-feedback memory of {kept} of its {layout.num_matrices} compressed matrices is kept"
              if new.error is not None else "no error-feedback memory (use_error_feedback is off)")
    warnings.warn(
        f"PowerSGD: bucket {index}: {_what_changed(mem, layout, params)} on the live state; {memory}; "
        + ("P and Q are kept" if warm else "P and Q are re-allocated and a fresh initial Q is drawn (warm start "
           "restarts)"),
        RuntimeWarning,
        stacklevel=4,
    )
    return new


def name_params(state, params) -> None:
    """Make sure the bound model names ``params`` (a bucket's parameters): when one is unnamed, find the
    DistributedDataParallel this state is registered on and bind its module (:func:`registered_module`).

    This is what lets PyTorch's own resume recipe (``state_dict()`` or pickling, a fresh DDP,
    ``register_comm_hook(loaded_state, hook)``) keep the memory: the saved state records which parameter each
    matrix belongs to, and the loaded memory follows its parameters into the fresh DDP's buckets, whose order
    differs from the trained DDP's. One scan of the garbage collector's objects, only when names are needed
    and missing, and not again for parameters it could not name.
    """
    if params is None:
        return
    unnamed = [p for p in params if param_name(state, p) is None]
    if not unnamed or all(state.buckets.unnameable.get(id(p), lambda: None)() is p for p in unnamed):
        return
    module = registered_module(state, params)
    if module is not None:
        bind_model(state, module)
    for p in params:
        if param_name(state, p) is None:
            state.buckets.unnameable[id(p)] = weakref.ref(p)


def _follow_batched(state, layout: BucketLayout, params, segments, buffer: torch.Tensor) -> Optional[BucketMemory]:
    """The batched hook's memory for a bucket holding exactly the parameters a memory was built for, in any
    order; None when there is none (the caller resets the bucket, with a warning if it had memory).

    The batched hook compresses the bucket's gradients back to back as one matrix, so its memory belongs to the
    parameters in one order (``order_params``). A fresh DDP holds them in registration order on its first
    iteration and in the saved (gradient-ready) order after it rebuilds its buckets: the memory is kept, with
    ``order`` telling the hook where each gradient lies in the live bucket (it computes on a copy in the
    memory's order, then writes the result back), exact as an uninterrupted run. A bucket that holds other
    parameters than any memory (DDP partitioned several buckets differently) cannot be followed.
    """
    if params is None or segments is None:
        return None
    ids = set(segments)
    signature = repr(layout.signature)
    found = None
    for old in list(state.buckets.values()) + list(state.buckets.retired):
        if old.p is None or old.signature != signature:
            continue
        if old.layout is not None:
            order = old.order_params if old.layout.batched else None
        elif old.matrices is None and old.param_names is not None:
            order = tuple(state.buckets.params_by_name.get(n) if n is not None else None for n in old.param_names)
            if any(p is None or param_name(state, p) is None for p in order):
                order = None
            elif old.shapes is not None and old.shapes != tuple(tuple(p.shape) for p in order):
                order = None
        else:
            order = None
        if order is not None and len(order) == len(ids) and {id(p) for p in order} == ids:
            found = (old, order)
            break
    if found is None:
        return None
    old, order = found
    new = BucketMemory()
    new.error, new.p, new.q = old.error, old.p, old.q
    new.q_initialized, new.q_predrawn, new.phase = old.q_initialized, old.q_predrawn, old.phase
    adopt_loaded(new, layout, buffer, state.use_error_feedback)  # on the bucket's device and dtype; a fresh q_work
    new.order_params = tuple(order)
    runs = [segments[id(p)] for p in order]
    new.order = None if runs == sorted(runs) else runs
    logger.info("PowerSGD: the batched memory of %s parameters followed them into a bucket in %s order",
                len(order), "the same" if new.order is None else "another")
    return new


def bind_model(state, model) -> None:
    """Remember the names of ``model``'s parameters (a DDP module is unwrapped).

    Lets :meth:`PowerSGDState.state_dict` record which parameter each saved matrix belongs to, and a loaded memory
    follow its parameters into whatever buckets a fresh DDP instance makes. Used by :mod:`powersgd_triton.integrations`
    and :mod:`powersgd_triton.checkpoint`.
    """
    module = getattr(model, "module", model)
    named = list(module.named_parameters())
    state.buckets.params_by_name = {name: p for name, p in named}
    state.buckets.names_by_param = {id(p): name for name, p in named}


def param_name(state, param: Optional[torch.Tensor]) -> Optional[str]:
    if param is None:
        return None
    name = state.buckets.names_by_param.get(id(param))
    if name is not None and state.buckets.params_by_name.get(name) is param:
        return name
    return None


def _loaded_names_match(state, mem: BucketMemory, params) -> bool:
    """A loaded memory with the right signature also has the right parameters (when both sides are named)."""
    if mem.param_names is None or params is None or not state.buckets.params_by_name:
        return True
    return tuple(param_name(state, p) for p in params) == tuple(mem.param_names)


def matrix_sources(state) -> Dict[int, Tuple[BucketMemory, Tuple[int, ...]]]:
    """id(parameter) -> (memory, packing row) of every compressed matrix the state holds memory for.

    Rows are ``(grad_index, n, m, rank, p_offset, q_offset, e_offset)``. Live memories are keyed by their
    parameter objects, loaded ones through the bound model's parameter names.
    """
    found: Dict[int, Tuple[BucketMemory, Tuple[int, ...]]] = {}
    for mem in list(state.buckets.retired) + list(state.buckets.values()):
        if mem.p is None:
            continue
        if mem.layout is not None:
            if mem.layout.batched or mem.params is None:
                continue
            for s in mem.layout.matrices:
                p = mem.params[s.grad_index]
                found[id(p)] = (mem, (s.grad_index, s.n, s.m, s.rank, s.p_offset, s.q_offset, s.e_offset))
        elif mem.matrices is not None and mem.param_names is not None:
            for row in mem.matrices:
                name = mem.param_names[row[0]] if row[0] < len(mem.param_names) else None
                p = state.buckets.params_by_name.get(name) if name is not None else None
                if p is not None:
                    found[id(p)] = (mem, tuple(row))
    return found


def _migrate(state, index: int, layout: BucketLayout, params, buffer: torch.Tensor) -> Optional[BucketMemory]:
    """New memory for bucket ``index`` assembled, matrix by matrix, from the memory its parameters had.

    Exact: each compressed matrix keeps its own error memory, P and warm-start Q (PowerSGD treats the matrices of
    a bucket independently; only the packing changes). Returns None when there is nothing to migrate from (a
    bucket seen for the first time) or when some matrix has no memory (the caller resets the bucket with a
    warning); raises ValueError instead when that memory was loaded with strict checks.
    """
    if layout.batched or params is None:
        return None  # the batched view mixes all parameters of a bucket: its memory cannot follow them
    old = state.buckets.get(index)
    if layout.num_matrices == 0:
        # Nothing compressed: no memory to carry, only whether the initial Q seed was consumed. A bucket seen for
        # the first time consumes one, as PyTorch's hook does (the RNG stream stays PyTorch's).
        if old is None:
            return None
        new = BucketMemory()
        allocate(new, layout, buffer, state.use_error_feedback)
        new.q_initialized, new.q_predrawn = old.q_initialized, old.q_predrawn
        new.phase = old.phase
        return new
    strict = any(m.strict for m in list(state.buckets.retired) + list(state.buckets.values()))
    sources = matrix_sources(state)
    if not sources:
        if strict:
            raise ValueError(
                f"PowerSGD: bucket {index} has compressed parameters {_describe_matrices(state, layout, params)} "
                "but the loaded hook state holds no memory for them (the state was saved from another model, "
                "or with other compression settings)"
            )
        return None
    rows, missing, wrong = [], [], []
    for s in layout.matrices:
        src = sources.get(id(params[s.grad_index]))
        if src is None:
            missing.append(param_name(state, params[s.grad_index]) or f"gradient {s.grad_index}")
            continue
        mem, row = src
        if tuple(row[1:4]) != (s.n, s.m, s.rank):
            name = param_name(state, params[s.grad_index]) or f"gradient {s.grad_index}"
            wrong.append(f"{name}: saved {row[1]}x{row[2]} rank {row[3]}, now {s.n}x{s.m} rank {s.rank}")
            continue
        if state.use_error_feedback and mem.error is None:
            missing.append((param_name(state, params[s.grad_index]) or f"gradient {s.grad_index}") + " (error)")
            continue
        rows.append((s, mem, row))
    phases = sorted({mem.phase for _, mem, _ in rows})
    if len(phases) > 1:  # a hook of half-steps: the matrices of one bucket must take the same half-step next
        wrong.append(f"memory from buckets in different half-step phases {phases}")
    if missing or wrong:
        if strict:
            what = []
            if missing:
                what.append(f"no saved memory for {missing}")
            if wrong:
                what.append(f"different matrices: {wrong}")
            raise ValueError(
                f"PowerSGD: the loaded hook state does not match bucket {index} of this model: " + "; ".join(what)
            )
        return None  # the caller resets the bucket (with a warning if it had memory)
    new = BucketMemory()
    allocate(new, layout, buffer, state.use_error_feedback)
    initialized, predrawn = [], []
    for s, mem, (gi, n, m, r, p_off, q_off, e_off) in rows:
        if new.error is not None:
            new.error[s.e_offset : s.e_offset + s.numel].copy_(mem.error[e_off : e_off + n * m])
        new.p[s.p_offset : s.p_offset + s.n * s.rank].copy_(mem.p[p_off : p_off + n * r])
        new.q[s.q_offset : s.q_offset + s.m * s.rank].copy_(mem.q[q_off : q_off + m * r])
        initialized.append(mem.q_initialized)
        predrawn.append(mem.q_predrawn)
    new.q_initialized = all(initialized)
    new.q_predrawn = new.q_initialized and all(predrawn)
    new.phase = phases[0]
    logger.info("PowerSGD: bucket %s changed layout; its memory followed its %s matrices", index, len(rows))
    return new


def end_of_iteration(state) -> None:
    """After the last bucket of an iteration: forget replaced memories, and buckets DDP no longer has.

    A bucket not seen in an iteration where layouts changed is dropped when its parameters now belong to a
    bucket that was seen (DDP rebuilt fewer buckets); memory without known parameters is kept.
    """
    if state.buckets.retired:
        state.buckets.retired.clear()
    if state.buckets.layout_changed:
        live = set()
        for i in state.buckets.seen:
            mem = state.buckets.get(i)
            if mem is not None and mem.params is not None:
                live.update(id(p) for p in mem.params)
        for i in [i for i in state.buckets if i not in state.buckets.seen]:
            if _param_ids(state, state.buckets[i]) & live:
                del state.buckets[i]
        state.buckets.layout_changed = False
    state.buckets.seen.clear()


def _param_ids(state, mem: BucketMemory) -> set:
    """id() of the parameters a memory belongs to: its own, or those its loaded names resolve to."""
    if mem.params is not None:
        return {id(p) for p in mem.params}
    if mem.param_names is not None:
        return {id(state.buckets.params_by_name[n]) for n in mem.param_names if n in state.buckets.params_by_name}
    return set()


def check_world(state, group) -> None:
    """Record rank and world size; a loaded state from another world size is refused (strict) or reset."""
    import torch.distributed as dist

    if state.buckets.world_size is None or state.buckets.loaded_world_size is not None:
        state.buckets.world_size = dist.get_world_size(group)
        state.buckets.rank = dist.get_rank(group)
    if state.buckets.loaded_world_size is None:
        return
    saved_ws, saved_rank = state.buckets.loaded_world_size, state.buckets.loaded_rank
    state.buckets.loaded_world_size = state.buckets.loaded_rank = None
    loaded = [i for i, m in state.buckets.items() if m.layout is None]
    if not loaded:
        return
    strict = any(state.buckets[i].strict for i in loaded)
    if saved_ws != state.buckets.world_size:
        msg = (
            f"PowerSGD: the hook state was saved with world size {saved_ws}, this job has world size "
            f"{state.buckets.world_size}; error-feedback memory is per rank and the warm-start Q is scaled by the "
            "world size, so it cannot be reused"
        )
        if strict:
            raise ValueError(msg)
        warnings.warn(msg + ": resetting it", RuntimeWarning, stacklevel=4)
        for i in loaded:
            del state.buckets[i]
    elif saved_rank is not None and saved_rank != state.buckets.rank and not strict:
        warnings.warn(
            f"PowerSGD: rank {state.buckets.rank} resumes from the hook state of rank {saved_rank}: its error-feedback "
            "memory is another rank's (an approximate resume); save one file per rank with "
            "powersgd_triton.checkpoint.save_hook_state for an exact one",
            RuntimeWarning,
            stacklevel=4,
        )


def _describe_matrices(state, layout: BucketLayout, params) -> List[str]:
    return [param_name(state, params[s.grad_index]) or f"gradient {s.grad_index}" for s in layout.matrices]
