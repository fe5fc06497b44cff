"""Which backend runs a bucket: the one resolver of ``backend="auto" | "triton" | "torch"``.

Used by :mod:`powersgd_triton.ops` (every numeric step, per tensor) and by
:class:`~powersgd_triton.PowerSGDState` (its constructor, and per bucket when the bucket's memory is built).

* ``"torch"`` runs everywhere (:mod:`powersgd_triton.ops.reference`);
* ``"triton"`` runs where Triton can run on the tensors' device (CUDA tensors; CPU tensors under
  ``TRITON_INTERPRET=1``) and our kernels import; elsewhere it is refused with ``RuntimeError`` saying why;
* ``"auto"`` is Triton where it can run, else torch.

The Triton kernels compute in float32: :func:`resolve_backend` gives float64 tensors to torch (``"auto"``) or refuses
them (``"triton"``); the state instead runs a float64 bucket on torch with a warning (:func:`device_backend` there).
"""

import functools
from typing import Optional

import torch

from powersgd_triton.compat import env as _env

BACKENDS = ("auto", "triton", "torch")


@functools.lru_cache(maxsize=None)
def _kernel_import_error() -> Optional[str]:
    """Why ``powersgd_triton.ops.triton_ops`` cannot be imported; None when it can (checked once per process)."""
    try:
        from powersgd_triton.ops import triton_ops  # noqa: F401
    except ImportError as exc:
        return str(exc) or type(exc).__name__
    return None


def check_backend(backend: str) -> None:
    """``ValueError`` unless ``backend`` is one of :data:`BACKENDS`."""
    if backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}")


def device_backend(backend: str, device: torch.device) -> str:
    """``"triton"`` or ``"torch"``: the backend that runs tensors of ``device`` (whatever their dtype).

    Raises:
        ValueError: unknown backend name.
        RuntimeError: ``"triton"`` where it cannot run on ``device`` (Triton missing or too old, the interpreter off
            for CPU tensors, on for CUDA tensors), or our Triton kernels cannot be imported.
    """
    if backend == "torch":  # runs everywhere
        return "torch"
    check_backend(backend)
    can_run = _env.triton_can_run(device)
    have_kernels = can_run and _kernel_import_error() is None
    if backend == "auto":
        return "triton" if have_kernels else "torch"
    if not can_run:
        raise RuntimeError(
            f"backend='triton' cannot run on {device} tensors here: " + _env.triton_unavailable_reason(device)
        )
    if not have_kernels:
        raise RuntimeError("backend='triton': powersgd_triton.ops.triton_ops cannot be imported")
    return "triton"


def resolve_backend(backend: str, tensor: torch.Tensor) -> str:
    """Map ``"auto"`` to ``"triton"`` or ``"torch"`` for ``tensor`` (its device and dtype); check that an explicit
    choice can run.

    Raises:
        ValueError: unknown backend name; ``"triton"`` for a float64 tensor (the kernels compute in float32).
        RuntimeError: ``"triton"`` asked for on a device where it cannot run (:func:`device_backend`).
    """
    if backend == "torch":  # runs everywhere
        return backend
    check_backend(backend)
    if tensor.dtype == torch.float64:  # the Triton kernels compute in float32; torch computes float64 in float64
        if backend == "triton":
            raise ValueError("backend='triton' computes in float32; float64 tensors need backend='torch' or 'auto'")
        return "torch"
    return device_backend(backend, tensor.device)


def triton_unusable_reason() -> Optional[str]:
    """Why ``backend="triton"`` cannot run on tensors of any device in this process, when that is known without a
    tensor; None when it may run on some device (then the first hook call checks the bucket's device).

    Known up front: Triton or our kernels cannot be imported; or Triton's interpreter is off (CPU tensors need it)
    and this torch build has no CUDA (no GPU tensors). Does not initialize CUDA (``torch.cuda.is_available()``
    would, which breaks a later ``fork``).
    """
    if not _env.triton_available():
        return _env.triton_unavailable_reason(torch.device("cpu"))  # not installed, or older than the tested floor
    error = _kernel_import_error()
    if error is not None:
        return f"powersgd_triton.ops.triton_ops cannot be imported ({error})"
    if _env.interpreter_enabled() or torch.backends.cuda.is_built():
        return None
    return (
        "this torch build has no CUDA, and CPU tensors need TRITON_INTERPRET=1 set before triton is imported "
        "(Triton's interpreter, slow)"
    )
