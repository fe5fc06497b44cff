"""Tile tables, config spaces and untuned heuristic configs of every tuned kernel (``project``, ``project_t`` and its
``reduce_splits``, ``reconstruct``, ``orthogonalize`` and its ``orthogonalize_gram`` launch).

The tables are the heuristic tiles per (padded rank, gradient element size) and how they were chosen (sm_90
compile, ptxas -v, the SASS replay of :func:`tools.aot.sass_loops`, the performance model); a Triton whose register
allocation spills a table's tile takes the override of :mod:`powersgd_triton.compat.tiles`. No kernel is imported
here.

A config is a dict of the kernel's block sizes plus ``num_warps``/``num_stages`` (and optionally ``maxnreg``, the
registers per thread ptxas may use: a compile option, passed at launch and to
:func:`~tools.aot_compile.compile_aot`):

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

:func:`config_space` lists the candidates the autotuner times, :func:`heuristic_config` the untuned default (the
tables below), and :data:`INTERPRETER_CONFIGS` the one config used under ``TRITON_INTERPRET=1`` (large blocks:
the interpreter's cost grows with programs x loop steps).
"""

import itertools
from typing import Dict, List, Optional

import torch

from powersgd_triton.compat import env as _env
from powersgd_triton.compat import tiles as _compat_tiles
from powersgd_triton.layout import KERNELS, MIN_DOT_RANK, BucketLayout, padded_rank
from powersgd_triton.ops.aligned import (
    ALIGNED_PROJECT_T_CONFIG, ALIGNED_PROJECT_T_SPLIT_CONFIG, ALIGNED_PROJECT_TILES, ALIGNED_RECONSTRUCT_TILES, vector_width,
)
from powersgd_triton.ops.launch import device_sms

# The kernels that stream the bucket (the ones the performance targets are about).
STREAMING_KERNELS = ("project", "project_t", "reconstruct")

# The one config per kernel used under TRITON_INTERPRET=1 (large blocks: the interpreter's cost grows with programs x
# loop steps).
INTERPRETER_CONFIGS: Dict[str, dict] = {
    "project": dict(BLOCK_N=64, BLOCK_K=64, USE_DOT=False, num_warps=4, num_stages=1),
    "project_t": dict(BLOCK_M=64, BLOCK_K=64, USE_DOT=False, num_warps=4, num_stages=1),
    "orthogonalize": dict(BLOCK=256, SHORT_ROWS=4096, GRAM_ROWS=256, SPLIT_ROWS=256, num_warps=4, num_stages=1),
    "reconstruct": dict(BLOCK_N=64, BLOCK_K=64, USE_DOT=False, num_warps=4, num_stages=1),
}


def _tile_key(kernel: str) -> str:
    return "BLOCK_M" if kernel == "project_t" else "BLOCK_N"


# Register budget of the broadcast-multiply path, per thread: elements of the [rows, k, R] accumulator (project,
# project_t) or product (reconstruct), and elements of one loaded tile. 16 and 8 keep the heuristic configs at
# <= 128 registers without spills for R <= 8 on sm_90 (ptxas -v, triton 3.9: tests/test_compile_table.py); 32
# accumulator elements per thread measured 128-150 registers.
BROADCAST_ELEMENTS_PER_THREAD = 16
TILE_ELEMENTS_PER_THREAD = 8


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
# the SASS replay of tools.aot.sass_loops) for the plain and the second-Q-output variants: no
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
# (triton 3.9: ptxas -v and the SASS replay of tools.aot.sass_loops) for all 12 variants x
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
# The tl.dot heuristic of reconstruct (R >= 16) and of project at R 32 (configs.heuristic_config)
DOT_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 32, "USE_DOT": True, "num_warps": 4, "num_stages": 2}


def broadcast_tile(kernel: str, table: dict, r: int, es: int) -> tuple:
    """The tile of ``table[(r, es)]`` (:data:`PROJECT_TILES`, :data:`PROJECT_T_TILES`, :data:`RECONSTRUCT_TILES`) for
    this Triton: the override of :func:`powersgd_triton.compat.tiles.broadcast_override` (an installed triton at or
    below the version of an entry of ``OLDER_TRITON_TILES``), else the table's."""
    older = _compat_tiles.broadcast_override(kernel, r, es)
    return table[(r, es)] if older is None else older


