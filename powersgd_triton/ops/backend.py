"""Which backend runs a bucket: the one resolver of ``backend="auto" | "triton" | "torch"``.

Used by :mod:`powersgd_triton.ops` (every numeric step, per tensor) and by
:class:`~powersgd_triton.PowerSGDState` (its constructor, and per bucket when the bucket's memory is built).

* ``"torch"`` runs everywhere (:mod:`powersgd_triton.ops.reference`);
* ``"triton"`` runs where Triton can run on the tensors' device (CUDA tensors; CPU tensors under
  ``TRITON_INTERPRET=1``) and our kernels import; elsewhere it is refused with ``RuntimeError`` saying why;
* ``"auto"`` is Triton where it can run, else torch.

The Triton kernels compute in float32: :func:`resolve_backend` gives float64 tensors to torch (``"auto"``) or refuses
them (``"triton"``); the state instead runs a float64 bucket on torch with a warning (:func:`device_backend` there).
"""

import functools
import operator
from typing import Optional

import torch

from powersgd_triton.compat import env as _env

BACKENDS = ("auto", "triton", "torch")


@functools.lru_cache(maxsize=None)
def _kernel_import_error() -> Optional[str]:
    """Why ``powersgd_triton.ops.kernels`` cannot be imported; None when it can (checked once per process)."""
    try:
        from powersgd_triton.ops import kernels  # noqa: F401
    except ImportError as exc:
        return str(exc) or type(exc).__name__
    return None


def check_backend(backend: str) -> None:
    """``ValueError`` unless ``backend`` is one of :data:`BACKENDS`."""
    if backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}")


def device_backend(backend: str, device: torch.device) -> str:
    """``"triton"`` or ``"torch"``: the backend that runs tensors of ``device`` (whatever their dtype).

    Raises:
        ValueError: unknown backend name.
        RuntimeError: ``"triton"`` where it cannot run on ``device`` (Triton missing or too old, the interpreter off
            for CPU tensors, on for CUDA tensors), or our Triton kernels cannot be imported.
    """
    if backend == "torch":  # runs everywhere
        return "torch"
    check_backend(backend)
    can_run = _env.triton_can_run(device)
    have_kernels = can_run and _kernel_import_error() is None
    if backend == "auto":
        return "triton" if have_kernels else "torch"
    if not can_run:
        raise RuntimeError(
            f"backend='triton' cannot run on {device} tensors here: " + _env.triton_unavailable_reason(device)
        )
    if not have_kernels:
        raise RuntimeError("backend='triton': powersgd_triton.ops.kernels cannot be imported")
    return "triton"


def resolve_backend(backend: str, tensor: torch.Tensor) -> str:
    """Map ``"auto"`` to ``"triton"`` or ``"torch"`` for ``tensor`` (its device and dtype); check that an explicit
    choice can run.

    Raises:
        ValueError: unknown backend name; ``"triton"`` for a float64 tensor (the kernels compute in float32).
        RuntimeError: ``"triton"`` asked for on a device where it cannot run (:func:`device_backend`).
    """
    if backend == "torch":  # runs everywhere
        return backend
    check_backend(backend)
    if tensor.dtype == torch.float64:  # the Triton kernels compute in float32; torch computes float64 in float64
        if backend == "triton":
            raise ValueError("backend='triton' computes in float32; float64 tensors need backend='torch' or 'auto'")
        return "torch"
    return device_backend(backend, tensor.device)


def triton_unusable_reason() -> Optional[str]:
    """Why ``backend="triton"`` cannot run on tensors of any device in this process, when that is known without a
    tensor; None when it may run on some device (then the first hook call checks the bucket's device).

    Known up front: Triton or our kernels cannot be imported; or Triton's interpreter is off (CPU tensors need it)
    and this torch build has no CUDA (no GPU tensors). Does not initialize CUDA (``torch.cuda.is_available()``
    would, which breaks a later ``fork``).
    """
    if not _env.triton_available():
        return _env.triton_unavailable_reason(torch.device("cpu"))  # not installed, or older than the tested floor
    error = _kernel_import_error()
    if error is not None:
        return f"powersgd_triton.ops.kernels cannot be imported ({error})"
    if _env.interpreter_enabled() or torch.backends.cuda.is_built():
        return None
    return (
        "this torch build has no CUDA, and CPU tensors need TRITON_INTERPRET=1 set before triton is imported "
        "(Triton's interpreter, slow)"
    )


