"""Memory accounting: :func:`held_bytes` (tensor storage a hook state keeps, per bucket) and
:func:`peak_extra_bytes` (CUDA allocator peak, or the CPU profiler's allocation trace).
"""

import types
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from powersgd_triton.benchmarking.profiler import quiet_profiler


def _tensor_bytes_by_owner(obj, owner, seen_objs, seen_storage, out, depth=0):
    if depth > 8 or id(obj) in seen_objs:
        return
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "meta":
            return
        try:
            st = obj.untyped_storage()
            key = (st.data_ptr(), obj.device)
            nbytes = st.nbytes()
        except Exception:  # pragma: no cover
            return
        if key in seen_storage or nbytes == 0:
            return
        seen_storage.add(key)
        out[owner] = out.get(owner, 0) + nbytes
        return
    if isinstance(obj, (types.ModuleType, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
        return  # code, not state (a module's namespace also holds deprecated names that warn when touched)
    seen_objs.add(id(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            child = k if (owner is None and isinstance(k, int) and not isinstance(k, bool)) else owner
            _tensor_bytes_by_owner(v, child, seen_objs, seen_storage, out, depth + 1)
        return
    if isinstance(obj, (list, tuple, set)):
        for v in obj:
            _tensor_bytes_by_owner(v, owner, seen_objs, seen_storage, out, depth + 1)
        return
    if isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)):
        return
    if isinstance(obj, (dist.ProcessGroup,)) or callable(obj) and not hasattr(obj, "__dict__"):
        return
    attrs = {}
    if hasattr(obj, "__dict__"):
        attrs.update(vars(obj))
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if isinstance(slot, str) and hasattr(obj, slot):
                attrs.setdefault(slot, getattr(obj, slot))
    for v in attrs.values():
        _tensor_bytes_by_owner(v, owner, seen_objs, seen_storage, out, depth + 1)


def held_bytes(state) -> Dict[Optional[int], int]:
    """Bytes of tensor storage a hook state keeps, per bucket index (``None``: not tied to a bucket).

    Walks the state's attributes, dicts keyed by bucket index (PyTorch's ``error_dict``/``p_memory_dict``/
    ``q_memory_dict``, our per-bucket memory), lists and slots; each storage is counted once.
    """
    out: Dict[Optional[int], int] = {}
    _tensor_bytes_by_owner(state, None, set(), set(), out)
    return out


def peak_extra_bytes(step: Callable[[], None], device) -> Optional[int]:
    """Peak memory allocated during ``step()`` above what was allocated before it.

    CUDA: the caching allocator's peak statistics. CPU: the allocator's running total carried by the profiler's
    allocation events (a private profiler API; run under :func:`synchronous_collectives` so that callbacks stay on
    this thread). ``None`` if it cannot be measured.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    try:
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile

        with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        events = []

        def walk(nodes):
            for n in nodes:
                if n.tag == _EventType.Allocation:
                    ef = n.extra_fields
                    events.append((n.start_time_ns, int(ef.alloc_size), int(ef.total_allocated)))
                walk(n.children)

        walk(prof.profiler.kineto_results.experimental_event_tree())
        if not events:
            return 0
        events.sort()
        base = events[0][2] - events[0][1]  # allocated before the first event
        return max(0, max(total for _, _, total in events) - base)
    except Exception:  # pragma: no cover - private profiler API moved
        return None
