"""powersgd_triton: PowerSGD gradient compression for PyTorch DDP, with grouped Triton kernels.

A drop-in replacement for ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``: PowerSGD (Vogels,
Karimireddy, Jaggi, NeurIPS 2019, arXiv 1905.13727) compresses each gradient matrix M to two thin factors
P = M·Q and Q = Mᵀ·P, with Gram-Schmidt orthogonalization, error feedback and warm start.

The public names are imported on first use (PEP 562), so ``import powersgd_triton`` does not import torch: the
command line answers ``powersgd-triton --help`` without it. ``from powersgd_triton import PowerSGDState`` imports
torch and the package's modules as before.
"""

from powersgd_triton.lazy import module_getattr

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


__getattr__ = module_getattr(__name__, _EXPORTS)


def __dir__():
    # the public names and what the package holds, not the machinery of its lazy attributes
    return sorted((set(globals()) | set(_EXPORTS)) - {"module_getattr", "lazy", "_EXPORTS"})
