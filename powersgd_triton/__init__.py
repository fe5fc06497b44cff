"""powersgd_triton: PowerSGD gradient compression for PyTorch DDP, with grouped Triton kernels.

A drop-in replacement for ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``: PowerSGD (Vogels,
Karimireddy, Jaggi, NeurIPS 2019, arXiv 1905.13727) compresses each gradient matrix M to two thin factors
P = M·Q and Q = Mᵀ·P, with Gram-Schmidt orthogonalization, error feedback and warm start.
"""

__version__ = "0.1.0"

from .layout import BucketLayout  # noqa: E402
from .state import PowerSGDState  # noqa: E402
from .hooks import batched_powerSGD_hook, powerSGD_hook  # noqa: E402
from .alternating import alternating_powerSGD_hook  # noqa: E402

__all__ = [
    "BucketLayout",
    "PowerSGDState",
    "powerSGD_hook",
    "batched_powerSGD_hook",
    "alternating_powerSGD_hook",
    "__version__",
]
