"""``state.error_dict`` / ``p_memory_dict`` / ``q_memory_dict``: PyTorch's memory dicts as live mappings.

PyTorch's hook (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook``) keeps its memory in three
plain dicts on its state, bucket index -> flat tensor, and writes them itself (``state.error_dict[i] = ...``,
``state.p_memory_dict.clear()``). Our hooks keep theirs per bucket (``state.buckets``, :mod:`powersgd_triton.state.memory`).
A :class:`MemoryDict` shows both, so that either hook runs on a :class:`~powersgd_triton.PowerSGDState`:

* entries written through the mapping (PyTorch's hook given our state, or a user) are kept as given, the same tensor
  objects, and read back first; they are saved by ``state_dict()`` / pickling (``"torch_hook_memory"``);
* the memory of our hooks is shown read-through (the state's own tensors, not copies). Assigning a tensor to one
  of its buckets copies it in (same number of elements and a floating dtype, else ``ValueError``: never a memory
  silently replaced by one of another size);
* ``del d[i]`` / ``d.pop(i)`` / ``d.clear()`` / ``state.error_dict = {}`` act on both, as on PyTorch's state: a
  deleted error memory restarts from zero, a deleted P or Q makes the bucket draw a fresh random initial Q at its
  next compressed step (PyTorch's hook draws one when ``p_memory_dict`` lacks the bucket); for a hook
  of half-steps, also the next half-step is a P step again.
"""

from collections.abc import MutableMapping
from typing import Dict, Iterator

import torch

from powersgd_triton.state.memory import drop_next_q

KINDS = ("error", "p", "q")


class MemoryDict(MutableMapping):
    """Bucket index -> flat tensor of one kind of memory (``"error"``, ``"p"`` or ``"q"``) of a state (see the
    module docstring). ``written`` holds the entries written through the mapping."""

    __slots__ = ("_state", "_kind", "written")

    def __init__(self, state, kind: str):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self._state = state
        self._kind = kind
        self.written: Dict[int, torch.Tensor] = {}

    def _ours(self, index):
        mem = self._state.buckets.get(index)
        return None if mem is None else getattr(mem, self._kind)

    def __getitem__(self, index) -> torch.Tensor:
        t = self.written.get(index)
        if t is None:
            t = self._ours(index)
        if t is None:
            raise KeyError(index)
        return t

    def __setitem__(self, index, value) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{self._kind} memory of bucket {index} must be a torch.Tensor, got {type(value).__name__}")
        ours = self._ours(index)
        if ours is not None and index not in self.written:
            if value.numel() != ours.numel() or not value.is_floating_point():
                raise ValueError(
                    f"bucket {index}'s {self._kind} memory (of powersgd_triton's hooks) holds {ours.numel()} "
                    f"{ours.dtype} elements; got a {value.dtype} tensor of {value.numel()}: assign one of the same "
                    f"size, or delete the entry (del state.{_NAMES[self._kind]}[{index}]) to reset it"
                )
            if self._kind != "error":
                drop_next_q(self._state.buckets[index])  # the Q orthogonalized ahead was made from the old memory
            ours.copy_(value.reshape(-1))
            return
        self.written[index] = value

    def __delitem__(self, index) -> None:
        found = self.written.pop(index, None) is not None
        mem = self._state.buckets.get(index)
        if mem is not None and getattr(mem, self._kind) is not None:
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
        for index in list(self):
            del self[index]

    def _keys(self):
        keys = dict.fromkeys(self.written)
        for index, mem in self._state.buckets.items():
            if getattr(mem, self._kind) is not None:
                keys.setdefault(index)
        return keys

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._keys()))

    def __len__(self) -> int:
        return len(self._keys())

    def __contains__(self, index) -> bool:
        return index in self.written or self._ours(index) is not None

    def __repr__(self) -> str:
        return f"{{{', '.join(f'{i}: <{tuple(t.shape)} {t.dtype}>' for i, t in self.items())}}}"

    def assign(self, value) -> None:
        """``state.error_dict = value``: clear (reset) every entry, then set those of ``value`` (a mapping)."""
        if not isinstance(value, (dict, MutableMapping)):
            raise TypeError(f"state.{_NAMES[self._kind]} must be set to a dict, got {type(value).__name__}")
        items = list(value.items())
        self.clear()
        for index, tensor in items:
            self[index] = tensor


_NAMES = {"error": "error_dict", "p": "p_memory_dict", "q": "q_memory_dict"}


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
