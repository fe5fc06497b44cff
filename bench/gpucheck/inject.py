"""Sleep injection: delay the work the hooks put on other streams, so that a tensor that work reads but nobody keeps
alive (or a wait that is missing) shows as wrong numbers instead of passing by luck of timing.

* :func:`sleep_in_callbacks`: every ``then()`` callback chained on the future of a ``dist.all_reduce(...,
  async_op=True)`` made inside the block (and on the futures those ``then()`` calls return, transitively) calls
  ``sleep()`` first. On NCCL the hooks run the rest of a step in such callbacks, on a stream of PyTorch's pool:
  ``torch.cuda._sleep`` there delays everything the callback enqueues while the caller goes on allocating and
  writing on the default stream.
* :func:`sleep_on_side_stream`: every orthogonalization the hooks make while the current stream is one of their
  side streams (the next step's Q, ``powersgd_triton.hooks.driver``) calls ``sleep()`` first, on that stream. Both ways the
  hooks reach it are wrapped: ``powersgd_triton.ops.orthogonalize`` (the torch backend, and any memory not on the
  Triton backend) and ``powersgd_triton.ops.backend.TritonSteps.orthogonalize`` (the Triton backend's unchecked launchers, which
  never call ``ops``).
* :func:`next_q_orthogonalizations`: a predicate for ``sleep_on_side_stream`` where there are no side streams (CPU):
  true while ``powersgd_triton.hooks.driver.orthogonalize_next_q`` runs, the call that runs on the side stream on CUDA (and
  inline on CPU), so the injection's plumbing runs on CPU through the same calls as on a GPU.

Both count what they injected (:class:`Injected`), so a check can tell the injection happened. Only torch and
powersgd_triton are needed (no GPU for the mechanism itself: ``sleep`` and ``on_side`` can be test doubles).
"""

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class Injected:
    callbacks: int = 0  # then() callbacks that slept first
    side: int = 0  # orthogonalize calls on a side stream that slept first


def cuda_sleep(cycles: int) -> Callable[[], None]:
    """``sleep()`` that enqueues ``torch.cuda._sleep(cycles)`` (a spin of that many GPU clock cycles) on the current
    stream."""
    import torch

    def sleep():
        torch.cuda._sleep(int(cycles))

    return sleep


class _Future:
    """A future whose ``then()`` wraps the callback (sleep first) and returns such a future again; everything else
    is the wrapped ``torch.futures.Future``'s."""

    def __init__(self, fut, sleep, counts: Injected):
        self._fut, self._sleep, self._counts = fut, sleep, counts

    def then(self, callback):
        sleep, counts = self._sleep, self._counts  # not self: no cycle through the wrapped future's callbacks

        def delayed(fut):
            counts.callbacks += 1
            sleep()
            return callback(fut)

        return _Future(self._fut.then(delayed), sleep, counts)

    def __getattr__(self, name):
        return getattr(self._fut, name)


class _Work:
    def __init__(self, work, sleep, counts: Injected):
        self._work, self._sleep, self._counts = work, sleep, counts

    def get_future(self):
        return _Future(self._work.get_future(), self._sleep, self._counts)

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def sleep_in_callbacks(sleep: Callable[[], None], counts: Optional[Injected] = None):
    """Within the block, ``torch.distributed.all_reduce(..., async_op=True)`` returns a work whose future's
    ``then()`` callbacks call ``sleep()`` first (see the module docstring). Yields the :class:`Injected` counts. The
    futures are proxies: fine for a hook called directly (``.wait()``, ``.value()``, ``.then()``), not for one
    registered with DDP (whose reducer needs the real future)."""
    import torch.distributed as dist

    counts = counts if counts is not None else Injected()
    original = dist.all_reduce

    def all_reduce(*args, **kwargs):
        work = original(*args, **kwargs)
        return _Work(work, sleep, counts) if work is not None else work

    dist.all_reduce = all_reduce
    try:
        yield counts
    finally:
        dist.all_reduce = original


def _on_a_side_stream() -> bool:
    import torch

    from powersgd_triton.hooks import driver as _step

    streams = getattr(_step, "_SIDE_STREAMS", None)
    if streams is None:
        raise RuntimeError("powersgd_triton.hooks.driver has no _SIDE_STREAMS (the next-Q side streams moved): update "
                           "bench/gpucheck/inject.py")
    if not torch.cuda.is_available() or not streams:
        return False
    current = torch.cuda.current_stream()
    return any(current == s for s in streams.values())


@contextlib.contextmanager
def sleep_on_side_stream(sleep: Callable[[], None], counts: Optional[Injected] = None,
                         on_side: Callable[[], bool] = _on_a_side_stream):
    """Within the block, every orthogonalization the hooks make, through ``powersgd_triton.ops.orthogonalize`` (torch
    backend) or ``powersgd_triton.ops.backend.TritonSteps.orthogonalize`` (Triton backend), calls ``sleep()`` first whenever
    ``on_side()`` (default: the current CUDA stream is one of ``powersgd_triton.hooks.driver``'s side streams; on CPU
    :func:`next_q_orthogonalizations`' predicate stands in for it). Yields the :class:`Injected` counts (``side``: the
    calls that slept). Both functions are restored on exit."""
    from powersgd_triton.ops.backend import TritonSteps as _hook_ops
    from powersgd_triton import ops

    counts = counts if counts is not None else Injected()
    originals = [(module, module.orthogonalize) for module in (ops, _hook_ops)]

    def delayed(original):
        def orthogonalize(*args, **kwargs):
            if on_side():
                counts.side += 1
                sleep()
            return original(*args, **kwargs)

        return orthogonalize

    for module, original in originals:
        module.orthogonalize = delayed(original)
    try:
        yield counts
    finally:
        for module, original in originals:
            module.orthogonalize = original


@contextlib.contextmanager
def next_q_orthogonalizations():
    """Within the block, yields a predicate that is true while ``powersgd_triton.hooks.driver.orthogonalize_next_q`` runs
    (in this thread): the next step's Q orthogonalized ahead, which runs on a side stream on CUDA and inline on CPU.
    The ``on_side`` of :func:`sleep_on_side_stream` where no side stream exists (the dry run, the CPU tests).
    ``orthogonalize_next_q`` is restored on exit."""
    import threading

    from powersgd_triton.hooks import driver as _step

    inside = threading.local()
    original = getattr(_step, "orthogonalize_next_q", None)
    if original is None:
        raise RuntimeError("powersgd_triton.hooks.driver has no orthogonalize_next_q (the next-Q orthogonalization moved): "
                           "update bench/gpucheck/inject.py")

    def orthogonalize_next_q(*args, **kwargs):
        depth = getattr(inside, "depth", 0)
        inside.depth = depth + 1
        try:
            return original(*args, **kwargs)
        finally:
            inside.depth = depth

    _step.orthogonalize_next_q = orthogonalize_next_q
    try:
        yield lambda: getattr(inside, "depth", 0) > 0
    finally:
        _step.orthogonalize_next_q = original
