"""powersgd_triton: PowerSGD gradient compression for PyTorch DDP, with grouped Triton kernels.

A drop-in replacement for ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``: PowerSGD (Vogels,
Karimireddy, Jaggi, NeurIPS 2019, arXiv 1905.13727) compresses each gradient matrix M to two thin factors
P = M·Q and Q = Mᵀ·P, with Gram-Schmidt orthogonalization, error feedback and warm start.

The public names are imported on first use (PEP 562), so ``import powersgd_triton`` does not import torch: the
command line answers ``powersgd-triton --help`` without it. ``from powersgd_triton import PowerSGDState`` imports
torch and the package's modules as before.
"""

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "BucketLayout": ".layout",
    "PowerSGDState": ".state",
    "powerSGD_hook": ".hooks",
    "batched_powerSGD_hook": ".hooks",
    "alternating_powerSGD_hook": ".alternating",
}

__all__ = [
    "BucketLayout",
    "PowerSGDState",
    "powerSGD_hook",
    "batched_powerSGD_hook",
    "alternating_powerSGD_hook",
    "__version__",
]


def __getattr__(name: str):
    """A public name (imported from its module on first use) or a submodule (``powersgd_triton.ops``)."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module("." + name, __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
