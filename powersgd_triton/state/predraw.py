"""The first compressed step's random Qs, drawn for a state dict saved before that step (resume at
``iter == start_powerSGD_iter``).

The initial Q of a bucket is drawn at its first compressed step, one seed of ``state.rng`` per bucket in the order DDP
calls them, ``randn`` per compressed matrix in the bucket's order (:func:`powersgd_triton.state.memory.draw_q`, PyTorch's
draw). A run saved at ``iter == start_powerSGD_iter`` has no memory yet; resumed with a fresh DDP, that first step
meets the fresh DDP's first buckets (parameters in registration order), not the rebuilt (gradient-ready order) buckets
the uninterrupted run compresses, so every matrix would get another Q and the runs would part.

Without warm start the same holds at every compressed step (each draws a fresh Q per bucket, in DDP's order).

So :meth:`PowerSGDState.state_dict` draws those Qs itself, from a copy of ``state.rng``, for the buckets of the last
warm-up iteration (``state.buckets.index_params``: the rebuilt buckets, DDP rebuilds after the first iteration and
``start_powerSGD_iter >= 2`` with warm start; with ``start_powerSGD_iter=1``, the buckets DDP will rebuild from its
first iteration, :mod:`powersgd_triton.state.rebuild`, or a warning where they cannot be told; without warm start,
the buckets of its memory), and saves them as each bucket's
memory (the error, the drawn Q, the parameter names; marked ``predrawn`` without warm start) with the RNG state after
the draws. The resumed state's memory then follows its parameters into
whatever buckets the fresh DDP has (:func:`powersgd_triton.state.buckets.prepare_bucket`), and draws nothing at that step:
bitwise the uninterrupted run. The live state is not changed (its next step draws the same numbers).
"""

import types
import warnings
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from powersgd_triton.state.memory import BucketMemory, allocate, draw_q
from powersgd_triton.state.rebuild import rebuilt_buckets
from powersgd_triton.state.state_dict import bucket_entry
from powersgd_triton.layout import BucketLayout


def _warmup_bucket(state, index: int) -> Optional[Tuple[tuple, torch.dtype, bool, bool]]:
    """``(params, bucket dtype, batched, draws_q_each_step)`` of bucket ``index`` at the last warm-up call (the last
    two: of the hook that made it), or None when unknown."""
    refs = state.buckets.index_params.get(index)
    seen = state.buckets.index_dtypes.get(index)
    if refs is None or seen is None:
        return None
    params = tuple(r() for r in refs)
    if any(p is None for p in params):
        return None
    return (params,) + seen


def _layout(state, params, dtype: torch.dtype, batched: bool) -> Tuple[BucketLayout, torch.Tensor]:
    """The layout the hook will build for a bucket of ``params`` (DDP lays their gradients out back to back), on a
    CPU stand-in of the bucket buffer."""
    sizes = [p.numel() for p in params]
    buffer = torch.empty(sum(sizes), dtype=dtype)
    if batched:
        return BucketLayout.batched(buffer.numel(), state.matrix_approximation_rank, buffer.device, dtype), buffer
    gradients = [g.view(p.shape) for g, p in zip(buffer.split(sizes), params)]
    return BucketLayout.from_gradients(buffer, gradients, state.matrix_approximation_rank,
                                       state.min_compression_rate), buffer


def _drawer(state):
    rng = np.random.RandomState()
    rng.set_state(state.rng.get_state())
    return types.SimpleNamespace(rng=rng, batch_tensors_with_same_shape=state.batch_tensors_with_same_shape)


def first_draws(state) -> Tuple[Dict[int, Dict[str, Any]], Optional[tuple]]:
    """``(bucket entries, RNG state)``: the memory of the buckets with the random Q their next compressed step would
    draw, drawn, and ``state.rng``'s state after those draws; ``({}, None)`` when the next step draws nothing or is a
    warm-up step, or where the buckets are not known well enough (a memory loaded and not yet used; a bucket of the
    last warm-up iteration whose parameters are gone or not ``nn.Parameter`` objects).

    Two cases: no bucket has memory yet (saved at ``iter == start_powerSGD_iter``: the first compressed step, every
    hook), and, without warm start, the layer-wise and batched hooks' steps, which each draw a fresh Q per bucket
    (saved at any compressed iteration); there the entries are marked ``predrawn``: the resumed step takes them."""
    buckets = state.buckets
    if state.iter < state.start_powerSGD_iter:
        return {}, None
    if buckets:
        return _redraws(state)
    pending = sorted(buckets.index_params)
    found = [_warmup_bucket(state, i) for i in pending]
    if not pending or any(f is None for f in found):
        return {}, None
    if state.start_powerSGD_iter < 2:
        # start_powerSGD_iter 1 (allowed without warm start and error feedback): the only warm-up iteration saw
        # DDP's first buckets, not the rebuilt ones the first compressed step meets (powersgd_triton.state.rebuild)
        rebuilt, why = rebuilt_buckets(state, [f[0] for f in found])
        if rebuilt is None or len({f[1:] for f in found}) != 1:
            warnings.warn(
                "PowerSGD: state_dict() at iteration 1, before the first compressed step (start_powerSGD_iter=1): "
                f"the buckets DDP builds for that step cannot be told ({why or 'buckets of several dtypes'}), so a "
                "resume from this state dict draws that step's random Qs for other buckets and is not bitwise; save "
                "at another iteration for a bitwise resume",
                RuntimeWarning,
                stacklevel=3,
            )
            return {}, None
        pending, found = list(range(len(rebuilt))), [(params,) + found[0][1:] for params in rebuilt]
    drawer = _drawer(state)
    entries = {}
    for index, (params, dtype, batched, redraws) in zip(pending, found):
        layout, buffer = _layout(state, params, dtype, batched)
        mem = BucketMemory()
        allocate(mem, layout, buffer, state.use_error_feedback)
        mem.layout, mem.signature, mem.params = layout, repr(layout.signature), params
        mem.order_params = params if layout.batched else None
        draw_q(drawer, mem, dtype)  # one seed per bucket, in DDP's call order, as the hook's first step
        mem.q_predrawn = not state.warm_start and redraws
        entries[index] = bucket_entry(state, mem)
    return entries, drawer.rng.get_state()


def _redraws(state) -> Tuple[Dict[int, Dict[str, Any]], Optional[tuple]]:
    """Without warm start: every bucket's next Q, drawn (the hooks whose steps each draw one: their memory's
    ``draws_q_each_step``)."""
    mems = [state.buckets[i] for i in sorted(state.buckets)]
    if state.warm_start or any(m.layout is None or not m.draws_q_each_step for m in mems):
        return {}, None
    drawer = _drawer(state)
    entries = {}
    for index, live in zip(sorted(state.buckets), mems):
        mem = BucketMemory()
        for name in ("layout", "signature", "params", "order_params", "error", "p", "phase"):
            setattr(mem, name, getattr(live, name))
        mem.q = torch.empty_like(live.q)
        draw_q(drawer, mem, live.layout.signature[2])
        mem.q_predrawn = True
        entries[index] = bucket_entry(state, mem)
    return entries, drawer.rng.get_state()
