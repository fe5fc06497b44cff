"""The four numeric steps of PowerSGD on a whole bucket, dispatched to Triton kernels or to torch.

For a bucket whose layout (:class:`~powersgd_triton.layout.BucketLayout`) lists L compressed matrices
``M_i`` (``n_i x m_i`` views of the flat bucket buffer at offset ``o_i``, ranks ``r_i``):

1. :func:`project`:        ``P_i = M_i · Q_i``                (optionally ``M_i += E_i`` first, error feedback)
2. :func:`orthogonalize`:  Gram-Schmidt on every ``P_i`` (or ``Q_i``)
3. :func:`project_t`:      ``Q_i = M_iᵀ · P_i``
4. :func:`reconstruct`:    ``M_i ← P_i · (s·Q_i)ᵀ`` and optionally ``E_i ← M_i(before) − P_i · (s·Q_i)ᵀ``

Each step is ONE kernel launch for the whole bucket on the Triton backend, whatever L is.

Shapes and dtypes (all flat, contiguous, on the bucket's device):

* ``buffer``: ``(N,)`` float32, float16 or bfloat16 — the bucket buffer, updated in place by project (with error)
  and reconstruct.
* ``p``: ``(layout.p_numel,)``, ``q``: ``(layout.q_numel,)``; float32 (any float dtype is accepted; arithmetic is
  float32, except for float64 buckets/factors on the torch backend: float64, with float64 P, Q and error).
* ``error``: ``(layout.e_numel,)`` float32 error-feedback memory of the compressed matrices only.

Backends: ``"triton"`` (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``), ``"torch"``
(:mod:`powersgd_triton.ops.reference`: batched torch ops, one ``bmm`` per run of same-shape matrices and step,
one foreach op per step for the error feedback and, on CPU, one orthogonalization batch per factor; 3 ops per shape
plus a constant per step, not per matrix),
``"auto"`` (Triton where it can run, else torch).

The Triton kernels compute in float32: ``"auto"`` runs float64 tensors on the torch backend, and ``"triton"`` refuses
them (``ValueError``).

Raises ``ValueError`` when a buffer's size, device or layout does not match, and ``RuntimeError`` when the Triton
backend is asked for where it cannot run. Nothing is written before the checks pass.
"""

import math
from typing import Optional

import torch

from powersgd_triton.ops.backend import BACKENDS, resolve_backend  # noqa: F401 - the one resolver, re-exported here
from powersgd_triton.ops import reference
from powersgd_triton.layout import BucketLayout

