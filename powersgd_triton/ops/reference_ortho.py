"""Torch reference of ``orthogonalize``: column-by-column Gram-Schmidt with completion vectors
(:func:`gram_schmidt_`) and the batched Cholesky-QR of float32 factors on CPU (:func:`orthogonalize`).

Part of :mod:`powersgd_triton.ops.reference` (which re-exports these names). :data:`DEPENDENT_TOL` is shared
with the Triton kernel (:mod:`powersgd_triton.ops.orthogonalization`).
"""

from typing import Dict, Optional

import torch

from powersgd_triton.layout import BucketLayout


# A column whose residual norm is at most this times its own norm (squared: 2^-40) is numerically dependent on the
# columns before it; it is replaced by a completion vector (see gram_schmidt_). Shared with the Triton kernel.
DEPENDENT_TOL = 2.0**-40
_DEPENDENT_NORM_TOL = 2.0**-20


def padded_rank_of(r: int) -> int:
    """The smallest power of two >= r: the number of completion vectors of a rank-r factor."""
    rm = 1
    while rm < r:
        rm *= 2
    return rm


_WALSH_CACHE: Dict[tuple, torch.Tensor] = {}


def walsh_vectors(rows: int, r: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Completion vectors of a ``rows x r`` factor: ``(h, rm)`` with ``rm = padded_rank_of(r)``, ``h = min(rows, rm)``.

    Column c is ``(-1)^popcount(i & c)`` on rows ``i < h`` (a Sylvester-Hadamard column on the first rows, zero below):
    orthogonal, of norm sqrt(rm), when ``rows >= rm``; of rank ``h`` otherwise. The same vectors as the Triton
    kernel's.
    """
    rm = padded_rank_of(r)
    h = min(rows, rm)
    key = (h, rm, dtype, str(device))
    w = _WALSH_CACHE.get(key)
    if w is None:
        v = torch.arange(h).unsqueeze(1) & torch.arange(rm).unsqueeze(0)
        parity = torch.zeros_like(v)
        while bool(v.any()):
            parity ^= v & 1
            v = v >> 1
        w = (1.0 - 2.0 * parity.double()).to(dtype=dtype, device=device)
        _WALSH_CACHE[key] = w
    return w


def _power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    """``2^-e`` with ``amax·2^-e`` in [0.5, 1) (exponent clamped to the normal range; 1 for 0, inf and NaN), exact.

    Scaling a column by a power of two changes no bit of its Gram-Schmidt result (unless it under/overflows), and
    makes its squared norm and its inner products with unit vectors impossible to overflow (BLAS ``nrm2``'s idea).
    """
    _, e = torch.frexp(amax)
    if amax.dtype == torch.float64:
        return ((1023 - e.to(torch.int64).clamp_(-1021, 1022)) << 52).view(torch.float64)
    scale = ((127 - e.clamp_(-125, 126)) << 23).view(torch.float32)
    return scale if amax.dtype == torch.float32 else scale.to(amax.dtype)


def _completion(x: torch.Tensor) -> torch.Tensor:
    """For each matrix of the batch ``x`` ``(B, rows, r)``: the :func:`walsh_vectors` column with the largest
    residual against all columns of ``x`` (orthonormal or zero), orthogonalized against them: ``(B, rows, 1)``.

    Every candidate has squared norm ``h``; the largest residual is at least ``h / rm`` (the candidates span ``rm >= r``
    dimensions), so one classical Gram-Schmidt pass is orthogonal to rounding in float64 (two in lower precisions).
    """
    rows, r = x.shape[1], x.shape[2]
    w = walsh_vectors(rows, r, x.dtype, x.device)  # (h, rm)
    h = w.shape[0]
    ot = torch.matmul(w.t(), x[:, :h, :])  # (B, rm, r): w_cᵀ q_k
    best = ot.square().sum(-1).argmin(dim=1)  # the largest residual h - Σ_k (w_cᵀ q_k)²; the first of equals
    v = torch.nn.functional.pad(w.t()[best], (0, rows - h)).unsqueeze(-1)  # (B, rows, 1)
    for _ in range(1 if x.dtype == torch.float64 else 2):
        v -= torch.bmm(x, torch.bmm(x.transpose(1, 2), v))
    return v


def gram_schmidt_(
    x: torch.Tensor, epsilon: float = 0.0, sync_free: Optional[bool] = None, scale: bool = True
) -> torch.Tensor:
    """Orthonormalize the columns of a batch ``x`` of shape ``(B, rows, r)`` in place, column by column (MGS).

    PyTorch's ``_orthogonalize_gram_schmidt``: column ``j`` is divided by ``norm + epsilon``, then its projection
    is removed from the later columns. Differences, for the inputs where PyTorch's gives NaN, inf or a wrong finite
    result:

    * overflow-safe (``scale``): each column is first scaled by a power of two that brings its largest entry into
      [0.5, 1) (``epsilon`` scaled with it), so no norm or inner product can overflow for finite input (BLAS
      ``nrm2``'s idea); the result has the same bits as without the scaling wherever that one does not overflow.
      ``scale=False`` where it cannot overflow anyway (float32 values in float64);
    * a column whose residual norm is at most 2^-20 of its own norm (numerically dependent on the columns before
      it, or all zero in a non-zero matrix) is left at zero during the sweep, then filled with a unit vector
      orthogonal to all other columns (the :func:`walsh_vectors` column with the largest residual, orthogonalized
      twice) divided by ``1 + epsilon``, as Householder QR gives an orthonormal column there: a zero column would
      keep the warm-start factor rank-deficient for ever. The Triton kernel follows the same rules;
    * an all-zero matrix stays zero (no NaN) with any epsilon; NaN/inf input stays non-finite.

    ``sync_free``: skip the host checks "is any column dependent?" and compute the completion vectors always
    (default: check on CPU, where it costs nothing; compute always elsewhere, so that no host synchronization
    happens). Works in ``x``'s dtype. Returns ``x``.
    """
    if x.numel() == 0:
        return x
    r = x.shape[-1]
    if sync_free is None:
        sync_free = x.device.type != "cpu"
    eps = epsilon
    if scale:
        pow2 = _power_of_two_scale(x.abs().amax(dim=1, keepdim=True))  # (B, 1, r)
        x.mul_(pow2)
        if epsilon:
            eps = pow2 * epsilon
    norm0 = torch.linalg.vector_norm(x, dim=1, keepdim=True)  # (B, 1, r)
    # dependent: residual norm <= thr; never in an all-zero matrix or for a non-finite column
    thr = torch.where(
        torch.isfinite(norm0) & (norm0.amax(dim=2, keepdim=True) > 0), norm0 * _DEPENDENT_NORM_TOL, -1.0
    )
    tiny = torch.finfo(x.dtype).tiny
    deps = []
    for i in range(r):
        col = x[:, :, i : i + 1]
        norm = torch.linalg.vector_norm(col, dim=1, keepdim=True)
        if epsilon:
            denom = norm + (eps[:, :, i : i + 1] if scale else eps)
        else:
            denom = norm
        col.div_(denom.clamp_min(tiny))  # a zero column stays zero (no NaN); NaN stays NaN
        dep = norm <= thr[:, :, i : i + 1]
        if sync_free or bool(dep.any()):
            col.masked_fill_(dep, 0.0)  # left out of the sweep, completed below
            deps.append((i, dep))
        if i + 1 < r:
            rest = x[:, :, i + 1 :]
            rest.sub_((col * rest).sum(dim=1, keepdim=True) * col)
    for i, dep in deps:
        v = _completion(x)
        v.div_(torch.linalg.vector_norm(v, dim=1, keepdim=True) + epsilon)
        col = x[:, :, i : i + 1]
        col.copy_(torch.where(dep, v, col))
    return x


# The one-batch orthogonalization pads every factor to the tallest one. Where the padded batch has more than this many
# times the factors' elements and more than a quarter of the bucket's, it runs one batch per shape group instead (no
# padding).
PAD_LIMIT = 8


def _ortho_plan(layout: BucketLayout, which: str):
    """The batches of the grouped orthogonalization of factor ``which``: a list of ``(offset, shape, pieces)``.
    ``shape = (B, rows, r)``: ``B`` factors padded to ``rows`` rows. ``pieces`` None: the batch is the slice of
    ``B*rows*r`` elements at ``offset`` (every factor has ``rows`` rows); else one ``(start, rows_i, pad_i)`` per
    factor: its ``rows_i x r`` block at ``start`` in the flat factor, followed in the batch by ``pad_i`` zero rows
    (one ``torch.cat`` gathers the padded batch, one writes the factors back). One padded batch for the whole bucket
    when the ranks agree and the padding is small (:data:`PAD_LIMIT`), else one batch per shape group. Cached on
    the layout."""
    return layout.memo(("torch_ortho", which), lambda: _build_ortho_plan(layout, which))


def _build_ortho_plan(layout: BucketLayout, which: str):
    mats = layout.matrices
    rows = [s.n if which == "p" else s.m for s in mats]
    starts = [(s.p_offset if which == "p" else s.q_offset) for s in mats]
    numel = layout.p_numel if which == "p" else layout.q_numel
    plan = []
    r = mats[0].rank if mats else 0
    tall = max(rows, default=0)
    padded = len(mats) * tall * r
    ends = [st + rw * s.rank for st, rw, s in zip(starts, rows, mats)]
    packed = bool(mats) and starts[0] == 0 and starts[1:] == ends[:-1]  # back to back, in order
    if (packed and len({s.rank for s in mats}) == 1
            and (padded <= PAD_LIMIT * numel or 4 * padded <= layout.numel)):
        pieces = None
        if min(rows) != tall:
            pieces = [(st, rw, tall - rw) for st, rw in zip(starts, rows)]
        plan.append((0, (len(mats), tall, r), pieces))
    else:
        for g in layout.groups:
            plan.append((starts[g.first], (g.count, rows[g.first], g.rank), None))
    return plan


def _zero64(layout: BucketLayout, rows: int, r: int) -> torch.Tensor:
    """Float64 zeros ``(rows, r)`` on the layout's device (the padding rows of :func:`_orthogonalize_batch`), made
    once per layout and sliced."""
    key = ("torch_zero64", r)
    z = layout._tiles.get(key)
    if z is None or z.shape[0] < rows:
        z = layout._tiles[key] = torch.zeros(rows, r, dtype=torch.float64, device=layout.device)
    return z


def _ortho_prepare(x: torch.Tensor, layout: BucketLayout, which: str) -> Optional[list]:
    """The float64 Cholesky factorizations of :func:`_orthogonalize_batch`, before its check: per batch of
    :func:`_ortho_plan`, ``(offset, shape, pieces, batch, u, top)``: the padded float64 batch, its upper Cholesky
    factor and ``top``, the 0-d largest margin ``‖x_k‖² − residual_k²/DEPENDENT_TOL`` (the batch is accepted where
    ``top <= 0``; NaN for non-finite values). None when a factorization failed (``info > 0``: not positive definite,
    a zero column, an all-zero factor, non-finite values), read by ``cholesky_ex`` itself (``check_errors``: LAPACK's
    info is on the host already). Per batch: one ``cat`` (cast and padding), ``bmm``, ``cholesky_ex``, ``addcmul``,
    ``amax``; nothing is written."""
    prepared = []
    for off, (count, rows, r), pieces in _ortho_plan(layout, which):
        if pieces is None:
            batch = x[off : off + count * rows * r].view(count, rows, r).to(torch.float64)
        else:
            zero = _zero64(layout, max(pad for _, _, pad in pieces), r)
            blocks = []
            for start, rw, pad in pieces:
                blocks.append(x[start : start + rw * r].view(rw, r))
                if pad:
                    blocks.append(zero[:pad])
            batch = torch.cat(blocks).view(count, rows, r)  # float32 factors and float64 zeros: float64
        gram = torch.bmm(batch.transpose(1, 2), batch)
        try:
            u, _ = torch.linalg.cholesky_ex(gram, upper=True, check_errors=True)
        except torch.linalg.LinAlgError:  # info > 0
            return None
        residual = u.diagonal(dim1=1, dim2=2)
        margin = torch.addcmul(gram.diagonal(dim1=1, dim2=2), residual, residual, value=-1.0 / DEPENDENT_TOL)
        prepared.append((off, (count, rows, r), pieces, batch, u, margin.amax()))
    return prepared


def orthogonalize_prepared(prepared: list, out: torch.Tensor) -> None:
    """The accepted batches of :func:`_ortho_prepare` into ``out``: per batch one ``solve_triangular`` (``X·U⁻¹``)
    and one ``cat`` (or ``copy_``) of the float64 rows rounded into ``out``."""
    results = [(off, shape, pieces, torch.linalg.solve_triangular(u, batch, upper=True, left=False))
               for off, shape, pieces, batch, u, _ in prepared]
    for off, (count, rows, r), pieces, y in results:
        if pieces is None:
            out[off : off + count * rows * r].view(count, rows, r).copy_(y)
        else:
            first = pieces[0][0]
            total = sum(rw for _, rw, _ in pieces)
            torch.cat([y[i, :rw] for i, (_, rw, _) in enumerate(pieces)],
                      out=out[first : first + total * r].view(total, r))  # float64 rows rounded into out


def _orthogonalize_batch(x: torch.Tensor, layout: BucketLayout, which: str, out: torch.Tensor) -> bool:
    """Epsilon-0 Gram-Schmidt of every factor in a few batches (:func:`_ortho_plan`: usually one for the bucket) as
    float64 Cholesky-QR (zero rows change no Gram matrix): ``G = XᵀX``, ``G = UᵀU``, ``X·U⁻¹``, the same factor as
    modified Gram-Schmidt (on the columns, or on ``G`` as the Triton kernel) to rounding. Products of float32 values
    are exact in float64, so ``G`` cannot overflow and the result scales exactly with a power-of-two scaling of ``x``.
    Per batch: one ``cat`` (cast and padding), ``bmm``, ``cholesky_ex`` (which checks its ``info``), the check
    (``addcmul``, ``amax`` and one host read), ``solve_triangular``, one ``cat`` (or ``copy_``) into ``out``
    (:func:`_ortho_prepare`, :func:`orthogonalize_prepared`).

    Returns False, having written nothing, where the per-group column path must run: a factor the Cholesky
    factorization cannot take as it is -- a zero or dependent column (residual² <= :data:`DEPENDENT_TOL` times its
    squared norm, the rule of :func:`gram_schmidt_`, tested as ``‖x_k‖² − residual²/DEPENDENT_TOL > 0``: the exact
    tie, a rounding-level case, counts as independent here), an all-zero factor, non-finite values (NaN in that
    margin), a failed factorization (``info > 0``). That test is a host check: the path runs on CPU tensors only."""
    prepared = _ortho_prepare(x, layout, which)
    if prepared is None:
        return False
    for *_, top in prepared:
        if not float(top) <= 0:  # dependent, or NaN
            return False
    orthogonalize_prepared(prepared, out)
    return True


def orthogonalize(
    x: torch.Tensor,
    layout: BucketLayout,
    which: str,
    epsilon: float = 0.0,
    out: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Gram-Schmidt (:func:`gram_schmidt_`) on every P_i (``which="p"``, ``n_i x r_i``) or Q_i (``which="q"``,
    ``m_i x r_i``) of ``x``, one batched op sequence per shape group.

    Computed in ``compute_dtype``: float64 by default, as the Triton kernel (products of float32 values are exact in
    float64 and their sums cannot overflow); with float32 each column is scaled by a power of two first. Writes into
    ``out`` (default: in place) and returns it.

    Float32 factors on CPU with ``epsilon == 0`` (either compute dtype: it computes in float64) first try
    :func:`_orthogonalize_batch` (usually one batch for the whole bucket: a constant number of ops whatever the number
    of matrices); where it declines (a zero/dependent column, non-finite values) and in every other case
    :func:`gram_schmidt_` runs per shape group.
    """
    if out is None:
        out = x
    if (
        epsilon == 0.0
        and x.dtype == torch.float32
        and out.dtype == torch.float32
        and x.device.type == "cpu"
        and _orthogonalize_batch(x, layout, which, out)
    ):
        return out
    # power-of-two scaling only where squares could overflow the compute dtype
    scale = not (compute_dtype == torch.float64 and x.dtype != torch.float64)
    for g in layout.groups:
        rows = g.n if which == "p" else g.m
        first = layout.matrices[g.first]
        off = first.p_offset if which == "p" else first.q_offset
        size = g.count * rows * g.rank
        dst = out[off : off + size]
        src = x[off : off + size].view(g.count, rows, g.rank)
        if dst.dtype == compute_dtype:
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src.reshape(-1))
            gram_schmidt_(dst.view(g.count, rows, g.rank), epsilon, scale=scale)
        else:
            block = src.to(compute_dtype, copy=True)
            gram_schmidt_(block, epsilon, scale=scale)
            dst.copy_(block.reshape(-1))
    return out
