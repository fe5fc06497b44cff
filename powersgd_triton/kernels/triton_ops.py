"""Launchers for the Triton bucket kernels, their config spaces, heuristics and ahead-of-time compilation.

Each launcher issues exactly ONE kernel launch for the whole bucket (no torch ops besides cached table lookups), so a
PowerSGD step costs a constant number of launches whatever the number of matrices L. Shapes and dtypes are those of
:mod:`powersgd_triton.ops`, which validates its inputs before calling here.

A config is a dict of the kernel's block sizes plus ``num_warps``/``num_stages`` (and optionally ``maxnreg``, the
registers per thread ptxas may use: a compile option, passed at launch and to :func:`compile_aot`):

=================  ===================================================
kernel             keys
=================  ===================================================
``project``        ``BLOCK_N`` rows per tile, ``BLOCK_K`` columns per step, ``PREFETCH`` further steps
                   in flight (``CARRY``: as a loop-carried copy), ``USE_DOT``
``project_t``      ``BLOCK_M`` columns per tile, ``BLOCK_K`` rows per step, ``PREFETCH`` further steps
                   in flight (broadcast path), ``SPLIT_ROWS`` rows per program at most (0: no split),
                   ``USE_DOT``, ``SPLIT_BF16`` (with ``USE_DOT`` on 2-byte gradients: bfloat16 tensor-core
                   dots on exactly split operands instead of the float32 FMA dot), ``PROGRAMS_PER_SM``
                   the row splits aim at (default: from ``maxnreg``, else ``PROJECT_T_PROGRAMS_PER_SM``)
``orthogonalize``  ``BLOCK`` rows per tile, ``SHORT_ROWS`` most rows of a factor whose Gram one program
                   computes (taller ones are split: two launches), ``APPLY_ROWS`` (optional, default
                   ``SHORT_ROWS``) rows such a program writes, ``GRAM_ROWS`` rows per float64 Gram slot of a
                   split factor (with ``min(BLOCK, ORTHO_GRAM_BLOCK)`` it fixes the summation order),
                   ``SPLIT_ROWS`` rows per program of the apply pass of a split factor
``reconstruct``    ``BLOCK_N`` rows per tile, ``BLOCK_K`` columns per step, ``PREFETCH`` further steps
                   in flight (``CARRY``: as a loop-carried copy), ``USE_DOT``
=================  ===================================================

:func:`config_space` lists the candidates the autotuner times, :func:`heuristic_config` the untuned default, and
:data:`INTERPRETER_CONFIGS` the one config used under ``TRITON_INTERPRET=1`` (large blocks: the interpreter's cost
grows with programs × loop steps). :func:`compile_aot` compiles a kernel for a GPU target on a machine without GPU.
"""

import itertools
import weakref
from typing import Dict, Iterable, List, Optional

import torch
import triton

from .. import _env
from ..layout import KERNELS, MIN_DOT_RANK, BucketLayout, padded_rank  # noqa: F401 - re-exported
from ..layout import COLS, P_OFF, Q_OFF, ROWS, table_row
from ..layout import GRAM_HEAD, GRAM_MAT, GRAM_N, GRAM_OFF, GRAM_R, GRAM_RM, GRAM_ROW0, GRAM_SLOT, ORTHO_GRAM_TASK_WIDTH
from ..layout import ORTHO_HEAD, ORTHO_MAT, ORTHO_N, ORTHO_OFF, ORTHO_R, ORTHO_RM, ORTHO_ROW0, ORTHO_ROW_END
from ..layout import ORTHO_SLOT0, ORTHO_SLOTS
from ..layout import ORTHO_TASK_WIDTH
from .lowrank_mm import _project_kernel, _project_t_kernel, _reduce_splits_kernel
from .orthogonalize import _commit_factor_kernel, _ortho_gram_kernel, _orthogonalize_kernel
from .reconstruct import _reconstruct_kernel
from .segments import _average_kernel, _copy_segments_kernel

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
# The kernels that stream the bucket (the ones the performance targets are about).
STREAMING_KERNELS = ("project", "project_t", "reconstruct")
SEGMENT_BLOCK = 1024
AVERAGE_BLOCK = 1024
# Register budget of the broadcast-multiply path, per thread: elements of the [rows, k, R] accumulator (project,
# project_t) or product (reconstruct), and elements of one loaded tile. 16 and 8 keep the heuristic configs at
# <= 128 registers without spills for R <= 8 on sm_90 (ptxas -v, triton 3.9: tests/test_compile_table.py); 32
# accumulator elements per thread measured 128-150 registers.
BROADCAST_ELEMENTS_PER_THREAD = 16
TILE_ELEMENTS_PER_THREAD = 8
# The tile plans aim at this many programs per SM (>= 2: while one program waits for memory another issues loads).
PROGRAMS_PER_SM = 2
# project's broadcast path (R <= 8): (BLOCK_N, BLOCK_K, PREFETCH, maxnreg) by (padded rank, gradient element size), 4
# warps, like RECONSTRUCT_TILES below (PREFETCH p: p + 1 register sets, the loop unrolled p + 1 times, no loop-carried
# copy; -1: the loop-carried CARRY form; 0 maxnreg: no cap). Its programs walk whole rows (one program per BLOCK_N
# rows), so the grid is fixed by the row count; the [R, BLOCK_N, BLOCK_K] accumulator puts a thread's loaded elements
# (spread over the columns) and all R columns of Q in its registers (at 128 columns, and 4 x 64 at R 1, no shared memory
# in the loop; the 64-column tiles at R >= 2 convert M's tile through shared memory once per step; the replay still
# waits one latency per trip). Picked from a sweep of tiles (1-16 rows x 32-256 columns) x PREFETCH 1-2 x maxnreg
# (72-128, none) on the sm_90 compile (triton 3.9: ptxas -v and the SASS replay of aot.main_loop) of the error-feedback
# variant, by the performance model on ResNet-50 / GPT-2 / BERT at the padded rank, then checked on all 7 variants x
# fp32 (4-byte) or bf16 + fp16 (2-byte): no spills, <= 128 registers (47-128), one DRAM latency per trip in fp32 and
# bf16 but for the batched view's padding-error variants (1.5 at R 4, R 8 fp32, R 2 bf16); fp16's error-feedback
# variants 1.5-2 at R 1-4. Tighter caps or wider tiles spill in the padding-error variants or interleave loads with
# waits. Modelled worst bucket (fp32 / bf16): R 1 86 / 91 %, R 2 86 / 91 %, R 4 79 / 85 %, R 8 58 / 51 % (the
# loop-carried 2-8 x 128 tiles before: 56-86 / 65-86, 56-86 / 62-85, 50-68 / 50-54, 33-42 / 27-29 %).
# R 8 (a second sweep: 1-32 rows x 32-512 columns, PREFETCH 1-2, maxnreg 96-128): R x BLOCK_K / 32 of Q's
# elements per step in every thread leave few registers for M's; 2-byte 8 x 32 PREFETCH 2 at 96 registers (5
# blocks per SM; 86-96 registers, no spills in all 7 variants x bf16 / fp16; one latency per trip but bf16's
# padding-error variants, 2) models 51 / 68 / 68 % on ResNet-50 / GPT-2 / BERT (4 x 64 PREFETCH 1 before: 50 / 51
# / 54). 8 x 64 PREFETCH 1 at 128 registers would model 63 / 86 / 82 % but spills 24 bytes in fp16's padding error
# with LOSS_SCALE; fp32 found nothing above 4 x 64 PREFETCH 2 (58 / 87 / 86 %: ResNet-50's short rows).
PROJECT_TILES = {
    (1, 4): (4, 128, 2, 96), (1, 2): (4, 64, 2, 0),
    (2, 4): (4, 128, 2, 112), (2, 2): (8, 64, 2, 112),
    (4, 4): (8, 64, 2, 128), (4, 2): (8, 64, 2, 128),
    (8, 4): (4, 64, 2, 112), (8, 2): (8, 32, 2, 96),
}
# project_t's row splits aim at one round of resident programs: blocks per SM at the config's maxnreg
# (project_t_programs_per_sm), else this many (the tl.dot heuristic: 80 registers, 6 blocks of 4 warps per SM on
# sm_90). Each split adds m x r float32 of workspace (written, then read by reduce_splits).
PROJECT_T_PROGRAMS_PER_SM = 6
# project_t's broadcast path (R <= 8), 4 warps, per (padded rank, gradient element size): (BLOCK_M, BLOCK_K,
# PREFETCH, maxnreg). Each thread holds BLOCK_M / 128 columns and every row of a step, so a step's rows are summed
# inside the thread; the loop is unrolled 1 + PREFETCH times. Chosen on the sm_90 compile (triton 3.9: ptxas -v and
# the SASS replay of powersgd_triton.autotune.aot.sass_loops) for the plain and the second-Q-output variants: no
# spills, <= 128 registers, and one DRAM latency per loop trip, i.e. 1 + PREFETCH steps of loads in flight. ptxas
# is erratic near a register cap: the same tile one notch tighter (or in the other variant) interleaves its loads
# with the waits (2-10 latencies per trip) or spills, so each entry was picked from a sweep of tiles x maxnreg
# (72-128) that checks both variants. Loaded bytes in flight per SM (blocks x steps x tile):
# R 1: 112 KiB fp32, 56 bf16; R 2: 84 / 42; R 4: 60 / 32; R 8: 32 / 16.
# R 8: P's [R, BLOCK_K] tile is loaded whole by every thread (R x BLOCK_K registers per step, as many as 4-8x the
# thread's M elements), so a sweep of 128-1024 columns x 1-8 rows x PREFETCH 0-2 x maxnreg 80-128 (split, split +
# HAS_Q2 and plain variants, fp32 / bf16 / fp16) found one step of 8 rows x 256 columns (PREFETCH 0, 128 registers,
# 4 blocks per SM, no spills, one latency per trip in every variant) ahead of the 2-row tiles with 2-3 steps in
# flight, which spill in the split + HAS_Q2 variant at the same held data (512 x 2 PREFETCH 1: 40 bytes, 512 x 4
# PREFETCH 0: 64-72). Model (ResNet-50 / GPT-2 / BERT): fp32 67 / 79 / 79 % (256 x 2 PREFETCH 1 at 96 registers
# before: 52 / 63 / 63); bf16 47 / 52 / 50 % (31 / 38 / 36), so 2-byte gradients at R 8 take the split tensor-core
# path instead (PROJECT_T_SPLIT_MIN_RANK); the 2-byte entry stays the broadcast candidate of config_space.
PROJECT_T_TILES = {
    (1, 4): (512, 4, 1, 72), (1, 2): (256, 8, 1, 72),
    (2, 4): (512, 2, 2, 72), (2, 2): (512, 2, 2, 72),
    (4, 4): (512, 2, 2, 96), (4, 2): (512, 4, 1, 128),
    (8, 4): (256, 8, 0, 128), (8, 2): (256, 8, 0, 128),
}
# reconstruct's broadcast path (R <= 8): (BLOCK_N, BLOCK_K, PREFETCH, maxnreg) by (padded rank, gradient element
# size), 4 warps; PREFETCH p unrolls the loop p + 1 times, one register set per step (no loop-carried copy); -1:
# PREFETCH 1 as the loop-carried copy (CARRY, one step per trip), 0 maxnreg: no cap. Seen on the sm_90 compile
# (triton 3.9: ptxas -v and the SASS replay of powersgd_triton.autotune.aot.sass_loops) for all 12 variants x
# fp32/bf16/fp16: no spills, <= 128 registers (but for R 1 2-byte's loop-carried tile: 136-168 in the two LOCAL_ERR
# 1 variants, as before the unrolled loop). The replay is 1.0-1.375 latencies per trip at PREFETCH 2, not always
# 1: the compiled loop converts the next step's Q tile (shared memory, barriers) before the loads after it go out.
# Picked from a sweep of tiles x PREFETCH x maxnreg (72-128), checked on the heaviest variants, by the performance
# model: R 4 goes from 1 to 2.2-2.4 steps in flight at 4 blocks per SM (53 % -> 86 % fp32,
# 34-46 % -> 85-93 % bf16 on ResNet-50 / GPT-2 / BERT). R 1 in 2-byte gradients keeps the loop-carried form (80
# registers, 6 blocks per SM): every unrolled tile there spills in a variant or drops to 4-5 blocks per SM, which
# the model puts below it.
RECONSTRUCT_TILES = {
    (1, 4): (16, 32, 2, 128), (1, 2): (16, 64, -1, 0),
    (2, 4): (16, 32, 2, 128), (2, 2): (16, 32, 2, 128),
    (4, 4): (8, 64, 2, 128), (4, 2): (8, 64, 2, 128),
    (8, 4): (16, 32, 2, 128), (8, 2): (16, 32, 2, 128),
}
# project_t on the batched view (one padded s x s matrix: the PADDED and PAD_ERROR variants, whose masks and
# padding-error loads take more registers): one tile for every R <= 8, no unrolling (one step in flight), chosen
# like PROJECT_T_TILES for both variants (no spills, one latency per step at R 1-8, fp32 and bf16).
PROJECT_T_BATCHED_TILE = (512, 4, 0, 128)
# reduce_splits (project_t's second launch for split matrices): each program sums REDUCE_TILE_ELEMENTS float32 of
# the partial sums (BLOCK_M columns x R, at most project_t's BLOCK_M columns) over the splits, loading up to
# REDUCE_MAX_SPLITS splits per step, all in flight at once (32 float32 per thread of 4 warps): a tall matrix split
# into hundreds of row ranges (GPT-2's 50257-row embedding) is summed in a few steps by many programs.
REDUCE_TILE_ELEMENTS = 64
REDUCE_MAX_SPLITS = 64
REDUCE_STEP_ELEMENTS = 32 * 32 * 4
# project_t's split tensor-core path (SPLIT_BF16, common._dot_bf16_split): its heuristic config at R >= 16 on
# 2-byte gradients. 64 columns per program (a wgmma per warpgroup on sm_90, where 32 columns get mma.sync), 64 rows
# per step, 3 stages, row splits for 3 programs per SM: 64 x 64 tiles with 3 steps in flight fill the bandwidth with
# fewer, longer programs, and fewer splits leave reduce_splits fewer partial sums (at the default 6 per SM, GPT-2's
# 768-row matrices are split in 3 and its reduce takes 74 µs per step instead of 31). sm_90, triton 3.9 (ptxas
# -v): bf16 94 / 72 registers at R 16 / 32, fp16 69 / 95, no spills. perfmodel (H200, ResNet-50 / GPT-2 / BERT,
# project_t + reduce_splits per step): bf16 R 16 75-78 % of copy bandwidth, 28 / 106 / 99 µs (float32 FMA dot:
# 45-46 %, 44 / 164 / 149 µs); R 32 78-79 %, 42 / 110 / 103 µs (26-27 %, 75 / 282 / 254 µs); fp16 R 16 70-72 %,
# R 32 55-56 %. The batched view keeps the 32-column float32 dot: its padding error (PAD_ERROR) takes the float32
# dot under any config, 122-128 registers at 32 x 32, 255 and spills at 64 x 64 (padding_error_config).
PROJECT_T_SPLIT_CONFIG = dict(BLOCK_M=64, BLOCK_K=64, USE_DOT=True, SPLIT_BF16=True, PROGRAMS_PER_SM=3, num_warps=4,
                              num_stages=3)
