"""The aligned layout (issue 39): when the streaming kernels may read and write a bucket 16 bytes at a time, and the
tiles they do it with.

A bucket whose compressed matrices start at and span multiples of 16 bytes (:func:`vector_width`; the common case:
every matrix of ResNet-50's, BERT's and GPT-2's 25 MB buckets but the one holding ResNet-50's first convolution,
64 x 147) is launched with the ``ALIGN`` constexpr of ``project``, ``project_t`` and ``reconstruct`` set to the
vector width (4 float32, 8 bfloat16 / float16): their table reads declare the alignment (``tl.multiple_of``), their
offsets inside a matrix are 32-bit, their masks are per row and per 16-byte group (no per-element ``numel`` test),
and their 2-byte stores round with the GPU's own conversion; Triton then gives each thread 16 contiguous bytes of
every M / E tile and emits ``ld.global.v4`` / ``st.global.v4``. Every other layout keeps the masked path
(``ALIGN`` 0), element for element the same numbers.

The tile tables below replace the masked path's where that one cannot give 16 bytes per thread (a 2-byte tile
needs 8 elements per thread: ``BLOCK_N x BLOCK_K >= 8 x 128`` threads of 4 warps). Chosen on the sm_90 compile
with the JIT's GPU attributes (16-byte-aligned pointers divisible by 16), triton 3.9: every variant of the hooks
16 bytes wide (PTX), no spills, one DRAM latency per loop trip (SASS replay), fewest SASS instructions per element.
"""

import torch

from powersgd_triton.layout import BucketLayout

# project's broadcast path on the aligned layout, by (padded rank, gradient element size): (BLOCK_N, BLOCK_K,
# PREFETCH, maxnreg) as configs.PROJECT_TILES, 4 warps; entries missing here take configs.PROJECT_TILES (4-byte
# tiles of 4 elements per thread). sm_90, triton 3.9, error feedback with and without the second P output and loss
# scale: 2-byte R 1-4 8 x 128 PREFETCH 1: 62-96 registers, 0.28-0.38 SASS warp-instructions per element, stores
# 16 bytes (the masked path's 8 x 64: 8 bytes); R 8 PREFETCH 0 (124 registers; PREFETCH 1: 156). 4-byte R 8:
# 8 x 64 PREFETCH 1, 92-96 registers, 0.57 (the masked path's 4 x 64: 2 elements, 8 bytes per thread).
ALIGNED_PROJECT_TILES = {
    (1, 2): (8, 128, 1, 0), (2, 2): (8, 128, 1, 0), (4, 2): (8, 128, 1, 0), (8, 2): (8, 128, 0, 0),
    (8, 4): (8, 64, 1, 0),
}
# reconstruct's broadcast path on the aligned layout (every entry; configs.RECONSTRUCT_TILES' 8 x 64 and 16 x 32
# tiles convert Q's [BLOCK_K, R] tile through shared memory every step, 8 x 64 fp32 R 4: 0.64 warp-instructions per
# element): 8 rows x 128 columns, PREFETCH 1 up to R 4 (fp32 R 4: 96 registers, 0.40; bf16: 111, 0.48; the
# local-error (LOCAL_ERR) and loss-scale variants up to 128, no spills), PREFETCH 0 at R 8 (PREFETCH 1 spills
# 24 bytes in bf16's LOCAL_ERR 1 variant). The product is rank by rank (reconstruction._outer_ranks).
# project_t on the aligned layout. 4-byte gradients, R <= 8 (projection_t._project_t_aligned: one row per step,
# P's row as scalars, an FMA per element and rank): BLOCK_M = 1024 columns (two 16-byte groups per thread), BLOCK_K
# = 4 rows per unrolled trip, 128 registers (row splits for the 4 blocks per SM that leaves). sm_90, triton 3.9: at
# R 1-4 every load of a trip issued before the trip waits (one DRAM latency per trip in the SASS replay; without the
# cap ptxas interleaves the rows' loads with their FMAs, 8 latencies per 8-row trip at R 4), 76-115 registers, no
# spills, 0.09-0.20 SASS warp-instructions per element (the masked path's 512 x 2: 0.47-0.60); R 8 128 registers,
# 2 latencies per trip. 2-byte gradients, any rank: the split tensor-core path (bfloat16 pieces of P, float32
# accumulator) on tiles whose loads are 16 bytes (cp.async) at every rank: 256 columns x 32 rows, 3 stages (bf16 R 4:
# 83 registers, 0.24 warp-instructions per element).
ALIGNED_PROJECT_T_CONFIG = dict(BLOCK_M=1024, BLOCK_K=4, USE_DOT=False, maxnreg=128, num_warps=4, num_stages=1)
ALIGNED_PROJECT_T_SPLIT_CONFIG = dict(BLOCK_M=256, BLOCK_K=32, USE_DOT=True, SPLIT_BF16=True, PROGRAMS_PER_SM=3,
                                      num_warps=4, num_stages=3)
