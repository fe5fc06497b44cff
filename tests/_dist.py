"""Small multi-rank harness for the hook tests: gloo ranks on 127.0.0.1, started through a fork server.

``run_ranks(fn, world_size, tmp_path)`` starts ``world_size`` children from multiprocessing's fork server (a
single-threaded process that imported torch and powersgd_triton once, so starting a rank is a cheap fork). Not a
plain fork of the pytest process: under pytest-xdist that process has an I/O thread (execnet), and a test may have
left gloo or OpenMP threads behind; a fork copies the locks those threads hold, and the ranks hung or aborted
intermittently in CI (3 runs out of ~10). Each child takes the parent's environment and, when the test has them, its
poisoned allocations (``_poison``), sets ``torch.set_num_threads(1)``, joins a gloo group through a FileStore in
``tmp_path``, runs
``fn(rank, world_size, *args, **kwargs)``, sends its (picklable) result back, then barriers and destroys the group
(ending without that intermittently aborts a rank). The parent waits on a load-scaled deadline (``_deadline``: it
extends while the machine is loaded) and kills the children on expiry or as soon as one rank fails, and re-raises the
child's traceback. On expiry it first has every living rank write its Python stack (``faulthandler`` on ``SIGUSR1``,
into a file next to the store) and puts those stacks in the ``TimeoutError``. pytest-timeout is the backstop.

Also :class:`FakeBucket`, a duck-typed ``dist.GradBucket`` (``GradBucket`` cannot be built from Python), and the
small convnet and training loop of the real-DDP tests (:class:`SmallConvNet`, :func:`train_ddp_steps`).
"""

import datetime
import faulthandler
import os
import pickle
import queue
import signal
import sys
import time
import traceback
import uuid
from typing import Callable, List, Sequence

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import _deadline
import _poison
from powersgd_triton import teardown
from powersgd_triton.train.launch import adopt_environment, forkserver_context

# Imported once by the fork server, before it forks any rank (missing ones are skipped by multiprocessing).
# torch._dynamo too: DDP and the dispatch-mode tests import it on first use (~470 modules, 2-4 s of every such
# rank's time on 2 loaded cores, issue 34); numpy.random and schema_check_mode: every rank imported them.
_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "torch._subclasses.schema_check_mode",
            "numpy.random", "triton", "powersgd_triton", "_dist"]

_STACK_FILE = None  # a rank's open stack file (faulthandler keeps only its descriptor)
_STACK_WAIT_S = 10.0  # how long the parent waits for the ranks' stacks on a timeout


def _stack_path(store_path: str, rank: int) -> str:
    return f"{store_path}.rank{rank}.stack"


def start_context():
    """multiprocessing's fork-server context, its preload list set (the library's :func:`forkserver_context`: the
    server starts on the first ``Process.start``; each rank then takes the launching test's environment)."""
    return forkserver_context(_PRELOAD)


