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
  always float32).
* ``error``: ``(layout.e_numel,)`` float32 error-feedback memory of the compressed matrices only.

Backends: ``"triton"`` (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``), ``"torch"``
(:mod:`powersgd_triton.kernels.reference`), ``"auto"`` (Triton where it can run, else torch).

Raises ``ValueError`` when a buffer's size, device or layout does not match, and ``RuntimeError`` when the Triton
backend is asked for where it cannot run. Nothing is written before the checks pass.
"""

from typing import Optional

import torch

from . import _env
from .kernels import reference
from .layout import BucketLayout

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, tensor: torch.Tensor) -> str:
    """Map ``"auto"`` to ``"triton"`` or ``"torch"`` for ``tensor``'s device; check an explicit choice can run.

    Raises:
        ValueError: unknown backend name.
        RuntimeError: ``"triton"`` asked for on a device where it cannot run.
    """
    if backend == "torch":  # runs everywhere
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    can = _env.triton_can_run(tensor.device)
    if backend == "auto":
        return "triton" if can else "torch"
    if backend == "triton" and not can:
        raise RuntimeError(
            f"backend='triton' cannot run on {tensor.device} tensors here: "
            + _env.triton_unavailable_reason(tensor.device)
        )
    return backend


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


def _check_buffer(buffer: torch.Tensor, layout: BucketLayout) -> None:
    _check("buffer", buffer, layout.numel, buffer.device)


def _kernels():
    from .kernels import triton_ops  # imported lazily: triton is optional on CPU

    return triton_ops


def project(buffer, layout: BucketLayout, q, p, error=None, *, backend: str = "auto", config=None) -> None:
    """Step 1: ``P_i = M_i · Q_i`` for every compressed matrix of the bucket (one launch).

    With ``error`` (error feedback, paper Alg. 2), ``M_i + E_i`` is used and written back into ``buffer`` in the same
    pass. ``config`` overrides the autotuned block sizes (Triton backend only).
    """
    _check_buffer(buffer, layout)
    _check("q", q, layout.q_numel, buffer.device)
    _check("p", p, layout.p_numel, buffer.device)
    _check("error", error, layout.e_numel, buffer.device)
    if layout.num_matrices == 0:
        return
    if resolve_backend(backend, buffer) == "triton":
        _kernels().project(buffer, layout, q, p, error, config=config)
    else:
        reference.project(buffer, layout, q, p, error)


def orthogonalize(x, layout: BucketLayout, which: str, epsilon: float = 0.0, out=None, *, backend="auto", config=None):
    """Step 2: modified Gram-Schmidt on the columns of every ``P_i`` (``which="p"``) or ``Q_i`` (``which="q"``).

    PyTorch's ``_orthogonalize_gram_schmidt``: columns come out orthonormal, in order (column j spans the first j+1
    input columns), each divided by ``norm + epsilon``. Computed in float64 from the float32 factors (Triton: on the
    Gram matrix; torch: on the columns), so no norm or inner product overflows or underflows for finite input. An
    all-zero factor stays zero (no NaN) even with ``epsilon=0``; a column that is zero or numerically dependent on
    the columns before it (residual norm <= 2^-20 of its norm) in a non-zero factor becomes a unit vector orthogonal
    to all other columns, as Householder QR gives; NaN/inf input stays non-finite. Deterministic (fixed reduction
    order, no atomics). Writes into ``out`` (default in place); returns it.
    """
    if which not in ("p", "q"):
        raise ValueError(f"which must be 'p' or 'q', got {which!r}")
    if epsilon < 0:
        raise ValueError(f"orthogonalization epsilon must be >= 0, got {epsilon}")
    numel = layout.p_numel if which == "p" else layout.q_numel
    _check(which, x, numel, layout.device if x is None else x.device)
    _check("out", out, numel, x.device)
    if out is None:
        out = x
    if layout.num_matrices == 0:
        return out
    if resolve_backend(backend, x) == "triton":
        _kernels().orthogonalize(x, layout, which, float(epsilon), out, config=config)
    else:
        reference.orthogonalize(x, layout, which, float(epsilon), out)
    return out


def project_t(buffer, layout: BucketLayout, p, q, *, backend: str = "auto", config=None) -> None:
    """Step 3: ``Q_i = M_iᵀ · P_i`` for every compressed matrix (one launch, no atomics)."""
    _check_buffer(buffer, layout)
    _check("p", p, layout.p_numel, buffer.device)
    _check("q", q, layout.q_numel, buffer.device)
    if layout.num_matrices == 0:
        return
    if resolve_backend(backend, buffer) == "triton":
        _kernels().project_t(buffer, layout, p, q, config=config)
    else:
        reference.project_t(buffer, layout, p, q)


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
    backend: str = "auto",
    config=None,
) -> None:
    """Step 4: ``M_i ← P_i · (scale·Q_i)ᵀ``; with ``error`` also ``E_i ← M_i(before) − P_i · (scale·Q_i)ᵀ``.

    One pass over the bucket (no clone of it). ``update_error``: optional 0-d bool device tensor; where it is False
    the error memory is left unchanged (used to keep the state valid on a non-finite step without a host sync).
    ``local_p`` / ``local_q`` (flat like ``p`` / ``q``, at most one): the error becomes the local residual
    ``M_i − P_local·Q_iᵀ`` / ``M_i − P_i·Q_localᵀ`` (alternating hook), the output stays ``P_i·(scale·Q_i)ᵀ``.
    Deterministic (no atomics). Padding of the batched view is never stored.
    """
    _check_buffer(buffer, layout)
    _check("p", p, layout.p_numel, buffer.device)
    _check("q", q, layout.q_numel, buffer.device)
    _check("error", error, layout.e_numel, buffer.device)
    _check("local_p", local_p, layout.p_numel, buffer.device)
    _check("local_q", local_q, layout.q_numel, buffer.device)
    if local_p is not None and local_q is not None:
        raise ValueError("give local_p or local_q, not both")
    if update_error is not None and (update_error.numel() != 1 or update_error.device != buffer.device):
        raise ValueError("update_error must be a one-element tensor on the bucket's device")
    if layout.num_matrices == 0:
        return
    if resolve_backend(backend, buffer) == "triton":
        _kernels().reconstruct(
            buffer, layout, p, q, float(scale), error, update_error, local_p=local_p, local_q=local_q, config=config
        )
    else:
        reference.reconstruct(
            buffer, layout, p, q, float(scale), error, update_error, local_p=local_p, local_q=local_q
        )


def _check_packed(name, t, layout, device):
    if t is None or t.dim() != 1 or t.numel() != layout.uncompressed_numel:
        raise ValueError(f"{name} must be a flat tensor of {layout.uncompressed_numel} elements (uncompressed numel)")
    if t.device != device or not t.is_contiguous() or not t.is_floating_point():
        raise ValueError(f"{name} must be a contiguous floating-point tensor on {device}")


def pack_uncompressed(buffer, layout: BucketLayout, dst, *, backend: str = "auto") -> None:
    """Copy the uncompressed gradients of the bucket into ``dst`` (flat, ``layout.uncompressed_numel`` elements,
    any float dtype, e.g. a slice of the alternating hook's single all-reduce buffer). One launch."""
    _check_buffer(buffer, layout)
    _check_packed("dst", dst, layout, buffer.device)
    if layout.uncompressed_numel == 0:
        return
    if resolve_backend(backend, buffer) == "triton":
        _kernels().copy_segments(buffer, dst, layout, to_packed=True)
    else:
        pos = 0
        for off, n in layout.uncompressed:
            dst[pos : pos + n].copy_(buffer[off : off + n])
            pos += n


def unpack_uncompressed(src, layout: BucketLayout, buffer, scale: float = 1.0, *, backend: str = "auto") -> None:
    """Write ``scale * src`` (from :func:`pack_uncompressed`'s layout) back into the bucket's uncompressed
    positions. One launch."""
    _check_buffer(buffer, layout)
    _check_packed("src", src, layout, buffer.device)
    if layout.uncompressed_numel == 0:
        return
    if resolve_backend(backend, buffer) == "triton":
        _kernels().copy_segments(src, buffer, layout, to_packed=False, scale=scale)
    else:
        pos = 0
        for off, n in layout.uncompressed:
            seg = src[pos : pos + n]
            buffer[off : off + n].copy_(seg * scale if scale != 1.0 else seg)
            pos += n


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
        _kernels().commit_factor(new, kept, layout, which, ok)
    else:
        index = layout.factor_matrix_index(which)
        peak = new.new_zeros(layout.num_matrices).scatter_reduce_(0, index, new.abs(), "amax")
        fresh = peak.ne(0).logical_and_(ok.reshape(())).index_select(0, index)
        torch.where(fresh, new, kept, out=kept)
