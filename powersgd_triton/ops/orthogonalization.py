"""Grouped orthogonalization of the factors of a bucket: Gram matrix in float64, Gram-Schmidt on it, one apply pass.

For each factor X_i (``rows_i x r_i`` float32, ``P_i`` or ``Q_i``) the result is ``X_i · T_i`` with ``T_i`` upper
triangular: modified Gram-Schmidt (PyTorch's ``_orthogonalize_gram_schmidt``, column ``j`` divided by
``norm_j + epsilon``, then its projection removed from the later columns) run on the ``r x r`` Gram matrix
``G_i = X_iᵀ·X_i`` instead of on the columns. In exact arithmetic that is the same ``Q`` column by column; it needs two
passes over X_i whatever r is (one to accumulate ``G_i``, one to write ``X_i · T_i``) instead of two per column.

Numerics. Each float32 product is exact in float64 and a float64 sum of them cannot overflow (fp32² ≤ 1.2e77), so
``G_i``, the ``r x r`` work and the apply ``X_i · T_i`` are all done in float64: norms and inner products are
overflow-safe for every finite float32 input, and the orthogonality of the float32 result is float32 rounding up to
condition numbers of ~1e4 (mixed-precision Cholesky-QR, Yamazaki, Tomov, Dongarra 2015; float32 Gram-Schmidt loses
``κ·u32``).

Dependent columns. A column whose residual norm² is at most ``DEPENDENT_TOL`` (2⁻⁴⁰) times its own norm² — numerically
in the span of the columns before it, or all zero while the factor is not — is left out of the Gram-Schmidt sweep and
then filled with a unit vector orthogonal to all other columns (of the ``rm`` Walsh vectors on the first ``rm`` rows,
``rm`` the rank rounded up to a power of two, the one with the largest residual), as Householder QR
(``torch.linalg.qr``, PyTorch's hook at rank > 2) gives an orthonormal column there too. Keeping such a column at zero
would keep that column of the warm-start Q at zero for ever (``M·0 = 0``). A factor that is all zero stays all zero
(no NaN, also with epsilon 0); NaN or inf input gives non-finite output. The torch backend
(:func:`powersgd_triton.ops.reference.gram_schmidt_`) follows the same rules.

Launches (:func:`orthogonalize`): factors of at most ``SHORT_ROWS`` rows get
one program each in ONE launch of :func:`_orthogonalize_kernel` (Gram pass, r x r work, apply pass); taller factors
are split over rows: :func:`_ortho_gram_kernel` writes the float64 Gram of each ``GRAM_ROWS`` rows to a workspace
slot, then one program per ``SPLIT_ROWS`` rows of :func:`_orthogonalize_kernel` sums the slots of its matrix (every
such program the same sum, in the same order), repeats the r x r work and applies it to its rows. No atomics and a
fixed summation order: the result is bitwise reproducible, depends on the config and the factor only (not on the
number of programs of the apply pass or their scheduling), and is the same on every rank with the same config.

The launch side lives here too: :class:`_OrthoPlan` builds the task tables of one call
(:data:`powersgd_triton.ops.tables.ORTHO_GRAM_TASK_COLUMNS`, :data:`~powersgd_triton.ops.tables.ORTHO_TASK_COLUMNS`)
once per layout and config (kept weakly with the layout, with the float64 Gram workspace); :func:`orthogonalize`
launches from them, :func:`orthogonalize_plan` describes the launches for the performance model. Configs:
:mod:`.configs`.
"""

import weakref
from typing import List, Optional

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

from powersgd_triton.compat import versions as _compat
from powersgd_triton.layout import BucketLayout, padded_rank, table_row
from powersgd_triton.ops.common import (
    GRAM_HEAD, GRAM_N, GRAM_OFF, GRAM_R, GRAM_RM, GRAM_ROW0, GRAM_SLOT, ORTHO_GRAM_TASK_WIDTH, ORTHO_HEAD, ORTHO_N, ORTHO_OFF, ORTHO_R, ORTHO_RM, ORTHO_ROW0, ORTHO_ROW_END, ORTHO_SLOT0, ORTHO_SLOTS, ORTHO_TASK_WIDTH,
)
from powersgd_triton.ops import tables as _tables
from powersgd_triton.ops.configs import _ortho_constexprs, _resolve
from powersgd_triton.ops.launch import DirectLaunch, _launch_options, bind_launches, factor_columns
from powersgd_triton.ops.reference_ortho import DEPENDENT_TOL