ALIGNED_RECONSTRUCT_TILES = {
    (1, 4): (8, 128, 1, 0), (2, 4): (8, 128, 1, 0), (4, 4): (8, 128, 1, 0), (8, 4): (8, 128, 0, 0),
    (1, 2): (8, 128, 1, 0), (2, 2): (8, 128, 1, 0), (4, 2): (8, 128, 1, 0), (8, 2): (8, 128, 0, 0),
}


def vector_width(layout: BucketLayout, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` (the bucket's) per 16 bytes when the streaming kernels may read and write every compressed
    matrix of ``layout`` 16 bytes at a time, else 0 (the masked path of any layout).

    The aligned layout (issue 39): a layer-wise layout (not the batched view, whose padding is masked per element)
    whose every matrix starts at a multiple of 16 bytes in the bucket (``offset``) and spans whole 16-byte groups
    per row (``m``), whose error memory starts at a multiple of 16 bytes (``e_offset`` a multiple of 4 float32),
    whose ranks all equal the padded rank (P's and Q's rows are ``R`` contiguous float32: no rank mask) and whose
    matrices have fewer than 2^31 elements (32-bit offsets inside a matrix). The bucket buffer, the factors and the
    error memory are then read at addresses the compiler can prove 16-byte aligned whenever the tensors themselves
    are (Triton's JIT specializes a 16-byte-aligned tensor argument as divisible by 16; an unaligned one gets a
    compile without that attribute, whose accesses stay narrow but correct). Decided once per layout and dtype
    (memoized with the layout)."""
    key = ("vector_width", dtype)
    width = layout._tiles.get(key)
    if width is None:
        width = layout.memo(key, lambda: _vector_width(layout, torch.empty((), dtype=dtype).element_size()))
    return width


def _vector_width(layout: BucketLayout, element_size: int) -> int:
    if layout.batched or not layout.matrices or 16 % element_size:
        return 0
    vec = 16 // element_size
    rank = max(s.rank for s in layout.matrices)
    full = 1
    while full < rank:
        full *= 2
    for s in layout.matrices:
        if s.offset % vec or s.m % vec or s.e_offset % 4 or s.rank != full or s.numel != s.n * s.m \
                or s.n * s.m >= 2**31:
            return 0
    return vec


def aligned_width(layout: BucketLayout, dtype: torch.dtype, cfg: dict, kernel: str = "") -> int:
    """The ``ALIGN`` constexpr of a streaming launch with ``cfg`` on ``layout``: the 16-byte vector width of the
    aligned layout (:func:`vector_width`) on the broadcast path and on project_t's split tensor-core path of 2-byte
    gradients (``kernel="project_t"``); 0 (the masked path) on the other ``tl.dot`` paths, where ``cfg`` says
    ``ALIGN=False`` (the tests run both paths on one layout), or where its ``BLOCK_K`` (project_t: ``BLOCK_M``) is not
    a multiple of the width (column ranges start at whole steps or tiles)."""
    split_dot = kernel == "project_t" and cfg.get("SPLIT_BF16") and torch.empty((), dtype=dtype).element_size() == 2
    if (cfg.get("USE_DOT") and not split_dot) or not cfg.get("ALIGN", True):
        return 0
    vec = vector_width(layout, dtype)
    # the column ranges a program starts at are whole tiles (project_t) or whole steps (reconstruct's splits)
    step = cfg.get("BLOCK_M", 0) if kernel == "project_t" else cfg.get("BLOCK_K", 0)
    return vec if step % max(vec, 1) == 0 else 0


