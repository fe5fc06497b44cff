"""Torch implementations of the four bucket steps: the CPU fallback and the tests' oracle.

Same contract as the Triton kernels (see :mod:`powersgd_triton.ops` for the shapes and dtypes): ``buffer`` is the
bucket's flat buffer, ``p``/``q``/``error`` are flat buffers packed as :class:`~powersgd_triton.layout.BucketLayout`
says. Arithmetic is done in ``compute_dtype`` (float32 by default, float64 for the oracle) whatever the bucket dtype.
Grouped: where the bucket, the factors and the error memory share the compute dtype (float32 buckets, float64 ones),
:func:`project`, :func:`project_t` and :func:`reconstruct` run one batched product per *run* of same-shape matrices
(``torch.bmm`` over a strided view of the bucket: matrices of one shape whose offsets in the bucket are evenly
spaced: one run per shape group in the 25 MB buckets of GPT-2 and BERT-base, 17 runs for 13 groups in ResNet-50's
largest), and the error feedback is one ``torch._foreach_*`` op over all runs (project: ``M += E``; reconstruct:
``E <- M + E``, then ``M <- P·Qᵀ`` per run, then ``E -= M``). :func:`orthogonalize` of float32 factors on CPU
(epsilon 0) is one padded batch for the whole bucket (one per shape group where padding would cost too much,
:data:`PAD_LIMIT`): the float64 Gram matrices of all factors, one batched Cholesky factorization and one batched
triangular solve (Cholesky-QR, the same factor as Gram-Schmidt on the Gram matrix, what the Triton kernel does),
8 ops. On CPU the end of a step (:func:`step_status`) reads the step's finiteness and the non-zero factors of the
warm-start commit with one host read; with warm start that read is the next Q's orthogonalization's, whose Gram
matrices tell both (:func:`status_and_orthogonalization`). So a step costs 3 products per run plus a constant (about
24 ops), not per matrix and per column (:func:`op_plan` tells which path a layout takes). Other dtypes, the batched view's padded
matrix, and factors with a zero or dependent column (or non-finite ones) take the per-matrix / per-shape-group column
path (:func:`gram_schmidt_`), as before; on other devices the step flags stay on the device (no host read) and the
error update where they are False takes the per-run ``torch.where`` path.

Source: PowerSGD, Vogels et al. 2019 (arXiv 1905.13727), Algorithm 1; column-by-column modified Gram-Schmidt as in
PyTorch's ``_orthogonalize_gram_schmidt``, except that a zero column stays zero instead of becoming NaN.
"""

import math
from typing import Dict, List, Optional

import torch

from ..layout import BucketLayout, MatrixSpec


def _matrix(buffer: torch.Tensor, s: MatrixSpec) -> torch.Tensor:
    """M_i as an ``n x m`` tensor: a view of the bucket, or a zero-padded copy for the batched view."""
    if s.numel == s.n * s.m:
        return buffer[s.offset : s.offset + s.numel].view(s.n, s.m)
    padded = buffer.new_zeros(s.n * s.m)
    padded[: s.numel] = buffer[s.offset : s.offset + s.numel]
    return padded.view(s.n, s.m)


def _store_matrix(buffer: torch.Tensor, s: MatrixSpec, value: torch.Tensor) -> None:
    buffer[s.offset : s.offset + s.numel].copy_(value.reshape(-1)[: s.numel])


def _error(error: torch.Tensor, s: MatrixSpec) -> torch.Tensor:
    """E_i, flat: ``n*m`` elements for the batched view (its padding has error memory too), else ``numel``."""
    return error[s.e_offset : s.e_offset + (s.n * s.m if s.grad_index < 0 else s.numel)]