class TorchSteps:
    """The numeric steps of one bucket on the torch backend (:mod:`powersgd_triton.ops.reference`): what a bucket's
    memory holds as ``mem.steps`` when its bucket runs on torch (CPU, float64, no Triton). Each method is the
    checked :mod:`powersgd_triton.ops` function of the same name with ``backend="torch"``: same arguments (without
    ``backend`` and ``config``), same shapes, dtypes and errors."""

    __slots__ = ("ops",)
    backend = "torch"

    def __init__(self):
        self.ops = _ops()

    def project(self, buffer, layout, q, p, error=None, *, p2=None, loss_scale=None, packed=None) -> None:
        self.ops.project(buffer, layout, q, p, error, p2=p2, loss_scale=loss_scale, packed=packed, backend="torch")

    def orthogonalize(self, x, layout, which, epsilon=0.0, out=None):
        return self.ops.orthogonalize(x, layout, which, epsilon, out, backend="torch")

    def project_t(self, buffer, layout, p, q, *, error=None, q2=None, loss_scale=None) -> None:
        self.ops.project_t(buffer, layout, p, q, error=error, q2=q2, loss_scale=loss_scale, backend="torch")

    def average(self, factor, layout, which, buffer, unc=None, world_size=1, *, out=None):
        return self.ops.average(factor, layout, which, buffer, unc, world_size, out=out, backend="torch")

    def reconstruct(self, buffer, layout, p, q, scale=1.0, error=None, update_error=None, *, local_p=None,
                    local_q=None, commit=None, orthogonalize_kept=None, loss_scale=None) -> bool:
        return self.ops.reconstruct(buffer, layout, p, q, scale, error, update_error, local_p=local_p,
                                    local_q=local_q, commit=commit, orthogonalize_kept=orthogonalize_kept,
                                    loss_scale=loss_scale, backend="torch")

    def pack_uncompressed(self, buffer, layout, dst) -> None:
        self.ops.pack_uncompressed(buffer, layout, dst, backend="torch")

    def unpack_uncompressed(self, src, layout, buffer, scale=1.0) -> None:
        self.ops.unpack_uncompressed(src, layout, buffer, scale, backend="torch")

    def kept_tensors(self, x, layout, which, out):
        """Device tensors an :meth:`orthogonalize` of these arguments keeps across calls besides ``x`` and ``out``
        (none on torch)."""
        return ()

    def plan_step(self, tensors: tuple, settings: tuple) -> None:
        """No step plan on torch (:meth:`TritonSteps.plan_step`)."""
        return None


class TritonSteps:
    """The numeric steps of one bucket on the Triton backend, with the bucket's kernel configs (``{kernel name:
    config}`` of :func:`powersgd_triton.autotune.configs_for_layout`): ``mem.steps`` of a bucket that runs on
    Triton. One launch per step for the whole bucket (project_t and orthogonalize: two when their plan splits a tall
    matrix over rows).

    The methods call the launchers themselves, unchecked: the hooks' tensors are the state's own (the bucket buffer
    is matched to its layout every step by :func:`powersgd_triton.state.buckets.prepare_bucket`, P/Q/error memory is
    allocated for that layout or checked when loaded), whereas :mod:`powersgd_triton.ops` checks every tensor of
    every call (a dozen Python calls per launch). Same arguments, results and launches as ``ops``' Triton branch
    (``tests/hooks/test_hooks_launches.py``, ``tests/ops/test_direct_launch.py``)."""

    __slots__ = ("configs", "k", "flags_type", "facts", "plan")
    backend = "triton"

    def __init__(self, configs: Optional[dict] = None):
        self.configs = configs if configs is not None else {}
        # the launch trust key of the hook steps on this memory (powersgd_triton.hooks.driver.launch_trust)
        self.facts = None
        self.plan = None  # the last step plan (plan_step)
        # the ops package: each launcher is looked up per call in its step module (tests patch it there)
        self.k = _kernels()
        self.flags_type = _ops().StepFlags

    def project(self, buffer, layout, q, p, error=None, *, p2=None, loss_scale=None, packed=None) -> None:
        self.k.projection.project(buffer, layout, q, p, error, p2=p2,
                                  loss_scale=loss_scale if error is not None else None, packed=packed,
                                  config=self.configs.get("project"))

    def orthogonalize(self, x, layout, which, epsilon=0.0, out=None):
        out = x if out is None else out
        self.k.orthogonalization.orthogonalize(x, layout, which, float(epsilon), out,
                                               config=self.configs.get("orthogonalize"))
        return out

    def project_t(self, buffer, layout, p, q, *, error=None, q2=None, loss_scale=None) -> None:
        self.k.projection_t.project_t(buffer, layout, p, q, error=error, q2=q2,
                                      loss_scale=loss_scale if error is not None and layout.batched else None,
                                      config=self.configs.get("project_t"))

    def average(self, factor, layout, which, buffer, unc=None, world_size=1, *, out=None):
        flags, first = self.k.segments.average(factor, layout, which, buffer, unc, world_size, out)
        return self.flags_type(which, flags=flags, first=first)

    def reconstruct(self, buffer, layout, p, q, scale=1.0, error=None, update_error=None, *, local_p=None,
                    local_q=None, commit=None, orthogonalize_kept=None, loss_scale=None) -> bool:
        """``update_error``: the :class:`~powersgd_triton.ops.StepFlags` of :meth:`average`, or None; returns False
        (the kept factor's orthogonalization is the caller's)."""
        flags = first = None
        if update_error is not None:
            flags, first = update_error.flags, update_error.first
        self.k.reconstruction.reconstruct(buffer, layout, p, q, float(scale), error, flags, local_p=local_p,
                                          local_q=local_q, commit=commit, first=first,
                                          loss_scale=loss_scale if error is not None else None,
                                          config=self.configs.get("reconstruct"))
        return False

    def pack_uncompressed(self, buffer, layout, dst) -> None:
        if layout.uncompressed_numel:
            self.k.segments.copy_segments(buffer, dst, layout, to_packed=True)

    def unpack_uncompressed(self, src, layout, buffer, scale=1.0) -> None:
        if layout.uncompressed_numel:
            self.k.segments.copy_segments(src, buffer, layout, to_packed=False, scale=scale)

    def kept_tensors(self, x, layout, which, out):
        """The device tensors :meth:`orthogonalize` of these arguments keeps with the layout across calls (task
        tables, Gram workspace): a caller running it on a side stream records that stream on them."""
        return self.k.orthogonalization.orthogonalize_kept_tensors(x, layout, which, out,
                                                                   config=self.configs.get("orthogonalize"))


    def plan_step(self, tensors: tuple, settings: tuple) -> "StepPlan":
        """The launches of a layer-wise or batched hook step (``powersgd_triton.hooks.layerwise``) on this memory,
        bound once: a :class:`StepPlan` of ``tensors = (buffer, layout, q, q_work, p, p_raw, p_send, q_raw,
        error)`` and ``settings = (epsilon, world_size, packed, flags, commit)`` (``packed``: the uncompressed
        gradients are packed; ``flags``: reconstruct updates the memory where the step is finite; ``commit``: it
        keeps Q in ``q``), without a loss scale. The last plan is kept and returned while the same tensor objects
        (``is``) and equal settings come; another call builds a new one. Its launches and their arguments are
        exactly those of this object's methods called by the hook with the same tensors (the launchers' ``*_bound``
        forms build them with the launchers' own code)."""
        plan = self.plan
        if plan is not None and plan.settings == settings and all(map(operator.is_, plan.tensors, tensors)):
            return plan
        self.plan = plan = StepPlan(self, tensors, settings)
        return plan