_TAU = tl.constexpr(DEPENDENT_TOL)
# tl.dot's smallest float64 inner dimension in this Triton (4 in 3.9, 16 in 3.6): below it, broadcast and sum
_DOT64_K = tl.constexpr(_compat.dot_min_k(64))
_DOT64_K8 = tl.constexpr(max(8, _compat.dot_min_k(64)))
# float64 tl.dot at all (not in triton 3.4): the Gram matrices are broadcast and summed without it
_DOT64 = tl.constexpr(_compat.dot_float64_supported())


@triton.jit
def _mm(a, b, USE_DOT: tl.constexpr):
    """a · b in float64 (``tl.dot`` needs an inner dimension >= ``_DOT64_K``; below that, broadcast and sum)."""
    if USE_DOT:
        return tl.dot(a, b)
    else:
        return tl.sum(a[:, :, None] * b[None, :, :], axis=1)


@triton.jit
def _walsh(rows, cols, n, rm):
    """Completion vectors: ``(-1)^popcount(row & c)`` at ``[rows, cols]`` for ``row < min(n, rm)``, ``c < rm``, else
    0 (Sylvester-Hadamard columns on the first ``rm`` rows: orthogonal, of norm sqrt(rm), when ``n >= rm``; of rank
    ``min(n, rm)`` otherwise). float64 [len(rows), len(cols)]."""
    v = rows[:, None].to(tl.int32) & cols[None, :].to(tl.int32)
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    sign = 1.0 - 2.0 * (v & 1).to(tl.float64)
    ok = (rows[:, None] < n) & (rows[:, None] < rm) & (cols[None, :] < rm)
    return tl.where(ok, sign, 0.0)


@triton.jit
def _gram_schmidt_on_gram(G, r, eps, R: tl.constexpr):
    """Modified Gram-Schmidt with epsilon on the Gram matrix ``G`` (float64 [R, R], columns >= r zero).

    Returns ``(Zx, dep)``: column j of the result is ``X·Zx[:, j]``; ``dep`` (float64 [R], 1.0 or 0.0) marks the
    dependent columns, which are left at zero here (so they take no part in the later columns' projections) and
    filled by :func:`_completions`. One serial step per column, kept to few operations (they are the latency of the
    kernel). (``tl.reduce(.., _sum_combine)`` is ``tl.sum`` without its wrapper, which costs ~10 ms a call in the
    interpreter.)
    """
    ia = tl.arange(0, R)[:, None]
    ib = tl.arange(0, R)[None, :]
    idx = tl.arange(0, R)
    Zx = tl.where((ia == ib) & (ib < r), 1.0, 0.0).to(tl.float64)
    C = G
    g0 = tl.reduce(tl.where(ia == ib, G, 0.0), 0, _sum_combine)  # squared column norms
    act = idx < r
    nonzero = tl.reduce(tl.where(act, g0, 0.0), 0, _sum_combine) > 0.0  # False for an all-zero (or NaN) factor
    # column j is dependent when its residual C[j, j] <= tol_j (never for inactive or non-finite columns, or in an
    # all-zero factor; a scalar in `&` is not portable to the interpreter, hence two wheres)
    tol = tl.where(act & (g0 - g0 == 0.0), _TAU * g0, -float("inf"))
    tol = tl.where(nonzero, tol, -float("inf"))
    dep = tl.zeros((R,), dtype=tl.float64)
    for j in range(R):
        mj = idx == j
        rowj = tl.reduce(tl.where(ia == j, C, 0.0), 0, _sum_combine)  # C[j, :]
        cjj = tl.reduce(tl.where(mj, rowj, 0.0), 0, _sum_combine)
        is_dep = cjj <= tl.reduce(tl.where(mj, tol, 0.0), 0, _sum_combine)
        denom = tl.sqrt(tl.where(cjj < 0.0, 0.0, cjj)) + eps  # (NaN stays NaN)
        inv = 1.0 / tl.where(denom == 0.0, 1.0, denom)  # a zero factor stays zero, no NaN
        inv = tl.where(is_dep, 0.0, inv)  # a dependent column is zero until completed
        dep = tl.where(mj, tl.where(is_dep, 1.0, 0.0), dep)
        d = tl.where((idx > j) & act, rowj * inv, 0.0)  # d_b = <q_j, v_b> for the later columns b
        # q_j = v_j / denom; v_b -= d_b q_j, so C[b, b'] -= (2 - |q_j|²) d_b d_b'
        C = C - ((2.0 - cjj * inv * inv) * d)[:, None] * d[None, :]
        zxj = tl.reduce(tl.where(ib == j, Zx, 0.0), 1, _sum_combine) * inv
        Zx = tl.where(ib == j, zxj[:, None], Zx - zxj[:, None] * d[None, :])
    return Zx, dep


