"""The Triton launchers of the bucket kernels, their config spaces, plans and ahead-of-time compilation: one
import for all of them.

This module is a facade: it re-exports the names of the modules below (every name it defined before they were
split out of it), so ``triton_ops.project(...)``, ``triton_ops.config_space(...)`` and friends keep working. Each
launcher issues exactly ONE kernel launch for the whole bucket (project_t a second for its fixed-order reduction of
split matrices), so a PowerSGD step costs a constant number of launches whatever the number of matrices L. Shapes
and dtypes are those of :mod:`powersgd_triton.ops`, which validates its inputs before calling here.

Layout of the launch side of :mod:`powersgd_triton.ops` (each module imports only those above it):

* :mod:`.occupancy` - blocks per SM of a compiled kernel (``blocks_per_sm``; the autotuner re-exports it);
* :mod:`.launch_common` - SM count (``device_sms``), launch options, loop steps per trip, ``INTERPRETER_CONFIGS``;
* :mod:`.lowrank_configs`, :mod:`.ortho_configs` - tile tables, candidate configs and constexprs per kernel family;
* :mod:`.configs` - ``config_space`` and ``heuristic_config`` of every tuned kernel (the config keys are listed there);
* :mod:`.segments_launch` - ``copy_segments``, ``average``, ``commit_factor``;
* :mod:`.lowrank_launch` - ``project``, ``project_t`` (+ ``reduce_splits``), ``reconstruct``, their row / column
  splits and ``plan``;
* :mod:`.ortho_launch` - ``orthogonalize``, its cached task tables and workspace, ``orthogonalize_plan``;
* ``KERNEL_FUNCTIONS``: kernel name -> ``@triton.jit`` function (compiled ahead of time by ``tools/aot_compile.py``).

The constants are re-exported as values: to change one for a test, patch it in its own module
(``ortho_configs.ORTHO_GRAM_BLOCK``, ``launch_common.DEFAULT_NUM_SMS``), not here.
"""

from powersgd_triton.compat import env as _env  # noqa: F401 - re-exported (tests patch triton_ops._env.interpreter_enabled)
from powersgd_triton.layout import KERNELS, MIN_DOT_RANK, BucketLayout, padded_rank  # noqa: F401 - re-exported
from powersgd_triton.ops.launch_common import (
    DEFAULT_NUM_SMS, INTERPRETER_CONFIGS, PROGRAMS_PER_SM, STREAMING_KERNELS, _check_prefetch, _factor_rank, _flag_bytes, _launch_options, _pow2_split, _tile_key, device_sms, factor_columns, steps_per_trip,
)
from powersgd_triton.ops.lowrank_configs import (
    BROADCAST_ELEMENTS_PER_THREAD, PROJECT_TILES, PROJECT_T_BATCHED_TILE, PROJECT_T_FP32_DOT_CONFIG, PROJECT_T_PROGRAMS_PER_SM, PROJECT_T_SPLIT_CONFIG, PROJECT_T_SPLIT_MIN_RANK, PROJECT_T_TILES, RECONSTRUCT_TILES, REDUCE_MAX_SPLITS, REDUCE_STEP_ELEMENTS, REDUCE_TILE_ELEMENTS, SPLIT_DOTS, SPLIT_OPS_M, SPLIT_OPS_P, TILE_ELEMENTS_PER_THREAD, _BROADCAST_TILES, _DEPTHS, _DOT_TILES, _PROJECT_T_MAXNREG, _PROJECT_T_TILES, _SPLIT_DOT_TILES, _broadcast_config, _project_t_broadcast_configs, padding_error_config, split_bf16_dot,
)
from powersgd_triton.ops.ortho_configs import (
    ORTHO_APPLY_ROWS, ORTHO_BLOCKS, ORTHO_GRAM_BLOCK, ORTHO_MAX_TILE_PER_THREAD, ORTHO_SHORT_BYTES, ORTHO_SPLIT_ROWS, ORTHO_WARPS, ORTHO_WIDE_SHORT_ROWS, ORTHO_WIDE_TILES, _check_ortho_config, _ortho_configs, _ortho_constexprs, _ortho_heuristic, _ortho_slot_block,
)
from powersgd_triton.ops.configs import _resolve, config_space, heuristic_config
from powersgd_triton.ops.lowrank_launch import (
    _plan_split_rows, plan, project, project_t, project_t_programs_per_sm, reconstruct, reduce_block_m, reduce_split_block, split_cols, split_rows,
)
from powersgd_triton.ops.ortho_launch import (
    _ORTHO_PLANS, _OrthoPlan, _in_place_config, _ortho_inputs, _ortho_plan, _ortho_workspace, _overlap, orthogonalize, orthogonalize_kept_tensors, orthogonalize_plan,
)
from powersgd_triton.ops.segments_launch import AVERAGE_BLOCK, SEGMENT_BLOCK, average, commit_factor, copy_segments
from powersgd_triton.ops.lowrank_mm import _project_kernel, _project_t_kernel, _reduce_splits_kernel
from powersgd_triton.ops.orthogonalization import _commit_factor_kernel, _ortho_gram_kernel, _orthogonalize_kernel
from powersgd_triton.ops.reconstruction import _reconstruct_kernel
from powersgd_triton.ops.segments import _average_kernel, _copy_segments_kernel

# kernel name -> its @triton.jit function (what a launch plan's "kernel" names; compiled ahead of time by tools/)
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
