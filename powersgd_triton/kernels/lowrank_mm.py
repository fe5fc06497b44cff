"""Grouped skinny matmuls over a whole bucket: ``P_i = M_i·Q_i`` (project) and ``Q_i = M_iᵀ·P_i`` (project_t).

One launch covers every compressed matrix of the bucket. Program ``pid`` reads its tile ``(matrix, first row or
column)`` from a host-built ``int32`` tile table, then the matrix's row of the ``int64`` layout table
(:data:`powersgd_triton.layout.TABLE_COLUMNS`: offset, n, m, numel, rank, p_offset, q_offset, e_offset). Ragged
shapes are handled by masks; for the batched view, flat indices ``>= numel`` are the (never stored) zero padding.

Both kernels stream M once and keep the thin factor (``m x r`` or ``n x r``, float32) in cache; they are
memory-bound for every r we use (arithmetic intensity ≈ 2r / sizeof(M) flop/byte). Loads are upcast to float32 right
away and accumulation is float32 (also the interpreter's bf16 rule). ``R`` is the bucket's largest rank padded to a
power of two; columns ``>= r_i`` are masked. ``USE_DOT`` picks ``tl.dot`` (fp32 ``ieee``, needs ``R >= 16``) or a
broadcast-multiply-and-sum, which wins for r below tensor-core tile sizes.
"""

import triton
import triton.language as tl


@triton.jit
def _load_matrix_row(table_ptr, mat):
    row = table_ptr + mat * 8
    off = tl.load(row + 0)
    n = tl.load(row + 1)
    m = tl.load(row + 2)
    numel = tl.load(row + 3)
    r = tl.load(row + 4)
    p_off = tl.load(row + 5)
    q_off = tl.load(row + 6)
    e_off = tl.load(row + 7)
    return off, n, m, numel, r, p_off, q_off, e_off


@triton.jit
def _cast_for_store(x, ptr):
    """float32 -> ``ptr``'s element type, rounding to nearest even.

    For bfloat16 the rounding is done on the bits: the interpreter truncates in ``.to(tl.bfloat16)`` while the GPU
    rounds, and this gives both the same result as torch's ``.to(torch.bfloat16)``.
    """
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(ptr.dtype.element_ty)


