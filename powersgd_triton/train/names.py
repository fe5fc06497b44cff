"""The names ``powersgd-triton train`` offers (hooks, workloads and their defaults), without torch.

:mod:`.loop` and :mod:`.cli` both read them from here, so the command's parser (and its ``--help``) is built
without importing torch.
"""

from typing import Any, Dict

HOOKS = ("powersgd", "batched", "alternating", "reference", "allreduce")
COMPARE_HOOKS = ("powersgd", "alternating", "reference", "allreduce")
# With --fsdp RxS (HSDP): our two hooks over the replicate group, and native HSDP ("allreduce": a 2-D mesh).
FSDP_HOOKS = ("powersgd", "alternating", "allreduce")

# Per-workload defaults (chosen so that a default run takes well under a minute on 2 CPU cores).
WORKLOAD_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "digits": dict(epochs=10, lr=0.1, batch_size=32, momentum=0.9, weight_decay=1e-4, optimizer="sgd"),
    "mnist5k": dict(epochs=8, lr=0.1, batch_size=32, momentum=0.9, weight_decay=1e-4, optimizer="sgd"),
    "charlm": dict(epochs=3, lr=1e-2, batch_size=16, momentum=0.0, weight_decay=0.0, optimizer="adam",
                   steps=600, clip=1.0),
}
