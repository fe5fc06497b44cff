"""``state.error_dict`` / ``p_memory_dict`` / ``q_memory_dict``: PyTorch's memory dicts as live mappings.

PyTorch's hook (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook``) keeps its memory in three
plain dicts on its state, bucket index -> flat tensor, and writes them itself (``state.error_dict[i] = ...``,
``state.p_memory_dict.clear()``). Our hooks keep theirs per bucket (``state.buckets``, :mod:`powersgd_triton.state.memory`).
A :class:`MemoryDict` shows both, so that either hook runs on a :class:`~powersgd_triton.PowerSGDState`:

* entries written through the mapping (PyTorch's hook given our state, or a user) are kept as given, the same tensor
  objects, and read back first; they are saved by ``state_dict()`` / pickling (``"torch_hook_memory"``);
* the memory of our hooks is shown read-through (the state's own tensors, not copies). Assigning a tensor to one
  of its buckets copies it in (same number of elements and a floating dtype, else ``ValueError``: never a memory
  silently replaced by one of another size); a Q assigned is the next step's warm start, as on PyTorch's state;
* ``del d[i]`` / ``d.pop(i)`` / ``d.clear()`` act on both, as on PyTorch's state: a deleted error memory restarts
  from zero, a deleted P or Q makes the bucket draw a fresh random initial Q at its next compressed step (PyTorch's
  hook draws one when ``p_memory_dict`` lacks the bucket); for a hook of half-steps, also the next half-step is a P
  step again;
* ``state.error_dict = d`` (likewise P and Q) is PyTorch's plain attribute assignment: afterwards the mapping holds
  exactly ``d``'s entries and the next step uses them (``state.error_dict = dict(state.error_dict)`` changes nothing);
  entries not in ``d`` are deleted as above.

PyTorch's hook on memory of ours (:func:`hand_over`). PyTorch's hook adds ``error_dict[i]`` to the whole flat bucket
(its length) and computes P and Q in ``p_memory_dict[i]`` / ``q_memory_dict[i]`` in the bucket's dtype; our error
memory covers the compressed matrices only, in float32. The mappings know PyTorch's hook by its code (the calling
frame: ``powerSGD_hook`` or one of its callbacks), and for it they hold PyTorch's own entries only. At its first
access to a bucket our memory has and PyTorch's does not (a live switch from our hook, or our ``state_dict()`` loaded
into a fresh DDP), our memory is handed over in PyTorch's form, matrix by matrix, for the bucket the hook is
processing (its parameters, offsets and dtype): the error memory whole-bucket, zero at the uncompressed gradients'
positions and each matrix's error at its offset; P and Q in PyTorch's packing (ours) and the bucket's dtype, when
every matrix has a warm-start Q. PyTorch's hook then computes what it computes on its own state with that memory.
Where our memory does not cover the bucket's matrices (another model, other compression settings, another world
size, the batched hook's memory), one ``RuntimeWarning`` and PyTorch's hook starts its own memory there (a zero
error, a fresh random Q). Each hook keeps its own memory afterwards: our hooks after PyTorch's run on theirs (as from
:meth:`~powersgd_triton.PowerSGDState.from_torch` where they have none), and PyTorch's hook takes ours again where
iterations ran without it since its last step on the bucket.
"""

import sys
import types
import warnings
from collections.abc import MutableMapping
from typing import Dict, Iterator, Optional, Tuple

import torch

from powersgd_triton.layout import BucketLayout
from powersgd_triton.state.buckets import matrix_sources, name_params
from powersgd_triton.state.memory import drop_next_q
from powersgd_triton.state.models import bucket_params

KINDS = ("error", "p", "q")

_CODES: Optional[Tuple[frozenset, Optional[types.CodeType]]] = None


def _torch_hook_codes() -> Tuple[frozenset, Optional[types.CodeType]]:
    """``(codes, main)``: the code objects of PyTorch's ``powerSGD_hook`` and of the callbacks defined in it, and its
    own (the frame that holds ``bucket``). Empty where torch.distributed is not available."""
    global _CODES
    if _CODES is None:
        try:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as theirs
        except ImportError:  # pragma: no cover - torch without distributed
            _CODES = (frozenset(), None)
            return _CODES
        main = theirs.powerSGD_hook.__code__
        codes, todo = set(), [main]
        while todo:
            code = todo.pop()
            codes.add(code)
            todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        _CODES = (frozenset(codes), main)
    return _CODES


