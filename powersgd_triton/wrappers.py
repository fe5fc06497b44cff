"""Old import path of :mod:`powersgd_triton.hooks.wrappers` (kept working)."""

from powersgd_triton.hooks.wrappers import bf16_compress_wrapper, fp16_compress_wrapper

__all__ = ["bf16_compress_wrapper", "fp16_compress_wrapper"]
