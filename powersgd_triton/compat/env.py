"""Environment probes and every ``POWERSGD_TRITON_*`` variable in one place.

| variable | meaning |
| --- | --- |
| ``TRITON_INTERPRET=1`` | Triton's interpreter: kernels run on CPU tensors (set before ``import triton``) |
| ``POWERSGD_TRITON_CACHE_DIR`` | folder of the autotuner's per-GPU JSON cache (default: the user cache dir) |
| ``POWERSGD_TRITON_GPU_NAME`` | override the GPU model name used as the autotuner's cache key |
| ``POWERSGD_TRITON_CONFIG_DIR`` | extra folder of shipped-format ``<gpu>.json`` autotune defaults, searched before the package's |
| ``XDG_CACHE_HOME`` | without ``platformdirs``: the cache dir is ``$XDG_CACHE_HOME/powersgd_triton`` (else ``~/.cache/...``) |

Optional helpers. The package needs only torch, triton and numpy; these are used when installed (``pip install``
brings them) and replaced as follows when not (e.g. a bare checkout run with ``PYTHONPATH=.``):

| module | used for | without it |
| --- | --- | --- |
| ``platformdirs`` | the autotune cache folder | ``$XDG_CACHE_HOME/powersgd_triton`` or ``~/.cache/powersgd_triton`` |
| ``filelock`` | the lock around cache writes | ``fcntl.flock`` on the same lock file (POSIX); elsewhere no lock: the write stays an atomic replace, two writers at once may drop one's entries |
| ``tqdm`` | progress bars (``autotune``, ``train``) | no bar; ``train`` prints its per-epoch lines |
"""

import functools
import importlib
import os
import sys
import time

import torch


def interpreter_enabled() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when ``import triton`` works and it is not older than the tested floor (:mod:`powersgd_triton.compat.versions`:
    an older one is not used)."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    from powersgd_triton.compat.versions import triton_too_old

    return triton_too_old() is None


def triton_unavailable_reason(device: torch.device) -> str:
    """Why the Triton kernels cannot run on tensors of ``device`` (for error messages; call when they cannot)."""
    if not triton_available():
        from powersgd_triton.compat.versions import triton_too_old

        return triton_too_old() or "triton is not installed"
    if device.type == "cpu":
        return "CPU tensors need TRITON_INTERPRET=1 set before triton is imported (Triton's interpreter, slow)"
    if device.type == "cuda":
        return "TRITON_INTERPRET=1 is set: Triton interprets its kernels on CPU tensors only"
    return f"Triton has no backend for {device.type} tensors"


def triton_can_run(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of ``device``."""
    if not triton_available():
        return False
    if device.type == "cuda":
        return not interpreter_enabled()
    if device.type == "cpu":
        return interpreter_enabled()
    return False


# ----------------------------------------------------------------------------------------------- optional helpers
def optional_import(name: str):
    """The module ``name`` if it imports, else None (also when it is blocked with ``sys.modules[name] = None``)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def user_cache_dir(app: str = "powersgd_triton") -> str:
    """The user cache folder for ``app``: ``platformdirs.user_cache_dir(app)`` when installed, else
    ``$XDG_CACHE_HOME/<app>`` or ``~/.cache/<app>`` (what platformdirs gives on Linux)."""
    pd = optional_import("platformdirs")
    if pd is not None:
        return pd.user_cache_dir(app, appauthor=False)
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    if not base or not os.path.isabs(base):  # the XDG spec ignores relative paths
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, app)


class _FlockLock:
    """``fcntl.flock`` on ``path`` (exclusive, polled until ``timeout`` seconds): the stand-in for
    ``filelock.FileLock`` on POSIX. Raises ``TimeoutError`` when the lock is not had in time, ``OSError`` when the
    lock file cannot be opened."""

    def __init__(self, path: str, timeout: float):
        self.path, self.timeout, self._fd = path, timeout, None

    def __enter__(self):
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + max(self.timeout, 0.0)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fd = fd
                return self
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise TimeoutError(f"could not lock {self.path} within {self.timeout} s") from None
                time.sleep(0.05)

    def __exit__(self, *exc):
        import fcntl

        fd, self._fd = self._fd, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        return False


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def file_lock(path: str, timeout: float):
    """An exclusive inter-process lock on the file ``path`` (a context manager): ``filelock.FileLock`` when
    installed, else ``fcntl.flock`` (POSIX), else no lock at all (see the module docstring)."""
    fl = optional_import("filelock")
    if fl is not None:
        return fl.FileLock(path, timeout=timeout)
    if optional_import("fcntl") is not None:
        return _FlockLock(path, timeout)
    return _NoLock()


class _NoBar:
    """What the code uses of a tqdm bar, doing nothing (tqdm not installed)."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def set_postfix_str(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass

    @staticmethod
    def write(text: str, file=None) -> None:
        print(text, file=file or sys.stdout, flush=True)


def progress_bar(auto: bool = False):
    """The tqdm class (``tqdm.auto.tqdm`` with ``auto``) when tqdm is installed, else a bar that shows nothing."""
    mod = optional_import("tqdm.auto" if auto else "tqdm")
    return mod.tqdm if mod is not None else _NoBar


def has_progress_bar() -> bool:
    """True when tqdm is installed."""
    return optional_import("tqdm") is not None
