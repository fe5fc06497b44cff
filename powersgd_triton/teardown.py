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

A second abort at exit, ``terminate called without an active exception`` (issue 40), is torch's too, and needs no
comm hook: DDP on gloo alone shows it. Gloo's worker thread drops its reference to a work just after running it, and a
work can hold Python objects: the thread state it was issued under (during ``backward()`` torch 2.13 keeps a
``contextvars`` context there, ``torch.autograd.graph._engine_run_backward``; torch 2.8 and 2.11 do not) and its
tensors (torch 2.13 releases a tensor's Python object when its C++ references drop). Releasing one takes the GIL. A
worker that starts waiting for the GIL while the main thread holds it into the interpreter's finalization (a script
that ends right after its last backward, on a loaded machine where the worker waits for a core) is ended inside a
``noexcept`` destructor: ``std::terminate``, SIGABRT, after the job finished (a core's stack: ``runLoop`` ->
``~AsyncAllreduceWork`` -> ``~ThreadLocalState`` or the tensors' destructor -> ``decref`` -> ``take_gil`` ->
``PyThread_exit_thread``). The threads outlive ``dist.destroy_process_group()`` and the user's last reference to the
model: once a DDP was made, ``torch.distributed.nn.functional``'s default arguments hold the world group until the
interpreter finalizes. So :func:`destroy_process_group` ends by waiting, with the GIL released, until every gloo
worker thread of the process is idle (:func:`wait_for_idle_gloo_workers`): a thread still releasing a finished work
is running, or waits for the GIL this function lets go of between its looks. A collective still pending when it
returns is not covered: call it after the last one has finished (DDP's have, once ``backward()`` returned).
"""

import gc
import os
import sys
import time
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


# the name torch gives a gloo worker thread when it first runs a work (torch >= 2.11; 2.8 names none)
GLOO_WORKER_NAME = "pt_gloo_runloop"


def gloo_worker_threads() -> List[str]:
    """The thread ids (``/proc/self/task`` entries) of this process's gloo worker threads, by their name; empty where
    ``/proc`` is not there (not Linux) or torch does not name them."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    found = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == GLOO_WORKER_NAME:
                    found.append(tid)
        except OSError:  # the thread has ended
            continue
    return found


def _look(tid: str):
    """Thread ``tid``'s state letter and context-switch counts (``/proc/self/task/<tid>/status``); None once gone."""
    try:
        with open(f"/proc/self/task/{tid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    return (fields.get("State", "?").strip()[:1], fields.get("voluntary_ctxt_switches", "").strip(),
            fields.get("nonvoluntary_ctxt_switches", "").strip())


def wait_for_idle_gloo_workers(timeout_s: float = 5.0, looks: int = 3, interval_s: float = 0.002) -> bool:
    """Wait until every gloo worker thread of this process stays blocked, not switched in once, over ``looks`` looks
    ``interval_s`` seconds apart; this thread sleeps between looks, so the GIL is free for a worker that needs it to
    release a finished work.

    A look reads each thread's state and context-switch counts: idle means state S, D or I (blocked) and the same
    counts as at the look before. A worker releasing a work runs (R), or waits for the GIL, which wakes it every few
    milliseconds (a new count). Returns True when they were idle (or there are none to see: not Linux, or a torch
    that does not name them), False after ``timeout_s`` seconds. A thread blocked in a collective that is still
    pending counts as idle: this waits for threads to finish with work they ran, not for collectives.
    """
    tids = gloo_worker_threads()
    deadline = time.monotonic() + timeout_s
    calm, before = 0, None
    while tids and calm < looks:
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
        now = [_look(t) for t in tids]
        idle = all(x is None or x[0] in "SDI" for x in now) and now == before
        calm, before = (calm + 1 if idle else 0), now
    return True


def destroy_process_group() -> None:
    """``torch.distributed.destroy_process_group()`` for every group, safe against gloo's worker threads.

    Call it where you would call ``dist.destroy_process_group()`` (on every rank, at the end of a run, after the last
    backward). It collects garbage first (a dropped DDP model sits in reference cycles), destroys every group as
    torch does, keeps the destroyed groups' Python objects until nothing else holds them (see the module docstring),
    so a group can outlive this call by as long as a ``then()`` callback of one of its collectives is still being torn
    down (a group still held then when the interpreter exits is left to it), and returns once gloo's worker threads
    are idle (:func:`wait_for_idle_gloo_workers`, at most 5 s), so none is left releasing a finished collective when
    the interpreter exits. Does nothing but those two last steps when no group is initialized.

    Raises:
        RuntimeError: What ``torch.distributed.destroy_process_group()`` raises (nothing is kept then).

    Source: pytorch/torch/csrc/distributed/c10d/ProcessGroupGloo.cpp (the destructor joins the worker threads;
    ``runLoop`` drops each work after running it, and a work keeps the ``at::ThreadLocalState`` it was issued under);
    reproduced with PyTorch's ``powerSGD_hook`` on a gloo world of size 1 (tests/test_teardown.py); the abort at exit
    with ``tests/_exit_loop.py`` (tests/test_teardown_exit.py).
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()  # DDP models already dropped, in reference cycles, let go of their groups here
        groups = live_groups()
        dist.destroy_process_group()
        _RETIRED.extend(groups)
        del groups
    release_retired()
    wait_for_idle_gloo_workers()
