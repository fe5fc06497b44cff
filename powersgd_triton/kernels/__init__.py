"""Triton kernels (one module per kernel family) and their torch reference (:mod:`.reference`).

``triton_ops`` imports triton; import it lazily (``powersgd_triton.ops`` does) so that the package works without
triton on CPU.
"""
