"""Grouped skinny matmuls over a whole bucket: ``P_i = M_i·Q_i`` (project) and ``Q_i = M_iᵀ·P_i`` (project_t).

One launch covers every compressed matrix of the bucket. Program ``pid`` reads its tile from a host-built ``int32``
tile table, then the matrix's row of the ``int64`` layout table (:data:`powersgd_triton.layout.TABLE_COLUMNS`:
offset, n, m, numel, rank, p_offset, q_offset, e_offset). Ragged shapes are handled by masks; for the batched view,
flat indices ``>= numel`` are the (never stored) zero padding, whose error memory (``PAD_ERROR``) takes part in the
products as in PyTorch's batched hook.

Both kernels stream M once and keep the thin factor (``m x r`` or ``n x r``, float32) in cache; they are
memory-bound for every r we use (arithmetic intensity ≈ 2r / sizeof(M) flop/byte). Loads are upcast to float32 right
away and accumulation is float32. ``R`` is the bucket's largest rank padded to a power of two; columns ``>= r_i``
are masked. ``USE_DOT`` picks ``tl.dot`` (fp32 ``ieee``, needs ``R >= 16``; project_t with ``SPLIT_BF16`` on a
2-byte M: bfloat16 tensor-core dots on exactly split operands, as accurate) or a broadcast multiply: project's
``[R, rows, k]`` products are accumulated elementwise over the loop and summed over k once after it (no
cross-thread reduction inside the loop; each thread multiplies the elements it loaded by all R columns of Q in its
registers); project_t keeps a ``[R, columns]`` accumulator and sums each step's rows inside the thread that loaded
them (see :func:`_project_t_kernel`). Both unroll their broadcast path's register prefetch (``PREFETCH`` p: p + 1
register sets, one per step of a loop trip); project's ``CARRY`` form and its ``tl.dot`` path with ``PREFETCH``
carry the prefetched tiles to the next trip instead (one step in flight).

Tiles: ``project`` has one program per ``BLOCK_N`` rows of a matrix (the sum over the columns stays in the program);
``project_t`` one per ``BLOCK_M`` columns and row range: a matrix whose rows are split over several programs writes
partial sums to a float32 workspace, summed in a fixed order by :func:`_reduce_splits_kernel` (no atomics).
"""

import triton
import triton.language as tl

from powersgd_triton.ops.common import (
    PROJECT_T_COL0, PROJECT_T_MAT, PROJECT_T_ROW0, PROJECT_T_ROW_END, PROJECT_T_TILE_WIDTH, PROJECT_T_WS_OFF, REDUCE_COL0, REDUCE_MAT, REDUCE_SPLITS, REDUCE_TILE_WIDTH, REDUCE_WS_OFF, TILE_FIRST, TILE_MAT, TILE_WIDTH, _cast_for_store, _dot_bf16_split, _load_matrix_row, loop_range,
)


@triton.jit
def _project_loads(m_ptr, e_ptr, q_ptr, rows, row_ok, ranks, k0, m, numel, r, HAS_ERROR: tl.constexpr,
                   PAD_ERROR: tl.constexpr, BLOCK_K: tl.constexpr, Q_T: tl.constexpr):
    """The tiles one project step reads at columns ``k0:k0 + BLOCK_K`` (masked past ``m``): M's ``[rows, k]``,
    E's (zeros without ``HAS_ERROR``; with ``PAD_ERROR`` also on the padding), Q's ``[k, R]`` (``Q_T``: its
    transpose ``[R, k]``, the broadcast path's); as stored."""
    cols = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
    col_ok = cols < m
    lin = rows[:, None] * m + cols[None, :]
    inside = row_ok[:, None] & col_ok[None, :]
    mask = inside & (lin < numel)
    x = tl.load(m_ptr + lin, mask=mask, other=0.0)
    if HAS_ERROR:
        if PAD_ERROR:
            e = tl.load(e_ptr + lin, mask=inside, other=0.0)
        else:
            e = tl.load(e_ptr + lin, mask=mask, other=0.0)
    else:
        e = tl.zeros((1, 1), dtype=tl.float32)
    if Q_T:  # [R, k]; the rank offsets are not known to be contiguous, so the load keeps the layout of M's tile
        rank_off = tl.where(ranks < r, ranks, 0)
        q = tl.load(q_ptr + cols[None, :] * r + rank_off[:, None], mask=col_ok[None, :] & (ranks[:, None] < r),
                    other=0.0)
    else:
        q = tl.load(q_ptr + cols[:, None] * r + ranks[None, :], mask=col_ok[:, None] & (ranks[None, :] < r), other=0.0)
    return x, e, q


