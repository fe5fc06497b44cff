"""Destroying torch.distributed process groups without aborting the process from a gloo worker thread.

Gloo's ``ProcessGroup`` destructor joins the group's worker threads. A ``then()`` callback of a gloo collective runs on
one of those threads, and the thread drops the callback (its closure) only after the future the callback completes has
woken the waiting thread. PyTorch's ``powerSGD_hook`` captures its process group in such closures (ours does on NCCL
only, where callbacks run on the calling thread, and under the tests' ``OPTIONS.callback_chain`` of powersgd_triton.hooks.driver). If the caller has
meanwhile destroyed the group (``dist.destroy_process_group()`` dropping the registry's references) and dropped its
own, the closure holds the last reference: the destructor then runs on the worker thread, joins that very thread, and
``std::thread::join`` throws ``Resource deadlock avoided``: ``std::terminate``, ``Fatal Python error: Aborted``. A busy
machine widens the window (the worker thread needs the GIL to drop the closure). Seen in CI on 2026-12-03 (an xdist
worker of the test suite aborted between two tests; the controller then hung).

:func:`destroy_process_group` destroys as torch does, but keeps the Python objects of the destroyed groups (one
wrapper per C++ group) in a module list and drops each only when that list is its last holder, checked then and on
every later call, always on the calling thread: the destructor runs there. Used by the package's training and analysis
runs and the test suite; use it in place of ``dist.destroy_process_group()`` wherever a gloo collective's
``then()`` callback may hold a group (PyTorch's PowerSGD hooks on CPU).
"""

import sys
from typing import List

import torch.distributed as dist

_RETIRED: List[object] = []  # destroyed groups' Python objects, dropped once nothing else holds them


def live_groups() -> List[object]:
    """The Python objects of the initialized process groups: WORLD and every ``new_group`` (empty before
    ``init_process_group``). Reads ``torch.distributed``'s private group map where it has one (torch 2.8-2.14)."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    groups = [dist.group.WORLD]
    pg_map = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    if isinstance(pg_map, dict):
        groups += [g for g in pg_map if all(g is not h for h in groups)]
    return [g for g in groups if g is not None]


def release_retired() -> int:
    """Drop (on this thread) each destroyed group that nothing but this module holds; returns how many are kept."""
    i = 0
    while i < len(_RETIRED):
        if sys.getrefcount(_RETIRED[i]) <= 2:  # the list's slot and getrefcount's own argument
            del _RETIRED[i]
        else:
            i += 1
    return len(_RETIRED)


def destroy_process_group() -> None:
    """``torch.distributed.destroy_process_group()`` for every group, safe against gloo's worker threads.

    Call it where you would call ``dist.destroy_process_group()`` (on every rank, at the end of a run). Does nothing
    but :func:`release_retired` when no group is initialized. The destroyed groups' Python objects are kept until
    nothing else holds them (see the module docstring), so a group can outlive this call by as long as a ``then()``
    callback of one of its collectives is still being torn down (a group still held then when the interpreter exits is
    left to it).

    Raises:
        RuntimeError: What ``torch.distributed.destroy_process_group()`` raises (nothing is kept then).

    Source: pytorch/torch/csrc/distributed/c10d/ProcessGroupGloo.cpp (the destructor joins the worker threads);
    reproduced with PyTorch's ``powerSGD_hook`` on a gloo world of size 1 (tests/test_teardown.py).
    """
    if dist.is_available() and dist.is_initialized():
        groups = live_groups()
        dist.destroy_process_group()
        _RETIRED.extend(groups)
        del groups
    release_retired()
