"""Start ``world_size`` ranks on this machine, or join a ``torchrun`` job, and never hang on a failure.

:func:`launch` runs ``fn(rank, world_size, init_method, *args)`` in one child process per rank (fork, the fork
server or spawn: see :func:`launch`), rendezvous over TCP on 127.0.0.1 with a free port (or ``port``), and returns rank 0's return
value. When a rank raises, its traceback is sent to the parent, the other ranks are terminated (they would
otherwise wait in a collective forever) and :class:`RankFailed` is raised with that rank's error; a rank that
dies without a word (a signal, ``os._exit``) is reported the same way; past ``timeout`` seconds every rank is
killed and :class:`LaunchTimeout` is raised.

:func:`torchrun_env` reads the environment ``torchrun`` exports (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``); under torchrun the caller runs its rank in-process with ``env://``.

:data:`CPU_NUMERICS_ENV` pins the instruction set of the CPU math libraries (ATen's vectorized kernels, oneDNN,
MKL), so that a CPU run with a given seed prints the same digits on every x86-64 machine with AVX2; ``launch(...,
env=...)`` hands such settings to the ranks only.
"""

import errno
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence

HOST = "127.0.0.1"


# Which kernels torch's CPU build runs depends on the CPU: ATen's vectorized loops (AVX2 or AVX-512), oneDNN's
# convolutions (up to AVX-512 / AMX) and MKL's GEMM (its own path per CPU vendor and generation, and, unless
# conditional numerical reproducibility is on, on the memory alignment). Each changes the rounding, and a training
# run amplifies one changed bit into different accuracy digits. Measured on this project's 2-core AMD EPYC
# (family 25, AVX-512) with the digits workload: each of the three settings alone changes the all-reduce or
# PyTorch-hook row's test loss in the 3rd-4th digit. Capped at AVX2 and MKL's compatible path, the kernels are the
# same on every x86-64 CPU with AVX2 (at some speed: ~25 % more ms/step on the digits workload).
CPU_NUMERICS_ENV: Dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_CBWR": "COMPATIBLE",
}


def cpu_numerics_env(environ=None) -> Dict[str, str]:
    """The :data:`CPU_NUMERICS_ENV` settings that ``environ`` (default ``os.environ``) does not set itself: a
    user's own value of any of them wins."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in CPU_NUMERICS_ENV.items() if k not in env}


class LaunchError(RuntimeError):
    """The ranks could not be started or did not finish."""


class RankFailed(LaunchError):
    """A rank raised or died; ``rank`` and ``details`` (its traceback, or how it died) say which and why."""

    def __init__(self, rank: int, details: str):
        self.rank = rank
        self.details = details
        super().__init__(f"rank {rank} failed:\n{details.rstrip()}")


class LaunchTimeout(LaunchError):
    """The ranks did not finish within the timeout."""


class PortInUse(LaunchError):
    """The requested rendezvous port is taken."""


def free_port(host: str = HOST) -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(port: int, host: str = HOST) -> None:
    """Raise :class:`PortInUse` (a clear message) when ``port`` cannot be bound on ``host``."""
    if not 0 < port < 65536:
        raise LaunchError(f"port {port} is out of range (1..65535)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                raise PortInUse(
                    f"port {port} on {host} is already in use (or not allowed); pick another with --port, "
                    f"or leave --port at 0 to use a free one"
                ) from None
            raise


@dataclass
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int


def torchrun_env(environ=None) -> Optional[TorchrunEnv]:
    """The rank/world size that torchrun (or any ``env://`` launcher) exported, or ``None`` when not under one."""
    env = os.environ if environ is None else environ
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in env for k in needed):
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
    except ValueError as exc:
        raise LaunchError(f"bad torchrun environment: {exc}") from None
    return TorchrunEnv(rank=rank, world_size=world, local_rank=local)


def forkserver_context(preload: Sequence[str]):
    """multiprocessing's fork-server context with ``preload`` (module names) imported by the server before it forks
    any child. The list takes effect when this process's fork server starts (its first ``Process.start``, with the
    environment and ``sys.path`` of that moment); later calls keep the running server. A child should call
    :func:`adopt_environment` with its launcher's ``os.environ`` of the moment it was started."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def adopt_environment(env: Dict[str, str]) -> None:
    """Replace this process's environment by ``env`` (a fork-server child: the launcher's environment when it
    started the child, not the server's when the server started)."""
    os.environ.clear()
    os.environ.update(env)