def _scaled(e: torch.Tensor, loss_scale: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``loss_scale·e`` in ``dtype`` (``e`` when there is no loss scale): the error memory in the gradients' units."""
    e = e.to(dtype)
    return e if loss_scale is None else e * loss_scale.to(dtype)


def _with_padding_error(mat: torch.Tensor, error: Optional[torch.Tensor], s: MatrixSpec,
                        loss_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The batched view's ``M + E``: the bucket holds it for the first ``numel`` elements (after :func:`project`),
    the padding's is its error memory (times ``loss_scale``). ``mat``: the zero-padded ``n x m`` copy from
    :func:`_matrix`."""
    if error is not None and s.numel < s.n * s.m:
        mat.view(-1)[s.numel :] = _scaled(_error(error, s)[s.numel :], loss_scale, mat.dtype)
    return mat


def _factor(x: torch.Tensor, off: int, rows: int, r: int) -> torch.Tensor:
    return x[off : off + rows * r].view(rows, r)


class _Run:
    """``count`` consecutive matrices (P/Q packing order) of one shape ``n x m``, rank ``r``, whose bucket offsets are
    ``offset + k * stride``: one ``(count, n, m)`` strided view of the bucket, and contiguous ``(count, ., .)`` blocks
    of P, Q and the error memory."""

    __slots__ = ("count", "n", "m", "r", "offset", "stride", "p_off", "q_off", "e_off")

    def __init__(self, s: MatrixSpec, count: int, stride: int):
        self.count, self.n, self.m, self.r = count, s.n, s.m, s.rank
        self.offset, self.stride = s.offset, stride
        self.p_off, self.q_off, self.e_off = s.p_offset, s.q_offset, s.e_offset

    def mat(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer.as_strided(
            (self.count, self.n, self.m), (self.stride, self.m, 1), buffer.storage_offset() + self.offset
        )

    def err(self, error: torch.Tensor) -> torch.Tensor:
        size = self.count * self.n * self.m
        return error[self.e_off : self.e_off + size].view(self.count, self.n, self.m)

    def p(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.p_off : self.p_off + self.count * self.n * self.r].view(self.count, self.n, self.r)

    def q(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.q_off : self.q_off + self.count * self.m * self.r].view(self.count, self.m, self.r)


def _runs(layout: BucketLayout) -> Optional[List[_Run]]:
    """The layout's matrices as :class:`_Run` s (each shape group split where its bucket offsets stop being evenly
    spaced); None for the batched view (its one matrix is padded). Cached on the layout."""
    return layout.memo(("torch_runs",), lambda: _build_runs(layout))


def _build_runs(layout: BucketLayout) -> Optional[List[_Run]]:
    runs: Optional[List[_Run]] = None
    if not layout.batched and all(s.numel == s.n * s.m for s in layout.matrices):
        runs = []
        for g in layout.groups:
            k = g.first
            end = g.first + g.count
            while k < end:
                first = layout.matrices[k]
                j = k + 1
                stride = first.n * first.m
                if j < end:
                    stride = layout.matrices[j].offset - first.offset
                    while j < end and layout.matrices[j].offset - layout.matrices[j - 1].offset == stride:
                        j += 1
                    if stride < first.n * first.m and j - k > 1:  # overlapping views cannot happen; be safe
                        j = k + 1
                runs.append(_Run(first, j - k, stride if j - k > 1 else first.n * first.m))
                k = j
    return runs


def _grouped(layout: BucketLayout, compute_dtype: torch.dtype,
             *tensors: Optional[torch.Tensor]) -> Optional[List[_Run]]:
    """The runs when the grouped path applies: a layer-wise layout and every tensor given in ``compute_dtype``."""
    if any(t is not None and t.dtype != compute_dtype for t in tensors):
        return None
    return _runs(layout)


def op_plan(layout: BucketLayout) -> dict:
    """How the torch backend runs a float32 bucket of ``layout``: ``runs`` (batched ops per product step; None: the
    per-matrix path, for the batched view), ``matrices``, ``groups``; and per factor (``"p"``/``"q"``) the shapes
    ``(B, rows, r)`` of the batches of the grouped orthogonalization on CPU (:func:`_ortho_plan`)."""
    runs = _runs(layout)
    return {
        "runs": None if runs is None else len(runs),
        "matrices": layout.num_matrices,
        "groups": len(layout.groups),
        "p": [shape for _, shape, _ in _ortho_plan(layout, "p")],
        "q": [shape for _, shape, _ in _ortho_plan(layout, "q")],
    }


def project(
    buffer: torch.Tensor,
    layout: BucketLayout,
    q: torch.Tensor,
    p: torch.Tensor,
    error: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float32,
    loss_scale: Optional[torch.Tensor] = None,
) -> None:
    """P_i = (M_i + E_i) · Q_i for every i; with ``error`` the sum M_i + E_i is also written back into ``buffer``.

    ``loss_scale`` (one-element tensor ``s``): the error memory is unscaled, ``M_i + s·E_i`` is used instead.
    Grouped path: one ``_foreach_add_`` over the runs (with ``error``; and one ``_foreach_mul`` with
    ``loss_scale``), then one ``bmm`` per run; else per matrix."""
    runs = _grouped(layout, compute_dtype, buffer, q, p, error)
    if runs is not None:
        mats = [run.mat(buffer) for run in runs]
        if error is not None:  # in place: the bucket now holds M + E (M + s·E)
            errs = [run.err(error) for run in runs]
            if loss_scale is not None:
                errs = torch._foreach_mul(errs, loss_scale.to(compute_dtype).reshape(()))
            torch._foreach_add_(mats, errs)
        for run, mat in zip(runs, mats):
            torch.bmm(mat, run.q(q), out=run.p(p))
        return
    for s in layout.matrices:
        dense = s.numel == s.n * s.m
        view = _matrix(buffer, s)
        if error is not None and dense and view.dtype == compute_dtype == error.dtype:
            e = _error(error, s).view(s.n, s.m)
            if loss_scale is None:
                mat = view.add_(e)  # in place: the bucket now holds M + E
            else:
                mat = view.add_(e * loss_scale.to(compute_dtype))
        else:
            mat = view.to(compute_dtype)
            if error is not None:
                mat = mat.clone()
                mat.view(-1).add_(_scaled(_error(error, s), loss_scale, compute_dtype))
                _store_matrix(buffer, s, mat)
        qf = _factor(q, s.q_offset, s.m, s.rank).to(compute_dtype)
        # (Qᵀ·Mᵀ)ᵀ: the skinny product runs 3-10x faster this way round on CPU BLAS (bench/RESULTS.md §4)
        _factor(p, s.p_offset, s.n, s.rank).copy_(torch.mm(qf.t(), mat.t()).t())


def project_t(
    buffer: torch.Tensor,
    layout: BucketLayout,
    p: torch.Tensor,
    q: torch.Tensor,
    compute_dtype: torch.dtype = torch.float32,
    error: Optional[torch.Tensor] = None,
    loss_scale: Optional[torch.Tensor] = None,
) -> None:
    """Q_i = M_iᵀ · P_i for every i (``error``: the batched view's padding error, see :func:`_with_padding_error`).

    Grouped path: one ``bmm`` per run; else per matrix."""
    runs = _grouped(layout, compute_dtype, buffer, p, q)
    if runs is not None:
        for run in runs:
            torch.bmm(run.mat(buffer).transpose(1, 2), run.p(p), out=run.q(q))
        return
    for s in layout.matrices:
        mat = _with_padding_error(_matrix(buffer, s).to(compute_dtype), error, s, loss_scale)
        pf = _factor(p, s.p_offset, s.n, s.rank).to(compute_dtype)
        _factor(q, s.q_offset, s.m, s.rank).copy_(torch.mm(pf.t(), mat).t())  # (Pᵀ·M)ᵀ, as in project


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


def reconstruct(
    buffer: torch.Tensor,
    layout: BucketLayout,
    p: torch.Tensor,
    q: torch.Tensor,
    scale: float = 1.0,
    error: Optional[torch.Tensor] = None,
    update_error: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float32,
    local_p: Optional[torch.Tensor] = None,
    local_q: Optional[torch.Tensor] = None,
    loss_scale: Optional[torch.Tensor] = None,
    copy_also: Optional[tuple] = None,
) -> None:
    """M_i ← P_i · (scale · Q_i)ᵀ; with ``error`` also E_i ← M_i(before) − P_i · (scale · Q_i)ᵀ.

    ``update_error`` (0-d bool tensor on the device, or a Python bool) keeps the old E_i where it is False. With
    ``local_p`` (``local_q``) the error is the local residual E_i ← M_i − P_local,i · Q_iᵀ (M_i − P_i · Q_local,iᵀ).
    ``loss_scale`` (one-element tensor ``s``): the error is stored divided by ``s`` (unscaled units; the batched
    padding's M(before) is ``s·E``). ``copy_also``: ``(dst, src)``, ``dst.copy_(src)`` with ``src`` as on entry
    (``dst`` overlaps nothing this call reads or writes), in the error update's ``_foreach_copy_`` where there is
    one (the warm-start commit of a step known to keep every factor: no op of its own).
    """
    if error is not None and update_error is not None and (isinstance(update_error, bool)
                                                           or update_error.device.type == "cpu"):
        # a CPU flag is read for free (or was, by step_status): skip the error update, or do it without torch.where
        if not bool(update_error):
            error = None
        update_error = None
    runs = _grouped(layout, compute_dtype, buffer, p, q, error, local_p, local_q)
    foreach = runs is not None and error is not None and update_error is None and local_p is None and local_q is None
    if copy_also is not None and not foreach:
        copy_also[0].copy_(copy_also[1])
        copy_also = None
    if foreach:
        # E = (M + E) - P·(sQ)ᵀ without temporaries: E <- M + E, M <- P·(sQ)ᵀ, E -= M (one foreach op each, one
        # bmm per run), E /= s with a loss scale (CPU flag, or no flag)
        qs_all = q * scale if scale != 1.0 else q
        mats, errs = [run.mat(buffer) for run in runs], [run.err(error) for run in runs]
        if copy_also is None:
            torch._foreach_copy_(errs, mats)
        else:
            torch._foreach_copy_(errs + [copy_also[0]], mats + [copy_also[1]])
        for run, mat in zip(runs, mats):
            torch.bmm(run.p(p), run.q(qs_all).transpose(1, 2), out=mat)
        torch._foreach_sub_(errs, mats)
        if loss_scale is not None:  # the error memory is kept in unscaled units
            torch._foreach_div_(errs, loss_scale.to(compute_dtype).reshape(()))
        return
    if runs is not None:
        qs_all = q * scale if scale != 1.0 else q
        for run in runs:
            mat, pf, qs = run.mat(buffer), run.p(p), run.q(qs_all)
            if error is not None:  # E = (M + E) - A·Bᵀ, then M = P·(sQ)ᵀ: no temporaries of M's size (CPU flag)
                left, right = pf, qs
                if local_p is not None:
                    left, right = run.p(local_p), run.q(q)
                elif local_q is not None:
                    right = run.q(local_q)
                e = run.err(error)
                if update_error is None and loss_scale is None:
                    torch.baddbmm(mat, left, right.transpose(1, 2), alpha=-1.0, out=e)
                else:
                    new = torch.baddbmm(mat, left, right.transpose(1, 2), alpha=-1.0)
                    if loss_scale is not None:  # the error memory is kept in unscaled units
                        new.div_(loss_scale.to(compute_dtype))
                    torch.where(update_error, new, e, out=e) if update_error is not None else e.copy_(new)
            torch.bmm(pf, qs.transpose(1, 2), out=mat)
        return
    for s in layout.matrices:
        pf = _factor(p, s.p_offset, s.n, s.rank).to(compute_dtype)
        q_raw = _factor(q, s.q_offset, s.m, s.rank).to(compute_dtype)
        qs = q_raw * scale if scale != 1.0 else q_raw
        err_left, err_right = pf, qs
        if local_p is not None:
            err_left, err_right = _factor(local_p, s.p_offset, s.n, s.rank).to(compute_dtype), q_raw
        elif local_q is not None:
            err_right = _factor(local_q, s.q_offset, s.m, s.rank).to(compute_dtype)
        view = buffer[s.offset : s.offset + s.numel]
        e = None if error is None else _error(error, s)
        fast = s.numel == s.n * s.m and view.dtype == compute_dtype and update_error is None
        if fast and (e is None or e.dtype == compute_dtype):
            m_view = view.view(s.n, s.m)
            if e is not None:  # E = M - A·Bᵀ in place, then M = P·(sQ)ᵀ: no temporaries of M's size
                e_view = e.view(s.n, s.m)
                e_view.copy_(m_view)
                e_view.addmm_(err_left, err_right.t(), alpha=-1.0)
                if loss_scale is not None:
                    e_view.div_(loss_scale.to(compute_dtype))
            torch.mm(pf, qs.t(), out=m_view)
            continue
        before = _matrix(buffer, s).to(compute_dtype)
        if e is not None and s.numel < s.n * s.m:
            before = _with_padding_error(before.clone(), error, s, loss_scale)
        approx = pf @ qs.t()
        if e is not None:
            approx_e = approx if err_left is pf and err_right is qs else err_left @ err_right.t()
            diff = before - approx_e
            if loss_scale is not None:
                diff = diff / loss_scale.to(compute_dtype)
            new = diff.reshape(-1)[: e.numel()].to(e.dtype)
            if update_error is not None:
                new = torch.where(update_error, new, e)
            e.copy_(new)
        _store_matrix(buffer, s, approx)


def all_finite(*tensors: Optional[torch.Tensor]) -> torch.Tensor:
    """0-d device bool: every element of every tensor is finite; no host sync, a few ops whatever the size.

    A float64 sum of float32/float16/bfloat16 values cannot overflow (it would need more than 1e269 elements), so
    it is finite exactly when every element is; ``s * 0 == 0`` is False exactly when ``s`` is inf or NaN.
    (``torch.isfinite(t).all()`` is five launches per tensor on CUDA: isfinite is a composite op.)
    """
    total = None
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        s = t.sum(dtype=torch.float64)
        total = s if total is None else total.add_(s)
    if total is None:
        raise ValueError("all_finite needs at least one non-empty tensor")
    return torch.eq(total.mul_(0), 0)


def unpack_uncompressed(buffer: torch.Tensor, layout: BucketLayout, values: torch.Tensor) -> None:
    """Write the packed uncompressed gradients ``values`` back into ``buffer``: one copy when they are one range,
    else one ``index_copy_`` over :meth:`BucketLayout.uncompressed_index`."""
    index = layout.uncompressed_index()
    if index is None:
        o, n = layout.uncompressed[0]
        buffer[o : o + n].copy_(values)
    else:
        buffer.index_copy_(0, index, values.to(buffer.dtype))


def average(
    factor: torch.Tensor,
    layout: BucketLayout,
    buffer: torch.Tensor,
    unc: Optional[torch.Tensor],
    world_size: int,
) -> torch.Tensor:
    """``factor /= world_size``; the uncompressed gradients divided by it and written into ``buffer`` (from the packed
    ``unc``, or in place); returns the 0-d bool "every element finite" (see :func:`all_finite`)."""
    return all_finite(factor, average_parts(factor, layout, buffer, unc, world_size))


def average_parts(
    factor: torch.Tensor,
    layout: BucketLayout,
    buffer: torch.Tensor,
    unc: Optional[torch.Tensor],
    world_size: int,
) -> Optional[torch.Tensor]:
    """:func:`average` without the finiteness flag: returns the averaged uncompressed gradients (``unc``, the view
    of the bucket holding them, or None) for :func:`all_finite` or :func:`step_status`."""
    if world_size != 1:
        factor.div_(world_size)
    part = unc
    if unc is not None:
        if world_size != 1:
            unc.div_(world_size)
        unpack_uncompressed(buffer, layout, unc)
    elif layout.uncompressed:
        o, n = layout.uncompressed[0]
        part = buffer[o : o + n]
        if world_size != 1:
            part.div_(world_size)
    return part


def _factor_lengths(layout: BucketLayout, which: str) -> torch.Tensor:
    """int64 ``(num_matrices,)`` on the layout's device: the number of elements of each matrix's factor ``which``
    (``n_i·r_i`` for P, ``m_i·r_i`` for Q), in packing order. Cached on the layout."""
    def build():
        sizes = [(s.n if which == "p" else s.m) * s.rank for s in layout.matrices]
        return torch.tensor(sizes, dtype=torch.int64, device=layout.device)

    return layout.memo(("torch_factor_lengths", which), build)


def step_status(factor: torch.Tensor, part: Optional[torch.Tensor], layout: BucketLayout, which: str,
                per_matrix: bool) -> "tuple[bool, Optional[torch.Tensor]]":
    """The end of a step on CPU tensors, with one host read in the usual case: ``(finite, fresh)``.

    ``finite``: every element of ``factor`` (the averaged P or Q, ``which``) and of ``part`` (the averaged
    uncompressed gradients, or None) is finite, :func:`all_finite`'s answer. ``fresh``: None when every matrix's
    factor has a non-zero element (or ``per_matrix`` is False, or the step is not finite), else the
    ``(num_matrices,)`` bool tensor telling which do (for :func:`commit_factor`).

    One score: ``Σ_i log(max|factor_i|) + Σ part`` (float64 for ``part``) is finite exactly when every matrix's
    peak is finite and non-zero and ``part`` is finite (a float64 sum of float32 values cannot overflow; a float32
    sum of at most 2^31 logs, each within [-104, 89], cannot either); without ``per_matrix``, ``Σ factor`` in
    float64. Where it is not finite, the finiteness is read apart (:func:`all_finite`) and the peaks tell the
    zero factors: abs, segment_reduce, log, sum (+ sum, add with ``part``) and one host read in the usual case.
    """
    peaks = None
    if per_matrix:
        peaks = torch.segment_reduce(factor.abs(), "max", lengths=_factor_lengths(layout, which), unsafe=True)
        score = peaks.log().sum()
    else:
        score = factor.sum(dtype=torch.float64)
    if part is not None and part.numel():
        score = score + part.sum(dtype=torch.float64)
    if math.isfinite(float(score)):
        return True, None
    if not bool(all_finite(factor, part)):
        return False, None
    return True, None if peaks is None else peaks.ne(0)


def status_and_orthogonalization(factor: torch.Tensor, part: Optional[torch.Tensor], layout: BucketLayout,
                                  which: str) -> Optional[list]:
    """The end of a warm-start step on CPU whose kept factor is orthogonalized next: :func:`step_status` and the
    first half of that orthogonalization (:func:`_ortho_prepare`) from the same Gram matrices, one host read.

    Returns the prepared batches of ``factor`` (float32 on CPU; for :func:`orthogonalize_prepared`) when every element of
    ``factor`` and of ``part`` is finite, every matrix's factor is non-zero and the batched Cholesky-QR accepts every
    factor; else None, having decided nothing (the caller runs :func:`step_status`). Accepted means: every Cholesky
    factorization succeeded (so every column has a positive squared norm: no factor is all zero) and every margin
    is <= 0 (not NaN: a NaN or inf element makes its column's squared norm, hence its margin, non-finite). Then
    :func:`step_status` would say ``(True, None)``, the commit keeps every matrix's new factor, and
    ``orthogonalize(kept)`` is :func:`orthogonalize_prepared` of these very batches, bit for bit. ``part``'s finiteness joins
    the read as ``top + 0·Σ part`` (NaN unless the float64 sum is finite). Ops: those of :func:`_ortho_prepare`,
    ``sum`` and ``add`` with ``part``, one host read."""
    if factor.dtype != torch.float32 or factor.device.type != "cpu" or layout.num_matrices == 0:
        return None
    prepared = _ortho_prepare(factor, layout, which)
    if prepared is None:
        return None
    top = prepared[0][-1]
    for *_, t in prepared[1:]:
        top = torch.maximum(top, t)
    if part is not None and part.numel():
        top = torch.add(top, part.sum(dtype=torch.float64), alpha=0)
    return prepared if float(top) <= 0 else None


def commit_factor(new: torch.Tensor, kept: torch.Tensor, layout: BucketLayout, which: str, ok,
                  fresh: Optional[torch.Tensor] = None) -> None:
    """``kept_i <- new_i`` for every matrix i whose ``new_i`` is not all zero, where ``ok`` (one-element bool).

    ``ok`` a Python bool (from :func:`step_status`): nothing when False; when True, ``fresh`` (``(num_matrices,)``
    bool, or None: every matrix) tells which matrices to keep: one ``copy_`` when all."""
    index = layout.factor_matrix_index(which)
    if isinstance(ok, bool):
        if not ok:
            return
        if fresh is None:
            kept.copy_(new)
        else:
            torch.where(fresh.index_select(0, index), new, kept, out=kept)
        return
    peak = new.new_zeros(layout.num_matrices).scatter_reduce_(0, index, new.abs(), "amax")
    fresh = peak.ne(0)
    if ok is not None:
        fresh = fresh.logical_and_(ok.reshape(()))
    torch.where(fresh.index_select(0, index), new, kept, out=kept)