@triton.jit
def _completions(Zx, dep, Gwx, Gww, eps, R: tl.constexpr):
    """Fill the dependent columns (``dep``), in order, each with the completion vector of largest residual against
    all other columns, orthogonalized against them, divided by ``norm + eps``; returns ``(Zx, Zw)``: column j is
    ``X·Zx[:, j] + W·Zw[:, j]``. ``Gwx = WᵀX``, ``Gww = WᵀW`` (W: :func:`_walsh`). The chosen residual is at least
    1/rm of the candidate's norm (the candidates span rm >= r dimensions), so one classical Gram-Schmidt pass in
    float64 is orthogonal to float64 rounding. Runs only for a factor with a dependent column.
    """
    ia = tl.arange(0, R)[:, None]
    ib = tl.arange(0, R)[None, :]
    idx = tl.arange(0, R)
    Zw = tl.zeros((R, R), dtype=tl.float64)
    wdiag = tl.sum(tl.where(ia == ib, Gww, 0.0), axis=1)
    OT = _mm(Gwx, Zx, R >= _DOT64_K8)  # OT[c, i] = w_cᵀ q_i (dependent columns still zero), updated per completed column
    for j in range(R):
        if tl.sum(tl.where(idx == j, dep, 0.0), axis=0) > 0.0:
            res = tl.where(wdiag > 0.0, wdiag - tl.sum(OT * OT, axis=1), -1.0)  # ||w_c||² - Σ_i (w_cᵀ q_i)²
            best = tl.max(res, axis=0)
            cstar = tl.min(tl.where(res == best, idx, R), axis=0)  # the first of the largest
            o = tl.sum(tl.where(ia == cstar, OT, 0.0), axis=0)  # o[i] = q_iᵀ w_c*
            inv = 1.0 / (tl.sqrt(best) + eps)
            vx = -tl.sum(Zx * o[None, :], axis=1) * inv  # (w_c* - Σ_i q_i o_i) / (norm + eps)
            vw = (tl.where(idx == cstar, 1.0, 0.0) - tl.sum(Zw * o[None, :], axis=1)) * inv
            Zx = tl.where(ib == j, vx[:, None], Zx)
            Zw = tl.where(ib == j, vw[:, None], Zw)
            ot = tl.sum(Gwx * vx[None, :], axis=1) + tl.sum(Gww * vw[None, :], axis=1)  # W^T q_j
            OT = tl.where(ib == j, ot[:, None], OT)
    return Zx, Zw


@triton.jit
def _head_gram(x_ptr, base, n, r, rm, enabled, R: tl.constexpr):
    """``Wᵀ·X`` ([R (candidate), R (column)], float64) from the first R rows of the factor (zeros where not
    ``enabled``, an int64 scalar > 0)."""
    hrows = tl.arange(0, R).to(tl.int64)
    ranks = tl.arange(0, R)
    mask = (hrows < n)[:, None] & (ranks < r)[None, :] & ((hrows[:, None] * 0 + enabled) > 0)
    xh = tl.load(x_ptr + base + hrows[:, None] * r + ranks[None, :], mask=mask, other=0.0).to(tl.float64)
    w = _walsh(hrows, ranks, n, rm)
    return _mm(tl.trans(w), xh, R >= _DOT64_K)


