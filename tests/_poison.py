"""Poisoned allocations for the tests: ``torch.empty`` and friends that return NaN-filled (or max-int) tensors.

Used by ``conftest._poisoned_empty`` (every test) and by the multi-rank harness (``_dist.run_ranks``), which installs
the same wrappers in its ranks when the test that launched them has them.
"""

from typing import Callable, Iterator, Tuple

import torch

_FACTORIES = (("torch", "empty"), ("torch", "empty_like"), ("torch", "empty_strided"), ("Tensor", "new_empty"),
              ("Tensor", "new_empty_strided"))
_MARK = "_powersgd_poisoned"


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with what no kernel writes by accident: NaN (floating and complex dtypes), the dtype's largest value
    (integers); bool and meta tensors are left alone. Runs outside any dispatch mode (op and launch counters do not
    see it) and outside autograd."""
    if t.device.type == "meta" or t.numel() == 0 or t.dtype == torch.bool:
        return t
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        else:
            t.fill_(torch.iinfo(t.dtype).max)
    return t


def poisoned_factories() -> Iterator[Tuple[object, str, Callable]]:
    """``(owner, name, wrapper)`` for each allocation factory: ``setattr(owner, name, wrapper)`` poisons it."""
    for owner_name, name in _FACTORIES:
        owner = torch if owner_name == "torch" else torch.Tensor
        original = getattr(owner, name)

        def poisoned(*args, __original=original, **kwargs):
            return poison_(__original(*args, **kwargs))

        setattr(poisoned, _MARK, True)
        yield owner, name, poisoned


def is_poisoned() -> bool:
    """Whether ``torch.empty`` is the poisoned wrapper right now (in this process)."""
    return bool(getattr(torch.empty, _MARK, False))


def install() -> None:
    """Poison the factories for the rest of this process (the harness's ranks)."""
    for owner, name, poisoned in poisoned_factories():
        setattr(owner, name, poisoned)
