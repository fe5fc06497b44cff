"""Transposed projection: ``Q_i = M_iᵀ · P_i`` for every compressed matrix of a bucket (:func:`project_t`: ONE launch
of :func:`_project_t_kernel`, plus one of :func:`_reduce_splits_kernel` when the plan splits a matrix over rows),
its row splits (:func:`split_rows`, :func:`project_t_programs_per_sm`) and the reduction's tiles
(:func:`reduce_block_m`, :func:`reduce_split_block`).

Tables as in :mod:`.projection` (tiles: :func:`powersgd_triton.ops.tables.project_t_tiles`): one program per
``BLOCK_M`` columns and row range of a matrix. The kernel keeps a ``[R, columns]`` accumulator and sums each step's
rows inside the thread that loaded them; its broadcast path unrolls the register prefetch (``PREFETCH``). ``USE_DOT``
picks ``tl.dot`` (fp32 ``ieee``, needs ``R >= 16``; with ``SPLIT_BF16`` on a 2-byte M: bfloat16 tensor-core dots on
exactly split operands, as accurate). For the batched view (``PADDED``) the zero padding's error memory
(``PAD_ERROR``) takes part in the product. A matrix whose rows are split over several programs writes float32
partial sums to a workspace, summed in a fixed order by :func:`_reduce_splits_kernel` (no atomics). Shapes and
dtypes are those of :func:`powersgd_triton.ops.project_t`; configs: :mod:`.configs`.
"""

from typing import Optional

import triton
import triton.language as tl

from powersgd_triton.layout import BucketLayout, padded_rank
from powersgd_triton.ops.aligned import aligned_width
from powersgd_triton.ops import tables as _tables
from powersgd_triton.ops.common import (
    PROJECT_T_COL0, PROJECT_T_MAT, PROJECT_T_ROW0, PROJECT_T_ROW_END, PROJECT_T_TILE_WIDTH, PROJECT_T_WS_OFF, REDUCE_COL0, REDUCE_MAT, REDUCE_SPLITS, REDUCE_TILE_WIDTH, REDUCE_WS_OFF, _aligned_matrix_row, _cast_for_store, _dot_bf16_split, _load_matrix_row, _m_plus_error, loop_range,
)
from powersgd_triton.ops.configs import (
    PROJECT_T_PROGRAMS_PER_SM, REDUCE_MAX_SPLITS, REDUCE_STEP_ELEMENTS, REDUCE_TILE_ELEMENTS, _resolve, padding_error_config,
)
from powersgd_triton.ops.launch import DirectLaunch, _factor_rank, bind_launches, _launch_options, device_sms, steps_per_trip
from powersgd_triton.ops.occupancy import blocks_per_sm


