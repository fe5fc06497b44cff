"""Projection, the first step: ``P_i = (M_i [+ s·E_i]) · Q_i`` for every compressed matrix of a bucket, in ONE
launch (:func:`project`; its kernel :func:`_project_kernel` and its launch plan :func:`_project_launch`).

Program ``pid`` reads its tile from a host-built ``int32`` tile table (:func:`powersgd_triton.ops.tables.tiles`:
one program per ``BLOCK_N`` rows of a matrix; the sum over the columns stays in the program), then the matrix's row
of the ``int64`` layout table (:data:`powersgd_triton.layout.TABLE_COLUMNS`: offset, n, m, numel, rank, p_offset,
q_offset, e_offset). Ragged shapes are handled by masks; for the batched view, flat indices ``>= numel`` are the
(never stored) zero padding, whose error memory (``PAD_ERROR``) takes part in the product as in PyTorch's batched
hook.

The kernel streams M once and keeps the thin factor Q (``m x r``, float32) in cache; it is memory-bound for every r
we use (arithmetic intensity ≈ 2r / sizeof(M) flop/byte). Loads are upcast to float32 right away and accumulation is
float32. ``R`` is the bucket's largest rank padded to a power of two; columns ``>= r_i`` are masked. ``USE_DOT``
picks ``tl.dot`` (fp32 ``ieee``, needs ``R >= 16``) or a broadcast multiply: the ``[R, rows, k]`` products are
accumulated elementwise over the loop and summed over k once after it (no cross-thread reduction inside the loop;
each thread multiplies the elements it loaded by all R columns of Q in its registers). The broadcast path unrolls
its register prefetch (``PREFETCH`` p: p + 1 register sets, one per step of a loop trip); the ``CARRY`` form and
the ``tl.dot`` path with ``PREFETCH`` carry the prefetched tiles to the next trip instead (one step in flight).
Shapes and dtypes are those of :func:`powersgd_triton.ops.project`, which validates its inputs before calling here;
configs: :mod:`.configs`.

The pack of the uncompressed gradients (``project(..., packed=)``, the ``PACK`` constexpr; the layer-wise hook's
step, issue 39: one launch less per compressed bucket step): the tile table ends with one row ``(-1, g)`` per pack
program, after the project tiles; pack program ``g`` copies chunks ``g x PACK .. g x PACK + PACK - 1`` of
:func:`powersgd_triton.ops.segments.pack_chunks` (the standalone pack's chunk table, padded with empty chunks) with
:func:`powersgd_triton.ops.segments._pack_rows`: a ``[PACK, SEGMENT_BLOCK]`` tile, ``PACK`` = the config's
``num_warps``, so each warp copies one chunk (short chunks, ResNet-50's normalization parameters, cost one warp's
trip, not four warps'); 16-byte accesses where the chunks are 16-byte aligned (``PACK_ALIGN``,
:func:`powersgd_triton.ops.segments.chunk_alignment`). The values are copied as they are (the packed buffer in the
bucket's dtype). The pack programs read only uncompressed positions and the project tiles only matrices: no order
between them. sm_90, triton 3.9, the heuristic configs at rank 4: the same registers as the launch without the pack
on the aligned layout (fp32 and bf16: 96), no spills; the pack's loads and stores 16 bytes wide on aligned chunks
(fp32: 2, 2-byte dtypes: 1 ``ld/st.global.v4.b32`` per thread and trip).
"""

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from powersgd_triton.layout import BucketLayout
from powersgd_triton.ops import tables as _tables
from powersgd_triton.ops.common import (
    TILE_FIRST, TILE_MAT, TILE_WIDTH, _aligned_matrix_row, _cast_for_store, _cast_rn, _load_matrix_row, _m_plus_error,
    loop_range,
)
from powersgd_triton.ops.aligned import aligned_width
from powersgd_triton.ops.configs import _resolve
from powersgd_triton.ops.launch import DirectLaunch, _factor_rank, _launch_options
from powersgd_triton.ops.segments import SEGMENT_BLOCK, _pack_rows, chunk_alignment, pack_chunks

# Elements per row and loop trip of the pack programs (segments._pack_rows): the standalone pack's block.
PACK_BLOCK = tl.constexpr(SEGMENT_BLOCK)


