"""The buckets DDP builds after its first iteration, known before it builds them (a state dict saved at iteration 1).

``start_powerSGD_iter=1`` (allowed without error feedback and warm start) compresses from the second iteration on.
The only warm-up iteration met DDP's first buckets (without ``find_unused_parameters``: one bucket of every parameter
in registration order); before the second forward DDP rebuilds them from the order in which the first backward made
the gradients ready, and the first compressed step meets those. A state dict saved in between must carry that step's
random Qs drawn for the rebuilt buckets (:mod:`powersgd_triton.state.predraw`), and nothing in the hooks has seen them
yet. DDP's reducer records, per parameter, when the last backward marked its gradient ready
(``reducer.get_backward_stats()``, nanoseconds, in the order it pushes the parameters for the rebuild) and builds the
rebuilt buckets with ``dist._compute_bucket_assignment_by_size`` from that order and its two byte limits
(:func:`powersgd_triton.compat.versions.ddp_rebuild_caps`); :func:`rebuilt_buckets` calls the same function with the
same arguments. Checked against the rebuilt buckets on torch 2.8, 2.11, 2.13 and 2.14
(``tests/state/test_resume_iteration_one.py``). Rank 0's rebuild is the one every rank takes; the ranks of one model
make their gradients ready in the same order.

Where the rebuild cannot be told (the DDP is not found: the state registered through a wrapper; ``static_graph``;
custom per-bucket limits; parameters of several dtypes or devices, or sparse gradients; ready times missing or equal),
:func:`rebuilt_buckets` says why and :meth:`~powersgd_triton.PowerSGDState.state_dict` warns.
"""

import os
from typing import List, Optional, Sequence, Tuple

import torch

from powersgd_triton.compat.versions import ddp_rebuild_caps
from powersgd_triton.state.models import registered_ddp


def reducer_params(ddp) -> List[torch.Tensor]:
    """The parameters of ``ddp``'s reducer, in its index order: those that require a gradient, module by module
    (``named_modules``, each module's own ``named_parameters``), without the ignored ones, each once (DDP's
    ``_build_params_for_reducer``)."""
    ignored = getattr(ddp, "parameters_to_ignore", set())
    params, seen = [], set()
    for module_name, module in ddp.module.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and f"{module_name}.{name}" not in ignored and p not in seen:
                seen.add(p)
                params.append(p)
    return params


def _sparse(ddp) -> bool:
    return any(isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse for m in ddp.module.modules())


def rebuilt_buckets(state, warmup: Sequence[Tuple[torch.Tensor, ...]]) -> Tuple[Optional[List[tuple]], str]:
    """``(buckets, why)``: the parameters of each bucket the first compressed step will meet, in bucket order, for a
    state whose last warm-up iteration saw the buckets ``warmup`` (each a tuple of parameters) and that has not
    compressed yet; ``warmup`` itself where DDP keeps its buckets (``find_unused_parameters`` without
    ``static_graph``, or already rebuilt). ``(None, why)`` where the rebuild cannot be told (module docstring)."""
    import torch.distributed as dist

    every = [p for bucket in warmup for p in bucket]
    ddp = registered_ddp(state, every)
    if ddp is None:
        return None, "the DistributedDataParallel model the state is registered on was not found"
    if getattr(ddp, "static_graph", False):
        return None, "DDP(static_graph=True) rebuilds its buckets later"
    if getattr(ddp, "_has_rebuilt_buckets", False) or getattr(ddp, "find_unused_parameters", False):
        return list(warmup), ""
    caps = ddp_rebuild_caps(ddp)
    if caps is None or os.environ.get("DDP_SET_LAST_BUCKET_CAP") == "1":
        return None, "DDP's bucket size limits are custom"
    params = reducer_params(ddp)
    if len({(p.dtype, p.device) for p in params}) != 1 or _sparse(ddp):
        return None, "the model's parameters have several dtypes or devices, or sparse gradients"
    stats = list(ddp.reducer.get_backward_stats())
    if len(stats) != len(params) or set(map(id, params)) != set(map(id, every)) or 0 in stats \
            or len(set(stats)) != len(stats):
        return None, "DDP's gradient-ready order of the first iteration is not known"
    order = sorted(range(len(params)), key=stats.__getitem__)
    indices, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], list(caps), [False] * len(params), order)
    return [tuple(params[i] for i in bucket) for bucket in indices], ""