def _child(fn, rank, world_size, store_path, timeout, q, args, kwargs, env, poison):
    global _STACK_FILE
    code = 0
    try:
        # first: SIGUSR1 writes every thread's Python stack to this rank's file (run_ranks' timeout message)
        _STACK_FILE = open(_stack_path(store_path, rank), "w")
        faulthandler.register(signal.SIGUSR1, file=_STACK_FILE, all_threads=True)
        adopt_environment(env)
        if poison:
            _poison.install()
        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
        )
        result = fn(rank, world_size, *args, **kwargs)
        q.put((rank, True, pickle.dumps(result)))
        dist.barrier()
        teardown.destroy_process_group()  # a gloo worker thread may hold the last reference (powersgd_triton.teardown)
    except BaseException:  # noqa: BLE001 - report everything to the parent
        code = 1
        try:
            q.put((rank, False, traceback.format_exc()))
        except Exception:
            pass
    finally:
        try:
            q.close()
            q.join_thread()
        except Exception:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_ranks(fn: Callable, world_size: int, tmp_path, *args, timeout: float = 90.0, **kwargs) -> List:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; results by rank. ``fn`` and the
    arguments are pickled (``fn`` a module-level function).

    ``timeout`` (seconds, a hang detector sized for a quiet machine) is a :class:`_deadline.Deadline`: times the
    machine's load scale, re-read while waiting. Raises ``TimeoutError`` on expiry (its message: the ranks missing, the
    deadline and every living rank's Python stack), ``RuntimeError`` when a rank fails (its traceback), dies or does
    not exit after returning its result."""
    deadline = _deadline.Deadline(timeout)
    ctx = start_context()
    q = ctx.Queue()
    store_path = os.path.join(str(tmp_path), f"store-{uuid.uuid4().hex}")
    env, poison = dict(os.environ), _poison.is_poisoned()
    # gloo's own timeout (per collective) well past the parent's deadline: the parent is the hang detector
    pg_timeout = 3 * deadline.limit
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, store_path, pg_timeout, q, args, kwargs, env, poison),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < world_size:
            left = deadline.left()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"ranks {missing} timed out after {deadline.describe()}\n"
                                   + rank_stacks(procs, store_path))
            try:
                rank, ok, payload = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} died with exit codes {[procs[i].exitcode for i in dead]}")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
        for p in procs:
            p.join(max(1.0, deadline.left()))
        bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            stacks = rank_stacks(procs, store_path) if any(p.is_alive() for p in procs) else ""
            raise RuntimeError(f"ranks exited abnormally after returning their results: {bad}\n{stacks}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        q.close()
    return [results[r] for r in range(world_size)]


def rank_stacks(procs, store_path: str, wait_s: float = _STACK_WAIT_S) -> str:
    """Every living rank's Python stack, all threads (``faulthandler``): SIGUSR1 to each rank that registered its
    stack file, then its file read back (waits up to ``wait_s`` seconds for the files to be written). One section a
    rank: "--- rank R (pid P): ..." then the stack, most recent call first."""
    signalled = {}
    for rank, p in enumerate(procs):
        path = _stack_path(store_path, rank)
        if p.is_alive() and os.path.exists(path):
            try:
                os.kill(p.pid, signal.SIGUSR1)
                signalled[rank] = path
            except OSError:
                pass
    stop = time.monotonic() + wait_s
    sizes = {}
    while signalled and time.monotonic() < stop:  # until every file is written and has stopped growing
        now = {rank: os.path.getsize(path) for rank, path in signalled.items()}
        if all(now.values()) and now == sizes:
            break
        sizes = now
        time.sleep(0.2)
    sections = []
    for rank, p in enumerate(procs):
        head = f"--- rank {rank} (pid {p.pid})"
        if rank in signalled:
            with open(signalled[rank]) as f:
                text = f.read().rstrip()
            sections.append(f"{head}: Python stack, most recent call first\n{text or '(nothing written in time)'}")
        elif p.is_alive():
            sections.append(f"{head}: alive, no stack (it had not reached the harness)")
        else:
            sections.append(f"{head}: exited with code {p.exitcode}")
    return "\n".join(sections)


class FakeBucket:
    """Duck-typed ``dist.GradBucket``: a flat buffer and per-gradient contiguous views into it (as DDP's are)."""

    def __init__(self, buffer: torch.Tensor, shapes: Sequence[Sequence[int]], index: int = 0, is_last: bool = True):
        self._buffer = buffer
        self._shapes = [tuple(s) for s in shapes]
        self._index = index
        self._is_last = is_last
        numel = sum(_numel(s) for s in self._shapes)
        if buffer.numel() != numel:
            raise ValueError(f"buffer has {buffer.numel()} elements, shapes need {numel}")

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> List[torch.Tensor]:
        out, off = [], 0
        for s in self._shapes:
            n = _numel(s)
            out.append(self._buffer[off : off + n].view(s))
            off += n
        return out

    def parameters(self) -> List[torch.Tensor]:
        return [torch.empty(s) for s in self._shapes]

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last


def error_text(fn) -> "str | None":
    """``"TypeName: message"`` of the exception ``fn()`` raises, or None (a rank's refusal, sent back as text)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def bucket_numel(shapes) -> int:
    return sum(_numel(s) for s in shapes)


def triton_backend_skip_reason():
    """Why the "triton" backend cannot be tested here (None when it can)."""
    try:
        from powersgd_triton.ops import kernels  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"powersgd_triton.ops.kernels is not importable ({type(exc).__name__}: {exc})"
    from powersgd_triton.compat import env as _env

    if not _env.triton_can_run(torch.device("cpu")):
        return "Triton kernels cannot run on CPU tensors here (set TRITON_INTERPRET=1 before triton is imported)"
    return None


def backend_params():
    """pytest params for the ops backends: "torch" always, "triton" skipped when its kernels cannot run."""
    import pytest

    reason = triton_backend_skip_reason()
    return [
        pytest.param("torch", id="torch"),
        pytest.param("triton", id="triton", marks=pytest.mark.skipif(reason is not None, reason=reason or "")),
    ]


def params_agree(model, world_size: int) -> bool:
    """True when ``model``'s parameters are bitwise identical on every rank of the default group (all-gather)."""
    mine = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


class SmallConvNet(nn.Module):
    """Two 3x3 convolutions and two linear layers on 3x8x8 inputs (``unused``: one more layer that never gets a
    gradient, for ``find_unused_parameters``)."""

    def __init__(self, unused: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 2 * 2, 32)
        self.fc2 = nn.Linear(32, 10)
        self.unused = nn.Linear(32, 32) if unused else None

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def train_ddp_steps(ddp, x, y, steps: int, world_size: int, no_sync: bool = False) -> dict:
    """``steps`` SGD steps (lr 0.2, momentum 0.9) of ``ddp`` on one batch: ``losses``, ``final`` loss, the steps after
    which the ranks' parameters differ (``mismatched``) and the PowerSGD ``warnings``. ``no_sync``: the first half of
    the batch accumulates under ``ddp.no_sync()`` first."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2, momentum=0.9)
    losses, mismatched = [], []
    half = x.shape[0] // 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            opt.zero_grad()
            if no_sync:
                with ddp.no_sync():
                    F.cross_entropy(ddp(x[:half]).float(), y[:half]).backward()
                loss = F.cross_entropy(ddp(x[half:]).float(), y[half:])
            else:
                loss = F.cross_entropy(ddp(x).float(), y)
            loss.backward()
            opt.step()
            losses.append(float(loss))
            if not params_agree(ddp.module, world_size):
                mismatched.append(step)
    with torch.no_grad():
        final = float(F.cross_entropy(ddp.module(x).float(), y))
    return {"losses": losses, "final": final, "mismatched": mismatched,
            "warnings": [str(w.message) for w in caught if "PowerSGD" in str(w.message)]}