@triton.jit
def _project_loads(m_ptr, e_ptr, q_ptr, rows, row_ok, ranks, k0, m, numel, r, HAS_ERROR: tl.constexpr,
                   PAD_ERROR: tl.constexpr, BLOCK_K: tl.constexpr, Q_T: tl.constexpr, ALIGN: tl.constexpr = 0):
    """The tiles one project step reads at columns ``k0:k0 + BLOCK_K`` (masked past ``m``): M's ``[rows, k]``,
    E's (zeros without ``HAS_ERROR``; with ``PAD_ERROR`` also on the padding), Q's ``[k, R]`` (``Q_T``: its
    transpose ``[R, k]``, the broadcast path's); as stored. ``ALIGN`` (the aligned layout, :func:`_project_kernel`):
    int32 offsets, every rank ``R``, no padding."""
    if ALIGN:
        cols = k0 + tl.arange(0, BLOCK_K)
    else:
        cols = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
    col_ok = cols < m
    lin = rows[:, None] * m + cols[None, :]
    inside = row_ok[:, None] & col_ok[None, :]
    if ALIGN:
        mask = inside
    else:
        mask = inside & (lin < numel)
    x = tl.load(m_ptr + lin, mask=mask, other=0.0)
    if HAS_ERROR:
        if PAD_ERROR:
            e = tl.load(e_ptr + lin, mask=inside, other=0.0)
        else:
            e = tl.load(e_ptr + lin, mask=mask, other=0.0)
    else:
        e = tl.zeros((1, 1), dtype=tl.float32)
    if ALIGN:  # every rank is R: Q's rows are R contiguous float32
        if Q_T:
            q = tl.load(q_ptr + cols[None, :] * r + ranks[:, None], mask=col_ok[None, :], other=0.0)
        else:
            q = tl.load(q_ptr + cols[:, None] * r + ranks[None, :], mask=col_ok[:, None], other=0.0)
    elif Q_T:  # [R, k]; the rank offsets are not known to be contiguous, so the load keeps the layout of M's tile
        rank_off = tl.where(ranks < r, ranks, 0)
        q = tl.load(q_ptr + cols[None, :] * r + rank_off[:, None], mask=col_ok[None, :] & (ranks[:, None] < r),
                    other=0.0)
    else:
        q = tl.load(q_ptr + cols[:, None] * r + ranks[None, :], mask=col_ok[:, None] & (ranks[None, :] < r), other=0.0)
    return x, e, q


@triton.jit
def _project_step(acc, x_raw, e_raw, q_raw, mp, scale, rows, row_ok, k0, m, numel, HAS_ERROR: tl.constexpr,
                  LOSS_SCALE: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, ALIGN: tl.constexpr = 0):
    """One project step at columns ``k0:k0 + BLOCK_K`` from its loaded tiles (:func:`_project_loads`): M + E
    (``M + scale·E`` with ``LOSS_SCALE``; stored back into M with ``HAS_ERROR``, masked past ``m`` and ``numel``: a
    step past the row's end stores nothing) times Q's tile, added to ``acc`` (``tl.dot``: ``[rows, R]``;
    broadcast: the ``[R, rows, k]`` products elementwise)."""
    x = _m_plus_error(x_raw, e_raw, scale, HAS_ERROR, LOSS_SCALE)
    if HAS_ERROR:
        if ALIGN:
            cols = k0 + tl.arange(0, BLOCK_K)
            lin = rows[:, None] * m + cols[None, :]
            tl.store(mp + lin, _cast_rn(x, mp), mask=row_ok[:, None] & (cols < m)[None, :])
        else:
            cols = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
            lin = rows[:, None] * m + cols[None, :]
            mask = row_ok[:, None] & (cols < m)[None, :] & (lin < numel)
            tl.store(mp + lin, _cast_for_store(x, mp), mask=mask)
    q = q_raw.to(tl.float32)
    if USE_DOT:
        return acc + tl.dot(x, q, input_precision="ieee")
    else:
        return acc + x[None, :, :] * q[:, None, :]


