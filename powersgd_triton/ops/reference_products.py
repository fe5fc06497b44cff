"""Torch reference of the product steps: ``project`` (P = M·Q), ``project_t`` (Q = Mᵀ·P) and ``reconstruct``
(M <- P·Qᵀ with the error feedback), per matrix or grouped per *run* of same-shape matrices.

Part of :mod:`powersgd_triton.ops.reference` (which re-exports these names; its docstring describes the
grouped path and the contract shared with the Triton kernels).
"""

from typing import List, Optional

import torch

from powersgd_triton.layout import BucketLayout, MatrixSpec


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
