"""Kernel name -> its ``@triton.jit`` function: the names a launch plan's ``"kernel"`` holds
(:func:`powersgd_triton.ops.plans.plan`, :func:`powersgd_triton.ops.orthogonalization.orthogonalize_plan`), which
``tools/aot_compile.py`` compiles ahead of time and the autotuner and benchmarks look up.

Importing this module imports every kernel module of :mod:`powersgd_triton.ops` (it needs triton).
"""

from powersgd_triton.ops.orthogonalization import _ortho_gram_kernel, _orthogonalize_kernel
from powersgd_triton.ops.projection import _project_kernel
from powersgd_triton.ops.projection_t import _project_t_kernel, _reduce_splits_kernel
from powersgd_triton.ops.reconstruction import _reconstruct_kernel
from powersgd_triton.ops.segments import _average_kernel, _commit_factor_kernel, _copy_segments_kernel

KERNEL_FUNCTIONS = {
    "project": _project_kernel,
    "orthogonalize": _orthogonalize_kernel,
    "orthogonalize_gram": _ortho_gram_kernel,  # first launch of orthogonalize when a factor is split over rows
    "project_t": _project_t_kernel,
    "reconstruct": _reconstruct_kernel,
    "reduce_splits": _reduce_splits_kernel,  # second stage of project_t for split (tall) matrices
    "copy_segments": _copy_segments_kernel,  # pack / unpack of the uncompressed gradients
    "average": _average_kernel,  # after the last all-reduce: divide by the world size, unpack, step flags
    "commit_factor": _commit_factor_kernel,  # warm-start factor update where finite and non-zero (standalone)
}