# The padded rank from which 2-byte gradients (not the batched view) take PROJECT_T_SPLIT_CONFIG: 8 (R 16 with tl.dot,
# the same compile as rank 16). perfmodel (H200, bf16, project_t + reduce_splits per step) at rank 8: 74 / 77 / 77 %
# of copy bandwidth on ResNet-50 / GPT-2 / BERT, 229 µs for the three (the best broadcast tile, PROJECT_T_TILES[(8,
# 2)]: 47-52 %, 380 µs); float32 gradients keep the broadcast path (the float32 FMA dot: about 45 %).
PROJECT_T_SPLIT_MIN_RANK = 8
# project_t's float32 FMA dot at R >= 16 (float32 gradients, the batched view): its heuristic config
PROJECT_T_FP32_DOT_CONFIG = dict(BLOCK_M=32, BLOCK_K=32, USE_DOT=True, num_warps=4, num_stages=3)
# The split path as the plan counts it: tensor-core dots per gradient dtype (bfloat16 M: 3, P in three bfloat16
# pieces; float16 M in two pieces: 5), and the instructions of the FMA pipe that split the operands: per float32
# element of P, per column tile that reads it (two masks, two subtractions, three conversions to bfloat16), and per
# float16 element of M (a conversion to float32, a mask, a subtraction, two conversions; bfloat16 M goes to the
# tensor cores as loaded).
SPLIT_DOTS = {torch.bfloat16: 3, torch.float16: 5}
SPLIT_OPS_P = 7
SPLIT_OPS_M = {torch.float16: 5}
# SM count used for plans when the device has none to ask (CPU, interpreter): 1 keeps interpreted grids small. The
# GPU's own count is read from CUDA (132 on H100/H200).
DEFAULT_NUM_SMS = 1

# Orthogonalize: a factor of at most SHORT_ROWS rows is done by one program (one launch for the bucket); the heuristic
# allows ORTHO_SHORT_BYTES of float32 factor per program (two passes over it by one SM, the second from L2: a few
# microseconds, about an extra launch), and splits taller factors (GPT-2's and BERT's embeddings) over rows.
ORTHO_SHORT_BYTES = 128 * 1024
# Rows per program of the apply pass of a split factor: >= 2 programs per SM of an H100/H200 (132 SMs) for BERT's
# 30522-row and GPT-2's 50257-row embeddings (318 and 524 programs).
ORTHO_SPLIT_ROWS = 96
# From rank 8 on, a factor taller than this many BLOCK tiles is split over rows (with Gram slots of as many tiles):
# at R 8-32 one program walking a factor's rows costs more than the extra Gram launch and the slot sums (model of
# an H200, perfmodel: ResNet-50 / GPT-2 / BERT fp32 steps, orthogonalization's share at R 8 23 % -> 16 %, R 16
# 42 % -> 24 %, R 32 52 % -> 22-27 %); at R <= 4 it changes nothing (the launches' fixed costs dominate).
ORTHO_WIDE_TILES = {8: 2, 16: 2, 32: 4}
# ... except a factor of at most ORTHO_WIDE_SHORT_ROWS rows, whose Gram every program of its apply pass computes
# itself (one launch, no Gram slots), one program per ORTHO_APPLY_ROWS rows (``APPLY_ROWS``): ResNet-50's P factors
# (<= 2048 rows) and GPT-2's and BERT's other than the embeddings then need no Gram launch. Model of an H200
# (perfmodel, fp32, ResNet-50 / GPT-2 / BERT): orthogonalization's share of the step at R 8 10.9-12.4 % -> 7.9-8.5 %,
# at R 16 9.6-12.1 % -> 8.6-9.1 % (1024 rows per program at R 16: the Gram of 4096 rows in one program, then a
# quarter of them written).
ORTHO_WIDE_SHORT_ROWS = {8: 4096, 16: 4096}
ORTHO_APPLY_ROWS = {8: 2048, 16: 1024}
# Rows per tile (BLOCK) and warps of the heuristic by padded rank (others: 1024 / R rows, 8 warps). Few programs run
# (one per short factor), so each takes a whole SM's worth of threads and as many rows per tile as 128 registers
# allow: a 4608-row Q (ResNet-50's 3x3 convolutions) is 5 tiles per pass at R 4 instead of 18. Seen on the sm_90
# compile (triton 3.9, ptxas -v) of both launches: no spills, 64-128 registers; ptxas is erratic here (R 2 at 2048
# rows spills 40 bytes, R 4 at 512 rows and 4 warps too), so each entry was checked. Model (perfmodel, H200):
# orthogonalization's share of the step at R 1-4 goes from 14-22 % to 9-13 %, at R 16 from 19-24 % to 14-19 %.
ORTHO_BLOCKS = {1: 2048, 2: 1024, 4: 1024, 8: 512, 16: 256}
ORTHO_WARPS = {1: 16, 2: 16, 4: 16, 8: 16, 16: 16}
# Rows per tile of the Gram launch of split factors (orthogonalize_gram): at most this many, whatever BLOCK (its
# [BLOCK, R]ᵀ·[BLOCK, R] float64 dot at 1024-2048 rows spills 0.1-2.8 KiB at R <= 4; it has many programs anyway).
ORTHO_GRAM_BLOCK = 256
# Largest [BLOCK, R] tile of an orthogonalize candidate, in float64 elements per thread (held in registers): 8, as
# in every heuristic (twice that spills 0.2-15 KiB on the sm_90 compile at R 4 and R 16).
ORTHO_MAX_TILE_PER_THREAD = 8

INTERPRETER_CONFIGS: Dict[str, dict] = {
    "project": dict(BLOCK_N=64, BLOCK_K=64, USE_DOT=False, num_warps=4, num_stages=1),
    "project_t": dict(BLOCK_M=64, BLOCK_K=64, USE_DOT=False, num_warps=4, num_stages=1),
    "orthogonalize": dict(BLOCK=256, SHORT_ROWS=4096, GRAM_ROWS=256, SPLIT_ROWS=256, num_warps=4, num_stages=1),
    "reconstruct": dict(BLOCK_N=64, BLOCK_K=64, USE_DOT=False, num_warps=4, num_stages=1),
}


def _tile_key(kernel: str) -> str:
    return "BLOCK_M" if kernel == "project_t" else "BLOCK_N"