@triton.jit
def _project_kernel(
    buf_ptr,  # bucket buffer (fp32/fp16/bf16), M_i at buf_ptr + off, row-major n x m
    q_ptr,  # flat Q (float32), Q_i row-major m x r at q_ptr + q_off
    p_ptr,  # flat P output, P_i row-major n x r at p_ptr + p_off
    p2_ptr,  # second P output (HAS_P2: a half-step hook's local copy), same layout
    e_ptr,  # flat error memory (float32), E_i row-major n x m at e_ptr + e_off (unused unless HAS_ERROR)
    table_ptr,  # int64 [L, TABLE_WIDTH] layout table
    tiles_ptr,  # int32 [T, TILE_WIDTH] (TILE_MAT: matrix, TILE_FIRST: first row; PACK: -1 and the chunk group)
    ls_ptr,  # float32 [1] loss scale s (LOSS_SCALE: the error memory is unscaled, M + s·E is used)
    chunks_ptr,  # int64 [G x PACK, 3] the pack's chunk table (segments.pack_chunks; PACK only)
    packed_ptr,  # the packed uncompressed gradients (PACK only); last: a step plan binds the others
    HAS_ERROR: tl.constexpr,
    PAD_ERROR: tl.constexpr,  # batched view: the padding (flat index >= numel) has error memory too
    HAS_P2: tl.constexpr,
    R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    PREFETCH: tl.constexpr = 0,  # 1 (2): the next 1 (2) steps' tiles are loaded before a step's arithmetic
    LOSS_SCALE: tl.constexpr = False,
    CARRY: tl.constexpr = False,  # PREFETCH 1 as a loop-carried register copy (one step per trip; see below)
    ALIGN: tl.constexpr = 0,  # the aligned layout: elements of the bucket's dtype per 16 bytes (aligned.vector_width)
    PACK: tl.constexpr = 0,  # > 0: the pack of the uncompressed gradients too, PACK chunks per pack program
    PACK_ALIGN: tl.constexpr = 0,  # the chunks' alignment (segments.chunk_alignment): 16-byte accesses
):
    """P_i[rows] = (M_i + E_i)[rows] · Q_i for one tile of BLOCK_N rows (:func:`_project_tile`); with ``PACK``, the
    programs whose tile row is ``(-1, g)`` (after the project tiles) copy the uncompressed gradients' chunks
    ``g x PACK .. g x PACK + PACK - 1`` into the packed buffer instead (:func:`segments._pack_rows`, a
    ``[PACK, SEGMENT_BLOCK]`` tile: one chunk per warp)."""
    pid = tl.program_id(0)
    if PACK:
        if tl.load(tiles_ptr + TILE_WIDTH * pid + TILE_MAT) < 0:
            _pack_rows(buf_ptr, packed_ptr, chunks_ptr, tl.load(tiles_ptr + TILE_WIDTH * pid + TILE_FIRST), PACK,
                       PACK_BLOCK, PACK_ALIGN)
        else:
            _project_tile(buf_ptr, q_ptr, p_ptr, p2_ptr, e_ptr, table_ptr, tiles_ptr, ls_ptr, pid, HAS_ERROR,
                          PAD_ERROR, HAS_P2, R, BLOCK_N, BLOCK_K, USE_DOT, PREFETCH, LOSS_SCALE, CARRY, ALIGN)
    else:
        _project_tile(buf_ptr, q_ptr, p_ptr, p2_ptr, e_ptr, table_ptr, tiles_ptr, ls_ptr, pid, HAS_ERROR, PAD_ERROR,
                      HAS_P2, R, BLOCK_N, BLOCK_K, USE_DOT, PREFETCH, LOSS_SCALE, CARRY, ALIGN)


