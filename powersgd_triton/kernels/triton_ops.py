"""The Triton launchers of the bucket kernels, their config spaces, plans and ahead-of-time compilation: one
import for all of them.

This module is a facade: it re-exports the names of the modules below (every name it defined before they were
split out of it), so ``triton_ops.project(...)``, ``triton_ops.config_space(...)`` and friends keep working. Each
launcher issues exactly ONE kernel launch for the whole bucket (project_t a second for its fixed-order reduction of
split matrices), so a PowerSGD step costs a constant number of launches whatever the number of matrices L. Shapes
and dtypes are those of :mod:`powersgd_triton.ops`, which validates its inputs before calling here.

Layout of the launch side of :mod:`powersgd_triton.kernels` (each module imports only those above it):

* :mod:`.occupancy` - blocks per SM of a compiled kernel (``blocks_per_sm``; the autotuner re-exports it);
* :mod:`.launch_common` - SM count (``device_sms``), launch options, loop steps per trip, ``INTERPRETER_CONFIGS``;
* :mod:`.lowrank_configs`, :mod:`.ortho_configs` - tile tables, candidate configs and constexprs per kernel family;
* :mod:`.configs` - ``config_space`` and ``heuristic_config`` of every tuned kernel (the config keys are listed there);
* :mod:`.segments_launch` - ``copy_segments``, ``average``, ``commit_factor``;
* :mod:`.lowrank_launch` - ``project``, ``project_t`` (+ ``reduce_splits``), ``reconstruct``, their row / column
  splits and ``plan``;
* :mod:`.ortho_launch` - ``orthogonalize``, its cached task tables and workspace, ``orthogonalize_plan``;
* :mod:`.aot_compile` - ``KERNEL_FUNCTIONS``, ``compile_aot`` (a GPU target on a machine without GPU), ``variants``.

The constants are re-exported as values: to change one for a test, patch it in its own module
(``ortho_configs.ORTHO_GRAM_BLOCK``, ``launch_common.DEFAULT_NUM_SMS``), not here.
"""

from .. import _env  # noqa: F401 - re-exported (tests patch triton_ops._env.interpreter_enabled)
from ..layout import KERNELS, MIN_DOT_RANK, BucketLayout, padded_rank  # noqa: F401 - re-exported
from .launch_common import (  # noqa: F401
    DEFAULT_NUM_SMS, INTERPRETER_CONFIGS, PROGRAMS_PER_SM, STREAMING_KERNELS, _check_prefetch, _factor_rank,
    _flag_bytes, _launch_options, _pow2_split, _tile_key, device_sms, factor_columns, steps_per_trip,
)
from .lowrank_configs import (  # noqa: F401
    BROADCAST_ELEMENTS_PER_THREAD, PROJECT_TILES, PROJECT_T_BATCHED_TILE, PROJECT_T_FP32_DOT_CONFIG,
    PROJECT_T_PROGRAMS_PER_SM, PROJECT_T_SPLIT_CONFIG, PROJECT_T_SPLIT_MIN_RANK, PROJECT_T_TILES,
    RECONSTRUCT_TILES, REDUCE_MAX_SPLITS, REDUCE_STEP_ELEMENTS, REDUCE_TILE_ELEMENTS, SPLIT_DOTS, SPLIT_OPS_M,
    SPLIT_OPS_P, TILE_ELEMENTS_PER_THREAD, _BROADCAST_TILES, _DEPTHS, _DOT_TILES, _PROJECT_T_MAXNREG,
    _PROJECT_T_TILES, _SPLIT_DOT_TILES, _broadcast_config, _project_t_broadcast_configs, padding_error_config,
    split_bf16_dot,
)
from .ortho_configs import (  # noqa: F401
    ORTHO_APPLY_ROWS, ORTHO_BLOCKS, ORTHO_GRAM_BLOCK, ORTHO_MAX_TILE_PER_THREAD, ORTHO_SHORT_BYTES,
    ORTHO_SPLIT_ROWS, ORTHO_WARPS, ORTHO_WIDE_SHORT_ROWS, ORTHO_WIDE_TILES, _check_ortho_config, _ortho_configs,
    _ortho_constexprs, _ortho_heuristic, _ortho_slot_block,
)
from .configs import (  # noqa: F401
    _resolve, config_space, heuristic_config,
)
from .lowrank_launch import (  # noqa: F401
    _plan_split_rows, plan, project, project_t, project_t_programs_per_sm, reconstruct, reduce_block_m,
    reduce_split_block, split_cols, split_rows,
)
from .ortho_launch import (  # noqa: F401
    _ORTHO_PLANS, _OrthoPlan, _in_place_config, _ortho_inputs, _ortho_plan, _ortho_workspace, _overlap,
    orthogonalize, orthogonalize_kept_tensors, orthogonalize_plan,
)
from .segments_launch import (  # noqa: F401
    AVERAGE_BLOCK, SEGMENT_BLOCK, average, commit_factor, copy_segments,
)
from .aot_compile import (  # noqa: F401
    KERNEL_FUNCTIONS, _TRITON_DTYPES, _constexprs, _signature, compile_aot, variants,
)
