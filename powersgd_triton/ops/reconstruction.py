"""Fused reconstruction with error feedback: ``M_i ← P_i·(s·Q_i)ᵀ`` and ``E_i ← M_i(before) − P_i·(s·Q_i)ᵀ``.

``LOCAL_ERR`` switches the error to the local residual of a half-step hook: ``E_i ← M_i − P_local·Q_iᵀ`` (a
P step, where P was all-reduced) or ``E_i ← M_i − P_i·Q_localᵀ`` (a Q step), while M_i still receives the
averaged ``P_i·(s·Q_i)ᵀ``.

One launch for the whole bucket, one program per tile of ``BLOCK_N`` rows and a range of columns of a matrix
(columns are split freely: every output element is computed by exactly one program). The program keeps its
``BLOCK_N x R`` slice of P in registers and streams its columns of M in chunks of ``BLOCK_K``: each element of M is
read once (for the error) and written once, each element of E written once — the bucket is never cloned.

``HAS_FLAG``: ``n_flags`` uint8 step flags (:func:`powersgd_triton.ops.segments._average_kernel`, or one byte
given by the caller); the step is finite when bit 0 is set in all of them. Where it is not, the error memory is left
untouched (the state stays valid without a host synchronization). ``COMMIT`` (1: P, 2: Q) also writes the factor
into the warm-start memory ``kept`` where the step is finite and the matrix's factor is not all zero (bit 1 of its
flags, ``first[mat]:first[mat + 1]``): the programs holding column range 0 write their P rows, those holding row
block 0 the Q rows of their columns. No atomics; every output element is computed by one program in a fixed order,
so results are bitwise reproducible.

The launcher :func:`reconstruct` (one launch, its plan built once per layout, config and variant) and the column
splits :func:`split_cols` (planned from the SM count) live here too; shapes and dtypes are those of
:func:`powersgd_triton.ops.reconstruct`, configs: :mod:`.configs`.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from powersgd_triton.layout import BucketLayout
from powersgd_triton.ops import tables as _tables
from powersgd_triton.ops.common import (
    RECON_COL0, RECON_COL_END, RECON_MAT, RECON_ROW0, RECON_TILE_WIDTH, _aligned_matrix_row, _cast_for_store, _cast_rn, _flags_all, _flags_any_nonzero, _load_m_and_pad_error, _load_matrix_row, loop_range,
)
from powersgd_triton.ops.aligned import aligned_width
from powersgd_triton.ops.configs import _resolve
from powersgd_triton.ops.launch import PROGRAMS_PER_SM, DirectLaunch, _factor_rank, _launch_options, device_sms, steps_per_trip


@triton.jit
def _outer(a, b, USE_DOT: tl.constexpr):
    """a · bᵀ for a [BLOCK_N, R] and b [BLOCK_K, R] tile (float32)."""
    if USE_DOT:
        return tl.dot(a, tl.trans(b), input_precision="ieee")
    else:
        return tl.sum(a[:, None, :] * b[None, :, :], axis=2)


@triton.jit
def _outer_ranks(a, b, R: tl.constexpr):
    """a · bᵀ for a [BLOCK_N, R] and b [BLOCK_K, R] tile (float32), rank by rank: ``R`` outer products of columns,
    each a broadcast multiply-add of the [BLOCK_N, BLOCK_K] tile (no reduction across threads: the aligned path's
    tile keeps its 16-byte groups)."""
    ranks = tl.arange(0, R)
    acc = tl.zeros((a.shape[0], b.shape[0]), dtype=tl.float32)
    for j in tl.static_range(R):
        aj = tl.sum(tl.where(ranks[None, :] == j, a, 0.0), axis=1)
        bj = tl.sum(tl.where(ranks[None, :] == j, b, 0.0), axis=1)
        acc += aj[:, None] * bj[None, :]
    return acc


@triton.jit
def _reconstruct_loads(m_ptr, e_ptr, q_ptr, lf_ptr, rows, row_ok, ranks, rank_ok, k0, c_end, m, numel, r,
                       HAS_ERROR: tl.constexpr, PAD_ERROR: tl.constexpr, LOCAL_ERR: tl.constexpr,
                       BLOCK_K: tl.constexpr, ALIGN: tl.constexpr = 0):
    """The tiles one reconstruct step reads at columns ``k0:k0 + BLOCK_K`` (masked past ``c_end``), as stored:
    Q's ``[k, R]``, the local Q (``LOCAL_ERR == 2``), M's ``[rows, k]`` (``HAS_ERROR``) and the padding's error
    (``PAD_ERROR``); zeros for the ones the variant does not read."""
    if ALIGN:  # int32 offsets inside the matrix, every rank R (no rank mask), no padding
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < c_end
        q_mask = col_ok[:, None]
    else:
        cols = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        col_ok = cols < c_end
        q_mask = col_ok[:, None] & rank_ok[None, :]
    q = tl.load(q_ptr + cols[:, None] * r + ranks[None, :], mask=q_mask, other=0.0)
    if LOCAL_ERR == 2 and HAS_ERROR:
        q_loc = tl.load(lf_ptr + cols[:, None] * r + ranks[None, :], mask=q_mask, other=0.0)
    else:
        q_loc = tl.zeros((1, 1), dtype=tl.float32)
    if HAS_ERROR and ALIGN:
        x = tl.load(m_ptr + rows[:, None] * m + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        e = tl.zeros((1, 1), dtype=tl.float32)
    elif HAS_ERROR:
        x, e = _load_m_and_pad_error(m_ptr, e_ptr, rows, row_ok, cols, col_ok, m, numel, PAD_ERROR)
    else:
        x = tl.zeros((1, 1), dtype=tl.float32)
        e = tl.zeros((1, 1), dtype=tl.float32)
    return q, q_loc, x, e


@triton.jit
def _reconstruct_step(q_in, ql_in, m_in, e_in, p, p_loc, bp, ep, kp, ls, rows, row_ok, ranks, rank_ok, keep,
                      commit_q, k0, c_end, m, numel, r, scale, HAS_ERROR: tl.constexpr, LOCAL_ERR: tl.constexpr,
                      PAD_ERROR: tl.constexpr, COMMIT: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                      LOSS_SCALE: tl.constexpr, ALIGN: tl.constexpr = 0):
    """One step at columns ``k0:k0 + BLOCK_K`` from its loaded tiles (:func:`_reconstruct_loads`): the Q commit
    (``COMMIT == 2``), the error and the output; every store is masked past ``c_end`` (a step past the range's end,
    in the last trip of an unrolled loop, stores nothing)."""
    if ALIGN:
        cols = k0 + tl.arange(0, BLOCK_K)
    else:
        cols = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
    col_ok = cols < c_end
    q_raw = q_in.to(tl.float32)
    if COMMIT == 2:
        q_mask = col_ok[:, None] & rank_ok[None, :]
        tl.store(kp + cols[:, None] * r + ranks[None, :], _cast_for_store(q_raw, kp), mask=q_mask & commit_q)
    if ALIGN:
        approx = _outer_ranks(p, q_raw * scale, p.shape[1])
    else:
        approx = _outer(p, q_raw * scale, USE_DOT)
    lin = rows[:, None] * m + cols[None, :]
    inside = row_ok[:, None] & col_ok[None, :]
    if ALIGN:
        mask = inside
    else:
        mask = inside & (lin < numel)
    if HAS_ERROR:
        before = m_in.to(tl.float32)
        if PAD_ERROR:  # the padding's M + E is its error memory (the bucket holds no padding)
            e_pad = e_in.to(tl.float32)
            if LOSS_SCALE:
                e_pad = e_pad * tl.load(ls)  # (the batched view: never ALIGN)
            before += e_pad
            e_mask = inside & keep
        else:
            e_mask = mask & keep
        if LOCAL_ERR == 1:
            approx_e = _outer(p_loc, q_raw, USE_DOT)
        elif LOCAL_ERR == 2:
            approx_e = _outer(p, ql_in.to(tl.float32), USE_DOT)
        else:
            approx_e = approx
        e_new = before - approx_e
        if LOSS_SCALE:  # the error memory is kept in unscaled units
            e_new = e_new / (ls if ALIGN else tl.load(ls))
        tl.store(ep + lin, _cast_for_store(e_new, ep), mask=e_mask)
    if ALIGN:
        tl.store(bp + lin, _cast_rn(approx, bp), mask=mask)
    else:
        tl.store(bp + lin, _cast_for_store(approx, bp), mask=mask)


@triton.jit
def _reconstruct_kernel(
    buf_ptr,  # bucket buffer, M_i row-major n x m at buf_ptr + off (overwritten with the approximation)
    p_ptr,  # flat P (float32), P_i row-major n x r
    q_ptr,  # flat Q (float32), Q_i row-major m x r
    lf_ptr,  # local factor for the error (LOCAL_ERR 1: P_local like p_ptr, 2: Q_local like q_ptr)
    e_ptr,  # flat error memory (float32), E_i row-major n x m (unused unless HAS_ERROR)
    kept_ptr,  # warm-start factor memory (COMMIT 1: like p_ptr, 2: like q_ptr)
    flags_ptr,  # uint8 step flags: bit 0 finite, bit 1 non-zero (HAS_FLAG / COMMIT)
    first_ptr,  # int32 [L + 1]: flags of matrix i are first[i]:first[i + 1] (COMMIT)
    table_ptr,  # int64 [L, TABLE_WIDTH] layout table
    tiles_ptr,  # int32 [T, RECON_TILE_WIDTH] (matrix, first row, first column, end column)
    ls_ptr,  # float32 [1] loss scale s (LOSS_SCALE: E is stored divided by s, the padding's M + E is s·E)
    n_flags,  # number of flags
    scale,  # float32 factor applied to Q (1 / world size, or 1 when Q was averaged already)
    HAS_ERROR: tl.constexpr,
    HAS_FLAG: tl.constexpr,
    LOCAL_ERR: tl.constexpr,  # 0: E = M - output; 1: E = M - P_local·Qᵀ; 2: E = M - P·Q_localᵀ
    PAD_ERROR: tl.constexpr,  # batched view: the padding (flat index >= numel) has error memory too
    COMMIT: tl.constexpr,  # 0: none; 1: kept P <- P; 2: kept Q <- Q (where finite and non-zero)
    R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    PREFETCH: tl.constexpr = 0,  # broadcast path: 1 (2) more steps' tiles loaded while one step is computed
    LOSS_SCALE: tl.constexpr = False,
    CARRY: tl.constexpr = False,  # PREFETCH 1 as a loop-carried register copy (one step per trip; see below)

    ALIGN: tl.constexpr = 0,  # the aligned layout: elements of the bucket's dtype per 16 bytes (aligned.vector_width)
):
    """The broadcast path (``USE_DOT`` false) with ``PREFETCH`` p unrolls its loop p + 1 times, one register set
    per step: the tiles of the next p steps are loaded before a step is computed, and each loaded register is
    consumed where it was loaded (no loop-carried copy, which waits for its loads within the trip). A column range
    that is not a multiple of (p + 1) x ``BLOCK_K`` columns ends with steps past its end: their loads and stores
    are masked (``c_end``). ``CARRY`` (with ``PREFETCH`` 1) keeps the older form, one step per trip whose next
    tiles are copied into this step's registers: fewer registers (kept where the unrolled loop would cost a block
    per SM, :data:`powersgd_triton.ops.configs.RECONSTRUCT_TILES`)."""
    pid = tl.program_id(0)
    mat = tl.load(tiles_ptr + RECON_TILE_WIDTH * pid + RECON_MAT).to(tl.int64)
    if ALIGN:  # int32 offsets inside a matrix, alignment declared (common._aligned_matrix_row), every rank R
        row0 = tl.load(tiles_ptr + RECON_TILE_WIDTH * pid + RECON_ROW0)
        # column ranges start at multiples of the split (whole steps) and end there or at m
        c_begin = tl.multiple_of(tl.load(tiles_ptr + RECON_TILE_WIDTH * pid + RECON_COL0), ALIGN)
        c_end = tl.multiple_of(tl.load(tiles_ptr + RECON_TILE_WIDTH * pid + RECON_COL_END), ALIGN)
        off, n, m, p_off, q_off, e_off = _aligned_matrix_row(table_ptr, mat, ALIGN, R)
        numel = 0
        r = R
        rows = row0 + tl.arange(0, BLOCK_N)
    else:
        row0 = tl.load(tiles_ptr + RECON_TILE_WIDTH * pid + RECON_ROW0).to(tl.int64)
        c_begin = tl.load(tiles_ptr + RECON_TILE_WIDTH * pid + RECON_COL0).to(tl.int64)
        c_end = tl.load(tiles_ptr + RECON_TILE_WIDTH * pid + RECON_COL_END).to(tl.int64)
        off, n, m, numel, r, p_off, q_off, e_off = _load_matrix_row(table_ptr, mat)
        rows = row0 + tl.arange(0, BLOCK_N).to(tl.int64)
    ranks = tl.arange(0, R)
    row_ok = rows < n
    rank_ok = ranks < r
    p_mask = row_ok[:, None] & rank_ok[None, :]
    p = tl.load(p_ptr + p_off + rows[:, None] * r + ranks[None, :], mask=p_mask, other=0.0).to(tl.float32)
    p_loc = p
    if LOCAL_ERR == 1:
        p_loc = tl.load(lf_ptr + p_off + rows[:, None] * r + ranks[None, :], mask=p_mask, other=0.0).to(tl.float32)
    ok = 1
    if HAS_FLAG:
        ok = _flags_all(flags_ptr, n_flags, 256)
    # block masks from scalars (a scalar bool in a mask expression is not portable to the interpreter)
    keep = (tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32) + ok) != 0
    commit_q = keep  # unused unless COMMIT == 2
    if COMMIT != 0:
        fresh = ok & _flags_any_nonzero(flags_ptr, first_ptr, mat, 64)
        if COMMIT == 1:
            mine = fresh * (c_begin == 0).to(tl.int32)
            commit_p = (tl.zeros((BLOCK_N, R), dtype=tl.int32) + mine) != 0
            tl.store(kept_ptr + p_off + rows[:, None] * r + ranks[None, :], _cast_for_store(p, kept_ptr),
                     mask=p_mask & commit_p)
        else:
            mine = fresh * (row0 == 0).to(tl.int32)
            commit_q = (tl.zeros((BLOCK_K, R), dtype=tl.int32) + mine) != 0
    ls = ls_ptr  # the masked path loads it per step (hoisted, its register spills in R 8's 2-byte LOSS_SCALE variant)
    if LOSS_SCALE and ALIGN:  # loaded once: a load inside the loop would wait a latency per step
        ls = tl.load(ls_ptr)
    bp = buf_ptr + off  # this matrix's M, error, Q and local Q
    ep = e_ptr + e_off
    qp = q_ptr + q_off
    lp = lf_ptr + q_off
    if CARRY:  # this step's tiles arrived during the last step; the next step's go out now
        q_n, ql_n, m_n, e_n = _reconstruct_loads(bp, ep, qp, lp, rows, row_ok, ranks, rank_ok, c_begin, c_end, m,
                                                 numel, r, HAS_ERROR, PAD_ERROR, LOCAL_ERR, BLOCK_K, ALIGN)
        for k0 in loop_range(c_begin, c_end, BLOCK_K):
            q_a, ql_a, m_a, e_a = q_n, ql_n, m_n, e_n
            q_n, ql_n, m_n, e_n = _reconstruct_loads(bp, ep, qp, lp, rows, row_ok, ranks, rank_ok, k0 + BLOCK_K,
                                                     c_end, m, numel, r, HAS_ERROR, PAD_ERROR, LOCAL_ERR, BLOCK_K, ALIGN)
            _reconstruct_step(q_a, ql_a, m_a, e_a, p, p_loc, bp, ep, kept_ptr + q_off, ls, rows, row_ok, ranks,
                              rank_ok, keep, commit_q, k0, c_end, m, numel, r, scale, HAS_ERROR, LOCAL_ERR, PAD_ERROR,
                              COMMIT, BLOCK_K, USE_DOT, LOSS_SCALE, ALIGN)
    elif PREFETCH == 0:
        for k0 in loop_range(c_begin, c_end, BLOCK_K):
            q_a, ql_a, m_a, e_a = _reconstruct_loads(bp, ep, qp, lp, rows, row_ok, ranks, rank_ok, k0, c_end, m,
                                                     numel, r, HAS_ERROR, PAD_ERROR, LOCAL_ERR, BLOCK_K, ALIGN)
            _reconstruct_step(q_a, ql_a, m_a, e_a, p, p_loc, bp, ep, kept_ptr + q_off, ls, rows, row_ok, ranks,
                              rank_ok, keep, commit_q, k0, c_end, m, numel, r, scale, HAS_ERROR, LOCAL_ERR, PAD_ERROR,
                              COMMIT, BLOCK_K, USE_DOT, LOSS_SCALE, ALIGN)
    elif PREFETCH == 1:  # register sets a, b: a's loads go out while b's step is computed, and b's during a's
        q_a, ql_a, m_a, e_a = _reconstruct_loads(bp, ep, qp, lp, rows, row_ok, ranks, rank_ok, c_begin, c_end, m,
                                                 numel, r, HAS_ERROR, PAD_ERROR, LOCAL_ERR, BLOCK_K, ALIGN)
        for k0 in loop_range(c_begin, c_end, 2 * BLOCK_K):
            q_b, ql_b, m_b, e_b = _reconstruct_loads(bp, ep, qp, lp, rows, row_ok, ranks, rank_ok, k0 + BLOCK_K,
                                                     c_end, m, numel, r, HAS_ERROR, PAD_ERROR, LOCAL_ERR, BLOCK_K, ALIGN)
            _reconstruct_step(q_a, ql_a, m_a, e_a, p, p_loc, bp, ep, kept_ptr + q_off, ls, rows, row_ok, ranks,
                              rank_ok, keep, commit_q, k0, c_end, m, numel, r, scale, HAS_ERROR, LOCAL_ERR, PAD_ERROR,
                              COMMIT, BLOCK_K, USE_DOT, LOSS_SCALE, ALIGN)
            q_a, ql_a, m_a, e_a = _reconstruct_loads(bp, ep, qp, lp, rows, row_ok, ranks, rank_ok, k0 + 2 * BLOCK_K,
                                                     c_end, m, numel, r, HAS_ERROR, PAD_ERROR, LOCAL_ERR, BLOCK_K, ALIGN)
            _reconstruct_step(q_b, ql_b, m_b, e_b, p, p_loc, bp, ep, kept_ptr + q_off, ls, rows, row_ok, ranks,
                              rank_ok, keep, commit_q, k0 + BLOCK_K, c_end, m, numel, r, scale, HAS_ERROR, LOCAL_ERR,
                              PAD_ERROR, COMMIT, BLOCK_K, USE_DOT, LOSS_SCALE, ALIGN)
    else:  # three register sets: two steps' loads in flight while one is computed
        q_a, ql_a, m_a, e_a = _reconstruct_loads(bp, ep, qp, lp, rows, row_ok, ranks, rank_ok, c_begin, c_end, m,
                                                 numel, r, HAS_ERROR, PAD_ERROR, LOCAL_ERR, BLOCK_K, ALIGN)
        q_b, ql_b, m_b, e_b = _reconstruct_loads(bp, ep, qp, lp, rows, row_ok, ranks, rank_ok, c_begin + BLOCK_K,
                                                 c_end, m, numel, r, HAS_ERROR, PAD_ERROR, LOCAL_ERR, BLOCK_K, ALIGN)
        for k0 in loop_range(c_begin, c_end, 3 * BLOCK_K):
            q_c, ql_c, m_c, e_c = _reconstruct_loads(bp, ep, qp, lp, rows, row_ok, ranks, rank_ok, k0 + 2 * BLOCK_K,
                                                     c_end, m, numel, r, HAS_ERROR, PAD_ERROR, LOCAL_ERR, BLOCK_K, ALIGN)
            _reconstruct_step(q_a, ql_a, m_a, e_a, p, p_loc, bp, ep, kept_ptr + q_off, ls, rows, row_ok, ranks,
                              rank_ok, keep, commit_q, k0, c_end, m, numel, r, scale, HAS_ERROR, LOCAL_ERR, PAD_ERROR,
                              COMMIT, BLOCK_K, USE_DOT, LOSS_SCALE, ALIGN)
            q_a, ql_a, m_a, e_a = _reconstruct_loads(bp, ep, qp, lp, rows, row_ok, ranks, rank_ok, k0 + 3 * BLOCK_K,
                                                     c_end, m, numel, r, HAS_ERROR, PAD_ERROR, LOCAL_ERR, BLOCK_K, ALIGN)
            _reconstruct_step(q_b, ql_b, m_b, e_b, p, p_loc, bp, ep, kept_ptr + q_off, ls, rows, row_ok, ranks,
                              rank_ok, keep, commit_q, k0 + BLOCK_K, c_end, m, numel, r, scale, HAS_ERROR, LOCAL_ERR,
                              PAD_ERROR, COMMIT, BLOCK_K, USE_DOT, LOSS_SCALE, ALIGN)
            q_b, ql_b, m_b, e_b = _reconstruct_loads(bp, ep, qp, lp, rows, row_ok, ranks, rank_ok, k0 + 4 * BLOCK_K,
                                                     c_end, m, numel, r, HAS_ERROR, PAD_ERROR, LOCAL_ERR, BLOCK_K, ALIGN)
            _reconstruct_step(q_c, ql_c, m_c, e_c, p, p_loc, bp, ep, kept_ptr + q_off, ls, rows, row_ok, ranks,
                              rank_ok, keep, commit_q, k0 + 2 * BLOCK_K, c_end, m, numel, r, scale, HAS_ERROR,
                              LOCAL_ERR, PAD_ERROR, COMMIT, BLOCK_K, USE_DOT, LOSS_SCALE, ALIGN)


def _pow2_split(work_per_program: float, align: int, extent: int) -> int:
    """Largest ``align * 2**k`` <= ``work_per_program`` (at least ``2 * align``: a few loop trips), so that the
    bucket gets at least the target number of programs; 0 (no split) when that is >= ``extent``."""
    split = 2 * align
    while split * 2 <= work_per_program:
        split *= 2
    return 0 if split >= extent else split


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
    matrix's flags (``first``, from :func:`powersgd_triton.ops.tables.average_tiles`) say non-zero.
    ``loss_scale``: one-element float32 ``s``; the error is stored divided by it (unscaled units). Launch plans as
    :func:`~powersgd_triton.ops.projection.project`'s (the column splits planned once, from the device's SM count).
    """
    launch, head, tail, tiles = _reconstruct_args(buffer, layout, p, q, scale, error, update_error is not None,
                                                   local_p, local_q, commit, loss_scale, config)
    if update_error is not None:
        flags = update_error.reshape(-1)
        if flags.dtype == torch.bool:
            flags = flags.view(torch.uint8)
        n_flags = update_error.numel()
    else:
        flags, n_flags = p, 0
    ls, scale = tail
    launch(*head, flags, first if first is not None else tiles, layout.table, tiles, ls, n_flags, scale)