# Candidate (tile, BLOCK_K) pairs of the broadcast path, filtered per rank by the register budget.
_BROADCAST_TILES = {
    "project": [(2, 128), (4, 64), (4, 128), (8, 16), (8, 32), (8, 64), (8, 128), (16, 16), (16, 32), (16, 64),
                (32, 32)],
    "reconstruct": [(4, 64), (4, 128), (8, 16), (8, 32), (8, 64), (16, 16), (16, 32), (16, 64), (32, 32)],
}
# project_t's broadcast candidates (BLOCK_M, BLOCK_K) x PREFETCH x maxnreg (4 warps), kept while the data one
# thread holds, (1 + PREFETCH) x BLOCK_K x (BLOCK_M / 128 + R) loaded and R x BLOCK_M / 128 accumulated elements,
# is at most 5/8 of maxnreg (the rest: addresses, masks, products); plus the heuristic tiles of the rank.
_PROJECT_T_TILES = [(256, 2), (256, 4), (512, 2), (512, 4), (1024, 2)]
_PROJECT_T_MAXNREG = (96, 128)
_DOT_TILES = [(16, 32), (16, 64), (32, 32), (64, 32)]
# project_t's split tensor-core candidates (BLOCK_M, BLOCK_K), 2-byte gradients (see PROJECT_T_SPLIT_CONFIG)
_SPLIT_DOT_TILES = [(32, 32), (64, 32), (64, 64), (128, 32)]
# (num_stages, PREFETCH) of the broadcast candidates: Triton's pipeliner leaves these loops alone (it pipelines the
# loads that feed tl.dot), so the loads of later steps are put in flight by the kernels' own register prefetch.
_DEPTHS = [(1, 0), (2, 0), (3, 0), (1, 1), (1, 2)]