@triton.jit
def _ortho_gram_kernel(
    x_ptr,  # flat factor input (float32), matrix i row-major rows_i x r_i at x_ptr + offset_i
    ws_ptr,  # float64 workspace of [R, R] slots
    tasks_ptr,  # int64 [T, ORTHO_GRAM_TASK_WIDTH] (layout.ORTHO_GRAM_TASK_COLUMNS, with the factor's rows/rank/offset)
    R: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP_TILES: tl.constexpr,  # tiles of BLOCK rows per Gram slot (GRAM_ROWS / BLOCK)
):
    """Split factors, first launch: the float64 Gram of GRAM_ROWS rows, tiles summed in order, into one slot; the
    program of the first rows also writes ``Wᵀ·X`` of the first R rows into the matrix's head slot."""
    pid = tl.program_id(0).to(tl.int64)
    task = tasks_ptr + pid * ORTHO_GRAM_TASK_WIDTH
    row0 = tl.load(task + GRAM_ROW0)
    slot = tl.load(task + GRAM_SLOT)
    head = tl.load(task + GRAM_HEAD)
    rm = tl.load(task + GRAM_RM)
    n = tl.load(task + GRAM_N)
    r = tl.load(task + GRAM_R)
    base = tl.load(task + GRAM_OFF)
    ranks = tl.arange(0, R)
    col_ok = ranks < r
    ar = tl.arange(0, BLOCK).to(tl.int64)
    acc = tl.zeros((R, R), dtype=tl.float64)
    for t in range(GROUP_TILES):
        rows = row0 + t * BLOCK + ar
        mask = (rows < n)[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + base + rows[:, None] * r + ranks[None, :], mask=mask, other=0.0).to(tl.float64)
        if _DOT64:  # (not a helper call: each costs ~10 ms in the interpreter)
            acc += tl.dot(tl.trans(x), x)
        else:
            acc += tl.sum(x[:, :, None] * x[:, None, :], axis=0)
    rr = ranks[:, None] * R + ranks[None, :]
    tl.store(ws_ptr + slot * (R * R) + rr, acc)
    gwx = _head_gram(x_ptr, base, n, r, rm, head + 1, R)
    tl.store(ws_ptr + head * (R * R) + rr, gwx, mask=(rr * 0 + head) >= 0)


@triton.jit
def _orthogonalize_kernel(
    x_ptr,  # flat factor input (float32)
    out_ptr,  # flat factor output (float32; may alias x_ptr)
    ws_ptr,  # float64 workspace written by _ortho_gram_kernel (unused when nothing is split)
    tasks_ptr,  # int64 [T, ORTHO_TASK_WIDTH] (layout.ORTHO_TASK_COLUMNS; short factor: 0 slots, head -1)
    eps,  # float32 epsilon added to each norm
    R: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK_TILES: tl.constexpr,  # tiles of BLOCK rows per chunk (an unconditional, software-pipelined inner loop)
    SHORT_CHUNKS: tl.constexpr,  # chunks of the tallest short factor (SHORT_ROWS)
    APPLY_CHUNKS: tl.constexpr,  # chunks one program writes at most (max(SHORT_ROWS, SPLIT_ROWS))
    SLOT_BLOCK: tl.constexpr,  # Gram slots summed per step
):
    """One program per short factor, or per SPLIT_ROWS rows of a split one: Gram (accumulated here, or summed from
    the slots), Gram-Schmidt on it, ``X·Zx (+ W·Zw)`` for its rows.

    Loop bounds are constexprs of the config (chunks past the end of the factor are skipped by a scalar test, the
    tiles inside a chunk are masked) or ``while`` conditions: a loop over a runtime bound, ``range(n)``, fails in
    Triton 3.6's interpreter.
    """
    pid = tl.program_id(0).to(tl.int64)
    task = tasks_ptr + pid * ORTHO_TASK_WIDTH
    row0 = tl.load(task + ORTHO_ROW0)
    row_end = tl.load(task + ORTHO_ROW_END)
    slot = tl.load(task + ORTHO_SLOT0)
    nparts = tl.load(task + ORTHO_SLOTS)
    head = tl.load(task + ORTHO_HEAD)
    rm = tl.load(task + ORTHO_RM)  # completion vectors: the smallest power of two >= r
    n = tl.load(task + ORTHO_N)
    r = tl.load(task + ORTHO_R)
    base = tl.load(task + ORTHO_OFF)
    ranks = tl.arange(0, R)
    col_ok = ranks < r
    ar = tl.arange(0, BLOCK).to(tl.int64)
    rr = ranks[:, None] * R + ranks[None, :]
    is_short = nparts == 0
    n_gram = tl.where(is_short, n, 0)

    # Gram of a short factor, chunk by chunk, tiles in order.
    total = tl.zeros((R, R), dtype=tl.float64)
    for c in range(SHORT_CHUNKS):
        if c * (CHUNK_TILES * BLOCK) < n_gram:
            for t in range(CHUNK_TILES):
                rows = (c * CHUNK_TILES + t) * BLOCK + ar
                mask = (rows < n_gram)[:, None] & col_ok[None, :]
                x = tl.load(x_ptr + base + rows[:, None] * r + ranks[None, :], mask=mask, other=0.0)
                x = x.to(tl.float64)
                if _DOT64:
                    total += tl.dot(tl.trans(x), x)
                else:
                    total += tl.sum(x[:, :, None] * x[:, None, :], axis=0)
    # Gram of a split factor: the sum of its slots, SLOT_BLOCK at a time.
    sb = tl.arange(0, SLOT_BLOCK).to(tl.int64)
    k = nparts * 0
    while k < nparts:
        sl = k + sb
        offs = (slot + sl)[:, None, None] * (R * R) + rr[None, :, :]
        total += tl.sum(tl.load(ws_ptr + offs, mask=(sl < nparts)[:, None, None], other=0.0), axis=0)
        k += SLOT_BLOCK

    eps64 = tl.zeros((), dtype=tl.float64) + eps
    Zx, dep = _gram_schmidt_on_gram(total, r, eps64, R)
    Zw = tl.zeros((R, R), dtype=tl.float64)
    use_w = tl.sum(dep, axis=0) > 0.0
    if use_w:  # a dependent column: complete it (rare; its vectors live on the first rm rows)
        gwx = _head_gram(x_ptr, base, n, r, rm, is_short.to(tl.int64), R)
        gwx += tl.load(ws_ptr + head * (R * R) + rr, mask=(rr * 0 + head) >= 0, other=0.0)
        w = _walsh(ranks, ranks, n, rm)
        Zx, Zw = _completions(Zx, dep, gwx, _mm(tl.trans(w), w, R >= _DOT64_K), eps64, R)

    for c in range(APPLY_CHUNKS):
        first = row0 + c * (CHUNK_TILES * BLOCK)
        if first < row_end:
            for t in range(CHUNK_TILES):
                rows = first + t * BLOCK + ar
                mask = (rows < row_end)[:, None] & col_ok[None, :]
                ptrs = base + rows[:, None] * r + ranks[None, :]
                x = tl.load(x_ptr + ptrs, mask=mask, other=0.0).to(tl.float64)
                if R >= _DOT64_K:
                    q = tl.dot(x, Zx)
                else:
                    q = tl.sum(x[:, :, None] * Zx[None, :, :], axis=1)
                if use_w:
                    q += _mm(_walsh(rows, ranks, n, rm), Zw, R >= _DOT64_K)
                tl.store(out_ptr + ptrs, q.to(out_ptr.dtype.element_ty), mask=mask)


