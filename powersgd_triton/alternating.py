"""Old import path of :func:`powersgd_triton.hooks.alternating.alternating_powerSGD_hook` (kept working)."""

from powersgd_triton.hooks.alternating import alternating_powerSGD_hook

__all__ = ["alternating_powerSGD_hook"]
