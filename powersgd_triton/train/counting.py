"""Counting what goes through ``torch.distributed.all_reduce`` while a model trains (:class:`AllReduceCounter`).

Bytes are measured, not computed: the counter replaces ``all_reduce`` in ``torch.distributed`` and its
``distributed_c10d`` module, which PyTorch's hooks and ours call through the module attribute.
:mod:`powersgd_triton.train.loop` re-exports the class.
"""

import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist


class AllReduceCounter:
    """Replaces ``torch.distributed.all_reduce`` with a wrapper that counts bytes and calls (thread-safe: gloo
    runs ``.then`` callbacks, which issue PyTorch's later all-reduces, on its worker threads).

    ``ranks``: count only the all-reduces over a group of exactly these global ranks (HSDP: the replicate group;
    ``None``: every all-reduce)."""

    def __init__(self, ranks: Optional[Sequence[int]] = None):
        self.bytes = 0
        self.calls = 0
        self._lock = threading.Lock()
        self._saved: List[Tuple[Any, str, Any]] = []
        self._ranks = None if ranks is None else tuple(sorted(int(r) for r in ranks))
        self._group_ranks: Dict[Any, Tuple[int, ...]] = {}

    def _counts(self, args, kwargs) -> bool:
        if self._ranks is None:
            return True
        group = kwargs.get("group", args[1] if len(args) > 1 else None)  # all_reduce(tensor, op, group, async_op)
        key = id(group)
        ranks = self._group_ranks.get(key)
        if ranks is None:
            ranks = tuple(sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)))
            self._group_ranks[key] = ranks
        return ranks == self._ranks

    def install(self) -> "AllReduceCounter":
        import torch.distributed.distributed_c10d as c10d

        original = c10d.all_reduce
        counter = self

        def all_reduce(tensor, *args, **kwargs):
            if counter._counts(args, kwargs):
                with counter._lock:
                    counter.bytes += tensor.numel() * tensor.element_size()
                    counter.calls += 1
            return original(tensor, *args, **kwargs)

        all_reduce.__wrapped__ = original  # type: ignore[attr-defined]
        for mod in (dist, c10d):
            self._saved.append((mod, "all_reduce", getattr(mod, "all_reduce")))
            setattr(mod, "all_reduce", all_reduce)
        return self

    def uninstall(self) -> None:
        while self._saved:
            mod, name, value = self._saved.pop()
            setattr(mod, name, value)

    def take(self) -> Tuple[int, int]:
        """(bytes, calls) since the last take."""
        with self._lock:
            out = (self.bytes, self.calls)
            self.bytes = 0
            self.calls = 0
        return out

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()
