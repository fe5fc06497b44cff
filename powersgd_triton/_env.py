"""Environment probes and every ``POWERSGD_TRITON_*`` variable in one place.

| variable | meaning |
| --- | --- |
| ``TRITON_INTERPRET=1`` | Triton's interpreter: kernels run on CPU tensors (set before ``import triton``) |
| ``POWERSGD_TRITON_CACHE_DIR`` | folder of the autotuner's per-GPU JSON cache (default: the user cache dir) |
| ``POWERSGD_TRITON_GPU_NAME`` | override the GPU model name used as the autotuner's cache key |
| ``POWERSGD_TRITON_CONFIG_DIR`` | extra folder of shipped-format ``<gpu>.json`` autotune defaults, searched before the package's |
"""

import functools
import os

import torch


def interpreter_enabled() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when ``import triton`` works."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


def triton_unavailable_reason(device: torch.device) -> str:
    """Why the Triton kernels cannot run on tensors of ``device`` (for error messages; call when they cannot)."""
    if not triton_available():
        return "triton is not installed"
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