@triton.jit
def _project_t_loads(m_ptr, e_ptr, p_ptr, col0, last_col, ranks, rank_ok, k0, row_end, m, numel, r,
                     PADDED: tl.constexpr, PAD_ERROR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                     P_T: tl.constexpr):
    """The tiles one project_t step reads at rows ``k0:k0 + BLOCK_K`` and columns ``col0:col0 + BLOCK_M``: M's
    ``[BLOCK_K, BLOCK_M]``, the padding's error (``PAD_ERROR``, else zeros) and P's ``[BLOCK_K, R]`` (``P_T``:
    its transpose ``[R, BLOCK_K]``), as stored; P is zero past ``row_end`` and at ranks ``>= r``.

    Without ``PADDED`` (every matrix has ``n * m`` elements) M is read unmasked: a row past ``row_end`` reads row
    ``row_end - 1`` again and a column past ``m`` column ``m - 1`` (``last_col``: ``min(j, m - 1 - col0)`` per tile
    column), so every address is inside the matrix; their products are zero (P is zero there) or land in columns
    that are not stored (a non-finite element there is a non-finite element of M: the result is non-finite anyway).
    With ``PADDED`` (the batched view, whose padding starts inside its last row and may lie past the buffer) the
    mask compares each column with its row's count of valid columns, ``min(m, numel - row * m) - col0``."""
    rows = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
    row_ok = rows < row_end
    if PADDED:
        j = tl.arange(0, BLOCK_M)
        row_first = rows * m + col0  # flat index of each row's first element in the tile
        valid = tl.where(row_ok, tl.minimum(tl.maximum(numel - rows * m, 0), m) - col0, 0).to(tl.int32)
        x = tl.load((m_ptr + row_first)[:, None] + j[None, :], mask=j[None, :] < valid[:, None], other=0.0)
        if PAD_ERROR:
            end = tl.where(row_ok, m - col0, 0).to(tl.int32)
            pad = (j[None, :] >= valid[:, None]) & (j[None, :] < end[:, None])
            e = tl.load((e_ptr + row_first)[:, None] + j[None, :], mask=pad, other=0.0)
        else:
            e = tl.zeros((1, 1), dtype=tl.float32)
    else:
        row_first = tl.minimum(rows, row_end - 1) * m + col0
        x = tl.load((m_ptr + row_first)[:, None] + last_col[None, :])
        e = tl.zeros((1, 1), dtype=tl.float32)
    if P_T:
        p = tl.load(p_ptr + rows[None, :] * r + ranks[:, None], mask=row_ok[None, :] & rank_ok[:, None], other=0.0)
    else:
        p = tl.load(p_ptr + rows[:, None] * r + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
    return x, e, p


@triton.jit
def _project_t_step(acc_t, x_raw, e_raw, p_raw, scale, PAD_ERROR: tl.constexpr, LOSS_SCALE: tl.constexpr):
    """``acc_t[R, BLOCK_M] + P[rows]ᵀ · M[rows, cols]`` for one step of the broadcast path: the ``[R, BLOCK_K,
    BLOCK_M]`` products are summed over the step's rows at once, in the thread that holds them (every row of a
    column's tile lies in one thread: the threads of the program spread over the columns)."""
    x = _m_plus_error(x_raw, e_raw, scale, PAD_ERROR, LOSS_SCALE)
    p = p_raw.to(tl.float32)
    return acc_t + tl.sum(p[:, :, None] * x[None, :, :], axis=1)


@triton.jit
def _pt_row(a0, a1, a2, a3, a4, a5, a6, a7, mp, pp, k, m, cols, col_ok, RANK: tl.constexpr):
    """The aligned float32 path's step: row ``k`` of M's column tile (16-byte loads, masked per 16-byte group)
    times row ``k`` of P (``RANK`` scalars, the same address in every thread), added to the accumulators of the
    ranks (``a_j``: ``[BLOCK_M]``, Q's column ``j`` of the tile; an FMA per element and rank)."""
    x = tl.load(mp + k * m + cols, mask=col_ok, other=0.0).to(tl.float32)
    pk = pp + k * RANK
    a0 += tl.load(pk) * x
    if RANK > 1:
        a1 += tl.load(pk + 1) * x
    if RANK > 2:
        a2 += tl.load(pk + 2) * x
        a3 += tl.load(pk + 3) * x
    if RANK > 4:
        a4 += tl.load(pk + 4) * x
        a5 += tl.load(pk + 5) * x
        a6 += tl.load(pk + 6) * x
        a7 += tl.load(pk + 7) * x
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _pt_store_all(base, a0, a1, a2, a3, a4, a5, a6, a7, cols, col_ok, RANK: tl.constexpr):
    """A Q (or partial sum) tile from the rank accumulators ``a_j`` (``[BLOCK_M]``, column ``j``): interleaved into
    ``[BLOCK_M, RANK]`` by ``tl.join`` (in registers: ``join(x, y)`` puts x at index 0 of a new last dimension) and
    stored at ``base + col * RANK + j``, each column's ``RANK`` values contiguous (16-byte stores at RANK 4)."""
    if RANK == 1:
        t = a0[:, None]
    elif RANK == 2:
        t = tl.join(a0, a1)
    elif RANK == 4:
        t = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (a0.shape[0], 4))
    else:
        t = tl.reshape(tl.join(tl.join(tl.join(a0, a4), tl.join(a2, a6)), tl.join(tl.join(a1, a5), tl.join(a3, a7))),
                       (a0.shape[0], 8))
    ranks = tl.arange(0, RANK)
    tl.store(base + cols[:, None] * RANK + ranks[None, :], _cast_for_store(t, base), mask=col_ok[:, None])