def _torch_frame(depth: int = 2):
    """The calling frame when PyTorch's ``powerSGD_hook`` (or a callback of it) made the call, else None."""
    frame = sys._getframe(depth)
    return frame if frame.f_code in _torch_hook_codes()[0] else None


class MemoryDict(MutableMapping):
    """Bucket index -> flat tensor of one kind of memory (``"error"``, ``"p"`` or ``"q"``) of a state (see the
    module docstring). ``written`` holds the entries written through the mapping; ``handed``, shared by the three
    mappings of a state: bucket index -> the iteration of PyTorch's hook's last access (:func:`hand_over`)."""

    __slots__ = ("_state", "_kind", "_written", "handed")

    def __init__(self, state, kind: str, handed: Optional[Dict[int, int]] = None):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self._state = state
        self._kind = kind
        self._written: Dict[int, torch.Tensor] = {}
        self.handed: Dict[int, int] = {} if handed is None else handed

    @property
    def written(self) -> Dict[int, torch.Tensor]:
        return self._written

    @written.setter
    def written(self, entries: Dict[int, torch.Tensor]) -> None:
        """Set PyTorch's entries (a load, an unpickle): taken as PyTorch's hook's, from the iteration before the
        state's (so its next step continues from them, not from ours)."""
        self._written = entries
        self.handed.clear()
        for d in self._state._memory_dicts.values():
            for index in d._written:
                self.handed[index] = self._state.iter - 1

    def _ours(self, index):
        """Our memory of bucket ``index`` as the mapping shows it: P and Q only once drawn (``q_initialized``; a
        bucket whose Q was deleted lacks them, as PyTorch's dicts do)."""
        mem = self._state.buckets.get(index)
        if mem is None or (self._kind != "error" and not mem.q_initialized):
            return None
        return getattr(mem, self._kind)

    def _raw(self, index):
        mem = self._state.buckets.get(index)
        return None if mem is None else getattr(mem, self._kind)

    def _theirs(self, frame, index) -> Dict[int, torch.Tensor]:
        """PyTorch's hook's entries, after handing our memory of bucket ``index`` over when due."""
        if frame.f_code is _torch_hook_codes()[1]:
            bucket = frame.f_locals.get("bucket")
            if bucket is not None:
                hand_over(self._state, bucket, index)
        return self._written

    def __getitem__(self, index) -> torch.Tensor:
        frame = _torch_frame()
        if frame is not None:
            return self._theirs(frame, index)[index]
        t = self._written.get(index)
        if t is None:
            t = self._ours(index)
        if t is None:
            raise KeyError(index)
        return t

    def _check(self, index, value) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{self._kind} memory of bucket {index} must be a torch.Tensor, got {type(value).__name__}")
        ours = self._raw(index)
        if ours is not None and index not in self._written:
            if value.numel() != ours.numel() or not value.is_floating_point():
                raise ValueError(
                    f"bucket {index}'s {self._kind} memory (of powersgd_triton's hooks) holds {ours.numel()} "
                    f"{ours.dtype} elements; got a {value.dtype} tensor of {value.numel()}: assign one of the same "
                    f"size, or delete the entry (del state.{_NAMES[self._kind]}[{index}]) to reset it"
                )

    def __setitem__(self, index, value) -> None:
        frame = _torch_frame()
        if frame is not None:
            self._theirs(frame, index)[index] = value
            return
        self._set(index, value)

    def _set(self, index, value) -> None:
        self._check(index, value)
        ours = self._raw(index)
        if ours is not None and index not in self._written:
            mem = self._state.buckets[index]
            if value is not ours:
                if self._kind != "error":
                    drop_next_q(mem)  # the Q orthogonalized ahead was made from the old memory
                ours.copy_(value.reshape(-1))
            if self._kind != "error":
                mem.q_initialized = True  # the next step starts warm from the Q held, as PyTorch's with P and Q set
            return
        self._written[index] = value.clone() if _shares_memory(self._state, value) else value

    def __delitem__(self, index) -> None:
        frame = _torch_frame()
        if frame is not None:
            del self._theirs(frame, index)[index]
            return
        found = self._written.pop(index, None) is not None
        mem = self._state.buckets.get(index)
        if self._ours(index) is not None:
            found = True
            if self._kind == "error":
                mem.error.zero_()
            else:  # a fresh random initial Q at the next compressed step, as PyTorch's hook draws one
                drop_next_q(mem)
                mem.q_initialized = False
                mem.phase = "p"
        if not found:
            raise KeyError(index)

    def clear(self) -> None:
        if _torch_frame() is not None:  # PyTorch's hook without warm start, after each step: its own entries
            self._written.clear()
            return
        for index in list(self):
            del self[index]

    def _keys(self):
        keys = dict.fromkeys(self._written)
        for index in self._state.buckets:
            if self._ours(index) is not None:
                keys.setdefault(index)
        return keys

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._keys()))

    def __len__(self) -> int:
        return len(self._keys())

    def __contains__(self, index) -> bool:
        frame = _torch_frame()
        if frame is not None:
            return index in self._theirs(frame, index)
        return index in self._written or self._ours(index) is not None

    def __repr__(self) -> str:
        return f"{{{', '.join(f'{i}: <{tuple(t.shape)} {t.dtype}>' for i, t in self.items())}}}"

    def assign(self, value) -> None:
        """``state.error_dict = value`` (a mapping), as PyTorch's plain attribute: the entries of ``value`` are set
        (copied into our memory, or kept), then the entries ``value`` lacks are deleted. Every value is checked
        first: on a ``TypeError`` / ``ValueError`` nothing changed."""
        if not isinstance(value, (dict, MutableMapping)):
            raise TypeError(f"state.{_NAMES[self._kind]} must be set to a dict, got {type(value).__name__}")
        items = list(value.items())
        for index, tensor in items:
            self._check(index, tensor)
        for index, tensor in items:
            self._set(index, tensor)
        keep = {index for index, _ in items}
        for index in [i for i in self if i not in keep]:
            del self[index]


