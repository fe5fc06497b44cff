"""Triton kernels (one module per kernel family) and their torch reference (:mod:`.reference`).

``triton_ops`` imports triton; import it lazily (``powersgd_triton.ops`` does) so that the package works without
triton on CPU.

Layout: the ``@triton.jit`` kernels are in :mod:`.lowrank_mm` (project, project_t, reduce_splits),
:mod:`.orthogonalize`, :mod:`.reconstruct` and :mod:`.segments` (helpers: :mod:`.common`); their launchers, configs
and plans in the ``*_launch`` / ``*configs`` modules, all re-exported by :mod:`.triton_ops` (its docstring lists
them); :mod:`.aot_compile` compiles them without a GPU and :mod:`.occupancy` counts blocks per SM. The torch
reference: :mod:`.reference` (end of a step; re-exports :mod:`.reference_products` and :mod:`.reference_ortho`).
Nothing here imports :mod:`powersgd_triton.autotune`.
"""