# Per layout (weakly held): {(which, R, BLOCK, SHORT_ROWS, GRAM_ROWS, SPLIT_ROWS, APPLY_ROWS): _OrthoPlan}
_ORTHO_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _OrthoPlan:
    """Host-side launch plan of one orthogonalize call (see :func:`orthogonalize_plan`); device tables made lazily."""

    def __init__(self, layout: BucketLayout, which: str, cfg: dict):
        self.R = padded_rank(layout.max_rank)
        self.consts = _ortho_constexprs(cfg, self.R)
        short, gram_rows, split = cfg["SHORT_ROWS"], cfg["GRAM_ROWS"], cfg["SPLIT_ROWS"]
        apply = cfg.get("APPLY_ROWS", short)
        chunk = self.consts["CHUNK_TILES"] * cfg["BLOCK"]
        self.gram_tasks: List[List[int]] = []  # rows of tables.ORTHO_GRAM_TASK_COLUMNS
        self.tasks: List[List[int]] = []  # rows of tables.ORTHO_TASK_COLUMNS
        self.tiles: List[int] = []  # per finish task: tiles of BLOCK rows read and written (chunks rounded up)
        self.slot_steps: List[int] = []  # per finish task: steps of the slot sum
        slot = 0
        self.split_matrices = 0
        self.factor_elems = 0  # valid elements of the factors
        self.split_elems = 0
        self.regram_elems = 0  # factor elements read again by the extra programs of short factors (APPLY_ROWS)
        for i, s in enumerate(layout.matrices):
            rows = s.n if which == "p" else s.m
            rm = padded_rank(s.rank)  # completion vectors of this factor (the torch backend's too)
            factor = {_tables.ORTHO_N: rows, _tables.ORTHO_R: s.rank,
                      _tables.ORTHO_OFF: s.p_offset if which == "p" else s.q_offset}
            self.factor_elems += rows * s.rank
            if rows <= short:
                # one program per APPLY_ROWS rows, each with the factor's whole Gram (the same tiles in the same
                # order: the same bits in every program, and as one program would write them)
                gram_tiles = -(-rows // chunk) * self.consts["CHUNK_TILES"]
                for c in range(0, rows, apply):
                    end = min(c + apply, rows)
                    self.tasks.append(table_row(_tables.ORTHO_TASK_WIDTH, {
                        _tables.ORTHO_MAT: i, _tables.ORTHO_ROW0: c, _tables.ORTHO_ROW_END: end, _tables.ORTHO_SLOT0: 0,
                        _tables.ORTHO_SLOTS: 0, _tables.ORTHO_HEAD: -1, _tables.ORTHO_RM: rm, **factor}))
                    self.tiles.append(gram_tiles + -(-(end - c) // chunk) * self.consts["CHUNK_TILES"])
                    self.slot_steps.append(0)
                    self.regram_elems += rows * s.rank if c else 0
                continue
            parts = -(-rows // gram_rows)
            head = slot + parts
            for k in range(parts):
                self.gram_tasks.append(table_row(_tables.ORTHO_GRAM_TASK_WIDTH, {
                    _tables.GRAM_MAT: i, _tables.GRAM_ROW0: k * gram_rows, _tables.GRAM_SLOT: slot + k,
                    _tables.GRAM_HEAD: head if k == 0 else -1, _tables.GRAM_RM: rm, _tables.GRAM_N: rows,
                    _tables.GRAM_R: s.rank, _tables.GRAM_OFF: factor[_tables.ORTHO_OFF]}))
            for c in range(0, rows, split):
                self.tasks.append(table_row(_tables.ORTHO_TASK_WIDTH, {
                    _tables.ORTHO_MAT: i, _tables.ORTHO_ROW0: c, _tables.ORTHO_ROW_END: min(c + split, rows),
                    _tables.ORTHO_SLOT0: slot, _tables.ORTHO_SLOTS: parts, _tables.ORTHO_HEAD: head, _tables.ORTHO_RM: rm,
                    **factor}))
                self.tiles.append(-(-(min(c + split, rows) - c) // chunk) * self.consts["CHUNK_TILES"])
                self.slot_steps.append(-(-parts // self.consts["SLOT_BLOCK"]))
            slot += parts + 1
            self.split_matrices += 1
            self.split_elems += rows * s.rank
        self.slots = slot
        self._device_tables = None

    def device_tables(self, device):
        if self._device_tables is None:
            def dev(rows, width):
                return torch.tensor(rows, dtype=torch.int64).reshape(-1, width).to(device)

            self._device_tables = (dev(self.gram_tasks, _tables.ORTHO_GRAM_TASK_WIDTH) if self.gram_tasks else None,
                                   dev(self.tasks, _tables.ORTHO_TASK_WIDTH))
        return self._device_tables


def _ortho_plan(layout: BucketLayout, which: str, cfg: dict) -> _OrthoPlan:
    key = (which, padded_rank(layout.max_rank), cfg.get("BLOCK"), cfg.get("SHORT_ROWS"), cfg.get("GRAM_ROWS"),
           cfg.get("SPLIT_ROWS"), cfg.get("APPLY_ROWS"))
    plans = _ORTHO_PLANS.setdefault(layout, {})
    plan = plans.get(key)
    if plan is None:
        plan = _OrthoPlan(layout, which, cfg)
        plans[key] = plan
    return plan


def _ortho_workspace(layout: BucketLayout, slots: int, R: int) -> torch.Tensor:
    """float64 workspace of at least ``slots`` [R, R] Gram slots, kept per layout for reuse."""
    plans = _ORTHO_PLANS.setdefault(layout, {})
    ws = plans.get("workspace")
    need = max(1, slots * R * R)
    if ws is None or ws.numel() < need:
        ws = torch.empty(need, dtype=torch.float64, device=layout.device)
        plans["workspace"] = ws
    return ws


def _overlap(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``out`` shares memory with ``x`` (in place: the hooks orthogonalize P that way)."""
    a, b = x.data_ptr(), out.data_ptr()
    return a < b + out.numel() * out.element_size() and b < a + x.numel() * x.element_size()


def _in_place_config(cfg: dict, in_place: bool) -> dict:
    """``cfg`` without ``APPLY_ROWS`` when the call is in place: every program of a short factor split by
    ``APPLY_ROWS`` reads the whole factor for its Gram (and its first rows for the completion vectors) while the
    other programs of that factor overwrite their rows, so it would read rows already orthogonalized. One program
    per short factor writes the same bits (same tiles, same order) and reads every row before writing any."""
    if in_place and "APPLY_ROWS" in cfg:
        return {k: v for k, v in cfg.items() if k != "APPLY_ROWS"}
    return cfg


def _ortho_inputs(x, layout: BucketLayout, which: str, out, config: Optional[dict], both: bool = False):
    """``(cfg, plan, gram_tasks, tasks, workspace)`` of an :func:`orthogonalize` call: the resolved config (without
    ``APPLY_ROWS`` in place), its plan, the plan's device task tables (``gram_tasks`` None when nothing is split)
    and the float64 Gram workspace (allocated even when unused: one compiled signature), the last three kept with
    the layout. ``both``: the workspace is sized for both factors' plans of this config (a launch plan keeps it:
    the other factor's call then finds it large enough and keeps the same tensor)."""
    cfg = _in_place_config(_resolve("orthogonalize", layout, x.dtype, config), _overlap(x, out))
    plan = _ortho_plan(layout, which, cfg)
    gram_tasks, tasks = plan.device_tables(x.device)
    slots = plan.slots
    if both:
        slots = max(slots, _ortho_plan(layout, "q" if which == "p" else "p", cfg).slots)
    return cfg, plan, gram_tasks, tasks, _ortho_workspace(layout, slots, plan.R)


def orthogonalize(x, layout: BucketLayout, which: str, epsilon: float, out, *, config: Optional[dict] = None) -> None:
    """Orthogonalize every P_i (``which="p"``) or Q_i (``"q"``): ONE launch when every factor has at most
    ``SHORT_ROWS`` rows, else two (float64 Gram slots of the split factors, then the rest); see
    :mod:`powersgd_triton.ops.orthogonalization`. Launch plans per layout, factor, config and in-place-ness (as
    :func:`~powersgd_triton.ops.projection.project`'s). Raises ``ValueError`` for a malformed config or another ``which``."""
    gram, gram_args, finish, args = _ortho_args(x, layout, which, epsilon, out, config)
    if gram is not None:
        gram(*gram_args)
    finish(*args)


def orthogonalize_bound(x, layout: BucketLayout, which: str, epsilon: float, out, *, config: Optional[dict] = None):
    """A callable of no argument that makes the launches :func:`orthogonalize` makes with these arguments (plans and
    arguments bound now, as :func:`~powersgd_triton.ops.projection.project_bound`; in place or not as ``x`` and
    ``out`` overlap now)."""
    gram, gram_args, finish, args = _ortho_args(x, layout, which, epsilon, out, config)
    return bind_launches(None if gram is None else (gram, gram_args), (finish, args))


def _ortho_args(x, layout, which, epsilon, out, config):
    a, b = x.data_ptr(), out.data_ptr()  # in place (shared memory): the hooks orthogonalize P that way
    in_place = a < b + out.numel() * out.element_size() and b < a + x.numel() * x.element_size()
    key = ("launch:orthogonalize", which, x.dtype, None if config is None else tuple(config.items()), in_place)
    plan = layout._tiles.get(key)  # the layout's memo (layout.memo), read without a call
    if plan is None:
        plan = layout.memo(key, lambda: _ortho_launch(x, layout, which, out, config))
    gram, gram_tasks, finish, tasks, ws = plan
    return gram, (x, ws, gram_tasks), finish, (x, out, ws, tasks, float(epsilon))


def _ortho_launch(x, layout, which, out, config):
    factor_columns(which)  # validates `which`; the task tables carry each factor's rows, rank and offset
    cfg, plan, gram_tasks, tasks, ws = _ortho_inputs(x, layout, which, out, config, both=True)
    c = plan.consts
    gram = None
    if gram_tasks is not None:
        gram = DirectLaunch(_ortho_gram_kernel, (gram_tasks.shape[0],), dict(
            R=plan.R, BLOCK=c["GRAM_BLOCK"], GROUP_TILES=c["GROUP_TILES"], **_launch_options(cfg)))
    finish = DirectLaunch(_orthogonalize_kernel, (tasks.shape[0],), dict(
        R=plan.R, BLOCK=c["BLOCK"], CHUNK_TILES=c["CHUNK_TILES"], SHORT_CHUNKS=c["SHORT_CHUNKS"],
        APPLY_CHUNKS=c["APPLY_CHUNKS"], SLOT_BLOCK=c["SLOT_BLOCK"], **_launch_options(cfg)))
    return gram, gram_tasks, finish, tasks, ws


def orthogonalize_kept_tensors(x, layout: BucketLayout, which: str, out, *,
                               config: Optional[dict] = None) -> List[torch.Tensor]:
    """The device tensors :func:`orthogonalize` with these arguments uses besides ``x`` and ``out`` and keeps with
    the layout across calls (its task tables and the float64 Gram workspace). They were allocated on the stream
    of the call that made them: a caller that runs orthogonalize on another stream (the next step's Q on a side
    stream: :func:`powersgd_triton.hooks.driver.orthogonalize_next_q`) records that stream on them, so that the caching
    allocator does not hand their memory to that stream's work while the side stream may still use it (when the
    layout is dropped: a bucket rebuild, ``load_state_dict``)."""
    if layout.num_matrices == 0:
        return []
    return [t for t in _ortho_inputs(x, layout, which, out, config)[2:] if t is not None]


def orthogonalize_plan(layout: BucketLayout, which: str, config: Optional[dict] = None, *,
                       in_place: bool = False) -> List[dict]:
    """The launches of one :func:`orthogonalize` call on ``layout`` (``which`` = "p" or "q"), in launch order.

    One dict per launch: ``kernel`` (a :data:`~powersgd_triton.ops.kernels.KERNEL_FUNCTIONS` name), ``programs``
    (grid size), ``iterations`` (the most loop trips of one program: tiles of ``BLOCK`` rows, reading and writing,
    plus steps of ``SLOT_BLOCK`` Gram slots), ``rank_steps`` (serial Gram-Schmidt steps on the r x r Gram per
    program, 0 for the Gram launch), ``lookups`` (dependent table loads before a program's loop: 1, its task row,
    which carries the factor's rows, rank and offset), ``split_programs`` (finish launch: programs of split
    factors), ``bytes_read`` / ``bytes_written`` (bytes the loads and stores of the whole launch touch: factor
    float32, Gram slots float64, task tables; a short factor is read twice, the second time likely from L2),
    ``config`` and ``variant`` (``compile_aot(kernel, config, ..., variant=variant)`` of :mod:`tools.aot_compile`
    compiles exactly this launch). ``config=None``: the heuristic (or interpreter) config. ``in_place``: a call with ``out`` sharing
    ``x``'s memory (the hooks' orthogonalization of P), which ignores ``APPLY_ROWS``. Raises ``ValueError`` for
    an unknown ``which`` or a malformed config.
    """
    if which not in ("p", "q"):
        raise ValueError(f"which must be 'p' or 'q', got {which!r}")
    cfg = dict(_in_place_config(_resolve("orthogonalize", layout, torch.float32, config), in_place))
    if layout.num_matrices == 0:
        return []
    plan = _ortho_plan(layout, which, cfg)
    R = plan.R
    variant: dict = {}  # the task rows carry each factor's rows, rank and offset: P and Q compile the same kernel
    slot_bytes = R * R * 8
    out = []
    if plan.gram_tasks:
        heads = sum(1 for t in plan.gram_tasks if t[_tables.GRAM_HEAD] >= 0)
        out.append(dict(
            kernel="orthogonalize_gram", programs=len(plan.gram_tasks), iterations=plan.consts["GROUP_TILES"],
            rank_steps=0, lookups=1,
            bytes_read=4 * plan.split_elems + len(plan.gram_tasks) * 8 * _tables.ORTHO_GRAM_TASK_WIDTH
            + heads * 4 * R * R,
            bytes_written=(len(plan.gram_tasks) + heads) * slot_bytes,
            config=dict(cfg), variant=dict(variant), dtype="float32", max_rank=layout.max_rank,
        ))
    short_elems = plan.factor_elems - plan.split_elems
    out.append(dict(
        kernel="orthogonalize", programs=len(plan.tasks),
        iterations=max(t + k for t, k in zip(plan.tiles, plan.slot_steps)), rank_steps=R, lookups=1,
        bytes_read=8 * short_elems + 4 * plan.split_elems + len(plan.tasks) * 8 * _tables.ORTHO_TASK_WIDTH
        + sum(t[_tables.ORTHO_SLOTS] * slot_bytes for t in plan.tasks if t[_tables.ORTHO_SLOTS] > 0),
        bytes_written=4 * plan.factor_elems, l2_bytes=4 * plan.regram_elems,
        config=dict(cfg), variant=dict(variant, WITH_GRAM=False), dtype="float32", max_rank=layout.max_rank,
        split_programs=sum(1 for t in plan.tasks if t[_tables.ORTHO_SLOTS] > 0),
    ))
    return out