_NAMES = {"error": "error_dict", "p": "p_memory_dict", "q": "q_memory_dict"}


def memory_dicts(state) -> Dict[str, MemoryDict]:
    """The state's three mappings, kind -> :class:`MemoryDict`, sharing one ``handed`` record."""
    handed: Dict[int, int] = {}
    return {kind: MemoryDict(state, kind, handed) for kind in KINDS}


def _shares_memory(state, value: torch.Tensor) -> bool:
    """``value`` lies in a tensor of our memory (kept as an entry of its own, it would change when that memory does)."""
    ptr = value.untyped_storage().data_ptr()
    return any(t is not None and t.untyped_storage().data_ptr() == ptr
               for mem in state.buckets.values() for t in (mem.error, mem.p, mem.q))


def hand_over(state, bucket, index: int) -> None:
    """PyTorch's hook is processing ``bucket`` (index ``index``): give it our memory in its form when due.

    Due when our hooks have memory, at PyTorch's hook's first access to the bucket, or when iterations ran without
    it since its last access to the bucket (``handed``: the state's iteration at each access, and for its loaded
    memory the iteration before the state's; our hooks ran since, so their memory is the newer one). Then PyTorch's
    entries for the bucket are replaced by :func:`torch_forms` of our memory, or dropped with one warning when our
    memory does not cover the bucket's matrices (PyTorch's hook then starts its own)."""
    dicts = state._memory_dicts
    handed = dicts["error"].handed
    last, now = handed.get(index), state.iter
    handed[index] = now
    if (last is not None and now - last <= 1) or not state.buckets:
        return  # PyTorch's hook goes on from its own memory (its last step's, or loaded), or there is none of ours
    forms, why = torch_forms(state, bucket, index)
    for d in dicts.values():
        d.written.pop(index, None)
    if forms is None:
        warnings.warn(
            f"PowerSGD: PyTorch's powerSGD_hook on bucket {index}: {why}; it starts its own memory there (a zero "
            "error, a fresh random Q)",
            RuntimeWarning,
            stacklevel=4,
        )
        return
    for kind, tensor in forms.items():
        dicts[kind].written[index] = tensor


