"""``powersgd-triton train``: DDP training with a PowerSGD hook on real data bundled in installed packages.

Use :func:`run_training` from Python (notebooks, tests) or the ``train`` sub-command from a shell. The names are
imported from :mod:`.loop` on first use, so the command line's ``--help`` does not import torch.
"""

import importlib

__all__ = ["COMPARE_HOOKS", "HOOKS", "TrainConfig", "run_training"]


def __getattr__(name: str):
    if name in __all__:
        value = getattr(importlib.import_module(".loop", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module("." + name, __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
