"""``powersgd-triton train``: DDP training with a PowerSGD hook on real data bundled in installed packages.

Use :func:`run_training` from Python (notebooks, tests) or the ``train`` sub-command from a shell.
"""

from .loop import COMPARE_HOOKS, HOOKS, TrainConfig, run_training

__all__ = ["COMPARE_HOOKS", "HOOKS", "TrainConfig", "run_training"]
