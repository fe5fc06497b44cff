"""``powersgd-triton train``: DDP training with a PowerSGD hook on real data bundled in installed packages.

Use :func:`run_training` from Python (notebooks, tests) or the ``train`` sub-command from a shell. The names are
imported from :mod:`.loop` on first use, so the command line's ``--help`` does not import torch.
"""

from powersgd_triton.lazy import module_getattr

__all__ = ["COMPARE_HOOKS", "HOOKS", "TrainConfig", "run_training"]


__getattr__ = module_getattr(__name__, {name: ".loop" for name in __all__})
