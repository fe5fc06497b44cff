"""The abort at exit of issue 40 item 5 (a torch/gloo hazard; our hook, PyTorch's and none alike), made deterministic,
and what :func:`powersgd_triton.teardown.destroy_process_group` does against it.

The cause: gloo's worker thread drops each work after running it, and a work can hold Python objects: the thread state
it was issued under (during ``backward()`` torch 2.13 keeps a ``contextvars`` context there) and its tensors (torch
2.13 releases a tensor's Python object when its C++ references drop). Releasing one takes the GIL. A worker that
starts waiting for the GIL while the main thread holds it into the interpreter's finalization is ended there, inside
a ``noexcept`` destructor: "terminate called without an active exception", SIGABRT. Here the wait is forced: rank 1
joins rank 0's last collective (issued during backward, as DDP's are) only while rank 0's main thread runs its last
``atexit`` handler, a builtin that holds the GIL (``sum`` over a range, ~1.5 s) straight into finalization.

The teardown's part: it returns only once gloo's worker threads are idle (``wait_for_idle_gloo_workers``: a worker
waiting for the GIL gets it while the teardown sleeps between its looks), so none is left releasing a finished work
when the script ends; a collective still pending then is not its to wait for. ``tests/_exit_loop.py`` counts the
aborts of the script issue 40 ran, with torch's destroy and with ours.
"""

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.distributed as dist

from _deadline import scaled

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_RANKS = textwrap.dedent('''
    import atexit, os, sys, time

    start = time.perf_counter()
    sum(range(10**6))
    n = int(1.5 / max(time.perf_counter() - start, 1e-4) * 10**6)  # ~1.5 s of sum(), however loaded the machine
    # registered before anything else (logging, torch) registers one, so run last: called from C, a builtin that
    # holds the GIL straight into finalization
    atexit.register(sum, range(n))

    import torch, torch.distributed as dist

    folder, rank, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    torch.set_num_threads(1)

    def path(name):
        return os.path.join(folder, name)

    def wait_for(name):
        end = time.monotonic() + limit
        while not os.path.exists(path(name)):
            if time.monotonic() > end:
                raise SystemExit(f"rank {rank}: no {name} after {limit} s")
            time.sleep(0.005)

    dist.init_process_group("gloo", store=dist.FileStore(path("store"), 2), rank=rank, world_size=2)
    dist.barrier()
    if rank == 1:
        wait_for("go")
        dist.all_reduce(torch.ones(4))  # rank 0's last collective completes now, while rank 0 holds the GIL
        open(path("done"), "w").close()
        dist.destroy_process_group()
        sys.exit(0)

    payload = torch.ones(4)

    def last_collective():  # issued during backward, as DDP's all-reduces are; its Work object dropped at once
        x = torch.ones(3, requires_grad=True)
        x.register_hook(lambda grad: (held.allreduce([payload]), grad)[1])
        (x * 2).sum().backward()
        open(path("go"), "w").close()

    atexit.register(last_collective)  # run first at exit
    held = dist.group.WORLD  # as a DDP model holds it (its collectives go to the group object itself)
    dist.destroy_process_group()
    print("trained", flush=True)
''')


def _run_pair(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    limit = scaled(60)
    procs = [subprocess.Popen([sys.executable, "-c", _RANKS, str(tmp_path), str(r), str(limit)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=limit + 60)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def test_worker_releasing_a_work_as_the_interpreter_finalizes_aborts(tmp_path):
    (rc0, out0, err0), (rc1, _, err1) = _run_pair(tmp_path)
    assert rc1 == 0, err1[-3000:]
    # torch 2.8's gloo prints its "[Gloo] Rank 0 is connected to ..." line to stdout first
    assert out0.strip().splitlines()[-1:] == ["trained"], (out0[-500:], err0[-3000:])
    if rc0 == 0:
        pytest.skip("this torch's gloo worker released the work without the GIL (torch 2.8 and 2.11 may)")
    assert rc0 == -6 and "terminate called without an active exception" in err0, (rc0, err0[-3000:])


def _busy_worker(rank, world_size, busy_s):
    """Rank 0: a then() callback that runs Python for ``busy_s`` seconds on a gloo worker thread; what
    ``wait_for_idle_gloo_workers`` says while it runs and after."""
    import time

    from powersgd_triton import teardown

    dist.barrier()  # a worker thread takes its name when it first runs a work
    seen = {"named": len(teardown.gloo_worker_threads()), "idle_before": teardown.wait_for_idle_gloo_workers()}
    started = threading.Event()

    def busy(fut):
        started.set()
        seen["on_worker"] = threading.current_thread() is not threading.main_thread()
        end = time.monotonic() + busy_s
        while time.monotonic() < end:
            pass
        return fut.value()

    if rank == 1:
        time.sleep(0.2)  # rank 0 chains the callback before the collective can finish
    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    if rank == 0:
        fut = fut.then(busy)
        assert started.wait(busy_s)
        seen["idle_while_busy"] = teardown.wait_for_idle_gloo_workers(timeout_s=0.3)
    fut.wait()
    seen["idle_after"] = teardown.wait_for_idle_gloo_workers()
    return seen


def test_idle_wait_sees_a_busy_worker(tmp_path):
    """A gloo worker thread running Python (a then() callback here; releasing a work's Python objects is the same
    kind of work) is not idle: the wait times out while it runs and returns True once it is done."""
    from _dist import run_ranks

    seen = run_ranks(_busy_worker, 2, tmp_path, scaled(3.0))[0]
    if seen["named"] == 0:
        pytest.skip("this torch does not name gloo's worker threads (torch 2.8): nothing to wait for")
    assert seen["named"] >= 1  # gloo's default: 2 worker threads per group, named once they ran a work
    assert seen["idle_before"] and seen["on_worker"]
    assert seen["idle_while_busy"] is False
    assert seen["idle_after"] is True