@triton.jit
def _project_tile(buf_ptr, q_ptr, p_ptr, p2_ptr, e_ptr, table_ptr, tiles_ptr, ls_ptr, pid,
                  HAS_ERROR: tl.constexpr, PAD_ERROR: tl.constexpr, HAS_P2: tl.constexpr, R: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, PREFETCH: tl.constexpr,
                  LOSS_SCALE: tl.constexpr, CARRY: tl.constexpr, ALIGN: tl.constexpr):
    """P_i[rows] = (M_i + E_i)[rows] · Q_i for one tile of BLOCK_N rows; writes M_i + E_i back if HAS_ERROR
    (``M_i + s·E_i`` with LOSS_SCALE).

    ``PREFETCH`` p unrolls the loop over the row's columns p + 1 times, one register set per step: the tiles of the
    next p steps are loaded before a step is computed, and each loaded register is consumed where it was loaded
    (a loop-carried copy waits for its loads within the trip: one step of loads in flight). A row that is not a
    multiple of (p + 1) x ``BLOCK_K`` columns ends with steps past its end: their loads are masked (zeros, so
    they add exact zeros to the accumulator) and they store nothing. ``CARRY`` (with ``PREFETCH`` 1) keeps the
    older form, one step per trip whose next tiles are copied into this step's registers; the ``tl.dot`` path
    takes ``PREFETCH`` in that form too. Every form adds the same products in the same order: the broadcast path
    accumulates the ``[R, BLOCK_N, BLOCK_K]`` products elementwise, step by step, and sums them over the columns
    once after the loop (a ``[R, BLOCK_N]`` tile of Pᵀ, stored as is)."""
    mat = tl.load(tiles_ptr + TILE_WIDTH * pid + TILE_MAT).to(tl.int64)
    if ALIGN:  # int32 offsets inside a matrix, alignment declared (common._aligned_matrix_row), every rank R
        row0 = tl.load(tiles_ptr + TILE_WIDTH * pid + TILE_FIRST)
        off, n, m, p_off, q_off, e_off = _aligned_matrix_row(table_ptr, mat, ALIGN, R)
        numel = 0
        r = R
        rows = row0 + tl.arange(0, BLOCK_N)
    else:
        row0 = tl.load(tiles_ptr + TILE_WIDTH * pid + TILE_FIRST).to(tl.int64)
        off, n, m, numel, r, p_off, q_off, e_off = _load_matrix_row(table_ptr, mat)
        rows = row0 + tl.arange(0, BLOCK_N).to(tl.int64)
    ranks = tl.arange(0, R)
    row_ok = rows < n
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, R), dtype=tl.float32)
    else:  # [R, rows, k]: a thread's loaded elements (spread over k) meet all R columns of Q in its registers
        acc = tl.zeros((R, BLOCK_N, BLOCK_K), dtype=tl.float32)
    mp = buf_ptr + off  # this matrix's M, error and Q
    ep = e_ptr + e_off
    qp = q_ptr + q_off
    scale = 1.0
    if LOSS_SCALE:  # loaded once: a load inside the loop would wait a latency per step
        scale = tl.load(ls_ptr)
    if CARRY or (USE_DOT and PREFETCH > 0):  # this step's tiles arrived during the last step; the next ones go out
        x_n, e_n, q_n = _project_loads(mp, ep, qp, rows, row_ok, ranks, 0, m, numel, r, HAS_ERROR, PAD_ERROR, BLOCK_K,
                                       not USE_DOT, ALIGN)
        for k0 in loop_range(0, m, BLOCK_K):
            x_a, e_a, q_a = x_n, e_n, q_n
            x_n, e_n, q_n = _project_loads(mp, ep, qp, rows, row_ok, ranks, k0 + BLOCK_K, m, numel, r, HAS_ERROR,
                                           PAD_ERROR, BLOCK_K, not USE_DOT, ALIGN)
            acc = _project_step(acc, x_a, e_a, q_a, mp, scale, rows, row_ok, k0, m, numel, HAS_ERROR, LOSS_SCALE,
                                BLOCK_K, USE_DOT, ALIGN)
    elif PREFETCH == 0:
        for k0 in loop_range(0, m, BLOCK_K):
            x_a, e_a, q_a = _project_loads(mp, ep, qp, rows, row_ok, ranks, k0, m, numel, r, HAS_ERROR, PAD_ERROR,
                                           BLOCK_K, not USE_DOT, ALIGN)
            acc = _project_step(acc, x_a, e_a, q_a, mp, scale, rows, row_ok, k0, m, numel, HAS_ERROR, LOSS_SCALE,
                                BLOCK_K, USE_DOT, ALIGN)
    elif PREFETCH == 1:  # register sets a, b: a's loads go out while b's step is computed, and b's during a's
        x_a, e_a, q_a = _project_loads(mp, ep, qp, rows, row_ok, ranks, 0, m, numel, r, HAS_ERROR, PAD_ERROR, BLOCK_K,
                                       not USE_DOT, ALIGN)
        for k0 in loop_range(0, m, 2 * BLOCK_K):
            x_b, e_b, q_b = _project_loads(mp, ep, qp, rows, row_ok, ranks, k0 + BLOCK_K, m, numel, r, HAS_ERROR,
                                           PAD_ERROR, BLOCK_K, not USE_DOT, ALIGN)
            acc = _project_step(acc, x_a, e_a, q_a, mp, scale, rows, row_ok, k0, m, numel, HAS_ERROR, LOSS_SCALE,
                                BLOCK_K, USE_DOT, ALIGN)
            x_a, e_a, q_a = _project_loads(mp, ep, qp, rows, row_ok, ranks, k0 + 2 * BLOCK_K, m, numel, r,
                                           HAS_ERROR, PAD_ERROR, BLOCK_K, not USE_DOT, ALIGN)
            acc = _project_step(acc, x_b, e_b, q_b, mp, scale, rows, row_ok, k0 + BLOCK_K, m, numel, HAS_ERROR,
                                LOSS_SCALE, BLOCK_K, USE_DOT, ALIGN)
    else:  # three register sets: two steps' loads in flight while one is computed
        x_a, e_a, q_a = _project_loads(mp, ep, qp, rows, row_ok, ranks, 0, m, numel, r, HAS_ERROR, PAD_ERROR, BLOCK_K,
                                       not USE_DOT, ALIGN)
        x_b, e_b, q_b = _project_loads(mp, ep, qp, rows, row_ok, ranks, BLOCK_K, m, numel, r, HAS_ERROR, PAD_ERROR,
                                       BLOCK_K, not USE_DOT, ALIGN)
        for k0 in loop_range(0, m, 3 * BLOCK_K):
            x_c, e_c, q_c = _project_loads(mp, ep, qp, rows, row_ok, ranks, k0 + 2 * BLOCK_K, m, numel, r,
                                           HAS_ERROR, PAD_ERROR, BLOCK_K, not USE_DOT, ALIGN)
            acc = _project_step(acc, x_a, e_a, q_a, mp, scale, rows, row_ok, k0, m, numel, HAS_ERROR, LOSS_SCALE,
                                BLOCK_K, USE_DOT, ALIGN)
            x_a, e_a, q_a = _project_loads(mp, ep, qp, rows, row_ok, ranks, k0 + 3 * BLOCK_K, m, numel, r,
                                           HAS_ERROR, PAD_ERROR, BLOCK_K, not USE_DOT, ALIGN)
            acc = _project_step(acc, x_b, e_b, q_b, mp, scale, rows, row_ok, k0 + BLOCK_K, m, numel, HAS_ERROR,
                                LOSS_SCALE, BLOCK_K, USE_DOT, ALIGN)
            x_b, e_b, q_b = _project_loads(mp, ep, qp, rows, row_ok, ranks, k0 + 4 * BLOCK_K, m, numel, r,
                                           HAS_ERROR, PAD_ERROR, BLOCK_K, not USE_DOT, ALIGN)
            acc = _project_step(acc, x_c, e_c, q_c, mp, scale, rows, row_ok, k0 + 2 * BLOCK_K, m, numel, HAS_ERROR,
                                LOSS_SCALE, BLOCK_K, USE_DOT, ALIGN)
    if USE_DOT:
        p_mask = row_ok[:, None] & (ranks[None, :] < r)
        local = p_off + rows[:, None] * r + ranks[None, :]
    else:  # Pᵀ's tile [R, rows], stored as is
        acc = tl.sum(acc, axis=2)
        p_mask = row_ok[None, :] & (ranks[:, None] < r)
        local = p_off + rows[None, :] * r + ranks[:, None]
    tl.store(p_ptr + local, _cast_for_store(acc, p_ptr), mask=p_mask)
    if HAS_P2:
        tl.store(p2_ptr + local, _cast_for_store(acc, p2_ptr), mask=p_mask)


