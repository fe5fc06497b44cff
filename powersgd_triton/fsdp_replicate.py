"""Old import path of :mod:`powersgd_triton.fsdp.replicate` (kept working)."""

from powersgd_triton.fsdp.replicate import ReplicatePowerSGD, register_replicate

__all__ = ["register_replicate", "ReplicatePowerSGD"]