@triton.jit
def _project_t_aligned(buf_ptr, p_ptr, q_ptr, q2_ptr, ws_ptr, table_ptr, tiles_ptr, HAS_Q2: tl.constexpr,
                       R: tl.constexpr, RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_DOT: tl.constexpr, VEC: tl.constexpr):
    """:func:`_project_t_kernel` on the aligned layout (:mod:`powersgd_triton.ops.aligned`): int32 offsets inside a
    matrix, alignment declared, every rank ``RANK``, no padding.

    Float32 M (``USE_DOT`` false, ``RANK <= 8``): one row per step, its ``BLOCK_M`` columns 16 bytes per thread,
    times the row's ``RANK`` values of P (scalars: no layout conversion), one FMA per element and rank into ``RANK``
    accumulators; the rows in trips of ``BLOCK_K`` (unrolled, unmasked), the rest one by one. The same products
    summed in the same order (row by row) as the masked path's, up to its blocking of the rows. 2-byte M
    (``USE_DOT``, the split tensor-core path, ``R`` the padded dot rank): ``[BLOCK_K, BLOCK_M]`` tiles of M 16 bytes
    per thread (software-pipelined through shared memory), times P's ``[BLOCK_K, R]`` split into three exact
    bfloat16 pieces (:func:`~powersgd_triton.ops.common._dot_bf16_split`)."""
    pid = tl.program_id(0)
    t = tiles_ptr + PROJECT_T_TILE_WIDTH * pid
    mat = tl.load(t + PROJECT_T_MAT).to(tl.int64)
    col0 = tl.multiple_of(tl.load(t + PROJECT_T_COL0), VEC)  # column tiles start at multiples of BLOCK_M
    row_begin = tl.load(t + PROJECT_T_ROW0)
    row_end = tl.load(t + PROJECT_T_ROW_END)
    ws_off = tl.load(t + PROJECT_T_WS_OFF).to(tl.int64)
    off, n, m, p_off, q_off, e_off = _aligned_matrix_row(table_ptr, mat, VEC, RANK)
    cols = tl.arange(0, BLOCK_M)
    col_ok = cols < m - col0
    mp = buf_ptr + off + col0
    pp = p_ptr + p_off
    first = col0.to(tl.int64) * RANK
    if USE_DOT:
        ranks = tl.arange(0, R)
        acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        for k0 in loop_range(row_begin, row_end, BLOCK_K):
            rows = k0 + tl.arange(0, BLOCK_K)
            row_ok = rows < row_end
            x = tl.load(mp + rows[:, None] * m + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            p = tl.load(pp + rows[:, None] * RANK + ranks[None, :], mask=row_ok[:, None] & (ranks < RANK)[None, :],
                        other=0.0)
            acc = _dot_bf16_split(acc, tl.trans(x), p)
        local = cols[:, None] * RANK + ranks[None, :]
        q_mask = col_ok[:, None] & (ranks < RANK)[None, :]
        if ws_off >= 0:
            tl.store(ws_ptr + (ws_off + first) + local, acc, mask=q_mask)
        else:
            tl.store(q_ptr + (q_off + first) + local, _cast_for_store(acc, q_ptr), mask=q_mask)
            if HAS_Q2:
                tl.store(q2_ptr + (q_off + first) + local, _cast_for_store(acc, q2_ptr), mask=q_mask)
    else:
        a0 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        a1 = a0
        a2 = a0
        a3 = a0
        a4 = a0
        a5 = a0
        a6 = a0
        a7 = a0
        full_end = row_begin + (row_end - row_begin) // BLOCK_K * BLOCK_K
        for k0 in loop_range(row_begin, full_end, BLOCK_K):
            for kk in tl.static_range(BLOCK_K):
                a0, a1, a2, a3, a4, a5, a6, a7 = _pt_row(a0, a1, a2, a3, a4, a5, a6, a7, mp, pp, k0 + kk, m, cols,
                                                         col_ok, RANK)
        for k in loop_range(full_end, row_end):
            a0, a1, a2, a3, a4, a5, a6, a7 = _pt_row(a0, a1, a2, a3, a4, a5, a6, a7, mp, pp, k, m, cols, col_ok,
                                                     RANK)
        if ws_off >= 0:
            _pt_store_all(ws_ptr + (ws_off + first), a0, a1, a2, a3, a4, a5, a6, a7, cols, col_ok, RANK)
        else:
            _pt_store_all(q_ptr + (q_off + first), a0, a1, a2, a3, a4, a5, a6, a7, cols, col_ok, RANK)
            if HAS_Q2:
                _pt_store_all(q2_ptr + (q_off + first), a0, a1, a2, a3, a4, a5, a6, a7, cols, col_ok, RANK)


@triton.jit
def _project_t_kernel(
    buf_ptr,  # bucket buffer, M_i row-major n x m at buf_ptr + off
    p_ptr,  # flat P (float32), P_i row-major n x r
    q_ptr,  # flat Q output, Q_i row-major m x r
    q2_ptr,  # second Q output (HAS_Q2: a half-step hook's local copy)
    e_ptr,  # flat error memory (PAD_ERROR only: the padding's error of the batched view)
    ws_ptr,  # float32 workspace for partial sums of split matrices
    table_ptr,  # int64 [L, TABLE_WIDTH] layout table
    tiles_ptr,  # int32 [T, PROJECT_T_TILE_WIDTH] (matrix, first column, first row, end row, workspace offset or -1)
    ls_ptr,  # float32 [1] loss scale s (LOSS_SCALE: the padding's M + E is s·E)
    PAD_ERROR: tl.constexpr,
    HAS_Q2: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    PREFETCH: tl.constexpr = 0,  # broadcast path: 1 (2) more steps' tiles in flight while one step is summed
    LOSS_SCALE: tl.constexpr = False,
    PADDED: tl.constexpr = False,  # the batched view: M has numel < n * m elements (implied by PAD_ERROR)
    SPLIT_BF16: tl.constexpr = False,  # tl.dot path, 2-byte M, no PAD_ERROR: bfloat16 tensor-core dots (see below)

    ALIGN: tl.constexpr = 0,  # the aligned layout: elements of the bucket's dtype per 16 bytes (aligned.vector_width)
    RANK: tl.constexpr = 0,  # with ALIGN: every matrix's rank
):
    """Q_i[cols] = M_i[rows, cols]ᵀ · P_i[rows] for one tile of BLOCK_M columns and one row range.

    Broadcast path (``USE_DOT`` false): a ``[R, BLOCK_M]`` float32 accumulator; each step of ``BLOCK_K`` rows adds
    its products summed over the rows inside one thread (no shuffles, no shared memory in the loop). With
    ``PREFETCH`` p the loop is unrolled p + 1 times, one register set per step: the tiles of the next p steps are
    loaded before a step is summed, and each loaded register is consumed where it was loaded (a loop-carried copy
    would wait for its load and leave one step in flight). A row range that is not a multiple of (p + 1) x
    ``BLOCK_K`` rows ends with steps past its end, and the last trip loads p steps that are never summed: P is
    zero there, and M is read at the range's last row (a cache hit; masked with ``PADDED``), so their products
    are zero for finite M. ``tl.dot`` path: one step per trip; Triton pipelines its loads (``num_stages``). Its dot
    is float32 ``ieee`` (FMAs), or, with ``SPLIT_BF16`` on a bfloat16 / float16 M (not with ``PAD_ERROR``, whose
    padding adds the float32 error memory), :func:`~powersgd_triton.ops.common._dot_bf16_split`: M as bfloat16
    (float16: two exact bfloat16 pieces), P as three exact bfloat16 pieces, 3 (5) tensor-core dots with exact
    products and a float32 accumulator -- the float32 dot's accuracy without its FMAs.

    A program whose row range is not the whole matrix writes its partial sums to the workspace;
    :func:`_reduce_splits_kernel` adds them up in a fixed order (no atomics).
    """
    if ALIGN:
        _project_t_aligned(buf_ptr, p_ptr, q_ptr, q2_ptr, ws_ptr, table_ptr, tiles_ptr, HAS_Q2, R, RANK, BLOCK_M,
                           BLOCK_K, USE_DOT, ALIGN)
        return
    pid = tl.program_id(0)
    mat = tl.load(tiles_ptr + PROJECT_T_TILE_WIDTH * pid + PROJECT_T_MAT).to(tl.int64)
    col0 = tl.load(tiles_ptr + PROJECT_T_TILE_WIDTH * pid + PROJECT_T_COL0).to(tl.int64)
    row_begin = tl.load(tiles_ptr + PROJECT_T_TILE_WIDTH * pid + PROJECT_T_ROW0).to(tl.int64)
    row_end = tl.load(tiles_ptr + PROJECT_T_TILE_WIDTH * pid + PROJECT_T_ROW_END).to(tl.int64)
    ws_off = tl.load(tiles_ptr + PROJECT_T_TILE_WIDTH * pid + PROJECT_T_WS_OFF).to(tl.int64)
    off, n, m, numel, r, p_off, q_off, e_off = _load_matrix_row(table_ptr, mat)

    cols = col0 + tl.arange(0, BLOCK_M).to(tl.int64)
    ranks = tl.arange(0, R)
    col_ok = cols < m
    rank_ok = ranks < r
    last_col = tl.minimum(tl.arange(0, BLOCK_M), (m - 1 - col0).to(tl.int32))
    mp = buf_ptr + off  # this matrix's M, padding error and P
    ep = e_ptr + e_off
    pp = p_ptr + p_off
    scale = 1.0
    if LOSS_SCALE:  # loaded once: a load inside the loop would wait a latency per step
        scale = tl.load(ls_ptr)
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        for k0 in loop_range(row_begin, row_end, BLOCK_K):
            x_raw, e_raw, p_raw = _project_t_loads(mp, ep, pp, col0, last_col, ranks, rank_ok, k0, row_end, m,
                                                   numel, r, PADDED, PAD_ERROR, BLOCK_M, BLOCK_K, False)
            if SPLIT_BF16 and x_raw.dtype.primitive_bitwidth == 16 and not PAD_ERROR:  # tensor cores, exact products
                acc = _dot_bf16_split(acc, tl.trans(x_raw), p_raw.to(tl.float32))
            else:
                x = _m_plus_error(x_raw, e_raw, scale, PAD_ERROR, LOSS_SCALE)  # [BLOCK_K, BLOCK_M]
                acc += tl.dot(tl.trans(x), p_raw.to(tl.float32), input_precision="ieee")
        q_mask = col_ok[:, None] & (ranks[None, :] < r)
        local = cols[:, None] * r + ranks[None, :]
    else:
        acc = tl.zeros((R, BLOCK_M), dtype=tl.float32)  # Qᵀ's tile: stored as is (no layout change)
        if PREFETCH == 0:
            for k0 in loop_range(row_begin, row_end, BLOCK_K):
                x_a, e_a, p_a = _project_t_loads(mp, ep, pp, col0, last_col, ranks, rank_ok, k0, row_end, m,
                                                 numel, r, PADDED, PAD_ERROR, BLOCK_M, BLOCK_K, True)
                acc = _project_t_step(acc, x_a, e_a, p_a, scale, PAD_ERROR, LOSS_SCALE)
        elif PREFETCH == 1:  # register sets a, b: a's loads go out while b's step is summed, and b's during a's
            x_a, e_a, p_a = _project_t_loads(mp, ep, pp, col0, last_col, ranks, rank_ok, row_begin, row_end, m,
                                             numel, r, PADDED, PAD_ERROR, BLOCK_M, BLOCK_K, True)
            for k0 in loop_range(row_begin, row_end, 2 * BLOCK_K):
                x_b, e_b, p_b = _project_t_loads(mp, ep, pp, col0, last_col, ranks, rank_ok, k0 + BLOCK_K,
                                                 row_end, m, numel, r, PADDED, PAD_ERROR, BLOCK_M, BLOCK_K, True)
                acc = _project_t_step(acc, x_a, e_a, p_a, scale, PAD_ERROR, LOSS_SCALE)
                x_a, e_a, p_a = _project_t_loads(mp, ep, pp, col0, last_col, ranks, rank_ok, k0 + 2 * BLOCK_K,
                                                 row_end, m, numel, r, PADDED, PAD_ERROR, BLOCK_M, BLOCK_K, True)
                acc = _project_t_step(acc, x_b, e_b, p_b, scale, PAD_ERROR, LOSS_SCALE)
        else:  # three register sets: two steps' loads in flight while one is summed
            x_a, e_a, p_a = _project_t_loads(mp, ep, pp, col0, last_col, ranks, rank_ok, row_begin, row_end, m,
                                             numel, r, PADDED, PAD_ERROR, BLOCK_M, BLOCK_K, True)
            x_b, e_b, p_b = _project_t_loads(mp, ep, pp, col0, last_col, ranks, rank_ok, row_begin + BLOCK_K,
                                             row_end, m, numel, r, PADDED, PAD_ERROR, BLOCK_M, BLOCK_K, True)
            for k0 in loop_range(row_begin, row_end, 3 * BLOCK_K):
                x_c, e_c, p_c = _project_t_loads(mp, ep, pp, col0, last_col, ranks, rank_ok, k0 + 2 * BLOCK_K,
                                                 row_end, m, numel, r, PADDED, PAD_ERROR, BLOCK_M, BLOCK_K, True)
                acc = _project_t_step(acc, x_a, e_a, p_a, scale, PAD_ERROR, LOSS_SCALE)
                x_a, e_a, p_a = _project_t_loads(mp, ep, pp, col0, last_col, ranks, rank_ok, k0 + 3 * BLOCK_K,
                                                 row_end, m, numel, r, PADDED, PAD_ERROR, BLOCK_M, BLOCK_K, True)
                acc = _project_t_step(acc, x_b, e_b, p_b, scale, PAD_ERROR, LOSS_SCALE)
                x_b, e_b, p_b = _project_t_loads(mp, ep, pp, col0, last_col, ranks, rank_ok, k0 + 4 * BLOCK_K,
                                                 row_end, m, numel, r, PADDED, PAD_ERROR, BLOCK_M, BLOCK_K, True)
                acc = _project_t_step(acc, x_c, e_c, p_c, scale, PAD_ERROR, LOSS_SCALE)
        # Qᵀ's tile at Q + (col0 + j) * r + rank: int32 offsets from the tile's first element
        j = tl.arange(0, BLOCK_M)
        q_mask = (j < (m - col0).to(tl.int32))[None, :] & rank_ok[:, None]
        local = j[None, :] * r.to(tl.int32) + ranks[:, None]
        first = col0 * r
        if ws_off >= 0:
            tl.store(ws_ptr + (ws_off + first) + local, acc, mask=q_mask)
        else:
            tl.store(q_ptr + (q_off + first) + local, _cast_for_store(acc, q_ptr), mask=q_mask)
            if HAS_Q2:
                tl.store(q2_ptr + (q_off + first) + local, _cast_for_store(acc, q2_ptr), mask=q_mask)
        return
    if ws_off >= 0:
        tl.store(ws_ptr + ws_off + local, acc, mask=q_mask)
    else:
        tl.store(q_ptr + q_off + local, _cast_for_store(acc, q_ptr), mask=q_mask)
        if HAS_Q2:
            tl.store(q2_ptr + q_off + local, _cast_for_store(acc, q2_ptr), mask=q_mask)


@triton.jit
def _reduce_splits_kernel(
    ws_ptr,  # float32 workspace: for matrix i, nsplit_i consecutive m_i x r_i partial sums
    q_ptr,  # flat Q output
    q2_ptr,  # second Q output (HAS_Q2)
    table_ptr,  # int64 [L, TABLE_WIDTH] layout table
    reduce_tiles_ptr,  # int32 [T, REDUCE_TILE_WIDTH] (matrix, first column, workspace offset of split 0, splits)
    HAS_Q2: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr = 1,  # partial sums loaded per step (all in flight at once), added by one tl.sum
):
    """Q_i[cols] = sum over splits s of the partial sums of project_t: deterministic split-K (SPLIT_BLOCK 1: in
    order; else blocks of SPLIT_BLOCK splits in order, each summed by ``tl.sum``'s fixed tree)."""
    pid = tl.program_id(0)
    mat = tl.load(reduce_tiles_ptr + REDUCE_TILE_WIDTH * pid + REDUCE_MAT).to(tl.int64)
    col0 = tl.load(reduce_tiles_ptr + REDUCE_TILE_WIDTH * pid + REDUCE_COL0).to(tl.int64)
    ws_off = tl.load(reduce_tiles_ptr + REDUCE_TILE_WIDTH * pid + REDUCE_WS_OFF).to(tl.int64)
    nsplit = tl.load(reduce_tiles_ptr + REDUCE_TILE_WIDTH * pid + REDUCE_SPLITS)
    off, n, m, numel, r, p_off, q_off, e_off = _load_matrix_row(table_ptr, mat)
    cols = col0 + tl.arange(0, BLOCK_M).to(tl.int64)
    ranks = tl.arange(0, R)
    mask = (cols < m)[:, None] & (ranks[None, :] < r)
    local = cols[:, None] * r + ranks[None, :]
    acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
    if SPLIT_BLOCK == 1:
        for s in loop_range(0, nsplit):
            acc += tl.load(ws_ptr + ws_off + s * m * r + local, mask=mask, other=0.0)
    else:
        splits = tl.arange(0, SPLIT_BLOCK).to(tl.int64)
        for s0 in loop_range(0, nsplit, SPLIT_BLOCK):
            s = s0 + splits
            ptrs = ws_ptr + ws_off + s[:, None, None] * m * r + local[None, :, :]
            acc += tl.sum(tl.load(ptrs, mask=(s < nsplit)[:, None, None] & mask[None, :, :], other=0.0), axis=0)
    tl.store(q_ptr + q_off + local, _cast_for_store(acc, q_ptr), mask=mask)
    if HAS_Q2:
        tl.store(q2_ptr + q_off + local, _cast_for_store(acc, q2_ptr), mask=mask)


def project_t_programs_per_sm(cfg: dict) -> int:
    """Programs per SM project_t's row splits aim at: ``cfg["PROGRAMS_PER_SM"]`` if given, else the blocks of
    ``num_warps`` warps that fit on one SM at ``cfg["maxnreg"]`` registers per thread (the compile's cap: one round
    of resident programs), else :data:`PROJECT_T_PROGRAMS_PER_SM`."""
    if cfg.get("PROGRAMS_PER_SM"):
        return max(1, int(cfg["PROGRAMS_PER_SM"]))
    if cfg.get("maxnreg"):
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


def project_t(buffer, layout: BucketLayout, p, q, *, error=None, q2=None, loss_scale=None,
              config: Optional[dict] = None) -> None:
    """``Q_i = M_iᵀ · P_i`` for all i (see :func:`powersgd_triton.ops.project_t`): one launch, plus one for the
    fixed-order reduction when the plan splits a matrix over rows. ``error``: the batched view's error memory (its
    padding's part is the padding's M + E); ``q2``: a second copy of Q. Launch plans as :func:`~powersgd_triton.ops.projection.project`'s (the row
    splits planned once, from the device's SM count)."""
    main, args, reduce, reduce_args = _project_t_args(buffer, layout, p, q, error, q2, loss_scale, config)
    main(*args)
    if reduce is not None:
        reduce(*reduce_args)


def project_t_bound(buffer, layout: BucketLayout, p, q, *, error=None, q2=None, loss_scale=None,
                    config: Optional[dict] = None):
    """A callable of no argument that makes the launches :func:`project_t` makes with these arguments (plans and
    arguments bound now, as :func:`~powersgd_triton.ops.projection.project_bound`)."""
    main, args, reduce, reduce_args = _project_t_args(buffer, layout, p, q, error, q2, loss_scale, config)
    return bind_launches((main, args), None if reduce is None else (reduce, reduce_args))


def _project_t_args(buffer, layout, p, q, error, q2, loss_scale, config):
    pad = layout.batched and error is not None
    key = ("launch:project_t", buffer.dtype, None if config is None else tuple(config.items()), pad, q2 is not None,
           loss_scale is not None)
    plan = layout._tiles.get(key)  # the layout's memo (layout.memo), read without a call
    if plan is None:
        plan = layout.memo(key, lambda: _project_t_launch(layout, buffer.dtype, config, *key[3:]))
    main, tiles, reduce, reduce_tiles, ws = plan
    q2 = q2 if q2 is not None else q
    args = (buffer, p, q, q2, error if pad else p, ws if ws is not None else p, layout.table, tiles,
            loss_scale if loss_scale is not None else p)
    return main, args, reduce, None if reduce is None else (ws, q, q2, layout.table, reduce_tiles)


def _project_t_launch(layout, dtype, config, pad, has_q2, has_ls):
    cfg = padding_error_config(_resolve("project_t", layout, dtype, config), pad)
    align = aligned_width(layout, dtype, cfg, "project_t")
    split = split_rows(layout, cfg, device_sms(layout.device))
    R = _factor_rank(layout, cfg)
    reduce_bm = reduce_block_m(cfg, R)
    tiles, reduce_tiles, ws_numel = _tables.project_t_tiles(layout, cfg["BLOCK_M"], split, reduce_bm)
    ws = layout.workspace(ws_numel) if reduce_tiles is not None else None
    main = DirectLaunch(_project_t_kernel, (tiles.shape[0],), dict(
        PAD_ERROR=pad, HAS_Q2=has_q2, R=R, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"],
        USE_DOT=cfg["USE_DOT"], PREFETCH=cfg.get("PREFETCH", 0), LOSS_SCALE=pad and has_ls,
        PADDED=layout.batched, SPLIT_BF16=bool(cfg.get("SPLIT_BF16", False)), ALIGN=align,
        RANK=padded_rank(layout.max_rank) if align else 0, **_launch_options(cfg)))
    reduce = None
    if reduce_tiles is not None:
        reduce = DirectLaunch(_reduce_splits_kernel, (reduce_tiles.shape[0],), dict(
            HAS_Q2=has_q2, R=R, BLOCK_M=reduce_bm, SPLIT_BLOCK=reduce_split_block(reduce_bm, R), num_warps=4,
            num_stages=1))
    return main, tiles, reduce, reduce_tiles, ws
