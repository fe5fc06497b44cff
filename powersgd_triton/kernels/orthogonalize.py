"""Grouped Gram-Schmidt: orthonormalize the columns of every P_i (or Q_i) of a bucket in one launch.

One program per matrix. Modified Gram-Schmidt in column order, the same operations as PyTorch's
``_orthogonalize_gram_schmidt``: column j is divided by ``norm_j + epsilon``, then its projection is removed from the
later columns. Two streaming passes per column over the (small, float32) factor:

* pass 1: normalize column j on the fly and reduce the dot products ``d_k = <col_j, col_k>`` for k > j;
* pass 2: write column j normalized, subtract ``d_k · col_j`` from the later columns, and reduce the squared norm of
  column j + 1 for the next step.

Every reduction runs in a fixed order inside one program (no atomics), so the result is bitwise reproducible and
identical on every rank that uses the same config. A column whose norm is exactly 0 stays 0 (also with epsilon 0)
instead of becoming NaN; NaN or inf input stays non-finite. Norms are accumulated in float32.
"""

import triton
import triton.language as tl

from .common import loop_range


@triton.jit
def _column(tile, ranks, j):
    """Column j of a [BLOCK, R] tile as a [BLOCK] vector (no dynamic indexing in Triton)."""
    return tl.sum(tl.where(ranks[None, :] == j, tile, 0.0), axis=1)


@triton.jit
def _orthogonalize_kernel(
    x_ptr,  # flat factor input (float32), matrix i row-major rows_i x r_i at x_ptr + offset_i
    out_ptr,  # flat factor output (may alias x_ptr)
    table_ptr,  # int64 [L, 8] layout table
    eps,  # float32 epsilon added to each norm
    ROWS_COL: tl.constexpr,  # table column holding the row count (1: n for P, 2: m for Q)
    OFF_COL: tl.constexpr,  # table column holding the factor offset (5: P, 6: Q)
    R: tl.constexpr,
    BLOCK: tl.constexpr,
):
    mat = tl.program_id(0).to(tl.int64)
    row = table_ptr + mat * 8
    rows_n = tl.load(row + ROWS_COL)
    r = tl.load(row + 4)
    base = tl.load(row + OFF_COL)
    ranks = tl.arange(0, R)
    rank_ok = ranks < r

    # Pass 0: copy input to output and reduce the squared norm of column 0.
    sumsq = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, rows_n, BLOCK):
        rows = k0 + tl.arange(0, BLOCK).to(tl.int64)
        mask = (rows < rows_n)[:, None] & rank_ok[None, :]
        ptrs = rows[:, None] * r + ranks[None, :]
        tile = tl.load(x_ptr + base + ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + base + ptrs, tile.to(out_ptr.dtype.element_ty), mask=mask)
        c = _column(tile, ranks, 0)
        sumsq += c * c

    for j in tl.static_range(R):
        denom = tl.sqrt(tl.sum(sumsq, axis=0)) + eps
        safe = tl.where(denom == 0.0, 1.0, denom)  # norm 0 (and eps 0): the column is 0 and stays 0
        later = ranks > j
        # Pass 1: dot products of the normalized column j with the later columns.
        dots = tl.zeros((BLOCK, R), dtype=tl.float32)
        for k0 in range(0, rows_n, BLOCK):
            rows = k0 + tl.arange(0, BLOCK).to(tl.int64)
            mask = (rows < rows_n)[:, None] & rank_ok[None, :]
            tile = tl.load(out_ptr + base + rows[:, None] * r + ranks[None, :], mask=mask, other=0.0).to(tl.float32)
            cj = _column(tile, ranks, j) / safe
            dots += cj[:, None] * tile
        d = tl.where(later, tl.sum(dots, axis=0), 0.0)
        # Pass 2: store column j normalized, remove its projection from the later columns,
        # and reduce the squared norm of column j + 1.
        sumsq = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, rows_n, BLOCK):
            rows = k0 + tl.arange(0, BLOCK).to(tl.int64)
            mask = (rows < rows_n)[:, None] & rank_ok[None, :]
            ptrs = rows[:, None] * r + ranks[None, :]
            tile = tl.load(out_ptr + base + ptrs, mask=mask, other=0.0).to(tl.float32)
            cj = _column(tile, ranks, j) / safe
            new = tl.where(ranks[None, :] == j, cj[:, None], tile - cj[:, None] * d[None, :])
            tl.store(out_ptr + base + ptrs, new.to(out_ptr.dtype.element_ty), mask=mask)
            c = _column(new, ranks, j + 1)
            sumsq += c * c


@triton.jit
def _commit_factor_kernel(
    new_ptr,  # flat factor of this step (float32)
    kept_ptr,  # flat factor kept between steps (float32), updated in place
    flag_ptr,  # uint8 flag: the step is finite (0: keep everything)
    table_ptr,  # int64 [L, 8] layout table
    ROWS_COL: tl.constexpr,  # 1: P (n rows), 2: Q (m rows)
    OFF_COL: tl.constexpr,  # 5: P offsets, 6: Q offsets
    BLOCK: tl.constexpr,
):
    """kept_i <- new_i for every matrix i whose new factor is not all zero, where the step is finite.

    One program per matrix: an exact max-abs reduction (order-independent), then a masked copy. A factor that is all
    zero (the layer had no gradient on any rank) is not kept: orth(0) = 0 and M·0 = 0 would zero it for good.
    """
    mat = tl.program_id(0).to(tl.int64)
    row = table_ptr + mat * 8
    count = tl.load(row + ROWS_COL) * tl.load(row + 4)
    base = tl.load(row + OFF_COL)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    peak = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in loop_range(0, count, BLOCK):
        x = tl.load(new_ptr + base + k0 + offs, mask=k0 + offs < count, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(x))
    # as a [BLOCK] mask: a scalar bool in a mask expression is not portable (the interpreter rejects it)
    nonzero = (tl.zeros((BLOCK,), dtype=tl.float32) + tl.max(peak, axis=0)) != 0.0
    ok = tl.load(flag_ptr + tl.zeros((BLOCK,), dtype=tl.int32)) != 0
    for k0 in loop_range(0, count, BLOCK):
        mask = k0 + offs < count
        x = tl.load(new_ptr + base + k0 + offs, mask=mask, other=0.0)
        tl.store(kept_ptr + base + k0 + offs, x, mask=mask & ok & nonzero)
