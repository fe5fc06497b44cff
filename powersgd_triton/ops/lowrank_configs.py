"""Tile tables and candidate configs of the streaming kernels: ``project``, ``project_t`` (and its
``reduce_splits``) and ``reconstruct``.

The tables below are the heuristic tiles per (padded rank, gradient element size) and how they were chosen (sm_90
compile, ptxas -v, the SASS replay of :func:`tools.aot.sass_loops`, the performance model);
:func:`powersgd_triton.ops.configs.config_space` and :func:`~powersgd_triton.ops.configs.heuristic_config`
read them. No kernel is imported here.
"""

import functools
import itertools
from typing import List, Optional

import torch

from powersgd_triton.ops.launch_common import _tile_key

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
# Tiles for an older Triton whose register allocation spills a table's tile: {the newest triton (major, minor) the
# entry applies to: {(kernel, padded rank, element size): tile}} (broadcast_tile). Seen on the sm_90 compile under
# triton 3.6 (ptxas -v, every variant): reconstruct's R 8 tile 16 x 32 PREFETCH 2 spills 56 bytes in fp32 and 104
# in bf16 (PREFETCH 1: 24 / 32); the nearest tile that does not spill keeps BLOCK_K, PREFETCH and maxnreg and takes
# half the rows (8 x 32 PREFETCH 2 at 128 registers: no spills in fp32, bf16); likewise R 2 bf16, whose 16 x 32
# PREFETCH 2 spills 8 bytes in the padding-error commit variant (8 x 32: 72-122 registers, none). project_t's broadcast tiles (split +
# HAS_Q2, split, plain) spill under triton 3.6 at six of its eight entries (bytes: R 1 fp32 224-236, R 1 bf16 176,
# R 2 bf16 36, R 4 fp32 12, R 4 bf16 176-484, R 8 fp32 28-64); the nearest that does not spill keeps the tile and
# PREFETCH and raises maxnreg to the next notch that holds it (R 1 fp32 and bf16: 72 -> 96, 80 still spills; R 2
# bf16: 72 -> 80; R 4 fp32: 96 -> 112), or where the cap is already 128 takes half the rows per step (R 4 bf16:
# 512 x 2 PREFETCH 1; R 8 fp32: 256 x 4 PREFETCH 0). triton 3.4 takes those and also spills project_t's R 2 fp32
# tile (512 x 2 PREFETCH 2 at 72: 24 bytes), so 80 there, and reconstruct's R 4 tile (8 x 64 PREFETCH 2 at 128:
# 40-168 bytes in fp32, 152-160 in bf16, in the commit variants), so half the rows (4 x 64: none). The whole compile
# table (tests/test_compile_table.py: every variant x fp32/bf16/fp16, triton 3.6) found two more under 3.6, in 2-byte
# gradients at R 4: project_t's 512 x 2 PREFETCH 1 spills 16 bytes in fp16's wire variant (512 x 1: 111-128
# registers, none in the wire, second-Q and plain variants, bf16 and fp16), reconstruct's 8 x 64 PREFETCH 2 8-16
# bytes in fp16's padding-error commit variants (4 x 64, triton 3.4's tile: 120-123 registers, none). Under triton
# 3.8 (the same table): project_t's R 1 bf16 tile spills 16 bytes (maxnreg 72 -> 96, as 3.6: none), reconstruct's
# R 1 fp32 and R 2 fp16 16 x 32 tiles 16-24 bytes in the padding-error commit variants (half the rows, 8 x 32: none
# in all 12 variants, also under 3.6 for R 1 fp32), project_t's batched tile at R 8 in bf16 88 bytes in the
# padding-error, loss-scale, wire variant (half the rows per step, 512 x 2 PREFETCH 0: none in the 4 batched
# variants, under 3.6 too); "project_t_batched" keys project_t_batched_tile. The first entry (the oldest) holding
# a key wins. Not tuned against the model.
OLDER_TRITON_TILES = {
    (3, 4): {("project_t", 2, 4): (512, 2, 2, 80), ("reconstruct", 4, 4): (4, 64, 2, 128)},
    (3, 6): {("reconstruct", 8, 4): (8, 32, 2, 128), ("reconstruct", 8, 2): (8, 32, 2, 128),
             ("reconstruct", 2, 2): (8, 32, 2, 128), ("reconstruct", 4, 2): (4, 64, 2, 128),
             ("project_t", 1, 4): (512, 4, 1, 96), ("project_t", 1, 2): (256, 8, 1, 96),
             ("project_t", 2, 2): (512, 2, 2, 80), ("project_t", 4, 4): (512, 2, 2, 112),
             ("project_t", 4, 2): (512, 1, 1, 128), ("project_t", 8, 4): (256, 4, 0, 128)},
    (3, 8): {("project_t", 1, 2): (256, 8, 1, 96), ("reconstruct", 1, 4): (8, 32, 2, 128),
             ("reconstruct", 2, 2): (8, 32, 2, 128), ("project_t_batched", 8, 2): (512, 2, 0, 128)},
}
# The tl.dot heuristics (R >= 16) changed for an older Triton: {newest triton (major, minor): {(kernel, padded rank,
# element size): the keys replaced}}, first (oldest) entry wins (dot_config). Seen under triton 3.6 (sm_90, ptxas -v,
# the whole compile table): reconstruct at R 32 in fp32 (16 x 32, 2 stages) spills 16 bytes in the padding-error
# commit variant with the loss scale (168 registers); half the columns per step (16 x 16, 2 stages) spill nothing
# (128-132 registers), one stage less neither (166-176). Not tuned against the model.
OLDER_TRITON_DOT = {(3, 6): {("reconstruct", 32, 4): dict(BLOCK_K=16)}}
# The tl.dot heuristic of reconstruct (R >= 16) and of project at R 32 (configs.heuristic_config)
DOT_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 32, "USE_DOT": True, "num_warps": 4, "num_stages": 2}