def project(buffer, layout: BucketLayout, q, p, error=None, *, p2=None, loss_scale=None, packed=None,
            config: Optional[dict] = None) -> None:
    """One launch: ``P_i = (M_i [+ s·E_i]) · Q_i`` for all i (see :func:`powersgd_triton.ops.project`); ``p2``: a
    second copy of P written by the same launch; ``loss_scale``: the one-element float32 ``s`` (else ``s = 1``);
    ``packed``: the uncompressed gradients are packed into it by the same launch (its pack programs, after the
    project tiles). The launch plan (config, tiles, grid, constexprs, the compiled kernel:
    :class:`~powersgd_triton.ops.launch.DirectLaunch`) is built once per layout, config and variant."""
    launch, args = _project_args(buffer, layout, q, p, error, p2, loss_scale, packed is not None, config)
    launch(*args, packed if packed is not None and layout.uncompressed_numel else p)


def project_bound(buffer, layout: BucketLayout, q, p, error=None, *, p2=None, loss_scale=None, packed=False,
                  config: Optional[dict] = None):
    """The launch :func:`project` makes with these arguments, its launch plan and arguments bound now
    (``functools.partial`` of the plan's :class:`~powersgd_triton.ops.launch.DirectLaunch`; the hooks' per-memory
    step plans, :meth:`powersgd_triton.ops.backend.TritonSteps.plan_step`): a callable of no argument, or with
    ``packed`` True one of the packed buffer (allocated per step: the kernel's last argument)."""
    launch, args = _project_args(buffer, layout, q, p, error, p2, loss_scale, packed, config)
    return functools.partial(launch, *args) if packed else functools.partial(launch, *args, p)


