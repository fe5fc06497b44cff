"""The first compressed step's random Qs, drawn for a state dict saved before that step (resume at
``iter == start_powerSGD_iter``).

The initial Q of a bucket is drawn at its first compressed step, one seed of ``state.rng`` per bucket in the order DDP
calls them, ``randn`` per compressed matrix in the bucket's order (:func:`powersgd_triton._memory.draw_q`, PyTorch's
draw). A run saved at ``iter == start_powerSGD_iter`` has no memory yet; resumed with a fresh DDP, that first step
meets the fresh DDP's first buckets (parameters in registration order), not the rebuilt (gradient-ready order) buckets
the uninterrupted run compresses, so every matrix would get another Q and the runs would part.

So :meth:`PowerSGDState.state_dict` draws those Qs itself, from a copy of ``state.rng``, for the buckets of the last
warm-up iteration (``state.buckets.index_params``: the rebuilt buckets, DDP rebuilds after the first iteration and
``start_powerSGD_iter >= 2`` with warm start), and saves them as each bucket's memory (zero error, drawn Q, the
parameter names) with the RNG state after the draws. The resumed state's memory then follows its parameters into
whatever buckets the fresh DDP has (:func:`powersgd_triton._buckets.prepare_bucket`), and draws nothing at that step:
bitwise the uninterrupted run. The live state is not changed (its next step draws the same numbers).
"""

import types
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from ._memory import BucketMemory, allocate, draw_q
from ._state_dict import bucket_entry
from .layout import BucketLayout


def _warmup_bucket(state, index: int) -> Optional[Tuple[tuple, torch.dtype, str]]:
    """``(params, bucket dtype, hook)`` of bucket ``index`` at the last warm-up call, or None when unknown."""
    refs = state.buckets.index_params.get(index)
    seen = state.buckets.index_dtypes.get(index)
    if refs is None or seen is None:
        return None
    params = tuple(r() for r in refs)
    if any(p is None for p in params):
        return None
    return (params,) + seen


def _layout(state, params, dtype: torch.dtype, hook: str) -> Tuple[BucketLayout, torch.Tensor]:
    """The layout the hook will build for a bucket of ``params`` (DDP lays their gradients out back to back), on a
    CPU stand-in of the bucket buffer."""
    sizes = [p.numel() for p in params]
    buffer = torch.empty(sum(sizes), dtype=dtype)
    if hook == "batched":
        return BucketLayout.batched(buffer.numel(), state.matrix_approximation_rank, buffer.device, dtype), buffer
    gradients = [g.view(p.shape) for g, p in zip(buffer.split(sizes), params)]
    return BucketLayout.from_gradients(buffer, gradients, state.matrix_approximation_rank,
                                       state.min_compression_rate), buffer


def first_draws(state) -> Tuple[Dict[int, Dict[str, Any]], Optional[tuple]]:
    """``(bucket entries, RNG state)``: the memory of the buckets whose first compressed step is the next step, with
    its Q drawn, and ``state.rng``'s state after those draws; ``({}, None)`` when there is nothing to draw ahead (the
    next step is a warm-up step, every bucket has memory, warm start is off, or a bucket of the last warm-up
    iteration is unknown: its parameters gone or not ``nn.Parameter`` objects)."""
    buckets = state.buckets
    if state.iter < state.start_powerSGD_iter or not buckets.index_params:
        return {}, None
    pending = sorted(i for i in buckets.index_params if i not in buckets)
    if not pending or len(pending) != len(buckets.index_params):
        return {}, None  # some buckets were compressed already: no first step ahead
    found = [_warmup_bucket(state, i) for i in pending]
    if any(f is None for f in found) or not state.warm_start and found[0][2] != "alternating":
        return {}, None  # without warm start every step draws anew: nothing to keep
    rng = np.random.RandomState()
    rng.set_state(state.rng.get_state())
    drawer = types.SimpleNamespace(rng=rng, batch_tensors_with_same_shape=state.batch_tensors_with_same_shape)
    entries = {}
    for index, (params, dtype, hook) in zip(pending, found):
        layout, buffer = _layout(state, params, dtype, hook)
        mem = BucketMemory()
        allocate(mem, layout, buffer, state.use_error_feedback)
        mem.layout, mem.signature, mem.params = layout, repr(layout.signature), params
        draw_q(drawer, mem, dtype)  # one seed per bucket, in DDP's call order, as the hook's first step
        mem.order_params = params if layout.batched else None
        entries[index] = bucket_entry(state, mem)
    return entries, rng.get_state()