@functools.lru_cache(maxsize=None)
def _triton_minor() -> Optional[tuple]:
    from powersgd_triton.compat import versions as _compat

    v = _compat.triton_version()
    return None if v is None else tuple(v[:2])


def broadcast_tile(kernel: str, table: dict, r: int, es: int) -> tuple:
    """The tile of ``table[(r, es)]`` (:data:`PROJECT_TILES`, :data:`PROJECT_T_TILES`, :data:`RECONSTRUCT_TILES`) for
    this Triton: :data:`OLDER_TRITON_TILES`' entry for an installed triton at or below the entry's version."""
    v = _triton_minor()
    if v is not None:
        for newest, tiles in sorted(OLDER_TRITON_TILES.items()):
            if v <= newest and (kernel, r, es) in tiles:
                return tiles[(kernel, r, es)]
    return table[(r, es)]


def dot_config(kernel: str, r: int, es: int, cfg: dict) -> dict:
    """The tl.dot heuristic ``cfg`` of ``kernel`` at padded rank ``r`` and gradient element size ``es`` for this
    Triton: with :data:`OLDER_TRITON_DOT`'s keys for an installed triton at or below an entry's version. A new
    dict."""
    v = _triton_minor()
    if v is not None:
        for newest, entries in sorted(OLDER_TRITON_DOT.items()):
            if v <= newest and (kernel, r, es) in entries:
                return dict(cfg, **entries[(kernel, r, es)])
    return dict(cfg)


# project_t on the batched view (one padded s x s matrix: the PADDED and PAD_ERROR variants, whose masks and
# padding-error loads take more registers): one tile for every R <= 8, no unrolling (one step in flight), chosen
# like PROJECT_T_TILES for both variants (no spills, one latency per step at R 1-8, fp32 and bf16).
PROJECT_T_BATCHED_TILE = (512, 4, 0, 128)


def project_t_batched_tile(r: int, es: int) -> tuple:
    """:data:`PROJECT_T_BATCHED_TILE` for this Triton at padded rank ``r`` and gradient element size ``es``
    (:data:`OLDER_TRITON_TILES`' ``"project_t_batched"`` entries)."""
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
