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

Layout: the product steps live in :mod:`.reference_products`, the orthogonalization in :mod:`.reference_ortho`;
this module re-exports both and holds the end of a step (averaging, step status, warm-start commit).
"""

import math
from typing import Optional

import torch

from powersgd_triton.layout import BucketLayout
from powersgd_triton.ops.reference_ortho import (
    _DEPENDENT_NORM_TOL, _WALSH_CACHE, DEPENDENT_TOL, PAD_LIMIT, _build_ortho_plan, _completion, _ortho_plan, _ortho_prepare, _orthogonalize_batch, _power_of_two_scale, _zero64, gram_schmidt_, orthogonalize, orthogonalize_prepared, padded_rank_of, walsh_vectors,
)
from powersgd_triton.ops.reference_products import (
    _build_runs, _error, _factor, _grouped, _matrix, _Run, _runs, _scaled, _store_matrix, _with_padding_error, project, project_t, reconstruct,
)


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