def _child(fn: Callable, rank: int, world_size: int, init_method: str, args: Sequence[Any], results,
           env: Optional[Dict[str, str]] = None) -> None:
    try:
        if env is not None:
            adopt_environment(env)
        out = fn(rank, world_size, init_method, *args)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        tb = traceback.format_exc()
        try:
            results.put(("error", rank, tb))
        except Exception:  # pragma: no cover - unpicklable beyond repair
            results.put(("error", rank, f"{type(exc).__name__}: {exc}"))
        # let the queue's feeder thread flush, then leave without running atexit handlers that may block in
        # a collective of a broken process group
        results.close()
        results.join_thread()
        os._exit(1)
    results.put(("ok", rank, out if rank == 0 else None))
    results.close()
    results.join_thread()


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"killed by signal {name}"
    return f"exited with code {code} without reporting a result or an error"


def _terminate(procs, grace: float = 3.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(1.0)


def launch(
    fn: Callable,
    world_size: int,
    args: Sequence[Any] = (),
    *,
    port: int = 0,
    timeout: float = 600.0,
    start_method: str = "fork",
    env: Optional[Dict[str, str]] = None,
) -> Any:
    """Run ``fn(rank, world_size, "tcp://127.0.0.1:PORT", *args)`` on ``world_size`` local processes.

    ``start_method``: ``"fork"`` (fast, ``fn`` may be a closure or defined in ``__main__``; but a fork copies the
    locks other threads of the caller hold: a Jupyter kernel, a pytest-xdist worker or a process with a live gloo
    group can hang its ranks), ``"forkserver"`` (multiprocessing's single-threaded fork server, started once per
    process with torch and ``fn``'s module imported; each rank gets the caller's current environment) or
    ``"spawn"`` (a fresh interpreter per rank; CUDA). ``fn`` must be importable (module level) for the last two.
    ``env``: variables set for the ranks on top of the caller's environment (e.g. :func:`cpu_numerics_env`), with
    the fork server and spawn only (they are read by libraries when the rank first uses them; a forked rank has
    its parent's libraries already set up): ``LaunchError`` with ``"fork"``.

    Returns rank 0's return value. Raises :class:`RankFailed` (first failing rank, with its traceback),
    :class:`LaunchTimeout`, :class:`PortInUse` or :class:`LaunchError`.
    """
    if world_size < 1:
        raise LaunchError(f"world size must be at least 1, got {world_size}")
    if port:
        check_port(port)
    else:
        port = free_port()
    init_method = f"tcp://{HOST}:{port}"
    extra = dict(env or {})
    if extra and start_method == "fork":
        raise LaunchError(f"env {sorted(extra)} needs start_method 'forkserver' or 'spawn': a forked rank inherits "
                          "its parent's libraries as they are")
    if start_method == "forkserver":
        ctx = forkserver_context(["torch", "torch.distributed", fn.__module__])
    else:
        ctx = mp.get_context(start_method)
    results = ctx.Queue()
    procs = []
    saved = {k: os.environ.get(k) for k in extra}
    try:
        # a spawned rank, and the fork server when this starts it, begin with the environment of this moment; a
        # fork-server child adopts it explicitly (the server's own is that of its start)
        os.environ.update(extra)
        child_env = dict(os.environ) if start_method == "forkserver" else None
        for rank in range(world_size):
            p = ctx.Process(
                target=_child, args=(fn, rank, world_size, init_method, tuple(args), results, child_env),
                name=f"rank{rank}", daemon=True,
            )
            p.start()
            procs.append(p)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    deadline = time.monotonic() + timeout
    done, value = set(), None
    try:
        while len(done) < world_size:
            try:
                kind, rank, payload = results.get(timeout=0.2)
            except queue_mod.Empty:
                kind = None
            if kind == "error":
                raise RankFailed(rank, payload)
            if kind == "ok":
                done.add(rank)
                if rank == 0:
                    value = payload
                continue
            # nothing reported: did a rank die silently?
            for r, p in enumerate(procs):
                if r not in done and p.exitcode is not None:
                    # it may have posted just before dying: give the queue one more look
                    try:
                        kind, rank, payload = results.get(timeout=0.5)
                    except queue_mod.Empty:
                        raise RankFailed(r, _describe_exit(p.exitcode)) from None
                    if kind == "error":
                        raise RankFailed(rank, payload)
                    done.add(rank)
                    if rank == 0:
                        value = payload
                    break
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - done)
                raise LaunchTimeout(
                    f"ranks {missing} did not finish within {timeout:g} s (raise it with --timeout); "
                    "all ranks were stopped"
                )
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        return value
    finally:
        _terminate(procs)
        results.close()
        results.cancel_join_thread()