def _project_args(buffer, layout, q, p, error, p2, loss_scale, packs, config):
    """``(launch, arguments but the last)`` (the packed buffer, or P standing in for it)."""
    packs = bool(packs) and layout.uncompressed_numel > 0
    key = ("launch:project", buffer.dtype, None if config is None else tuple(config.items()), error is not None,
           p2 is not None, loss_scale is not None, packs)
    plan = layout._tiles.get(key)  # the layout's memo (layout.memo), read without a call
    if plan is None:
        plan = layout.memo(key, lambda: _project_launch(layout, buffer.dtype, config, *key[3:]))
    launch, tiles, chunks = plan
    return launch, (buffer, q, p, p2 if p2 is not None else p, error if error is not None else p, layout.table,
                    tiles, loss_scale if loss_scale is not None else p, chunks)


def _project_launch(layout, dtype, config, has_error, has_p2, has_ls, packs=False):
    """``(launch, tiles, chunks)``; with ``packs``, the tiles end with one row ``(-1, g)`` per pack program, each of
    ``num_warps`` chunks of :func:`~powersgd_triton.ops.segments.pack_chunks` (the tiles stand in for ``chunks``
    without)."""
    cfg = _resolve("project", layout, dtype, config)
    tiles = _tables.tiles(layout, "rows", cfg["BLOCK_N"])
    R = _factor_rank(layout, cfg)
    options = _launch_options(cfg)
    chunks, pack = tiles, dict(PACK=0, PACK_ALIGN=0)
    if packs:
        rows = options["num_warps"]
        chunks = pack_chunks(layout, rows)
        groups = chunks.shape[0] // rows
        extra = torch.stack([torch.full((groups,), -1, dtype=torch.int32), torch.arange(groups, dtype=torch.int32)], 1)
        tiles = torch.cat([tiles, extra.to(tiles.device)]).contiguous()
        pack = dict(PACK=rows, PACK_ALIGN=chunk_alignment(layout))
    return DirectLaunch(_project_kernel, (tiles.shape[0],), dict(
        HAS_ERROR=has_error, PAD_ERROR=layout.batched and has_error, HAS_P2=has_p2,
        R=R, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], USE_DOT=cfg["USE_DOT"], PREFETCH=cfg.get("PREFETCH", 0),
        LOSS_SCALE=has_ls and has_error, CARRY=bool(cfg.get("CARRY", False)), ALIGN=aligned_width(layout, dtype, cfg),
        **pack, **options)), tiles, chunks