def torch_forms(state, bucket, index: int) -> Tuple[Optional[Dict[str, torch.Tensor]], str]:
    """``(forms, why)``: our memory of the compressed matrices of ``bucket`` in PyTorch's form, kind -> flat tensor
    in the bucket's dtype and on its device (``"error"``: the whole bucket, zero where a gradient is not compressed;
    ``"p"``, ``"q"``: PyTorch's packing, when every matrix has a warm-start Q), or ``(None, why)`` when our memory
    does not cover them. Each matrix's memory is found by its parameter (ours by object, loaded memory by name),
    or, for buckets without ``nn.Parameter`` objects, in the memory of the same index with the same layout."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    try:
        layout = BucketLayout.from_gradients(buffer, bucket.gradients(), state.matrix_approximation_rank,
                                             state.min_compression_rate)
    except ValueError as exc:
        return None, str(exc)
    saved_ws = state.buckets.loaded_world_size
    if saved_ws is not None and any(m.layout is None for m in state.buckets.values()):
        group = state.process_group if state.process_group is not None else dist.group.WORLD
        if saved_ws != dist.get_world_size(group):
            return None, f"powersgd_triton's memory was saved with world size {saved_ws}"
    params = bucket_params(bucket)
    mem = state.buckets.get(index)
    rows, missing = [], []
    if params is not None:
        if any(m.layout is None and m.param_names is not None for m in state.buckets.values()):
            name_params(state, params)  # loaded memory follows its parameters by name
        sources = matrix_sources(state)
        for s in layout.matrices:
            src = sources.get(id(params[s.grad_index]))
            if src is None or tuple(src[1][1:4]) != (s.n, s.m, s.rank):
                missing.append(s.grad_index)
            else:
                rows.append((s,) + src)
    elif mem is not None and mem.layout is not None and mem.layout.signature == layout.signature:
        rows = [(s, mem, (s.grad_index, s.n, s.m, s.rank, s.p_offset, s.q_offset, s.e_offset))
                for s in mem.layout.matrices]
    else:
        missing = [s.grad_index for s in layout.matrices]
    if state.use_error_feedback:
        missing += [s.grad_index for s, m, _ in rows if m.error is None]
    if missing:
        return None, (f"powersgd_triton's memory does not cover its compressed gradients {sorted(set(missing))} "
                      "(another model or other compression settings)")
    like = dict(dtype=buffer.dtype, device=buffer.device)
    forms = {}
    if state.use_error_feedback:
        error = torch.zeros(buffer.numel(), **like)
        for s, m, (_, n, cols, _, _, _, e_off) in rows:
            error[s.offset : s.offset + s.numel].copy_(m.error[e_off : e_off + n * cols])
        forms["error"] = error
    warm = all(m.q_initialized for _, m, _ in rows) if rows else (mem is not None and mem.q_initialized)
    if warm:
        p, q = torch.zeros(layout.p_numel, **like), torch.zeros(layout.q_numel, **like)
        for s, m, (_, n, cols, r, p_off, q_off, _) in rows:
            p[s.p_offset : s.p_offset + s.n * s.rank].copy_(m.p[p_off : p_off + n * r])
            q[s.q_offset : s.q_offset + s.m * s.rank].copy_(m.q[q_off : q_off + cols * r])
        forms["p"], forms["q"] = p, q
    return forms, ""


def written_entries(state) -> Dict[str, Dict[int, torch.Tensor]]:
    """What was written through the state's memory dicts, per kind (for ``state_dict()``); empty kinds left out."""
    return {kind: dict(d.written) for kind, d in state._memory_dicts.items() if d.written}


def check_written(saved) -> Dict[str, Dict[int, torch.Tensor]]:
    """The ``"torch_hook_memory"`` entry of a state dict, checked: kind -> {bucket index (int >= 0) -> finite
    floating-point tensor}. ``ValueError`` naming the entry otherwise."""
    if saved is None:
        return {}
    if not isinstance(saved, dict) or not set(saved) <= set(KINDS):
        raise ValueError(f"state dict 'torch_hook_memory' must map some of {KINDS} to dicts, got {saved!r:.200}")
    out = {}
    for kind, entries in saved.items():
        if not isinstance(entries, dict):
            raise ValueError(f"state dict 'torch_hook_memory'[{kind!r}] must be a dict, got {type(entries).__name__}")
        checked = {}
        for index, t in entries.items():
            where = f"state dict 'torch_hook_memory'[{kind!r}][{index!r}]"
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise ValueError(f"{where}: the bucket index must be an int >= 0")
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(f"{where} must be a floating-point tensor, got {t!r:.100}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{where} holds NaN or inf")
            checked[index] = t.detach().clone()
        out[kind] = checked
    return out