def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """Arithmetic dtype of the torch backend: float64 for float64 tensors (a float64 model keeps float64
    precision, as PyTorch's hook does), float32 for everything else."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check(name: str, t: Optional[torch.Tensor], numel: int, device: torch.device) -> None:
    if t is None:
        return
    if t.dim() != 1 or t.numel() != numel:
        raise ValueError(f"{name} must be a flat tensor of {numel} elements for this layout, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the bucket buffer on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


def _check_loss_scale(loss_scale: Optional[torch.Tensor], device: torch.device) -> None:
    """None, or the loss scale of the step's gradients: a one-element float32 tensor on the bucket's device (a
    ``GradScaler``'s scale tensor), read by the kernels (no host synchronization)."""
    if loss_scale is None:
        return
    if not isinstance(loss_scale, torch.Tensor) or loss_scale.numel() != 1 or loss_scale.dtype != torch.float32:
        raise ValueError("loss_scale must be a one-element float32 tensor (the GradScaler's scale)")
    if loss_scale.device != device:
        raise ValueError(f"loss_scale is on {loss_scale.device}, the bucket buffer on {device}")


def _check_buffer(buffer: torch.Tensor, layout: BucketLayout) -> None:
    _check("buffer", buffer, layout.numel, buffer.device)


_KERNELS = []


def _kernels():
    """This package with its Triton step modules (``projection``, ``projection_t``, ``orthogonalization``,
    ``reconstruction``, ``segments``) imported, on first use (triton is optional on CPU)."""
    if not _KERNELS:
        from powersgd_triton import ops
        from powersgd_triton.ops import orthogonalization, projection, projection_t, reconstruction, segments  # noqa: F401

        _KERNELS.append(ops)
    return _KERNELS[0]


def project(buffer, layout: BucketLayout, q, p, error=None, *, p2=None, loss_scale=None, packed=None,
            backend: str = "auto", config=None) -> None:
    """Step 1: ``P_i = M_i · Q_i`` for every compressed matrix of the bucket (one launch).

    With ``error`` (error feedback, paper Alg. 2), ``M_i + E_i`` is used and written back into ``buffer`` in the same
    pass (for the batched view, the padding's ``M + E`` is its error memory). ``p2`` (flat like ``p``): a second copy
    of P written by the same launch. ``loss_scale`` (one-element float32 device tensor ``s``, with ``error``): the
    error memory is in unscaled units and the gradients scaled by ``s``: ``M_i + s·E_i`` is used (and written back).
    ``packed`` (flat, ``layout.uncompressed_numel`` elements, any float dtype): the uncompressed gradients are packed
    into it too, as :func:`pack_uncompressed` packs them (on the Triton backend by the same launch: its pack
    programs; on torch, the pack and then the projection).
    ``config`` overrides the autotuned block sizes (Triton backend only).
    """
    _check_buffer(buffer, layout)
    if packed is not None:
        _check_packed("packed", packed, layout, buffer.device)
    _check_loss_scale(loss_scale, buffer.device)
    if error is None:
        loss_scale = None
    _check("q", q, layout.q_numel, buffer.device)
    _check("p", p, layout.p_numel, buffer.device)
    _check("p2", p2, layout.p_numel, buffer.device)
    _check("error", error, layout.e_numel, buffer.device)
    if layout.num_matrices == 0:
        if packed is not None:
            _pack(buffer, layout, packed, backend)
        return
    if resolve_backend(backend, buffer) == "triton":
        _kernels().projection.project(buffer, layout, q, p, error, p2=p2, loss_scale=loss_scale, packed=packed,
                                      config=config)
    else:
        if packed is not None:
            _pack(buffer, layout, packed, "torch")
        reference.project(buffer, layout, q, p, error, compute_dtype=_compute_dtype(buffer), loss_scale=loss_scale)
        if p2 is not None:
            p2.copy_(p)


def orthogonalize(x, layout: BucketLayout, which: str, epsilon: float = 0.0, out=None, *, backend="auto", config=None):
    """Step 2: modified Gram-Schmidt on the columns of every ``P_i`` (``which="p"``) or ``Q_i`` (``which="q"``).

    PyTorch's ``_orthogonalize_gram_schmidt``: columns come out orthonormal, in order (column j spans the first j+1
    input columns), each divided by ``norm + epsilon``. Computed in float64 from the float32 factors on the Gram matrix
    (Triton; torch on CPU with epsilon 0: one batched Cholesky-QR for all factors), or on the columns with a
    power-of-two scaling per column (torch otherwise), so no norm or inner product overflows for finite input. An
    all-zero factor stays zero (no NaN) even with ``epsilon=0``; a column that is zero or numerically dependent on
    the columns before it (residual norm <= 2^-20 of its norm) in a non-zero factor becomes a unit vector orthogonal
    to all other columns, as Householder QR gives; NaN/inf input stays non-finite. Deterministic (fixed reduction
    order, no atomics). Writes into ``out`` (default in place); returns it.
    """
    if which not in ("p", "q"):
        raise ValueError(f"which must be 'p' or 'q', got {which!r}")
    if not (epsilon >= 0 and math.isfinite(epsilon)):  # inf would turn every column into zero
        raise ValueError(f"orthogonalization epsilon must be finite and >= 0, got {epsilon}")
    numel = layout.p_numel if which == "p" else layout.q_numel
    _check(which, x, numel, layout.device if x is None else x.device)
    _check("out", out, numel, x.device)
    if out is None:
        out = x
    if layout.num_matrices == 0:
        return out
    if resolve_backend(backend, x) == "triton":
        _kernels().orthogonalization.orthogonalize(x, layout, which, float(epsilon), out, config=config)
    else:
        # float64 for every factor dtype (as the Triton kernel's Gram): products of float32 values are exact there
        reference.orthogonalize(x, layout, which, float(epsilon), out, compute_dtype=torch.float64)
    return out


def project_t(buffer, layout: BucketLayout, p, q, *, error=None, q2=None, loss_scale=None, backend: str = "auto",
              config=None) -> None:
    """Step 3: ``Q_i = M_iᵀ · P_i`` for every compressed matrix (one launch, two when the plan splits a tall matrix
    over rows; no atomics).

    ``error``: only read for the batched view, whose padding's ``M + E`` is its error memory (the bucket holds
    ``M + E`` already after :func:`project` with the error); ``loss_scale``: that padding's is ``s·E`` (see
    :func:`project`). ``q2`` (flat like ``q``): a second copy of Q.
    """
    _check_buffer(buffer, layout)
    _check_loss_scale(loss_scale, buffer.device)
    if error is None or not layout.batched:
        loss_scale = None
    _check("p", p, layout.p_numel, buffer.device)
    _check("q", q, layout.q_numel, buffer.device)
    _check("q2", q2, layout.q_numel, buffer.device)
    _check("error", error, layout.e_numel, buffer.device)
    if layout.num_matrices == 0:
        return
    if resolve_backend(backend, buffer) == "triton":
        _kernels().projection_t.project_t(buffer, layout, p, q, error=error, q2=q2, loss_scale=loss_scale, config=config)
    else:
        reference.project_t(buffer, layout, p, q, error=error, compute_dtype=_compute_dtype(buffer),
                            loss_scale=loss_scale)
        if q2 is not None:
            q2.copy_(q)


def reconstruct(
    buffer,
    layout: BucketLayout,
    p,
    q,
    scale: float = 1.0,
    error=None,
    update_error=None,
    *,
    local_p=None,
    local_q=None,
    commit=None,
    orthogonalize_kept=None,
    loss_scale=None,
    backend: str = "auto",
    config=None,
) -> bool:
    """Step 4: ``M_i ← P_i · (scale·Q_i)ᵀ``; with ``error`` also ``E_i ← M_i(before) − P_i · (scale·Q_i)ᵀ``.

    One pass over the bucket (no clone of it). ``update_error``: a one-element bool device tensor, or the
    :class:`StepFlags` of :func:`average`; where the step is not finite the error memory is left unchanged (used to keep
    the state valid on a non-finite step without a host sync). ``local_p`` / ``local_q`` (flat like ``p`` / ``q``, at
    most one): the error becomes the local residual ``M_i − P_local·Q_iᵀ`` / ``M_i − P_i·Q_localᵀ`` (a hook that
    all-reduces one factor per step), the output stays ``P_i·(scale·Q_i)ᵀ``. ``commit=(which, kept)``: also the
    warm-start update ``kept_i <- p_i`` (``which="p"``) or ``q_i`` (``"q"``) for every matrix whose factor is not all
    zero, where the step is finite; needs ``update_error`` from :func:`average` on the same factor (as
    :func:`commit_factor`, in the same launch). Deterministic (no atomics). Padding of the batched view is never stored
    in the bucket; its error memory is updated like the rest (PyTorch's batched hook). ``loss_scale`` (one-element
    float32 device tensor ``s``, with ``error``): the error memory is in unscaled units, ``E_i ← (M_i(before) −
    P_i·(scale·Q_i)ᵀ) / s`` (``M_i(before)`` holds ``M + s·E`` after :func:`project` with the same ``s``; the batched
    padding's is ``s·E``); the output stays in the gradients' (scaled) units.

    ``orthogonalize_kept`` (flat like ``kept``, not ``kept`` itself; ``q``/``p`` may be it: it is written last),
    with ``commit``: the caller will set it to ``orthogonalize(kept, epsilon=0)`` next (warm start). Where that is
    cheaper done here, it is: the torch backend on CPU (float32 factors) tells the step's finiteness and the non-zero
    factors from the Gram matrices of that orthogonalization (one host read for both,
    :func:`~powersgd_triton.ops.reference.status_and_orthogonalization`). Returns True when
    ``orthogonalize_kept`` now holds ``orthogonalize(kept, epsilon=0)`` (the same bits), else False (nothing was
    written into it: the caller orthogonalizes).
    """
    _check_buffer(buffer, layout)
    _check_loss_scale(loss_scale, buffer.device)
    if error is None:
        loss_scale = None
    _check("p", p, layout.p_numel, buffer.device)
    _check("q", q, layout.q_numel, buffer.device)
    _check("error", error, layout.e_numel, buffer.device)
    _check("local_p", local_p, layout.p_numel, buffer.device)
    _check("local_q", local_q, layout.q_numel, buffer.device)
    if local_p is not None and local_q is not None:
        raise ValueError("give local_p or local_q, not both")
    flags = update_error
    if isinstance(flags, StepFlags):
        if flags.device != buffer.device:
            raise ValueError("update_error must be on the bucket's device")
    elif flags is not None and (flags.numel() != 1 or flags.device != buffer.device):
        raise ValueError("update_error must be a one-element tensor on the bucket's device")
    if commit is not None:
        which, kept = commit
        if which not in ("p", "q"):
            raise ValueError(f"commit's factor must be 'p' or 'q', got {which!r}")
        _check("kept", kept, layout.p_numel if which == "p" else layout.q_numel, buffer.device)
        if not isinstance(flags, StepFlags) or flags.which != which:
            raise ValueError(f"commit=({which!r}, ...) needs update_error from average() on the {which!r} factor")
    if orthogonalize_kept is not None:
        if commit is None:
            raise ValueError("orthogonalize_kept needs commit")
        _check("orthogonalize_kept", orthogonalize_kept, commit[1].numel(), buffer.device)
        if orthogonalize_kept.data_ptr() == commit[1].data_ptr():
            raise ValueError("orthogonalize_kept must not be the kept factor itself")
    if layout.num_matrices == 0:
        return False
    if resolve_backend(backend, buffer) == "triton":
        if isinstance(flags, StepFlags):
            flag_tensor, first = flags.flags, flags.first
        else:
            flag_tensor, first = flags, None
        _kernels().reconstruction.reconstruct(
            buffer, layout, p, q, float(scale), error, flag_tensor, local_p=local_p, local_q=local_q,
            commit=commit, first=first, loss_scale=loss_scale, config=config,
        )
        return False
    fresh = prepared = None
    if isinstance(flags, StepFlags) and flags.parts is not None:
        # CPU: the step's finiteness and the non-zero factors, one host read in the usual case; with
        # orthogonalize_kept read from the Gram matrices of that orthogonalization where every factor is kept
        if orthogonalize_kept is not None and commit[1].dtype == orthogonalize_kept.dtype == torch.float32:
            prepared = reference.status_and_orthogonalization(*flags.parts, layout, flags.which)
        if prepared is not None:
            ok = True
        else:
            ok, fresh = reference.step_status(*flags.parts, layout, flags.which, per_matrix=commit is not None)
    else:
        ok = flags.ok if isinstance(flags, StepFlags) else flags
    copy_also = None
    if prepared is not None:  # every factor kept: the commit is one copy, made by the error update's foreach copy
        copy_also = (commit[1], p if commit[0] == "p" else q)
    reference.reconstruct(
        buffer, layout, p, q, float(scale), error, ok, local_p=local_p, local_q=local_q,
        compute_dtype=_compute_dtype(buffer), loss_scale=loss_scale, copy_also=copy_also,
    )
    if commit is not None and copy_also is None:
        which, kept = commit
        reference.commit_factor(p if which == "p" else q, kept, layout, which, ok, fresh)
    if prepared is None:
        return False
    # every factor was finite, non-zero and kept (kept == the new factor): its orthogonalization, prepared above
    reference.orthogonalize_prepared(prepared, orthogonalize_kept)
    return True


class StepFlags:
    """What :func:`average` learned about a step, for :func:`reconstruct`: is it finite, which factor matrices are
    not all zero. Device tensors only (no host synchronization).

    Triton backend: ``flags`` (uint8, one per chunk of the average launch: bit 0 finite, bit 1 non-zero) and
    ``first`` (int32, the chunks of matrix i are ``first[i]:first[i + 1]``). Torch backend: ``ok`` (one-element
    bool). Torch backend on CPU: ``parts`` (the averaged factor and uncompressed gradients), which
    :func:`reconstruct` checks with one host read (:func:`~powersgd_triton.ops.reference.step_status`) together
    with the per-matrix test of the commit; ``ok`` is computed from them when asked for. ``which``: the factor
    (``"p"`` or ``"q"``) the flags describe.
    """

    __slots__ = ("flags", "first", "_ok", "which", "parts")

    def __init__(self, which: str, flags=None, first=None, ok=None, parts=None):
        self.which = which
        self.flags = flags if flags is not None else ok
        self.first = first
        self._ok = ok
        self.parts = parts

    @property
    def ok(self):
        """One-element bool device tensor: the step is finite (torch backend)."""
        if self._ok is None and self.parts is not None:
            self._ok = reference.all_finite(*self.parts)
        return self._ok

    @property
    def device(self) -> torch.device:
        return self.flags.device if self.flags is not None else self.parts[0].device


def average(factor, layout: BucketLayout, which: str, buffer, unc=None, world_size: int = 1, *,
            out=None, backend: str = "auto") -> StepFlags:
    """The end of a step's all-reduces, one launch: divide the all-reduced ``factor`` (flat P or Q, ``which``) by
    ``world_size`` into ``out`` (default: ``factor``, in place), divide the all-reduced uncompressed gradients by it
    and write them into ``buffer``, and return the :class:`StepFlags` that :func:`reconstruct` reads (step finite:
    every element of ``factor`` and of the uncompressed gradients is finite; per matrix: its averaged factor is not
    all zero).

    ``out``: the memory's float32 factor when ``factor`` is the buffer it was all-reduced in, in the communication
    dtype (the hooks on the Triton backend): the division is done in float32 on the exact float32 value of each
    element, as a copy back followed by ``div_`` gives. Raises ``ValueError`` for a malformed ``out`` (size, device,
    not contiguous or not floating point), as for ``factor``.

    ``unc``: the packed uncompressed gradients (from :func:`pack_uncompressed`, ``layout.uncompressed_numel``
    elements), or None when they are all-reduced in place in ``buffer`` (one range, or none). The division is
    PyTorch's ``div_(world_size)`` (IEEE division, rounded to the destination dtype). No host synchronization (on CPU
    tensors the torch backend leaves the check to :func:`reconstruct`, which reads it with the commit's per-matrix
    test in one host read).
    """
    if which not in ("p", "q"):
        raise ValueError(f"which must be 'p' or 'q', got {which!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    _check_buffer(buffer, layout)
    _check(which, factor, layout.p_numel if which == "p" else layout.q_numel, buffer.device)
    _check("out", out, factor.numel(), buffer.device)
    if unc is not None:
        _check_packed("unc", unc, layout, buffer.device)
    elif len(layout.uncompressed) > 1:
        raise ValueError("the uncompressed gradients lie in several ranges of the bucket: pass them packed (unc)")
    if resolve_backend(backend, buffer) == "triton":
        flags, first = _kernels().segments.average(factor, layout, which, buffer, unc, world_size, out)
        return StepFlags(which, flags=flags, first=first)
    if out is not None and out is not factor:
        factor = out.copy_(factor)  # exact for a 2-byte factor into float32: then divided in place
    part = reference.average_parts(factor, layout, buffer, unc, world_size)
    if buffer.device.type == "cpu":  # checked by reconstruct, with the commit's per-matrix test (one host read)
        return StepFlags(which, parts=(factor, part))
    return StepFlags(which, ok=reference.all_finite(factor, part))


def _check_packed(name, t, layout, device):
    if t is None or t.dim() != 1 or t.numel() != layout.uncompressed_numel:
        raise ValueError(f"{name} must be a flat tensor of {layout.uncompressed_numel} elements (uncompressed numel)")
    if t.device != device or not t.is_contiguous() or not t.is_floating_point():
        raise ValueError(f"{name} must be a contiguous floating-point tensor on {device}")


def pack_uncompressed(buffer, layout: BucketLayout, dst, *, backend: str = "auto") -> None:
    """Copy the uncompressed gradients of the bucket into ``dst`` (flat, ``layout.uncompressed_numel`` elements,
    any float dtype, e.g. a slice of a one-all-reduce hook's single buffer). One launch."""
    _check_buffer(buffer, layout)
    _check_packed("dst", dst, layout, buffer.device)
    _pack(buffer, layout, dst, backend)


def _pack(buffer, layout, dst, backend) -> None:
    """:func:`pack_uncompressed` of checked arguments."""
    if layout.uncompressed_numel == 0:
        return
    if resolve_backend(backend, buffer) == "triton":
        _kernels().segments.copy_segments(buffer, dst, layout, to_packed=True)
    else:
        index = layout.uncompressed_index()
        if index is None:
            o, n = layout.uncompressed[0]
            dst.copy_(buffer[o : o + n])
        elif dst.dtype == buffer.dtype:
            torch.index_select(buffer, 0, index, out=dst)
        else:
            dst.copy_(buffer.index_select(0, index))


def unpack_uncompressed(src, layout: BucketLayout, buffer, scale: float = 1.0, *, backend: str = "auto") -> None:
    """Write ``scale * src`` (from :func:`pack_uncompressed`'s layout) back into the bucket's uncompressed
    positions. One launch."""
    _check_buffer(buffer, layout)
    _check_packed("src", src, layout, buffer.device)
    if layout.uncompressed_numel == 0:
        return
    if resolve_backend(backend, buffer) == "triton":
        _kernels().segments.copy_segments(src, buffer, layout, to_packed=False, scale=scale)
    else:
        reference.unpack_uncompressed(buffer, layout, src * scale if scale != 1.0 else src)


def commit_factor(new, kept, layout: BucketLayout, which: str, ok, *, backend: str = "auto") -> None:
    """Warm-start update: ``kept_i <- new_i`` for every matrix i whose new factor (``which`` = "p" or "q") is not all
    zero, and only where ``ok`` (one-element bool device tensor: the step was finite) holds. One launch, no host sync.

    A factor that is exactly zero (the layer had no gradient on any rank) is not kept: ``orth(0) = 0`` and
    ``M·0 = 0`` would keep that layer at zero for good.
    """
    if which not in ("p", "q"):
        raise ValueError(f"which must be 'p' or 'q', got {which!r}")
    numel = layout.p_numel if which == "p" else layout.q_numel
    _check("new", new, numel, kept.device)
    _check("kept", kept, numel, kept.device)
    if ok.numel() != 1 or ok.device != kept.device:
        raise ValueError("ok must be a one-element tensor on the factors' device")
    if layout.num_matrices == 0:
        return
    if resolve_backend(backend, kept) == "triton":
        _kernels().segments.commit_factor(new, kept, layout, which, ok)
    else:
        reference.commit_factor(new, kept, layout, which, ok)
