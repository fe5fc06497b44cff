"""Fused reconstruction with error feedback: ``M_i ← P_i·(s·Q_i)ᵀ`` and ``E_i ← M_i(before) − P_i·(s·Q_i)ᵀ``.

``LOCAL_ERR`` switches the error to the local residual of the alternating hook: ``E_i ← M_i − P_local·Q_iᵀ`` (a
P step, where P was all-reduced) or ``E_i ← M_i − P_i·Q_localᵀ`` (a Q step), while M_i still receives the
averaged ``P_i·(s·Q_i)ᵀ``.

One launch for the whole bucket, one program per tile of ``BLOCK_N`` rows of a matrix. The program keeps its
``BLOCK_N x R`` slice of P in registers and streams the columns of M in chunks of ``BLOCK_K``: each element of M is
read once (for the error) and written once, each element of E written once — the bucket is never cloned.

``UPDATE_FLAG``: a one-byte device flag; where it is 0 the error memory is left untouched (the hook clears it on a
non-finite step, so the state stays valid without a host synchronization). No atomics; every output element is
computed by one program in a fixed order, so results are bitwise reproducible.
"""

import triton
import triton.language as tl

from .lowrank_mm import _cast_for_store, _load_matrix_row


@triton.jit
def _outer(a, b, USE_DOT: tl.constexpr):
    """a · bᵀ for a [BLOCK_N, R] and b [BLOCK_K, R] tile (float32)."""
    if USE_DOT:
        return tl.dot(a, tl.trans(b), input_precision="ieee")
    else:
        return tl.sum(a[:, None, :] * b[None, :, :], axis=2)


@triton.jit
def _reconstruct_kernel(
    buf_ptr,  # bucket buffer, M_i row-major n x m at buf_ptr + off (overwritten with the approximation)
    p_ptr,  # flat P (float32), P_i row-major n x r
    q_ptr,  # flat Q (float32), Q_i row-major m x r
    lf_ptr,  # local factor for the error (LOCAL_ERR 1: P_local like p_ptr, 2: Q_local like q_ptr)
    e_ptr,  # flat error memory (float32), E_i row-major n x m (unused unless HAS_ERROR)
    flag_ptr,  # uint8 flag: update the error memory only if != 0 (unused unless HAS_FLAG)
    table_ptr,  # int64 [L, 8] layout table
    tiles_ptr,  # int32 [T, 2] (matrix, first row)
    scale,  # float32 factor applied to Q (1 / world size)
    HAS_ERROR: tl.constexpr,
    HAS_FLAG: tl.constexpr,
    LOCAL_ERR: tl.constexpr,  # 0: E = M - output; 1: E = M - P_local·Qᵀ; 2: E = M - P·Q_localᵀ
    R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    mat = tl.load(tiles_ptr + 2 * pid).to(tl.int64)
    row0 = tl.load(tiles_ptr + 2 * pid + 1).to(tl.int64)
    off, n, m, numel, r, p_off, q_off, e_off = _load_matrix_row(table_ptr, mat)

    rows = row0 + tl.arange(0, BLOCK_N).to(tl.int64)
    ranks = tl.arange(0, R)
    row_ok = rows < n
    rank_ok = ranks < r
    p = tl.load(
        p_ptr + p_off + rows[:, None] * r + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :], other=0.0
    ).to(tl.float32)
    if LOCAL_ERR == 1:
        p_loc = tl.load(
            lf_ptr + p_off + rows[:, None] * r + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :], other=0.0
        ).to(tl.float32)
    if HAS_FLAG:
        # broadcast load of the one-byte flag: a [BLOCK_N, BLOCK_K] mask (a scalar bool mask is not portable)
        keep = tl.load(flag_ptr + tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)) != 0
    for k0 in range(0, m, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        col_ok = cols < m
        q_mask = col_ok[:, None] & rank_ok[None, :]
        q_raw = tl.load(q_ptr + q_off + cols[:, None] * r + ranks[None, :], mask=q_mask, other=0.0).to(tl.float32)
        approx = _outer(p, q_raw * scale, USE_DOT)
        lin = rows[:, None] * m + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :] & (lin < numel)
        if HAS_ERROR:
            before = tl.load(buf_ptr + off + lin, mask=mask, other=0.0).to(tl.float32)
            e_mask = mask
            if HAS_FLAG:
                e_mask = mask & keep
            if LOCAL_ERR == 1:
                approx_e = _outer(p_loc, q_raw, USE_DOT)
            elif LOCAL_ERR == 2:
                q_loc = tl.load(lf_ptr + q_off + cols[:, None] * r + ranks[None, :], mask=q_mask, other=0.0)
                approx_e = _outer(p, q_loc.to(tl.float32), USE_DOT)
            else:
                approx_e = approx
            tl.store(e_ptr + e_off + lin, (before - approx_e).to(e_ptr.dtype.element_ty), mask=e_mask)
        tl.store(buf_ptr + off + lin, _cast_for_store(approx, buf_ptr), mask=mask)
