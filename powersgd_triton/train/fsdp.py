"""``powersgd-triton train --fsdp RxS``: HSDP with FSDP2 on ``R x S`` ranks instead of DDP.

The ranks form a 2-D mesh ``(replicate=R, shard=S)`` (rank ``i`` is replica ``i // S``, shard ``i % S``). Every module
of the workload's model that has parameters of its own, then the root, is sharded with ``fully_shard``:

* our layer-wise hooks (:data:`powersgd_triton.variants.VARIANTS` with ``fsdp``): on the 1-D shard mesh
  ``mesh["shard"]``, with
  :func:`powersgd_triton.fsdp.hsdp.register_fsdp` doing the replicate all-reduce over ``mesh["replicate"]``;
* ``allreduce``: native HSDP, ``fully_shard(..., mesh=mesh)`` on the 2-D mesh (FSDP's own replicate all-reduce).

Every rank trains on its own batches (the data-parallel world is all ``R x S`` ranks). Bytes and calls are those of
the all-reduces over the replicate group (what crosses between replicas: nodes), per rank, counted through
``dist.all_reduce`` as for DDP; the reduce-scatters and all-gathers inside the shard group are the same for all
hooks and not counted. Rank 0's shard group (ranks ``0..S-1``) runs the evaluation forward, rank 0 records it.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

# The mesh option's parsing and checks live with the rest of the configuration (torch-free); re-exported here.
from powersgd_triton.train.config import FSDP_LABELS as LABELS, check_fsdp_config, parse_mesh  # noqa: F401


@dataclass
class FSDPRun:
    """One rank's FSDP setup for one hook: what the training loop needs from it."""

    state: Any  # PowerSGDState (None for native HSDP)
    hook: Any  # the hook function, or FSDP's native all-reduce (described by name)
    replicate_ranks: List[int]
    evaluates: bool
    shard_bytes: int  # bytes of this rank's gradient shards (what native HSDP all-reduces, without padding)
    groups: List[Dict[str, Any]] = field(default_factory=list)
    mesh: Tuple[int, int] = (1, 1)

    def metrics(self) -> Dict[str, Any]:
        return {"fsdp_mesh": list(self.mesh), "fsdp_groups": self.groups, "replicate_ranks": self.replicate_ranks}


def _native_hsdp():
    """Stands in for the hook in the metrics of the native HSDP run."""


_native_hsdp.__qualname__ = "fully_shard(mesh=2-D HSDP mesh)"
_native_hsdp.__module__ = "torch.distributed.fsdp"


def wrap_model(hook_name: str, cfg, model: torch.nn.Module, rank: int) -> FSDPRun:
    """Shard ``model`` in place for ``hook_name`` (see the module docstring) and register the hook; collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    r, s = cfg.fsdp
    device_type = "cuda" if cfg.device == "cuda" else "cpu"
    mesh = init_device_mesh(device_type, (r, s), mesh_dim_names=("replicate", "shard"))
    native = hook_name == "allreduce"
    shard_on = mesh if native else mesh["shard"]
    owners = [m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))]
    for m in owners:
        fully_shard(m, mesh=shard_on)
    fully_shard(model, mesh=shard_on)
    replicate = mesh["replicate"].get_group()
    replicate_ranks = [int(x) for x in dist.get_process_group_ranks(replicate)]
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    evaluates = rank // s == 0
    if native:
        return FSDPRun(None, _native_hsdp, replicate_ranks, evaluates, shard_bytes, mesh=(r, s))

    from powersgd_triton.benchmarking import make_hook as make_powersgd_hook
    from powersgd_triton.fsdp.hsdp import register_fsdp

    state, hook = make_powersgd_hook(
        hook_name, cfg.matrix_approximation_rank, backend=cfg.kernels,
        start_powerSGD_iter=cfg.start_iter, min_compression_rate=cfg.min_compression_rate,
        use_error_feedback=cfg.use_error_feedback, warm_start=cfg.warm_start, random_seed=cfg.seed,
        process_group=replicate, verify=cfg.verify,
    )
    handle = register_fsdp(model, state, hook)
    groups = [{"module": g.module_name, "parameters": [[p.name, list(p.shape)] for p in g.params]}
              for g in handle.groups]
    return FSDPRun(state, hook, replicate_ranks, evaluates, shard_bytes, groups=groups, mesh=(r, s))
