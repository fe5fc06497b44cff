"""The names ``powersgd-triton train`` offers (hooks, workloads and their defaults), without torch.

They live in :mod:`.config` (no torch import either); this module re-exports them for the command's parser, which
is built without importing torch (``powersgd-triton train --help``).
"""

from powersgd_triton.train.config import COMPARE_HOOKS, FSDP_HOOKS, HOOKS, WORKLOAD_DEFAULTS  # noqa: F401

__all__ = ["COMPARE_HOOKS", "FSDP_HOOKS", "HOOKS", "WORKLOAD_DEFAULTS"]
