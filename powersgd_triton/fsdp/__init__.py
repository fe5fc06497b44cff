"""PowerSGD on FSDP2: HSDP (:mod:`.hsdp`, ``register_fsdp``) and FSDP2's ``replicate()`` (:mod:`.replicate`,
``register_replicate``), with the checks both share (:mod:`.checks`). The kernels, state and error feedback are the
DDP hooks'; only where a bucket's layout comes from differs (FSDP's per-parameter shard metadata)."""

from powersgd_triton.fsdp.hsdp import FORMAT, FSDPPowerSGD, ShardGroup, ShardParam, register_fsdp
from powersgd_triton.fsdp.replicate import ReplicatePowerSGD, register_replicate

__all__ = ["register_fsdp", "FSDPPowerSGD", "ShardParam", "ShardGroup", "FORMAT", "register_replicate",
           "ReplicatePowerSGD"]