def device_sms(device) -> int:
    """SM count of ``device`` (CUDA), else :data:`DEFAULT_NUM_SMS`."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return DEFAULT_NUM_SMS


def config_space(kernel: str, max_rank: int, dtype: torch.dtype) -> List[dict]:
    """Candidate configs the autotuner times for ``kernel`` at this rank and gradient dtype.

    Broadcast-multiply tiles are kept while ``tile * BLOCK_K * R <= 16 * 32 * num_warps`` (16 accumulator elements
    per thread) and ``tile * BLOCK_K <= 8 * 32 * num_warps``; ``tl.dot`` tiles are offered from
    rank 8 on (below that, padding r to 16 only multiplies the FMAs).
    Every broadcast tile comes with ``num_stages`` 1, 2 and 3, and with ``PREFETCH`` 1 and 2 (the kernel loads the
    tiles of the next one or two loop steps before this step's arithmetic: 2 or 3 steps of loads in flight); every
    ``tl.dot`` tile with ``num_stages`` 1, 2 and 3 (Triton's software pipelining of the loads feeding the dot);
    project_t on 2-byte gradients also the split tensor-core tiles (``SPLIT_BF16``, ``_SPLIT_DOT_TILES``) with
    ``num_stages`` 3, their row splits aiming at 3 or 6 programs per SM (``PROGRAMS_PER_SM``).
    project_t's broadcast path (R <= 8) instead: its heuristic tiles for 4- and 2-byte gradients
    (:data:`PROJECT_T_TILES`) and for the batched view (:data:`PROJECT_T_BATCHED_TILE`), and the tiles of
    ``_PROJECT_T_TILES`` with ``PREFETCH`` 0-2 and ``maxnreg`` 96 or 128 whose held data fits (see there).
    project's and reconstruct's broadcast paths (R <= 8) also have their heuristic tiles (:data:`PROJECT_TILES`,
    :data:`RECONSTRUCT_TILES`, for 4- and 2-byte gradients).
    Orthogonalize: the heuristics of every rank, at their own warps and at 8 (4 where they have 8), whose float64
    tile fits (:func:`_ortho_configs`).
    The row or column splits are not part of a config: they are planned per bucket from the GPU's SM count.
    Raises ``ValueError`` for an unknown kernel name.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    if kernel == "orthogonalize":
        return _ortho_configs(padded_rank(max_rank))
    tile = _tile_key(kernel)
    out = []
    r = padded_rank(max_rank)
    if kernel == "project_t":
        out = _project_t_broadcast_configs(r)
    if kernel in ("project", "reconstruct") and r <= 8:  # their heuristic tiles for 4- and 2-byte gradients
        table = PROJECT_TILES if kernel == "project" else RECONSTRUCT_TILES
        for es in (4, 2):
            cfg = _broadcast_config(kernel, *table[(r, es)])
            if cfg not in out:
                out.append(cfg)
    for (bt, bk), warps, (stages, prefetch) in itertools.product(_BROADCAST_TILES.get(kernel, ()), (4, 8), _DEPTHS):
        if bt * bk * r > BROADCAST_ELEMENTS_PER_THREAD * 32 * warps or bt * bk > TILE_ELEMENTS_PER_THREAD * 32 * warps:
            continue
        cfg = {tile: bt, "BLOCK_K": bk, "USE_DOT": False, "num_warps": warps, "num_stages": stages}
        out.append(dict(cfg, PREFETCH=prefetch) if prefetch else cfg)
    if r >= 8:  # the padded rank, as the heuristic reads it (ranks 5-7 take R 8's configs)
        for (bt, bk), stages in itertools.product(_DOT_TILES, (1, 2, 3)):
            if kernel == "project_t":
                bt, bk = bk, bt  # BLOCK_M columns x BLOCK_K rows; tl.dot needs both >= 16
            out.append({tile: bt, "BLOCK_K": bk, "USE_DOT": True, "num_warps": 4, "num_stages": stages})
        if kernel == "project_t" and dtype.itemsize == 2:  # the split bfloat16 tensor-core dots
            for (bm, bk), pps in itertools.product(_SPLIT_DOT_TILES, (3, 6)):
                out.append({"BLOCK_M": bm, "BLOCK_K": bk, "USE_DOT": True, "SPLIT_BF16": True, "PROGRAMS_PER_SM": pps,
                            "num_warps": 4, "num_stages": 3})
    if not out:  # very large rank: smallest broadcast tile
        out.append({tile: 4 if kernel != "project_t" else 32, "BLOCK_K": 16 if kernel != "project_t" else 2,
                    "USE_DOT": False, "num_warps": 4, "num_stages": 2})
    return out


def _broadcast_config(kernel: str, tile: int, bk: int, prefetch: int, maxnreg: int) -> dict:
    """The 4-warp broadcast-path config of one entry of :data:`PROJECT_TILES` / :data:`PROJECT_T_TILES` /
    :data:`RECONSTRUCT_TILES`
    (``prefetch`` -1: ``PREFETCH`` 1 as project's and reconstruct's loop-carried ``CARRY`` form; ``maxnreg`` 0: no
    cap)."""
    cfg = {_tile_key(kernel): tile, "BLOCK_K": bk, "USE_DOT": False, "num_warps": 4, "num_stages": 1}
    if prefetch < 0:
        cfg["PREFETCH"], cfg["CARRY"] = 1, True
    elif prefetch:
        cfg["PREFETCH"] = prefetch
    if maxnreg:
        cfg["maxnreg"] = maxnreg
    return cfg


def _project_t_broadcast_configs(R: int) -> List[dict]:
    """project_t's broadcast candidates at padded rank ``R`` (see ``_PROJECT_T_TILES``); none above R 8."""
    if R > 8:
        return []
    out = [_broadcast_config("project_t", *PROJECT_T_TILES[(R, es)]) for es in (4, 2)]
    if _broadcast_config("project_t", *PROJECT_T_BATCHED_TILE) not in out:
        out.append(_broadcast_config("project_t", *PROJECT_T_BATCHED_TILE))
    for (bm, bk), prefetch, maxnreg in itertools.product(_PROJECT_T_TILES, (0, 1, 2), _PROJECT_T_MAXNREG):
        held = (1 + prefetch) * bk * (bm // 128 + R) + R * bm // 128
        cfg = _broadcast_config("project_t", bm, bk, prefetch, maxnreg)
        if 8 * held <= 5 * maxnreg and cfg not in out:
            out.append(cfg)
    return out


def _rows_total(layout, kernel: str, tile: int) -> Optional[int]:
    mats = getattr(layout, "matrices", None)
    if not mats:
        return None
    if kernel == "project_t":
        return sum(-(-s.m // tile) for s in mats)
    return sum(-(-s.n // tile) for s in mats)


def heuristic_config(kernel: str, layout: Optional[BucketLayout], dtype: torch.dtype,
                     num_sms: Optional[int] = None) -> dict:
    """Untuned default for ``kernel``: the interpreter config under TRITON_INTERPRET=1, else a GPU heuristic.

    GPU heuristic (sized with :mod:`powersgd_triton.perfmodel` for an H100/H200): at rank <= 8 the broadcast
    multiply with the kernels' unrolled register prefetch (Triton does not pipeline these loops) and tiles per
    padded rank and gradient element size (``dtype.itemsize`` 4, else 2) with ``maxnreg`` (no spills, <= 128
    registers on sm_90): project takes :data:`PROJECT_TILES` (4-8 rows x 64-128 columns per step, ``PREFETCH`` 2;
    rank 8 in 2-byte gradients 8 x 32 with ``PREFETCH`` 2 at 96 registers); reconstruct :data:`RECONSTRUCT_TILES`
    (``PREFETCH`` 2, ``maxnreg`` 128; rank 1 in 2-byte gradients the loop-carried ``CARRY`` form); project_t
    :data:`PROJECT_T_TILES` (wide column tiles, a ``[R, BLOCK_M]`` accumulator, 2-3 steps of loads in flight,
    ``maxnreg`` for 4-7 blocks per SM; rank 8 one step of 8 rows), on the batched view :data:`PROJECT_T_BATCHED_TILE`. ``tl.dot`` tiles from rank 16
    on, software-pipelined (``num_stages`` 3; project at rank 32: 32 columns, 2 stages, no spills); project_t on
    2-byte gradients from rank 8 on (:data:`PROJECT_T_SPLIT_MIN_RANK`: R padded to 16) takes
    :data:`PROJECT_T_SPLIT_CONFIG` (bfloat16 tensor-core dots on exactly split operands,
    :func:`split_bf16_dot`), but on the batched view, whose padding error keeps the float32 dot
    (:func:`padding_error_config`). The row and column splits are planned at launch from the SM count
    (:func:`split_rows`, :func:`split_cols`, :func:`plan`); ``num_sms`` is kept for the signature. Returns a new
    dict; raises ``ValueError`` for an unknown kernel name.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    if _env.interpreter_enabled():
        return dict(INTERPRETER_CONFIGS[kernel])
    max_rank = layout.max_rank if layout is not None else 4
    if kernel == "orthogonalize":
        return _ortho_heuristic(padded_rank(max_rank))
    r = padded_rank(max_rank)
    if (kernel == "project_t" and r >= PROJECT_T_SPLIT_MIN_RANK and dtype.itemsize == 2
            and not getattr(layout, "batched", False)):  # split_bf16_dot's tensor cores (R padded to 16)
        return dict(PROJECT_T_SPLIT_CONFIG)
    if r >= MIN_DOT_RANK:
        if kernel == "project_t":  # (2-byte gradients took the split path above)
            return dict(PROJECT_T_FP32_DOT_CONFIG)
        if kernel == "project" and r <= 16:  # 64 columns per step: 188 registers, no spills (sm_90); 128 spill
            return {"BLOCK_N": 16, "BLOCK_K": 64, "USE_DOT": True, "num_warps": 4, "num_stages": 3}
        return {"BLOCK_N": 16, "BLOCK_K": 32, "USE_DOT": True, "num_warps": 4, "num_stages": 2}
    es = 4 if dtype.itemsize >= 4 else 2  # the tile tables' element-size column (runs at every launch: no tensor)
    if kernel == "project_t":
        if getattr(layout, "batched", False):
            return _broadcast_config("project_t", *PROJECT_T_BATCHED_TILE)
        return _broadcast_config("project_t", *PROJECT_T_TILES[(r, es)])
    if kernel == "project":
        return _broadcast_config("project", *PROJECT_TILES[(r, es)])
    return _broadcast_config("reconstruct", *RECONSTRUCT_TILES[(r, es)])


def _resolve(kernel: str, layout: BucketLayout, dtype: torch.dtype, config: Optional[dict]) -> dict:
    if config is None:
        return heuristic_config(kernel, layout, dtype, device_sms(layout.device))
    return config


def _launch_options(cfg: dict) -> dict:
    """Triton launch options of a config (``num_warps``, ``num_stages``, ``maxnreg``). Raises ``ValueError`` for a
    ``PREFETCH`` other than 0, 1 or 2 (the kernels unroll at most three register sets; the plans count trips of
    ``1 + PREFETCH`` steps)."""
    _check_prefetch(cfg)
    out = {"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 1)}
    if cfg.get("maxnreg"):
        out["maxnreg"] = cfg["maxnreg"]
    return out


def _pow2_split(work_per_program: float, align: int, extent: int) -> int:
    """Largest ``align * 2**k`` <= ``work_per_program`` (at least ``2 * align``: a few loop trips), so that the
    bucket gets at least the target number of programs; 0 (no split) when that is >= ``extent``."""
    split = 2 * align
    while split * 2 <= work_per_program:
        split *= 2
    return 0 if split >= extent else split


def _check_prefetch(cfg: dict) -> int:
    prefetch = cfg.get("PREFETCH", 0)
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or not 0 <= prefetch <= 2:
        raise ValueError(f"config PREFETCH must be 0, 1 or 2, got {prefetch!r}")
    return prefetch


def steps_per_trip(cfg: dict) -> int:
    """Loop steps (``BLOCK_K`` rows of project_t, columns of project and reconstruct) one trip of the kernel's loop
    does: ``1 + PREFETCH`` on the broadcast path (the loop is unrolled once per step in flight), 1 with ``tl.dot``
    (project's ``PREFETCH`` there is the loop-carried form) or the loop-carried ``CARRY`` form. Raises
    ``ValueError`` for a ``PREFETCH`` other than 0, 1 or 2."""
    prefetch = _check_prefetch(cfg)
    return 1 if cfg.get("USE_DOT") or cfg.get("CARRY") else 1 + prefetch


def project_t_programs_per_sm(cfg: dict) -> int:
    """Programs per SM project_t's row splits aim at: ``cfg["PROGRAMS_PER_SM"]`` if given, else the blocks of
    ``num_warps`` warps that fit on one SM at ``cfg["maxnreg"]`` registers per thread (the compile's cap: one round
    of resident programs), else :data:`PROJECT_T_PROGRAMS_PER_SM`."""
    if cfg.get("PROGRAMS_PER_SM"):
        return max(1, int(cfg["PROGRAMS_PER_SM"]))
    if cfg.get("maxnreg"):
        from ..autotune.aot import blocks_per_sm

        return max(1, blocks_per_sm(int(cfg["maxnreg"]), int(cfg.get("num_warps", 4)), 0, 90)["blocks_per_sm"])
    return PROJECT_T_PROGRAMS_PER_SM


def split_rows(layout: BucketLayout, cfg: dict, num_sms: int) -> int:
    """Rows per project_t program: ``cfg["SPLIT_ROWS"]`` if given, else planned from the SM count (0: no split).

    The target is ``project_t_programs_per_sm(cfg) * num_sms`` programs (one round of resident programs). When the
    column tiles alone reach it, no split, unless one matrix is much taller than the rest (then rows of about
    work / target). Else the smallest multiple of one loop trip's rows (``BLOCK_K * steps per trip``) for which the
    bucket has at most the target: all programs start at once and the longest is as short as the target allows.
    Cached on the layout per tile width, trip rows and target (it runs at every launch).
    """
    if "SPLIT_ROWS" in cfg:
        return int(cfg["SPLIT_ROWS"])
    bm = cfg["BLOCK_M"]
    unit = cfg["BLOCK_K"] * steps_per_trip(cfg)
    target = project_t_programs_per_sm(cfg) * num_sms
    return layout.memo(("split_rows", bm, unit, target), lambda: _plan_split_rows(layout, bm, unit, target))


def _plan_split_rows(layout: BucketLayout, bm: int, unit: int, target: int) -> int:
    shapes = [(s.n, -(-s.m // bm)) for s in layout.matrices]
    tiles = sum(ct for _, ct in shapes)
    work = sum(n * ct for n, ct in shapes)  # rows walked by all column tiles
    tallest = max(n for n, _ in shapes)
    if tiles >= target:
        if tallest * tiles <= 2 * work:  # enough programs and no matrix much longer than the rest
            return 0
        split = -(-int(work / target) // unit) * unit
        return 0 if split >= tallest else max(unit, split)

    def programs(split: int) -> int:
        return sum(ct * -(-n // split) for n, ct in shapes)

    lo, hi = 1, -(-tallest // unit)  # in trips; programs(hi * unit) == tiles <= target
    while lo < hi:
        mid = (lo + hi) // 2
        if programs(mid * unit) <= target:
            hi = mid
        else:
            lo = mid + 1
    split = lo * unit
    return 0 if split >= tallest else split


def split_cols(layout: BucketLayout, cfg: dict, num_sms: int) -> int:
    """Columns per reconstruct program: ``cfg["SPLIT_COLS"]`` if given, else planned like :func:`split_rows`."""
    if "SPLIT_COLS" in cfg:
        return int(cfg["SPLIT_COLS"])
    bn = cfg["BLOCK_N"]
    tiles = sum(-(-s.n // bn) for s in layout.matrices)
    target = PROGRAMS_PER_SM * num_sms
    work = sum(s.m * -(-s.n // bn) for s in layout.matrices)
    widest = max(s.m for s in layout.matrices)
    if tiles >= target and widest * tiles <= 2 * work:
        return 0
    return _pow2_split(work / target, cfg["BLOCK_K"] * steps_per_trip(cfg), widest)


def reduce_block_m(cfg: dict, R: int) -> int:
    """Columns per reduce_splits program for project_t's ``cfg`` at padded rank ``R``: ``REDUCE_TILE_ELEMENTS // R``,
    at most ``BLOCK_M``, at least 1 (a power of two)."""
    return max(1, min(int(cfg["BLOCK_M"]), REDUCE_TILE_ELEMENTS // R))


def reduce_split_block(block_m: int, R: int) -> int:
    """Partial sums of project_t that ``reduce_splits`` loads per step (all in flight at once): a power of two, at
    most :data:`REDUCE_MAX_SPLITS`, with ``SPLIT_BLOCK x block_m x R <= REDUCE_STEP_ELEMENTS`` (32 float32 per
    thread of 4 warps), at least 1."""
    sb = 1
    while sb < REDUCE_MAX_SPLITS and 2 * sb * block_m * R <= REDUCE_STEP_ELEMENTS:
        sb *= 2
    return sb


def factor_columns(which: str) -> dict:
    """The layout-table columns of factor ``which`` ("p" or "q") as the constexprs of the commit_factor kernel:
    ``ROWS_COL`` (its row count: ``ROWS`` n for P, ``COLS`` m for Q) and ``OFF_COL`` (its offset in the flat factor:
    ``P_OFF``, ``Q_OFF``). Raises ``ValueError`` for another ``which``."""
    if which == "p":
        return dict(ROWS_COL=ROWS, OFF_COL=P_OFF)
    if which == "q":
        return dict(ROWS_COL=COLS, OFF_COL=Q_OFF)
    raise ValueError(f"which must be 'p' or 'q', got {which!r}")


def split_bf16_dot(cfg: dict, dtype: torch.dtype, variant: Optional[dict] = None) -> bool:
    """Whether project_t with ``cfg`` on a ``dtype`` bucket takes the split tensor-core path
    (:func:`powersgd_triton.kernels.common._dot_bf16_split`): ``USE_DOT`` and ``SPLIT_BF16`` set, a 2-byte
    gradient (bfloat16, float16), and not the batched view's padding error (``variant["PAD_ERROR"]``, whose M + E
    is float32: the float32 ``ieee`` dot there, as for float32 gradients)."""
    return (bool(cfg.get("USE_DOT")) and bool(cfg.get("SPLIT_BF16")) and dtype.itemsize == 2
            and not (variant or {}).get("PAD_ERROR", False))


def padding_error_config(cfg: dict, pad_error: bool) -> dict:
    """project_t's config for a launch with (``pad_error``) or without the batched view's padding error: a
    ``SPLIT_BF16`` config's tile is sized for the tensor-core path, and the padding error (float32 M + E) takes the
    float32 ``ieee`` dot (:func:`split_bf16_dot`), which spills at 64 x 64 on sm_90 (255 registers); such a launch
    takes the float32-dot tile of the heuristic instead (32 x 32, 3 stages: 122-128 registers). Any other
    ``cfg`` is returned as is."""
    if pad_error and cfg.get("USE_DOT") and cfg.get("SPLIT_BF16"):
        return dict(PROJECT_T_FP32_DOT_CONFIG)
    return cfg


def _factor_rank(layout: BucketLayout, cfg: dict) -> int:
    return padded_rank(layout.max_rank, cfg.get("USE_DOT", False))


def plan(kernel: str, layout: BucketLayout, dtype: torch.dtype, config: Optional[dict] = None, *,
         num_sms: Optional[int] = None, variant: Optional[dict] = None) -> List[dict]:
    """The launches of one bucket step ``kernel`` on ``layout``, as the performance model reads them.

    Returns a list of dicts (one per launch) with keys ``kernel`` (a name of :data:`KERNEL_FUNCTIONS`),
    ``programs``, ``iterations`` (most loop trips of one program), ``bytes_read``, ``bytes_written`` (DRAM bytes,
    each element once), ``config`` and ``variant`` (what :func:`compile_aot` needs), plus ``dtype``, ``max_rank``,
    ``flops`` (work of the FMA pipe: multiply-adds x 2 on the padded rank; on project_t's split tensor-core path,
    :func:`split_bf16_dot`, its operand splits instead, 2 per instruction, :data:`SPLIT_OPS_P` /
    :data:`SPLIT_OPS_M`), ``tensor_flops`` (project_t: multiply-adds x 2 done on tensor cores, every dot of the
    split path counted; 0 elsewhere or absent) and ``l2_bytes`` (factor bytes re-read by several programs, served
    by L2). ``kernel`` is one of ``project``, ``project_t``, ``reconstruct``, ``average``, ``copy_segments``;
    ``orthogonalize`` is :func:`orthogonalize_plan`. ``num_sms`` sizes the splits (default: the layout's device).
    """
    if config is not None:
        cfg = dict(config)
    elif kernel in KERNELS:
        cfg = heuristic_config(kernel, layout, dtype, num_sms)
    else:
        cfg = {}
    if num_sms is None:
        num_sms = device_sms(layout.device)
    variant = dict(variant or {})
    es = torch.empty((), dtype=dtype).element_size()
    mats = layout.matrices
    mn = sum(s.numel for s in mats)
    e_numel = layout.e_numel
    p4, q4 = 4 * layout.p_numel, 4 * layout.q_numel
    base = dict(config=cfg, variant=variant, dtype=str(dtype).replace("torch.", ""), max_rank=layout.max_rank)
    if kernel == "project":
        R = _factor_rank(layout, cfg)
        bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
        err = variant.get("HAS_ERROR", True)
        steps = steps_per_trip(cfg)
        # tile-table order; whole trips of the loop (the last trip's extra steps are masked)
        per = [-(-s.m // (bk * steps)) * steps for s in mats for _ in range(-(-s.n // bn))]
        programs = len(per)
        return [dict(base, kernel="project", programs=programs, iterations=max(per), program_iterations=per,
                     steps_per_trip=steps,
                     bytes_read=mn * es + (4 * e_numel if err else 0) + q4,
                     bytes_written=(mn * es if err else 0) + p4 * (2 if variant.get("HAS_P2") else 1),
                     flops=2 * R * sum(s.n * s.m for s in mats),
                     l2_bytes=sum(-(-s.n // bn) * s.m * s.rank * 4 for s in mats))]
    if kernel == "project_t":
        cfg = base["config"] = padding_error_config(cfg, variant.get("PAD_ERROR", False))
        R = _factor_rank(layout, cfg)
        bm, bk = cfg["BLOCK_M"], cfg["BLOCK_K"]
        split = split_rows(layout, cfg, num_sms)
        steps = steps_per_trip(cfg)
        per, ws, red, red_per = [], 0, 0, []

        def loop_steps(rows):  # steps the loop runs: whole trips (the last one's extra steps are masked)
            return -(-rows // (bk * steps)) * steps

        for s in mats:  # project_t_tiles' order: per column tile, its row splits
            ns = -(-s.n // split) if split and s.n > split else 1
            ct = -(-s.m // bm)
            for _ in range(ct):
                per += [loop_steps(min(s.n, (k + 1) * split) - k * split) for k in range(ns)] if ns > 1 else [
                    loop_steps(s.n)]
            if ns > 1:
                ws += ns * s.m * s.rank * 4
                rt = -(-s.m // reduce_block_m(cfg, R))
                red += rt
                red_per += [ns] * rt
        programs, iters = len(per), max(per)
        products = 2 * R * sum(s.n * s.m for s in mats)
        if split_bf16_dot(cfg, dtype, variant):  # tensor-core dots; the FMA pipe only splits the operands
            flops = 2 * SPLIT_OPS_P * R * sum(-(-s.m // bm) * s.n for s in mats)
            flops += 2 * SPLIT_OPS_M.get(dtype, 0) * mn
            tensor = SPLIT_DOTS[dtype] * products
        else:
            flops, tensor = products, 0
        out = [dict(base, kernel="project_t", programs=programs, iterations=iters, program_iterations=per,
                    steps_per_trip=steps,
                    bytes_read=mn * es + p4, bytes_written=q4 + ws,
                    flops=flops, tensor_flops=tensor,
                    l2_bytes=sum(-(-s.m // bm) * s.n * s.rank * 4 for s in mats), split_rows=split)]
        if red:
            sb = reduce_split_block(reduce_block_m(cfg, R), R)
            red_per = [-(-ns // sb) for ns in red_per]
            out.append(dict(base, kernel="reduce_splits", programs=red, iterations=max(red_per),
                            program_iterations=red_per, bytes_read=ws, bytes_written=q4,
                flops=0, l2_bytes=0))
        return out
    if kernel == "reconstruct":
        R = _factor_rank(layout, cfg)
        bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
        split = split_cols(layout, cfg, num_sms)
        err = variant.get("HAS_ERROR", True)
        steps = steps_per_trip(cfg)
        per = []
        for s in mats:  # reconstruct_tiles' order: per row block, its column ranges (whole trips of the loop)
            chunk = split if 0 < split < s.m else s.m
            per += [-(-(min(s.m, c + chunk) - c) // (bk * steps)) * steps
                    for c in range(0, s.m, chunk)] * -(-s.n // bn)
        programs, iters = len(per), max(per)
        commit = {1: p4, 2: q4}.get(variant.get("COMMIT", 0), 0)
        local = {1: p4, 2: q4}.get(variant.get("LOCAL_ERR", 0), 0)
        return [dict(base, kernel="reconstruct", programs=programs, iterations=iters, program_iterations=per,
                     bytes_read=p4 + q4 + local + ((mn * es + (e_numel - mn) * 4) if err else 0),
                     bytes_written=mn * es + (4 * e_numel if err else 0) + commit,
                     flops=2 * R * sum(s.n * s.m for s in mats) * (2 if local else 1),
                     l2_bytes=programs * bn * R * 4 + sum(-(-s.n // bn) * s.m * s.rank * 4 for s in mats),
                     split_cols=split, steps_per_trip=steps)]
    if kernel in ("average", "copy_segments"):
        which = variant.get("which", "q")
        factor = 0 if kernel == "copy_segments" else (layout.p_numel if which == "p" else layout.q_numel)
        unc = layout.uncompressed_numel
        block = AVERAGE_BLOCK if kernel == "average" else SEGMENT_BLOCK
        programs = sum(-(-n // block) for _, n in layout.uncompressed)
        programs += sum(-(-((s.n if which == "p" else s.m) * s.rank) // block) for s in mats) if factor else 0
        return [dict(base, kernel=kernel, programs=programs, iterations=1, bytes_read=4 * factor + unc * es,
                     bytes_written=4 * factor + unc * es + (programs if kernel == "average" else 0),
                     flops=0, l2_bytes=0, config=dict(BLOCK=block, num_warps=4, num_stages=1))]
    raise ValueError(f"no plan for kernel {kernel!r}")


def project(buffer, layout: BucketLayout, q, p, error=None, *, p2=None, loss_scale=None,
            config: Optional[dict] = None) -> None:
    """One launch: ``P_i = (M_i [+ s·E_i]) · Q_i`` for all i (see :func:`powersgd_triton.ops.project`); ``p2``: a
    second copy of P written by the same launch; ``loss_scale``: the one-element float32 ``s`` (else ``s = 1``)."""
    cfg = _resolve("project", layout, buffer.dtype, config)
    tiles = layout.tiles("rows", cfg["BLOCK_N"])
    R = _factor_rank(layout, cfg)
    _project_kernel[(tiles.shape[0],)](
        buffer, q, p, p2 if p2 is not None else p, error if error is not None else p, layout.table, tiles,
        loss_scale if loss_scale is not None else p,
        HAS_ERROR=error is not None, PAD_ERROR=layout.batched and error is not None, HAS_P2=p2 is not None,
        R=R, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], USE_DOT=cfg["USE_DOT"], PREFETCH=cfg.get("PREFETCH", 0),
        LOSS_SCALE=loss_scale is not None and error is not None, CARRY=bool(cfg.get("CARRY", False)),
        **_launch_options(cfg),
    )


def project_t(buffer, layout: BucketLayout, p, q, *, error=None, q2=None, loss_scale=None,
              config: Optional[dict] = None) -> None:
    """``Q_i = M_iᵀ · P_i`` for all i (see :func:`powersgd_triton.ops.project_t`): one launch, plus one for the
    fixed-order reduction when the plan splits a matrix over rows. ``error``: the batched view's error memory (its
    padding's part is the padding's M + E); ``q2``: a second copy of Q."""
    pad = layout.batched and error is not None
    cfg = padding_error_config(_resolve("project_t", layout, buffer.dtype, config), pad)
    split = split_rows(layout, cfg, device_sms(layout.device))
    R = _factor_rank(layout, cfg)
    reduce_bm = reduce_block_m(cfg, R)
    tiles, reduce_tiles, ws_numel = layout.project_t_tiles(cfg["BLOCK_M"], split, reduce_bm)
    ws = layout.workspace(ws_numel) if reduce_tiles is not None else p
    _project_t_kernel[(tiles.shape[0],)](
        buffer, p, q, q2 if q2 is not None else q, error if pad else p, ws, layout.table, tiles,
        loss_scale if loss_scale is not None else p,
        PAD_ERROR=pad, HAS_Q2=q2 is not None, R=R, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"],
        USE_DOT=cfg["USE_DOT"], PREFETCH=cfg.get("PREFETCH", 0), LOSS_SCALE=pad and loss_scale is not None,
        PADDED=layout.batched, SPLIT_BF16=bool(cfg.get("SPLIT_BF16", False)), **_launch_options(cfg),
    )
    if reduce_tiles is not None:
        _reduce_splits_kernel[(reduce_tiles.shape[0],)](
            ws, q, q2 if q2 is not None else q, layout.table, reduce_tiles, HAS_Q2=q2 is not None, R=R,
            BLOCK_M=reduce_bm, SPLIT_BLOCK=reduce_split_block(reduce_bm, R), num_warps=4, num_stages=1,
        )


def _ortho_heuristic(R: int) -> dict:
    """Orthogonalize default at padded rank R, from a model of an H100/H200 (132 SMs, ~4 TB/s, 64K registers/SM).

    * ``BLOCK`` rows per tile and warps: :data:`ORTHO_BLOCKS` and :data:`ORTHO_WARPS` (2048 rows at R 1, 1024 at
      R 2-4, 512 at R 8, 256 at R 16, 16 warps; R 32: 32 rows, 8 warps), held in float64 in registers. Chosen from
      the sm_90 compile (ptxas -v, triton 3.9): no spills at any R <= 32, at most 128 registers per thread up to
      R 16; the Gram launch reads at most :data:`ORTHO_GRAM_BLOCK` rows per tile;
    * ``SHORT_ROWS``: up to R 4, ``ORTHO_SHORT_BYTES`` of factor per program, at most 32 tiles (8192 rows at R 4,
      16384 at R 2, 32768 at R 1: ResNet-50's, BERT's and GPT-2's layers other than the embeddings are one launch);
      at R 8 and 16 :data:`ORTHO_WIDE_SHORT_ROWS` (4096), their apply pass split into ``APPLY_ROWS``
      (:data:`ORTHO_APPLY_ROWS`: 2048 at R 8, 1024 at R 16) rows per program, each computing the whole Gram; at
      R 32 ``ORTHO_WIDE_TILES[R]`` tiles (128 rows): taller factors are split;
    * ``GRAM_ROWS``: rows per float64 Gram slot, ``max(BLOCK, 512)`` up to R 4, ``ORTHO_WIDE_TILES[R]`` tiles from
      R 8 on (1024 rows at R 8, 512 at R 16, 128 at R 32). Every
      program of the apply pass sums all slots of its matrix, ``slots·R²·8`` bytes from L2 (GPT-2's 50257 rows: 50
      slots, 6 KiB at R 4; 99 slots, 200 KiB at R 16), and the Gram launch has one program per slot (4-64 KiB of
      factor each);
    * ``SPLIT_ROWS``: ``ORTHO_SPLIT_ROWS`` up to R 8 (>= 2 programs per SM for the embeddings), twice that
      above (the slots every program sums grow as R²: half the programs, half the L2 traffic); 3 stages (the row
      loops are software-pipelined, several tiles in flight per SM).
    """
    block = ORTHO_BLOCKS.get(R, max(16, 1024 // R))
    extra = {}
    if R <= 4:
        short = max(block, min(ORTHO_SHORT_BYTES // (4 * R), 32 * block))
        gram = max(block, 512)
    else:
        short = gram = ORTHO_WIDE_TILES.get(R, 4) * block
        if R in ORTHO_WIDE_SHORT_ROWS:
            short, extra = ORTHO_WIDE_SHORT_ROWS[R], dict(APPLY_ROWS=ORTHO_APPLY_ROWS[R])
    split = ORTHO_SPLIT_ROWS if R <= 8 else 2 * ORTHO_SPLIT_ROWS
    return dict(BLOCK=block, SHORT_ROWS=short, GRAM_ROWS=gram, SPLIT_ROWS=split, num_warps=ORTHO_WARPS.get(R, 8),
                num_stages=3, **extra)


def _ortho_configs(R: int) -> List[dict]:
    """Orthogonalize candidates at padded rank R: the heuristic of every rank 1..32, at its own warps and at 8 (or 4
    where it has 8), whose float64 tile fits (``BLOCK * R <= ORTHO_MAX_TILE_PER_THREAD * 32 * num_warps``); the
    rank's own heuristic first. Rank 1's candidates include every other rank's."""
    own = _ortho_heuristic(R)
    out = [own]
    for r in (1, 2, 4, 8, 16, 32):
        h = _ortho_heuristic(r)
        for c in (h, dict(h, num_warps=4 if h["num_warps"] == 8 else 8)):
            if c["BLOCK"] * R <= ORTHO_MAX_TILE_PER_THREAD * 32 * c["num_warps"] and c not in out:
                out.append(c)
    return out


def _check_ortho_config(cfg: dict) -> None:
    """Raise ``ValueError`` unless BLOCK is a power of two >= 16, SHORT_ROWS and GRAM_ROWS multiples of it and
    SPLIT_ROWS (and APPLY_ROWS, when given) a positive multiple of 16 (a split program writes ceil(SPLIT_ROWS /
    BLOCK) tiles, masked)."""
    block = cfg.get("BLOCK")
    if not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"orthogonalize config: BLOCK must be a power of two >= 16, got {block!r}")
    for key in ("SHORT_ROWS", "GRAM_ROWS"):
        v = cfg.get(key)
        if not isinstance(v, int) or v < block or v % block:
            raise ValueError(f"orthogonalize config: {key} must be a multiple of BLOCK ({block}), got {v!r}")
    split = cfg.get("SPLIT_ROWS")
    if not isinstance(split, int) or split < 16 or split % 16:
        raise ValueError(f"orthogonalize config: SPLIT_ROWS must be a positive multiple of 16, got {split!r}")
    apply = cfg.get("APPLY_ROWS", cfg["SHORT_ROWS"])
    if not isinstance(apply, int) or apply < 16 or apply % 16:
        raise ValueError(f"orthogonalize config: APPLY_ROWS must be a positive multiple of 16, got {apply!r}")


# Per layout (weakly held): {(which, R, BLOCK, SHORT_ROWS, GRAM_ROWS, SPLIT_ROWS, APPLY_ROWS): _OrthoPlan}
_ORTHO_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _ortho_slot_block(R: int) -> int:
    """Gram slots summed per step by a program of a split factor: 16 KiB of float64 per load (2 to 64 slots)."""
    return max(2, min(64, 2048 // (R * R)))


def _ortho_constexprs(cfg: dict, R: int) -> dict:
    """The orthogonalize kernels' loop constexprs, functions of the config and the padded rank R: ``GRAM_BLOCK``
    (rows per tile of the Gram launch, ``min(BLOCK, ORTHO_GRAM_BLOCK)``), ``GROUP_TILES`` (its tiles per Gram slot,
    ``GRAM_ROWS // GRAM_BLOCK``), ``CHUNK_TILES`` (tiles per unconditional inner loop), ``SHORT_CHUNKS``,
    ``APPLY_CHUNKS`` and ``SLOT_BLOCK``."""
    _check_ortho_config(cfg)
    block = cfg["BLOCK"]
    gram_block = min(block, ORTHO_GRAM_BLOCK)
    chunk_tiles = min(4, cfg["SHORT_ROWS"] // block)
    chunk = chunk_tiles * block
    return dict(
        BLOCK=block,
        GRAM_BLOCK=gram_block,
        GROUP_TILES=cfg["GRAM_ROWS"] // gram_block,
        CHUNK_TILES=chunk_tiles,
        SHORT_CHUNKS=-(-cfg["SHORT_ROWS"] // chunk),
        APPLY_CHUNKS=-(-max(cfg["SHORT_ROWS"], cfg["SPLIT_ROWS"]) // chunk),
        SLOT_BLOCK=_ortho_slot_block(R),
    )


class _OrthoPlan:
    """Host-side launch plan of one orthogonalize call (see :func:`orthogonalize_plan`); device tables made lazily."""

    def __init__(self, layout: BucketLayout, which: str, cfg: dict):
        self.R = padded_rank(layout.max_rank)
        self.consts = _ortho_constexprs(cfg, self.R)
        short, gram_rows, split = cfg["SHORT_ROWS"], cfg["GRAM_ROWS"], cfg["SPLIT_ROWS"]
        apply = cfg.get("APPLY_ROWS", short)
        chunk = self.consts["CHUNK_TILES"] * cfg["BLOCK"]
        self.gram_tasks: List[List[int]] = []  # rows of layout.ORTHO_GRAM_TASK_COLUMNS
        self.tasks: List[List[int]] = []  # rows of layout.ORTHO_TASK_COLUMNS
        self.tiles: List[int] = []  # per finish task: tiles of BLOCK rows read and written (chunks rounded up)
        self.slot_steps: List[int] = []  # per finish task: steps of the slot sum
        slot = 0
        self.split_matrices = 0
        self.factor_elems = 0  # valid elements of the factors
        self.split_elems = 0
        self.regram_elems = 0  # factor elements read again by the extra programs of short factors (APPLY_ROWS)
        for i, s in enumerate(layout.matrices):
            rows = s.n if which == "p" else s.m
            rm = padded_rank(s.rank)  # completion vectors of this factor (the torch backend's too)
            factor = {ORTHO_N: rows, ORTHO_R: s.rank, ORTHO_OFF: s.p_offset if which == "p" else s.q_offset}
            self.factor_elems += rows * s.rank
            if rows <= short:
                # one program per APPLY_ROWS rows, each with the factor's whole Gram (the same tiles in the same
                # order: the same bits in every program, and as one program would write them)
                gram_tiles = -(-rows // chunk) * self.consts["CHUNK_TILES"]
                for c in range(0, rows, apply):
                    end = min(c + apply, rows)
                    self.tasks.append(table_row(ORTHO_TASK_WIDTH, {ORTHO_MAT: i, ORTHO_ROW0: c, ORTHO_ROW_END: end,
                                                                   ORTHO_SLOT0: 0, ORTHO_SLOTS: 0, ORTHO_HEAD: -1,
                                                                   ORTHO_RM: rm, **factor}))
                    self.tiles.append(gram_tiles + -(-(end - c) // chunk) * self.consts["CHUNK_TILES"])
                    self.slot_steps.append(0)
                    self.regram_elems += rows * s.rank if c else 0
                continue
            parts = -(-rows // gram_rows)
            head = slot + parts
            for k in range(parts):
                self.gram_tasks.append(table_row(ORTHO_GRAM_TASK_WIDTH, {
                    GRAM_MAT: i, GRAM_ROW0: k * gram_rows, GRAM_SLOT: slot + k, GRAM_HEAD: head if k == 0 else -1,
                    GRAM_RM: rm, GRAM_N: rows, GRAM_R: s.rank, GRAM_OFF: factor[ORTHO_OFF]}))
            for c in range(0, rows, split):
                self.tasks.append(table_row(ORTHO_TASK_WIDTH, {
                    ORTHO_MAT: i, ORTHO_ROW0: c, ORTHO_ROW_END: min(c + split, rows), ORTHO_SLOT0: slot,
                    ORTHO_SLOTS: parts, ORTHO_HEAD: head, ORTHO_RM: rm, **factor}))
                self.tiles.append(-(-(min(c + split, rows) - c) // chunk) * self.consts["CHUNK_TILES"])
                self.slot_steps.append(-(-parts // self.consts["SLOT_BLOCK"]))
            slot += parts + 1
            self.split_matrices += 1
            self.split_elems += rows * s.rank
        self.slots = slot
        self._device_tables = None

    def device_tables(self, device):
        if self._device_tables is None:
            def dev(rows, width):
                return torch.tensor(rows, dtype=torch.int64).reshape(-1, width).to(device)

            self._device_tables = (dev(self.gram_tasks, ORTHO_GRAM_TASK_WIDTH) if self.gram_tasks else None,
                                   dev(self.tasks, ORTHO_TASK_WIDTH))
        return self._device_tables


def _ortho_plan(layout: BucketLayout, which: str, cfg: dict) -> _OrthoPlan:
    key = (which, padded_rank(layout.max_rank), cfg.get("BLOCK"), cfg.get("SHORT_ROWS"), cfg.get("GRAM_ROWS"),
           cfg.get("SPLIT_ROWS"), cfg.get("APPLY_ROWS"))
    plans = _ORTHO_PLANS.setdefault(layout, {})
    plan = plans.get(key)
    if plan is None:
        plan = _OrthoPlan(layout, which, cfg)
        plans[key] = plan
    return plan


def _ortho_workspace(layout: BucketLayout, slots: int, R: int) -> torch.Tensor:
    """float64 workspace of at least ``slots`` [R, R] Gram slots, kept per layout for reuse."""
    plans = _ORTHO_PLANS.setdefault(layout, {})
    ws = plans.get("workspace")
    need = max(1, slots * R * R)
    if ws is None or ws.numel() < need:
        ws = torch.empty(need, dtype=torch.float64, device=layout.device)
        plans["workspace"] = ws
    return ws


def _overlap(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``out`` shares memory with ``x`` (in place: the hooks orthogonalize P that way)."""
    a, b = x.data_ptr(), out.data_ptr()
    return a < b + out.numel() * out.element_size() and b < a + x.numel() * x.element_size()


def _in_place_config(cfg: dict, in_place: bool) -> dict:
    """``cfg`` without ``APPLY_ROWS`` when the call is in place: every program of a short factor split by
    ``APPLY_ROWS`` reads the whole factor for its Gram (and its first rows for the completion vectors) while the
    other programs of that factor overwrite their rows, so it would read rows already orthogonalized. One program
    per short factor writes the same bits (same tiles, same order) and reads every row before writing any."""
    if in_place and "APPLY_ROWS" in cfg:
        return {k: v for k, v in cfg.items() if k != "APPLY_ROWS"}
    return cfg


def _ortho_inputs(x, layout: BucketLayout, which: str, out, config: Optional[dict]):
    """``(cfg, plan, gram_tasks, tasks, workspace)`` of an :func:`orthogonalize` call: the resolved config (without
    ``APPLY_ROWS`` in place), its plan, the plan's device task tables (``gram_tasks`` None when nothing is split)
    and the float64 Gram workspace (allocated even when unused: one compiled signature), the last three kept with
    the layout."""
    cfg = _in_place_config(_resolve("orthogonalize", layout, x.dtype, config), _overlap(x, out))
    plan = _ortho_plan(layout, which, cfg)
    gram_tasks, tasks = plan.device_tables(x.device)
    return cfg, plan, gram_tasks, tasks, _ortho_workspace(layout, plan.slots, plan.R)


def orthogonalize(x, layout: BucketLayout, which: str, epsilon: float, out, *, config: Optional[dict] = None) -> None:
    """Orthogonalize every P_i (``which="p"``) or Q_i (``"q"``): ONE launch when every factor has at most
    ``SHORT_ROWS`` rows, else two (float64 Gram slots of the split factors, then the rest); see
    :mod:`powersgd_triton.kernels.orthogonalize`. Raises ``ValueError`` for a malformed config or another
    ``which``."""
    factor_columns(which)  # validates `which`; the task tables carry each factor's rows, rank and offset
    cfg, plan, gram_tasks, tasks, ws = _ortho_inputs(x, layout, which, out, config)
    c = plan.consts
    if gram_tasks is not None:
        _ortho_gram_kernel[(gram_tasks.shape[0],)](
            x, ws, gram_tasks, R=plan.R, BLOCK=c["GRAM_BLOCK"], GROUP_TILES=c["GROUP_TILES"], **_launch_options(cfg)
        )
    _orthogonalize_kernel[(tasks.shape[0],)](
        x, out, ws, tasks, float(epsilon), R=plan.R, BLOCK=c["BLOCK"], CHUNK_TILES=c["CHUNK_TILES"],
        SHORT_CHUNKS=c["SHORT_CHUNKS"], APPLY_CHUNKS=c["APPLY_CHUNKS"], SLOT_BLOCK=c["SLOT_BLOCK"],
        **_launch_options(cfg),
    )


def orthogonalize_kept_tensors(x, layout: BucketLayout, which: str, out, *,
                               config: Optional[dict] = None) -> List[torch.Tensor]:
    """The device tensors :func:`orthogonalize` with these arguments uses besides ``x`` and ``out`` and keeps with
    the layout across calls (its task tables and the float64 Gram workspace). They were allocated on the stream
    of the call that made them: a caller that runs orthogonalize on another stream (the next step's Q on a side
    stream: :func:`powersgd_triton._step.orthogonalize_next_q`) records that stream on them, so that the caching
    allocator does not hand their memory to that stream's work while the side stream may still use it (when the
    layout is dropped: a bucket rebuild, ``load_state_dict``)."""
    if layout.num_matrices == 0:
        return []
    return [t for t in _ortho_inputs(x, layout, which, out, config)[2:] if t is not None]


def orthogonalize_plan(layout: BucketLayout, which: str, config: Optional[dict] = None, *,
                       in_place: bool = False) -> List[dict]:
    """The launches of one :func:`orthogonalize` call on ``layout`` (``which`` = "p" or "q"), in launch order.

    One dict per launch: ``kernel`` (a :data:`KERNEL_FUNCTIONS` name), ``programs`` (grid size), ``iterations``
    (the most loop trips of one program: tiles of ``BLOCK`` rows, reading and writing, plus steps of
    ``SLOT_BLOCK`` Gram slots), ``rank_steps`` (serial Gram-Schmidt steps on the r x r Gram per program, 0 for
    the Gram launch), ``lookups`` (dependent table loads before a program's loop: 1, its task row, which carries
    the factor's rows, rank and offset), ``split_programs`` (finish launch: programs of split factors),
    ``bytes_read`` / ``bytes_written`` (bytes the loads and stores of the whole launch touch: factor float32,
    Gram slots float64, task tables; a short factor is read twice, the second time likely from L2),
    ``config`` and ``variant`` (``compile_aot(kernel, config, ..., variant=variant)`` compiles exactly this
    launch). ``config=None``: the heuristic (or interpreter) config. ``in_place``: a call with ``out`` sharing
    ``x``'s memory (the hooks' orthogonalization of P), which ignores ``APPLY_ROWS``. Raises ``ValueError`` for
    an unknown ``which`` or a malformed config.
    """
    if which not in ("p", "q"):
        raise ValueError(f"which must be 'p' or 'q', got {which!r}")
    cfg = dict(_in_place_config(_resolve("orthogonalize", layout, torch.float32, config), in_place))
    if layout.num_matrices == 0:
        return []
    plan = _ortho_plan(layout, which, cfg)
    R = plan.R
    variant: dict = {}  # the task rows carry each factor's rows, rank and offset: P and Q compile the same kernel
    slot_bytes = R * R * 8
    out = []
    if plan.gram_tasks:
        heads = sum(1 for t in plan.gram_tasks if t[GRAM_HEAD] >= 0)
        out.append(dict(
            kernel="orthogonalize_gram", programs=len(plan.gram_tasks), iterations=plan.consts["GROUP_TILES"],
            rank_steps=0, lookups=1,
            bytes_read=4 * plan.split_elems + len(plan.gram_tasks) * 8 * ORTHO_GRAM_TASK_WIDTH
            + heads * 4 * R * R,
            bytes_written=(len(plan.gram_tasks) + heads) * slot_bytes,
            config=dict(cfg), variant=dict(variant), dtype="float32", max_rank=layout.max_rank,
        ))
    short_elems = plan.factor_elems - plan.split_elems
    out.append(dict(
        kernel="orthogonalize", programs=len(plan.tasks),
        iterations=max(t + k for t, k in zip(plan.tiles, plan.slot_steps)), rank_steps=R, lookups=1,
        bytes_read=8 * short_elems + 4 * plan.split_elems + len(plan.tasks) * 8 * ORTHO_TASK_WIDTH
        + sum(t[ORTHO_SLOTS] * slot_bytes for t in plan.tasks if t[ORTHO_SLOTS] > 0),
        bytes_written=4 * plan.factor_elems, l2_bytes=4 * plan.regram_elems,
        config=dict(cfg), variant=dict(variant, WITH_GRAM=False), dtype="float32", max_rank=layout.max_rank,
        split_programs=sum(1 for t in plan.tasks if t[ORTHO_SLOTS] > 0),
    ))
    return out


def _flag_bytes(flags):
    if flags.dtype == torch.bool:
        return flags.view(torch.uint8)
    return flags


def reconstruct(
    buffer,
    layout: BucketLayout,
    p,
    q,
    scale: float,
    error=None,
    update_error=None,
    *,
    local_p=None,
    local_q=None,
    commit=None,
    first=None,
    loss_scale=None,
    config: Optional[dict] = None,
) -> None:
    """One launch: ``M_i ← P_i·(scale·Q_i)ᵀ`` and optionally ``E_i ← M_i − P_i·(scale·Q_i)ᵀ`` for all i.

    With ``local_p`` (``local_q``) the error is the local residual ``M_i − P_local·Q_iᵀ`` (``M_i − P_i·Q_localᵀ``).
    ``update_error``: uint8/bool device flags (all must have bit 0 set for the error update). ``commit``:
    ``(which, kept)``: also ``kept_i <- p_i`` (``"p"``) or ``q_i`` (``"q"``) where the step is finite and the
    matrix's flags (``first``, from :meth:`~powersgd_triton.layout.BucketLayout.average_tiles`) say non-zero.
    ``loss_scale``: one-element float32 ``s``; the error is stored divided by it (unscaled units).
    """
    cfg = _resolve("reconstruct", layout, buffer.dtype, config)
    split = split_cols(layout, cfg, device_sms(layout.device))
    tiles = layout.reconstruct_tiles(cfg["BLOCK_N"], split)
    R = _factor_rank(layout, cfg)
    flags = _flag_bytes(update_error.reshape(-1)) if update_error is not None else p
    n_flags = update_error.numel() if update_error is not None else 0
    local_err = 1 if local_p is not None else 2 if local_q is not None else 0
    local = local_p if local_p is not None else local_q if local_q is not None else p
    commit_mode, kept = 0, p
    if commit is not None:
        which, kept = commit
        commit_mode = 1 if which == "p" else 2
    _reconstruct_kernel[(tiles.shape[0],)](
        buffer, p, q, local, error if error is not None else p, kept, flags, first if first is not None else tiles,
        layout.table, tiles, loss_scale if loss_scale is not None else p, n_flags, float(scale),
        HAS_ERROR=error is not None, HAS_FLAG=update_error is not None, LOCAL_ERR=local_err,
        PAD_ERROR=layout.batched and error is not None, COMMIT=commit_mode,
        R=R, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], USE_DOT=cfg["USE_DOT"], PREFETCH=cfg.get("PREFETCH", 0),
        LOSS_SCALE=loss_scale is not None and error is not None, CARRY=bool(cfg.get("CARRY", False)),
        **_launch_options(cfg),
    )


def copy_segments(src, dst, layout: BucketLayout, to_packed: bool, scale: float = 1.0) -> None:
    """One launch: the uncompressed gradients, bucket -> packed buffer (``to_packed``) or packed -> bucket."""
    tiles = layout.segment_tiles(SEGMENT_BLOCK, to_packed)
    if tiles.shape[0] == 0:
        return
    _copy_segments_kernel[(tiles.shape[0],)](src, dst, tiles, float(scale), BLOCK=SEGMENT_BLOCK, num_warps=4)


def average(factor, layout: BucketLayout, which: str, buffer, unc, world_size: int):
    """One launch after the last all-reduce: ``factor /= world_size`` in place; ``unc / world_size`` into the
    bucket's uncompressed positions (``unc`` packed, or None when they are one range of ``buffer``, divided in
    place); returns ``(flags, first)``: uint8 step flags (bit 0 finite, bit 1 non-zero factor chunk) and the int32
    table of each matrix's flags, for :func:`reconstruct`."""
    packed = unc is not None
    tiles, first = layout.average_tiles(which, packed, AVERAGE_BLOCK)
    flags = torch.empty(tiles.shape[0], dtype=torch.uint8, device=buffer.device)
    if tiles.shape[0]:
        _average_kernel[(tiles.shape[0],)](
            factor, unc if packed else buffer, buffer, flags, tiles, float(world_size), BLOCK=AVERAGE_BLOCK,
            num_warps=4,
        )
    return flags, first


def commit_factor(new, kept, layout: BucketLayout, which: str, ok) -> None:
    """One launch: ``kept_i <- new_i`` for every matrix whose new factor is not all zero, if ``ok`` (device flag)."""
    columns = factor_columns(which)
    flag = ok.reshape(1)
    if flag.dtype == torch.bool:
        flag = flag.view(torch.uint8)
    _commit_factor_kernel[(layout.num_matrices,)](
        new, kept, flag, layout.table, **columns, BLOCK=256, num_warps=4
    )


# ----------------------------------------------------------------------------------------------- AOT compilation
_TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _signature(kernel: str, grad_dtype: torch.dtype) -> Dict[str, str]:
    g = "*" + _TRITON_DTYPES[grad_dtype]
    f, i64, i32 = "*fp32", "*i64", "*i32"
    if kernel == "project":
        return dict(buf_ptr=g, q_ptr=f, p_ptr=f, p2_ptr=f, e_ptr=f, table_ptr=i64, tiles_ptr=i32, ls_ptr=f)
    if kernel == "project_t":
        return dict(buf_ptr=g, p_ptr=f, q_ptr=f, q2_ptr=f, e_ptr=f, ws_ptr=f, table_ptr=i64, tiles_ptr=i32, ls_ptr=f)
    if kernel == "reduce_splits":
        return dict(ws_ptr=f, q_ptr=f, q2_ptr=f, table_ptr=i64, reduce_tiles_ptr=i32)
    if kernel == "copy_segments":
        return dict(src_ptr=g, dst_ptr=f, tiles_ptr=i64, scale="fp32")
    if kernel == "average":
        return dict(f_ptr=f, src_ptr=g, dst_ptr=g, flags_ptr="*u8", tiles_ptr=i64, world="fp32")
    if kernel == "commit_factor":
        return dict(new_ptr=f, kept_ptr=f, flag_ptr="*u8", table_ptr=i64)
    if kernel == "orthogonalize":
        return dict(x_ptr=f, out_ptr=f, ws_ptr="*fp64", tasks_ptr=i64, eps="fp32")
    if kernel == "orthogonalize_gram":
        return dict(x_ptr=f, ws_ptr="*fp64", tasks_ptr=i64)
    return dict(
        buf_ptr=g, p_ptr=f, q_ptr=f, lf_ptr=f, e_ptr=f, kept_ptr=f, flags_ptr="*u8", first_ptr=i32, table_ptr=i64,
        tiles_ptr=i32, ls_ptr=f, n_flags="i32", scale="fp32",
    )


def _constexprs(kernel: str, config: dict, max_rank: int, variant: dict) -> dict:
    use_dot = config.get("USE_DOT", False)
    c = {"R": padded_rank(max_rank, use_dot)}
    if kernel in ("orthogonalize", "orthogonalize_gram"):
        oc = _ortho_constexprs(config, c["R"])
        if kernel == "orthogonalize_gram":
            c.update(BLOCK=oc["GRAM_BLOCK"], GROUP_TILES=oc["GROUP_TILES"])
        else:
            c.update({k: oc[k] for k in ("BLOCK", "CHUNK_TILES", "SHORT_CHUNKS", "APPLY_CHUNKS", "SLOT_BLOCK")})
        return c
    if kernel == "reduce_splits":
        bm = reduce_block_m(config, c["R"])
        c.update(BLOCK_M=bm, HAS_Q2=variant.get("HAS_Q2", False), SPLIT_BLOCK=reduce_split_block(bm, c["R"]))
        return c
    if kernel == "copy_segments":
        return {"BLOCK": SEGMENT_BLOCK}
    if kernel == "average":
        return {"BLOCK": AVERAGE_BLOCK}
    if kernel == "commit_factor":
        return {"BLOCK": 256, "ROWS_COL": variant.get("ROWS_COL", COLS), "OFF_COL": variant.get("OFF_COL", Q_OFF)}
    c.update({k: config[k] for k in (_tile_key(kernel), "BLOCK_K", "USE_DOT")})
    c["PREFETCH"] = config.get("PREFETCH", 0)
    c["PAD_ERROR"] = variant.get("PAD_ERROR", False)
    c["LOSS_SCALE"] = variant.get("LOSS_SCALE", False)
    if kernel == "project":
        c["HAS_ERROR"] = variant.get("HAS_ERROR", True)
        c["HAS_P2"] = variant.get("HAS_P2", False)
    if kernel == "project_t":
        c["HAS_Q2"] = variant.get("HAS_Q2", False)
        c["PADDED"] = variant.get("PADDED", c["PAD_ERROR"])
        c["SPLIT_BF16"] = bool(config.get("SPLIT_BF16", False))
    if kernel in ("project", "reconstruct"):
        c["CARRY"] = bool(config.get("CARRY", False))
    if kernel == "reconstruct":
        c["HAS_ERROR"] = variant.get("HAS_ERROR", True)
        c["HAS_FLAG"] = variant.get("HAS_FLAG", True)
        c["LOCAL_ERR"] = variant.get("LOCAL_ERR", 0)
        c["COMMIT"] = variant.get("COMMIT", 0)
    return c


def compile_aot(kernel: str, config: dict, grad_dtype: torch.dtype, max_rank: int, arch: int, variant=None):
    """Compile ``kernel`` with ``config`` for ``sm_<arch>`` (e.g. 80, 90) without a GPU; returns the compiled kernel.

    ``variant`` sets the feature constexprs (``HAS_ERROR``, ``HAS_FLAG``, commit_factor's ``ROWS_COL``/``OFF_COL``);
    ``orthogonalize`` also compiles ``orthogonalize_gram`` (its first launch for split factors) unless
    ``WITH_GRAM=False``; ``project_t`` compiles the config its launcher would use for the variant
    (:func:`padding_error_config`). Must run with ``TRITON_INTERPRET`` unset (the interpreter replaces ``@triton.jit`` functions at import time). Raises
    ``RuntimeError`` under the interpreter and whatever Triton raises on a compile error.
    """
    from .._compat import ast_source, gpu_target

    fn = KERNEL_FUNCTIONS[kernel]
    if not hasattr(fn, "arg_names") or _env.interpreter_enabled():
        raise RuntimeError("compile_aot needs TRITON_INTERPRET unset (kernels are interpreted functions here)")
    if kernel == "project_t":  # what project_t() launches for this variant
        config = padding_error_config(config, (variant or {}).get("PAD_ERROR", False))
    constexprs = _constexprs(kernel, config, max_rank, variant or {})
    signature = dict(_signature(kernel, grad_dtype))
    if kernel == "copy_segments" and not (variant or {}).get("to_packed", True):
        signature["src_ptr"], signature["dst_ptr"] = signature["dst_ptr"], signature["src_ptr"]
    for name in constexprs:
        signature[name] = "constexpr"
    src = ast_source(fn, signature, constexprs)
    if kernel == "reduce_splits":  # launched with its own options, whatever project_t's config
        options = {"num_warps": 4, "num_stages": 1}
    else:
        options = _launch_options(config)
    compiled = triton.compile(src, target=gpu_target(arch), options=options)
    if kernel == "project_t" and variant is not None and variant.get("split"):  # the split path's reducer too
        compile_aot("reduce_splits", config, grad_dtype, max_rank, arch, dict(HAS_Q2=variant.get("HAS_Q2", False)))
    if kernel == "orthogonalize" and (variant or {}).get("WITH_GRAM", True):  # and the Gram launch of split factors
        compile_aot("orthogonalize_gram", config, grad_dtype, max_rank, arch, variant)
    return compiled


def variants(kernel: str) -> Iterable[dict]:
    """The feature-flag combinations a kernel is launched with (all are compiled in the AOT test), largest first.

    ``project``: error feedback or not, the alternating hook's second P output, the batched view's padding error,
    the loss scale of unscaled error memory (``LOSS_SCALE``, ``PowerSGDState(grad_scaler=)``; also in
    ``reconstruct`` and, for the padding error, ``project_t``).
    ``project_t``: plain, with the reducer of split matrices (``split``), second Q output, the batched view
    (``PADDED``: M has fewer than n x m elements), its padding error (``PAD_ERROR``, implies ``PADDED``).
    ``reconstruct``: the standard hooks (error feedback and/or warm-start commit of Q, gated by the step flags), the
    alternating hook's P and Q steps (local error, commit of P or Q), the batched view's padding error.
    """
    if kernel == "project":
        return [dict(HAS_ERROR=True, HAS_P2=True, LOSS_SCALE=True), dict(HAS_ERROR=True, HAS_P2=True),
                dict(HAS_ERROR=True), dict(HAS_ERROR=False),
                dict(HAS_ERROR=False, HAS_P2=True), dict(HAS_ERROR=True, PAD_ERROR=True),
                dict(HAS_ERROR=True, PAD_ERROR=True, LOSS_SCALE=True)]
    if kernel == "reconstruct":
        return [
            dict(HAS_ERROR=True, HAS_FLAG=True, LOCAL_ERR=2, COMMIT=2, LOSS_SCALE=True),
            dict(HAS_ERROR=True, HAS_FLAG=True, LOCAL_ERR=2, COMMIT=2),
            dict(HAS_ERROR=True, HAS_FLAG=True, COMMIT=2),
            dict(HAS_ERROR=True, HAS_FLAG=True),
            dict(HAS_ERROR=True, HAS_FLAG=False),
            dict(HAS_ERROR=False, HAS_FLAG=False),
            dict(HAS_ERROR=False, HAS_FLAG=True, COMMIT=2),
            dict(HAS_ERROR=True, HAS_FLAG=True, LOCAL_ERR=1, COMMIT=1),
            dict(HAS_ERROR=False, HAS_FLAG=True, COMMIT=1),
            dict(HAS_ERROR=True, HAS_FLAG=True, PAD_ERROR=True, COMMIT=2),
            dict(HAS_ERROR=True, HAS_FLAG=True, PAD_ERROR=True, COMMIT=2, LOSS_SCALE=True),
            dict(HAS_ERROR=True, HAS_FLAG=True, LOCAL_ERR=1, COMMIT=1, LOSS_SCALE=True),
        ]
    if kernel == "commit_factor":
        return [factor_columns("p"), factor_columns("q")]
    if kernel == "project_t":
        return [dict(split=True, HAS_Q2=True), dict(split=True), dict(), dict(PADDED=True), dict(PAD_ERROR=True),
                dict(PAD_ERROR=True, LOSS_SCALE=True)]
    if kernel == "copy_segments":
        return [dict(to_packed=True), dict(to_packed=False)]
    if kernel == "reduce_splits":
        return [dict(HAS_Q2=True), dict()]
    return [dict()]