def dot_config(kernel: str, r: int, es: int, cfg: dict) -> dict:
    """The tl.dot heuristic ``cfg`` of ``kernel`` at padded rank ``r`` and gradient element size ``es`` for this
    Triton: with the keys :func:`powersgd_triton.compat.tiles.dot_override` replaces for an installed triton at or
    below an entry's version (``OLDER_TRITON_DOT``). A new dict."""
    older = _compat_tiles.dot_override(kernel, r, es)
    return dict(cfg) if older is None else dict(cfg, **older)


# project_t on the batched view (one padded s x s matrix: the PADDED and PAD_ERROR variants, whose masks and
# padding-error loads take more registers): one tile for every R <= 8, no unrolling (one step in flight), chosen
# like PROJECT_T_TILES for both variants (no spills, one latency per step at R 1-8, fp32 and bf16).
PROJECT_T_BATCHED_TILE = (512, 4, 0, 128)


def project_t_batched_tile(r: int, es: int) -> tuple:
    """:data:`PROJECT_T_BATCHED_TILE` for this Triton at padded rank ``r`` and gradient element size ``es``
    (``OLDER_TRITON_TILES``' ``"project_t_batched"`` entries, :mod:`powersgd_triton.compat.tiles`)."""
    return broadcast_tile("project_t_batched", {(r, es): PROJECT_T_BATCHED_TILE}, r, es)
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
    out = [_broadcast_config("project_t", *broadcast_tile("project_t", PROJECT_T_TILES, R, es)) for es in (4, 2)]
    for es in (4, 2):  # the batched view's tile (this Triton's)
        if _broadcast_config("project_t", *project_t_batched_tile(R, es)) not in out:
            out.append(_broadcast_config("project_t", *project_t_batched_tile(R, es)))
    for (bm, bk), prefetch, maxnreg in itertools.product(_PROJECT_T_TILES, (0, 1, 2), _PROJECT_T_MAXNREG):
        held = (1 + prefetch) * bk * (bm // 128 + R) + R * bm // 128
        cfg = _broadcast_config("project_t", bm, bk, prefetch, maxnreg)
        if 8 * held <= 5 * maxnreg and cfg not in out:
            out.append(cfg)
    return out


def split_bf16_dot(cfg: dict, dtype: torch.dtype, variant: Optional[dict] = None) -> bool:
    """Whether project_t with ``cfg`` on a ``dtype`` bucket takes the split tensor-core path
    (:func:`powersgd_triton.ops.common._dot_bf16_split`): ``USE_DOT`` and ``SPLIT_BF16`` set, a 2-byte
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


def _ortho_heuristic(R: int) -> dict:
    """Orthogonalize default at padded rank R, from a model of an H100/H200 (132 SMs, ~4 TB/s, 64K registers/SM).

    * ``BLOCK`` rows per tile and warps: :data:`ORTHO_BLOCKS` and :data:`ORTHO_WARPS` (2048 rows at R 1, 1024 at
      R 2-4, 512 at R 8, 256 at R 16, 16 warps; R 32: 32 rows, 8 warps), held in float64 in registers. Chosen from
      the sm_90 compile (ptxas -v, triton 3.9): no spills at any R <= 32, at most 128 registers per thread up to
      R 16 (triton <= 3.6: half the rows at 8 warps at R 4, 8 and 16, as the JIT compiles them; triton 3.4 a
      quarter at R 8, 32 rows at R 16, 16 at R 32: ``compat.tiles.OLDER_TRITON_ORTHO``; at R 32 triton 3.4 spills at
      every tile tried); the Gram launch
      reads at most :data:`ORTHO_GRAM_BLOCK` rows per tile;
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
    block, warps = ORTHO_BLOCKS.get(R, max(16, 1024 // R)), ORTHO_WARPS.get(R, 8)
    older = _compat_tiles.ortho_override(R)
    if older is not None:  # this Triton spills the entry (compat.tiles.OLDER_TRITON_ORTHO)
        block, warps = older[:2]
    extra = {}
    if R <= 4:
        short = max(block, min(ORTHO_SHORT_BYTES // (4 * R), 32 * block))
        gram = max(block, 512)
    else:
        short = gram = ORTHO_WIDE_TILES.get(R, 4) * block
        if older is not None and len(older) > 2:
            gram = older[2]
        if R in ORTHO_WIDE_SHORT_ROWS:
            short, extra = ORTHO_WIDE_SHORT_ROWS[R], dict(APPLY_ROWS=ORTHO_APPLY_ROWS[R])
    split = ORTHO_SPLIT_ROWS if R <= 8 else 2 * ORTHO_SPLIT_ROWS
    return dict(BLOCK=block, SHORT_ROWS=short, GRAM_ROWS=gram, SPLIT_ROWS=split, num_warps=warps, num_stages=3,
                **extra)




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
        for es in (4, 2):  # this Triton's heuristic tile (OLDER_TRITON_TILES), and the table's
            for entry in (broadcast_tile(kernel, table, r, es), table[(r, es)]):
                cfg = _broadcast_config(kernel, *entry)
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
        if kernel == "reconstruct" and r >= MIN_DOT_RANK:  # this Triton's heuristic (OLDER_TRITON_DOT)
            for es in (4, 2):
                cfg = dot_config(kernel, r, es, DOT_CONFIG)
                if cfg not in out:
                    out.append(cfg)
        if kernel == "project_t" and dtype.itemsize == 2:  # the split bfloat16 tensor-core dots
            for (bm, bk), pps in itertools.product(_SPLIT_DOT_TILES, (3, 6)):
                out.append({"BLOCK_M": bm, "BLOCK_K": bk, "USE_DOT": True, "SPLIT_BF16": True, "PROGRAMS_PER_SM": pps,
                            "num_warps": 4, "num_stages": 3})
    if not out:  # very large rank: smallest broadcast tile
        out.append({tile: 4 if kernel != "project_t" else 32, "BLOCK_K": 16 if kernel != "project_t" else 2,
                    "USE_DOT": False, "num_warps": 4, "num_stages": 2})
    return out


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
    if kernel == "project_t" and _aligned(layout, dtype):  # ops.aligned: FMA rows (4-byte), tensor cores (2-byte)
        if dtype.itemsize == 2:
            return dict(ALIGNED_PROJECT_T_SPLIT_CONFIG)
        if r <= 8:
            return dict(ALIGNED_PROJECT_T_CONFIG)
    if (kernel == "project_t" and r >= PROJECT_T_SPLIT_MIN_RANK and dtype.itemsize == 2
            and not getattr(layout, "batched", False)):  # split_bf16_dot's tensor cores (R padded to 16)
        return dict(PROJECT_T_SPLIT_CONFIG)
    es = 4 if dtype.itemsize >= 4 else 2  # the tile tables' element-size column (runs at every launch: no tensor)
    if r >= MIN_DOT_RANK:
        if kernel == "project_t":  # (2-byte gradients took the split path above)
            return dict(PROJECT_T_FP32_DOT_CONFIG)
        if kernel == "project" and r <= 16:  # 64 columns per step: 188 registers, no spills (sm_90); 128 spill
            # (OLDER_TRITON_DOT: triton <= 3.8 takes 32 columns per step on 2-byte gradients)
            return dot_config(kernel, r, es, {"BLOCK_N": 16, "BLOCK_K": 64, "USE_DOT": True, "num_warps": 4,
                                              "num_stages": 3})
        # (OLDER_TRITON_DOT: triton <= 3.6 takes reconstruct's R 32 fp32 at 16 columns per step)
        return dot_config(kernel, r, es, DOT_CONFIG)
    if kernel == "project_t":
        if getattr(layout, "batched", False):
            return _broadcast_config("project_t", *project_t_batched_tile(r, es))
        return _broadcast_config("project_t", *broadcast_tile("project_t", PROJECT_T_TILES, r, es))
    if kernel == "project":
        if (r, es) in ALIGNED_PROJECT_TILES and _aligned(layout, dtype):  # 16 bytes per thread (ops.aligned)
            return _broadcast_config("project", *broadcast_tile("project_aligned", ALIGNED_PROJECT_TILES, r, es))
        return _broadcast_config("project", *broadcast_tile("project", PROJECT_TILES, r, es))
    if (r, es) in ALIGNED_RECONSTRUCT_TILES and _aligned(layout, dtype):
        return _broadcast_config("reconstruct", *ALIGNED_RECONSTRUCT_TILES[(r, es)])
    return _broadcast_config("reconstruct", *broadcast_tile("reconstruct", RECONSTRUCT_TILES, r, es))


def _aligned(layout, dtype: torch.dtype) -> bool:
    """Whether the heuristic sizes tiles for the aligned layout (:func:`powersgd_triton.ops.aligned.vector_width`):
    a bucket layout's own answer, or the ``aligned`` attribute of the stand-in the compile table passes."""
    if isinstance(layout, BucketLayout):
        return vector_width(layout, dtype) > 0
    return bool(getattr(layout, "aligned", False))


def _resolve(kernel: str, layout: BucketLayout, dtype: torch.dtype, config: Optional[dict]) -> dict:
    if config is None:
        return heuristic_config(kernel, layout, dtype, device_sms(layout.device))
    return config
