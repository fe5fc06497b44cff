"""The numeric steps as the hooks call them on a bucket whose memory runs the Triton backend: the launchers of
:mod:`powersgd_triton.ops.triton_ops` themselves, with :mod:`powersgd_triton.ops`' signatures.

:mod:`powersgd_triton.ops` checks every tensor of every call (flat, the layout's size, the bucket's device,
contiguous, floating point) and resolves the backend per tensor: a dozen Python calls per launch. The hooks' tensors
are the state's own: the bucket buffer is matched to its layout every step
(:func:`powersgd_triton.hooks.driver.prepare_bucket`), the P/Q/error memory is allocated for that layout or checked when loaded (:mod:`powersgd_triton.state.state_dict`), and
the backend is resolved once per bucket memory and checked per device (``check_backend_runs``). So these functions
pass the call straight to the launcher: same arguments, same results and launches as ``ops``' Triton branch
(``tests/test_hooks_launches.py``, ``tests/test_direct_launch.py``). :func:`for_memory` picks this module or
``ops`` for a bucket memory.
"""

from powersgd_triton import ops
from powersgd_triton.ops import StepFlags


K = None  # powersgd_triton.ops.triton_ops, once a memory on the Triton backend asked for this module


def for_memory(mem):
    """This module for a bucket memory on the Triton backend, else :mod:`powersgd_triton.ops`."""
    global K
    if mem.backend != "triton":
        return ops
    if K is None:
        K = ops._kernels()
    return _THIS


def project(buffer, layout, q, p, error=None, *, p2=None, loss_scale=None, backend=None, config=None) -> None:
    """:func:`powersgd_triton.ops.project` on the Triton backend, unchecked."""
    K.project(buffer, layout, q, p, error, p2=p2, loss_scale=loss_scale if error is not None else None,
                           config=config)


def orthogonalize(x, layout, which, epsilon=0.0, out=None, *, backend=None, config=None):
    """:func:`powersgd_triton.ops.orthogonalize` on the Triton backend, unchecked (``epsilon``: the state's,
    validated when the state was made)."""
    out = x if out is None else out
    K.orthogonalize(x, layout, which, float(epsilon), out, config=config)
    return out


def project_t(buffer, layout, p, q, *, error=None, q2=None, loss_scale=None, backend=None, config=None) -> None:
    """:func:`powersgd_triton.ops.project_t` on the Triton backend, unchecked."""
    K.project_t(buffer, layout, p, q, error=error, q2=q2,
                             loss_scale=loss_scale if error is not None and layout.batched else None, config=config)


def average(factor, layout, which, buffer, unc=None, world_size=1, *, out=None, backend=None) -> StepFlags:
    """:func:`powersgd_triton.ops.average` on the Triton backend, unchecked."""
    flags, first = K.average(factor, layout, which, buffer, unc, world_size, out)
    return StepFlags(which, flags=flags, first=first)


def reconstruct(buffer, layout, p, q, scale=1.0, error=None, update_error=None, *, local_p=None, local_q=None,
                commit=None, orthogonalize_kept=None, loss_scale=None, backend=None, config=None) -> bool:
    """:func:`powersgd_triton.ops.reconstruct` on the Triton backend, unchecked (``update_error``: the
    :class:`~powersgd_triton.ops.StepFlags` of :func:`average`, or None); returns False (the kept factor's
    orthogonalization is the caller's)."""
    flags = first = None
    if update_error is not None:
        flags, first = update_error.flags, update_error.first
    K.reconstruct(buffer, layout, p, q, float(scale), error, flags, local_p=local_p, local_q=local_q,
                               commit=commit, first=first, loss_scale=loss_scale if error is not None else None,
                               config=config)
    return False


def pack_uncompressed(buffer, layout, dst, *, backend=None) -> None:
    """:func:`powersgd_triton.ops.pack_uncompressed` on the Triton backend, unchecked."""
    if layout.uncompressed_numel:
        K.copy_segments(buffer, dst, layout, to_packed=True)


def unpack_uncompressed(src, layout, buffer, scale=1.0, *, backend=None) -> None:
    """:func:`powersgd_triton.ops.unpack_uncompressed` on the Triton backend, unchecked."""
    if layout.uncompressed_numel:
        K.copy_segments(src, buffer, layout, to_packed=False, scale=scale)


import sys as _sys  # noqa: E402 - the module itself, for for_memory

_THIS = _sys.modules[__name__]
