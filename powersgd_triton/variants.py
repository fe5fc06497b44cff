"""Our hook variants, in one table: :data:`VARIANTS`.

Everything outside ``powersgd_triton/hooks/`` that needs to know which hooks we have (the train, bench and analysis
commands, the FSDP/replicate registrations, the integrations' ``register``) reads it here, so a new variant is its
step class (a :class:`powersgd_triton.hooks.driver.HookStep` in ``powersgd_triton/hooks/``), its public name in
``powersgd_triton/__init__.py`` and one row below; nothing in ``state/`` or ``ops/`` names a hook.

No torch at import: the command-line parsers read the names. The hook functions are imported on first use
(:meth:`Variant.load`).
"""

import importlib
from dataclasses import dataclass
from typing import Callable, Optional, Tuple


@dataclass(frozen=True)
class Variant:
    """One of our DDP hooks.

    Fields: ``name`` (the train/bench commands' name, e.g. ``--hook powersgd``), ``function`` (its public dotted
    path, what the commands print), ``module`` and ``step`` (where its function and its ``HookStep`` class are
    defined), ``batched`` (the whole bucket as one matrix), ``pytorch_twin`` (the name of PyTorch's hook with the
    same semantics, or None for a variant PyTorch does not have), ``compared`` (in ``train --compare``'s default
    list), ``fsdp`` (runs per shard group under ``register_fsdp`` / ``register_replicate``), ``warm_start_only``
    (its settings check refuses ``warm_start=False``: the commands refuse that flag before starting ranks),
    ``help`` (one phrase).
    """

    name: str
    function: str
    module: str
    step: str
    batched: bool = False
    pytorch_twin: Optional[str] = None
    compared: bool = True
    fsdp: bool = True
    warm_start_only: bool = False
    help: str = ""

    @property
    def hook_name(self) -> str:
        """The hook function's name (``"powerSGD_hook"``), as messages and DDP's logging print it."""
        return self.function.rsplit(".", 1)[1]

    def load(self) -> Callable:
        """The hook function (imports torch and the hook's module)."""
        return getattr(importlib.import_module(self.module), self.hook_name)

    def check_settings(self, state) -> None:
        """The hook's own check of ``state``'s settings (raises ``ValueError`` where the hook cannot run with them),
        as its first DDP call makes it; for the registrations that run the hook outside DDP."""
        check = getattr(importlib.import_module(self.module), self.step).check_settings
        if check is not None:
            check(state)


VARIANTS: Tuple[Variant, ...] = (
    Variant("powersgd", "powersgd_triton.powerSGD_hook", "powersgd_triton.hooks.layerwise", "_Step",
            pytorch_twin="powerSGD_hook", help="each gradient matrix of a bucket, PyTorch's powerSGD_hook"),
    Variant("batched", "powersgd_triton.batched_powerSGD_hook", "powersgd_triton.hooks.layerwise", "_BatchedStep",
            batched=True, pytorch_twin="batched_powerSGD_hook", compared=False, fsdp=False,
            help="the whole bucket as one square matrix, PyTorch's batched_powerSGD_hook"),
    Variant("alternating", "powersgd_triton.alternating_powerSGD_hook", "powersgd_triton.hooks.alternating",
            "_HalfStep", warm_start_only=True,
            help="one all-reduce per bucket per step, P and Q in turn (needs warm start)"),
)
BY_NAME = {v.name: v for v in VARIANTS}
NAMES: Tuple[str, ...] = tuple(BY_NAME)


def get(name: str) -> Variant:
    """The variant called ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown hook {name!r}; expected one of {NAMES}") from None


def functions() -> Tuple[Callable, ...]:
    """Every variant's hook function (imports torch)."""
    return tuple(v.load() for v in VARIANTS)


def of_function(hook) -> Optional[Variant]:
    """The variant whose hook function is ``hook`` (the object itself, not a wrapper of it), or None."""
    for v in VARIANTS:
        if v.load() is hook:
            return v
    return None