class StepPlan:
    """The bound launches of one hook step (:meth:`TritonSteps.plan_step`): ``orth_q()`` (``q_work <-
    orthogonalize(q)``), ``project()`` (P into ``p_send``; ``project(packed)`` when the step packs: the same launch
    packs the uncompressed gradients into ``packed``), ``orth_p()`` (``p <-
    orthogonalize(p_raw)``), ``project_t()`` (Q into ``q_raw``), ``average(packed or None) -> flags``
    (``q_raw / world`` into ``q_work``, the uncompressed gradients, the step flags), ``reconstruct(flags)``
    (output, error, the committed Q; ``flags`` None without memory updates)."""

    __slots__ = ("tensors", "settings", "orth_q", "project", "orth_p", "project_t", "average", "reconstruct")

    def __init__(self, steps: TritonSteps, tensors: tuple, settings: tuple):
        self.tensors, self.settings = tensors, settings
        buffer, layout, q, q_work, p, p_raw, p_send, q_raw, error = tensors
        epsilon, world_size, packed, flags, commit = settings
        k, cfg = steps.k, steps.configs
        self.orth_q = k.orthogonalization.orthogonalize_bound(q, layout, "q", float(epsilon), q_work,
                                                              config=cfg.get("orthogonalize"))
        self.project = k.projection.project_bound(buffer, layout, q_work, p_send, error,
                                                  packed=bool(packed) and layout.uncompressed_numel > 0,
                                                  config=cfg.get("project"))
        self.orth_p = k.orthogonalization.orthogonalize_bound(p_raw, layout, "p", float(epsilon), p,
                                                              config=cfg.get("orthogonalize"))
        self.project_t = k.projection_t.project_t_bound(buffer, layout, p, q_raw,
                                                        error=error if layout.batched else None,
                                                        config=cfg.get("project_t"))
        self.average, n_flags, first = k.segments.average_bound(q_raw, layout, "q", buffer, bool(packed),
                                                                world_size, None if q_raw is q_work else q_work)
        self.reconstruct = k.reconstruction.reconstruct_bound(
            buffer, layout, p, q_work, 1.0, error, n_flags if flags else None, first if flags else None,
            commit=("q", q) if commit else None, config=cfg.get("reconstruct"))


def steps_for(backend: str, configs: Optional[dict] = None):
    """The steps object of a bucket memory: :class:`TritonSteps` (with ``configs``) for ``"triton"``, else
    :class:`TorchSteps`."""
    return TritonSteps(configs) if backend == "triton" else TorchSteps()


def _ops():
    """:mod:`powersgd_triton.ops` (the checked functions; imported at first use: it imports this module)."""
    from powersgd_triton import ops

    return ops


def _kernels():
    """The Triton launchers (imported at first use: triton is optional on CPU)."""
    return _ops()._kernels()