@triton.jit
def _project_kernel(
    buf_ptr,  # bucket buffer (fp32/fp16/bf16), M_i at buf_ptr + off, row-major n x m
    q_ptr,  # flat Q (float32), Q_i row-major m x r at q_ptr + q_off
    p_ptr,  # flat P (float32) output, P_i row-major n x r at p_ptr + p_off
    e_ptr,  # flat error memory (float32), E_i row-major n x m at e_ptr + e_off (unused unless HAS_ERROR)
    table_ptr,  # int64 [L, 8] layout table
    tiles_ptr,  # int32 [T, 2] (matrix, first row)
    HAS_ERROR: tl.constexpr,
    R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    """P_i[rows] = (M_i + E_i)[rows] · Q_i for one tile of BLOCK_N rows; writes M_i + E_i back if HAS_ERROR."""
    pid = tl.program_id(0)
    mat = tl.load(tiles_ptr + 2 * pid).to(tl.int64)
    row0 = tl.load(tiles_ptr + 2 * pid + 1).to(tl.int64)
    off, n, m, numel, r, p_off, q_off, e_off = _load_matrix_row(table_ptr, mat)

    rows = row0 + tl.arange(0, BLOCK_N).to(tl.int64)
    ranks = tl.arange(0, R)
    row_ok = rows < n
    acc = tl.zeros((BLOCK_N, R), dtype=tl.float32)
    for k0 in range(0, m, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        col_ok = cols < m
        lin = rows[:, None] * m + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :] & (lin < numel)
        x = tl.load(buf_ptr + off + lin, mask=mask, other=0.0).to(tl.float32)
        if HAS_ERROR:
            x += tl.load(e_ptr + e_off + lin, mask=mask, other=0.0).to(tl.float32)
            tl.store(buf_ptr + off + lin, _cast_for_store(x, buf_ptr), mask=mask)
        q_mask = col_ok[:, None] & (ranks[None, :] < r)
        q = tl.load(q_ptr + q_off + cols[:, None] * r + ranks[None, :], mask=q_mask, other=0.0).to(tl.float32)
        if USE_DOT:
            acc += tl.dot(x, q, input_precision="ieee")
        else:
            acc += tl.sum(x[:, :, None] * q[None, :, :], axis=1)
    p_mask = row_ok[:, None] & (ranks[None, :] < r)
    tl.store(p_ptr + p_off + rows[:, None] * r + ranks[None, :], acc.to(p_ptr.dtype.element_ty), mask=p_mask)


@triton.jit
def _project_t_kernel(
    buf_ptr,  # bucket buffer, M_i row-major n x m at buf_ptr + off
    p_ptr,  # flat P (float32), P_i row-major n x r
    q_ptr,  # flat Q (float32) output, Q_i row-major m x r
    ws_ptr,  # float32 workspace for partial sums of split matrices (unused unless SPLIT_ROWS > 0)
    table_ptr,  # int64 [L, 8] layout table
    tiles_ptr,  # int32 [T, 4] (matrix, first column, first row, workspace offset or -1 to write Q directly)
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_ROWS: tl.constexpr,  # 0: one program reduces all n rows; else at most SPLIT_ROWS rows per program
    USE_DOT: tl.constexpr,
):
    """Q_i[cols] = M_i[rows, cols]ᵀ · P_i[rows] for one tile of BLOCK_M columns, rows reduced in a fixed order.

    A tall matrix (n > SPLIT_ROWS) is split over rows so that it gets enough programs; its partial sums go to the
    workspace and :func:`_reduce_splits_kernel` adds them up in a fixed order (no atomics).
    """
    pid = tl.program_id(0)
    mat = tl.load(tiles_ptr + 4 * pid).to(tl.int64)
    col0 = tl.load(tiles_ptr + 4 * pid + 1).to(tl.int64)
    row_begin = tl.load(tiles_ptr + 4 * pid + 2).to(tl.int64)
    ws_off = tl.load(tiles_ptr + 4 * pid + 3).to(tl.int64)
    off, n, m, numel, r, p_off, q_off, e_off = _load_matrix_row(table_ptr, mat)
    row_end = n
    if SPLIT_ROWS > 0:
        row_end = tl.minimum(row_begin + SPLIT_ROWS, n)

    cols = col0 + tl.arange(0, BLOCK_M).to(tl.int64)
    ranks = tl.arange(0, R)
    col_ok = cols < m
    acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
    for k0 in range(row_begin, row_end, BLOCK_K):
        rows = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        row_ok = rows < row_end
        lin = rows[:, None] * m + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :] & (lin < numel)
        x = tl.load(buf_ptr + off + lin, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_M]
        p_mask = row_ok[:, None] & (ranks[None, :] < r)
        p = tl.load(p_ptr + p_off + rows[:, None] * r + ranks[None, :], mask=p_mask, other=0.0).to(tl.float32)
        if USE_DOT:
            acc += tl.dot(tl.trans(x), p, input_precision="ieee")
        else:
            acc += tl.sum(x[:, :, None] * p[:, None, :], axis=0)
    q_mask = col_ok[:, None] & (ranks[None, :] < r)
    local = cols[:, None] * r + ranks[None, :]
    if SPLIT_ROWS > 0:
        if ws_off >= 0:
            tl.store(ws_ptr + ws_off + local, acc, mask=q_mask)
        else:
            tl.store(q_ptr + q_off + local, acc.to(q_ptr.dtype.element_ty), mask=q_mask)
    else:
        tl.store(q_ptr + q_off + local, acc.to(q_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _reduce_splits_kernel(
    ws_ptr,  # float32 workspace: for matrix i, nsplit_i consecutive m_i x r_i partial sums
    q_ptr,  # flat Q (float32) output
    table_ptr,  # int64 [L, 8] layout table
    tiles_ptr,  # int32 [T, 4] (matrix, first column, workspace offset of split 0, number of splits)
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Q_i[cols] = sum over splits s (in order) of the partial sums of project_t: deterministic split-K."""
    pid = tl.program_id(0)
    mat = tl.load(tiles_ptr + 4 * pid).to(tl.int64)
    col0 = tl.load(tiles_ptr + 4 * pid + 1).to(tl.int64)
    ws_off = tl.load(tiles_ptr + 4 * pid + 2).to(tl.int64)
    nsplit = tl.load(tiles_ptr + 4 * pid + 3)
    off, n, m, numel, r, p_off, q_off, e_off = _load_matrix_row(table_ptr, mat)
    cols = col0 + tl.arange(0, BLOCK_M).to(tl.int64)
    ranks = tl.arange(0, R)
    mask = (cols < m)[:, None] & (ranks[None, :] < r)
    local = cols[:, None] * r + ranks[None, :]
    acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
    for s in range(0, nsplit):
        acc += tl.load(ws_ptr + ws_off + s * m * r + local, mask=mask, other=0.0)
    tl.store(q_ptr + q_off + local, acc.to(q_ptr.dtype.element_ty), mask=mask)