@triton.jit
def _m_plus_error(x_raw, e_raw, scale, WITH_ERROR: tl.constexpr, LOSS_SCALE: tl.constexpr):
    """M's tile in float32, plus the error memory's tile with ``WITH_ERROR`` (project: every element's; project_t:
    the padding's), times the loss scale ``scale`` (loaded once per program) with ``LOSS_SCALE``."""
    x = x_raw.to(tl.float32)
    if WITH_ERROR:
        e = e_raw.to(tl.float32)
        if LOSS_SCALE:
            e = e * scale
        x += e
    return x


@triton.jit
def _project_step(acc, x_raw, e_raw, q_raw, mp, scale, rows, row_ok, k0, m, numel, HAS_ERROR: tl.constexpr,
                  LOSS_SCALE: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr):
    """One project step at columns ``k0:k0 + BLOCK_K`` from its loaded tiles (:func:`_project_loads`): M + E
    (``M + scale·E`` with ``LOSS_SCALE``; stored back into M with ``HAS_ERROR``, masked past ``m`` and ``numel``: a
    step past the row's end stores nothing) times Q's tile, added to ``acc`` (``tl.dot``: ``[rows, R]``;
    broadcast: the ``[R, rows, k]`` products elementwise)."""
    x = _m_plus_error(x_raw, e_raw, scale, HAS_ERROR, LOSS_SCALE)
    if HAS_ERROR:
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
    p2_ptr,  # second P output (HAS_P2: the alternating hook's local copy), same layout
    e_ptr,  # flat error memory (float32), E_i row-major n x m at e_ptr + e_off (unused unless HAS_ERROR)
    table_ptr,  # int64 [L, TABLE_WIDTH] layout table
    tiles_ptr,  # int32 [T, TILE_WIDTH] (TILE_MAT: matrix, TILE_FIRST: first row)
    ls_ptr,  # float32 [1] loss scale s (LOSS_SCALE: the error memory is unscaled, M + s·E is used)
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
):
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
    pid = tl.program_id(0)
    mat = tl.load(tiles_ptr + TILE_WIDTH * pid + TILE_MAT).to(tl.int64)
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
                                       not USE_DOT)
        for k0 in loop_range(0, m, BLOCK_K):
            x_a, e_a, q_a = x_n, e_n, q_n
            x_n, e_n, q_n = _project_loads(mp, ep, qp, rows, row_ok, ranks, k0 + BLOCK_K, m, numel, r, HAS_ERROR,
                                           PAD_ERROR, BLOCK_K, not USE_DOT)
            acc = _project_step(acc, x_a, e_a, q_a, mp, scale, rows, row_ok, k0, m, numel, HAS_ERROR, LOSS_SCALE,
                                BLOCK_K, USE_DOT)
    elif PREFETCH == 0:
        for k0 in loop_range(0, m, BLOCK_K):
            x_a, e_a, q_a = _project_loads(mp, ep, qp, rows, row_ok, ranks, k0, m, numel, r, HAS_ERROR, PAD_ERROR,
                                           BLOCK_K, not USE_DOT)
            acc = _project_step(acc, x_a, e_a, q_a, mp, scale, rows, row_ok, k0, m, numel, HAS_ERROR, LOSS_SCALE,
                                BLOCK_K, USE_DOT)
    elif PREFETCH == 1:  # register sets a, b: a's loads go out while b's step is computed, and b's during a's
        x_a, e_a, q_a = _project_loads(mp, ep, qp, rows, row_ok, ranks, 0, m, numel, r, HAS_ERROR, PAD_ERROR, BLOCK_K,
                                       not USE_DOT)
        for k0 in loop_range(0, m, 2 * BLOCK_K):
            x_b, e_b, q_b = _project_loads(mp, ep, qp, rows, row_ok, ranks, k0 + BLOCK_K, m, numel, r, HAS_ERROR,
                                           PAD_ERROR, BLOCK_K, not USE_DOT)
            acc = _project_step(acc, x_a, e_a, q_a, mp, scale, rows, row_ok, k0, m, numel, HAS_ERROR, LOSS_SCALE,
                                BLOCK_K, USE_DOT)
            x_a, e_a, q_a = _project_loads(mp, ep, qp, rows, row_ok, ranks, k0 + 2 * BLOCK_K, m, numel, r,
                                           HAS_ERROR, PAD_ERROR, BLOCK_K, not USE_DOT)
            acc = _project_step(acc, x_b, e_b, q_b, mp, scale, rows, row_ok, k0 + BLOCK_K, m, numel, HAS_ERROR,
                                LOSS_SCALE, BLOCK_K, USE_DOT)
    else:  # three register sets: two steps' loads in flight while one is computed
        x_a, e_a, q_a = _project_loads(mp, ep, qp, rows, row_ok, ranks, 0, m, numel, r, HAS_ERROR, PAD_ERROR, BLOCK_K,
                                       not USE_DOT)
        x_b, e_b, q_b = _project_loads(mp, ep, qp, rows, row_ok, ranks, BLOCK_K, m, numel, r, HAS_ERROR, PAD_ERROR,
                                       BLOCK_K, not USE_DOT)
        for k0 in loop_range(0, m, 3 * BLOCK_K):
            x_c, e_c, q_c = _project_loads(mp, ep, qp, rows, row_ok, ranks, k0 + 2 * BLOCK_K, m, numel, r,
                                           HAS_ERROR, PAD_ERROR, BLOCK_K, not USE_DOT)
            acc = _project_step(acc, x_a, e_a, q_a, mp, scale, rows, row_ok, k0, m, numel, HAS_ERROR, LOSS_SCALE,
                                BLOCK_K, USE_DOT)
            x_a, e_a, q_a = _project_loads(mp, ep, qp, rows, row_ok, ranks, k0 + 3 * BLOCK_K, m, numel, r,
                                           HAS_ERROR, PAD_ERROR, BLOCK_K, not USE_DOT)
            acc = _project_step(acc, x_b, e_b, q_b, mp, scale, rows, row_ok, k0 + BLOCK_K, m, numel, HAS_ERROR,
                                LOSS_SCALE, BLOCK_K, USE_DOT)
            x_b, e_b, q_b = _project_loads(mp, ep, qp, rows, row_ok, ranks, k0 + 4 * BLOCK_K, m, numel, r,
                                           HAS_ERROR, PAD_ERROR, BLOCK_K, not USE_DOT)
            acc = _project_step(acc, x_c, e_c, q_c, mp, scale, rows, row_ok, k0 + 2 * BLOCK_K, m, numel, HAS_ERROR,
                                LOSS_SCALE, BLOCK_K, USE_DOT)
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
def _project_t_kernel(
    buf_ptr,  # bucket buffer, M_i row-major n x m at buf_ptr + off
    p_ptr,  # flat P (float32), P_i row-major n x r
    q_ptr,  # flat Q output, Q_i row-major m x r
    q2_ptr,  # second Q output (HAS_Q2: the alternating hook's local copy)
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
