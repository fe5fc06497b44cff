"""Counting ATen ops: :class:`OpCounter`, a ``TorchDispatchMode`` that counts the ops run on this thread by kind
(``compute``, ``view``, ``alloc``, ``collective``) and by overload name.
"""

from collections import Counter


_ALLOC_OPS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "resize_", "set_"}


def _op_kind(func) -> str:
    name = str(func)  # "aten.add.Tensor"
    if name.startswith("c10d."):
        return "collective"
    packet = name.split(".")[1] if "." in name else name
    if packet in _ALLOC_OPS:
        return "alloc"
    try:
        if func.is_view:
            return "view"
    except Exception:  # pragma: no cover
        pass
    if packet in ("detach", "alias", "lift_fresh", "_unsafe_view", "view", "as_strided", "t", "unsqueeze"):
        return "view"
    return "compute"


try:
    from torch.utils._python_dispatch import TorchDispatchMode
except Exception:  # pragma: no cover
    TorchDispatchMode = object  # type: ignore


class OpCounter(TorchDispatchMode):
    """Counts the ATen (and c10d) ops run on this thread while active.

    ``by_kind``: ``compute`` (everything that touches data), ``view``, ``alloc`` (empty tensors), ``collective``.
    ``by_op``: counts per overload name. Thread-local like every dispatch mode: run the code under
    :func:`synchronous_collectives` so that ``then()`` callbacks run on this thread.
    """

    def __init__(self):
        super().__init__()
        self.by_op: Counter = Counter()
        self.by_kind: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_op[str(func)] += 1
        self.by_kind[_op_kind(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(v for k, v in self.by_kind.items() if k != "collective")

    @property
    def compute(self) -> int:
        return self.by_kind["compute"]