def reconstruct_bound(buffer, layout: BucketLayout, p, q, scale: float, error=None, n_flags: Optional[int] = None,
                      first=None, *, commit=None, loss_scale=None, config: Optional[dict] = None):
    """``flags -> None``: the launch :func:`reconstruct` makes with these arguments (no local factor) and
    ``update_error=flags``, a 1-D uint8 tensor of ``n_flags`` step flags (``n_flags`` None: no flags, ``flags``
    None), ``first`` their table per matrix (the plan and the other arguments bound now; the hooks' step plans)."""
    has_flags = n_flags is not None
    launch, head, tail, tiles = _reconstruct_args(buffer, layout, p, q, scale, error, has_flags, None, None, commit,
                                                  loss_scale, config)
    mid = (first if first is not None else tiles, layout.table, tiles, tail[0], n_flags if has_flags else 0, tail[1])

    def reconstruct_step(flags) -> None:
        launch(*head, p if flags is None else flags, *mid)

    return reconstruct_step


def _reconstruct_args(buffer, layout, p, q, scale, error, has_flags, local_p, local_q, commit, loss_scale, config):
    """``(launch, head, tail, tiles)``: the launch's arguments are ``head + (flags, first, layout.table, tiles,
    tail[0], n_flags, tail[1])``."""
    local_err = 1 if local_p is not None else 2 if local_q is not None else 0
    local = local_p if local_p is not None else local_q if local_q is not None else p
    commit_mode, kept = 0, p
    if commit is not None:
        which, kept = commit
        commit_mode = 1 if which == "p" else 2
    key = ("launch:reconstruct", buffer.dtype, None if config is None else tuple(config.items()), error is not None,
           has_flags, local_err, commit_mode, loss_scale is not None)
    plan = layout._tiles.get(key)  # the layout's memo (layout.memo), read without a call
    if plan is None:
        plan = layout.memo(key, lambda: _reconstruct_launch(layout, buffer.dtype, config, *key[3:]))
    launch, tiles = plan
    head = (buffer, p, q, local, error if error is not None else p, kept)
    return launch, head, (loss_scale if loss_scale is not None else p, float(scale)), tiles


def _reconstruct_launch(layout, dtype, config, has_error, has_flag, local_err, commit_mode, has_ls):
    cfg = _resolve("reconstruct", layout, dtype, config)
    split = split_cols(layout, cfg, device_sms(layout.device))
    tiles = _tables.reconstruct_tiles(layout, cfg["BLOCK_N"], split)
    R = _factor_rank(layout, cfg)
    return DirectLaunch(_reconstruct_kernel, (tiles.shape[0],), dict(
        HAS_ERROR=has_error, HAS_FLAG=has_flag, LOCAL_ERR=local_err, PAD_ERROR=layout.batched and has_error,
        COMMIT=commit_mode, R=R, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], USE_DOT=cfg["USE_DOT"],
        PREFETCH=cfg.get("PREFETCH", 0), LOSS_SCALE=has_ls and has_error, CARRY=bool(cfg.get("CARRY", False)),
        ALIGN=aligned_width(layout, dtype, cfg), **_launch_options(cfg))), tiles
