"""``PowerSGDState``: the hyper-parameters and per-bucket memory of the PowerSGD DDP hooks.

Drop-in for ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState``: the same constructor
arguments and defaults (plus ``backend``), the same public attributes (``process_group``, ``iter``,
``total_numel_before_compression``, ``compression_stats()``, ...), the same validation, and the same random
numbers for the initial Q (a ``numpy.random.RandomState(random_seed)`` seeds a forked CPU torch RNG), so that our
hooks reproduce PyTorch's outputs.

Per bucket index the state keeps a :class:`BucketMemory`:

* ``layout``: the :class:`~powersgd_triton.layout.BucketLayout` of the bucket, built once on its first compressed
  step and re-checked on every step, with the bucket's parameters (``params``, checked by identity); a bucket that
  no longer matches it (DDP rebuilt its buckets, another model, a dtype swapped in by ``fp16_compress_wrapper``) gets
  a new layout, and its memory follows its parameters matrix by matrix (exact: a fresh DDP after a resume orders
  its first buckets differently, then rebuilds them); what cannot follow is reset with a warning;
* ``error``: float32 error-feedback memory of the *compressed* gradients only (``layout.e_numel``); the error of an
  uncompressed gradient cancels in the average, PyTorch stores it anyway (a full copy of the bucket); float64 for a
  float64 bucket, like ``p`` and ``q`` (such a bucket is computed in float64, on the torch backend);
* ``p``: float32 ``P`` (``layout.p_numel``), ``q``: float32 warm-start ``Q`` (``layout.q_numel``), stored as
  ``Q / world_size`` like PyTorch's ``q_memory_dict`` (all-reduced in ``communication_dtype``, default the
  bucket's dtype, through a transient cast; the error is in unscaled units with a ``grad_scaler``); ``q_work``: the Q of the step in flight, committed to ``q``
  only when the step's all-reduced values are finite (no host sync);
* for :func:`~powersgd_triton.alternating_powerSGD_hook`: ``p`` / ``q`` are the kept factors (the averaged P of
  the last P step, the averaged Q of the last Q step or the initial random Q), ``error`` the local residual, and
  ``phase`` (``"p"`` or ``"q"``) the half-step the bucket takes next; its communication buffers are transient.

Persistence: :meth:`PowerSGDState.state_dict` holds only tensors and plain Python types (``torch.load(...,
weights_only=True)`` reads it); pickling goes through it too. The process group is never saved: a loaded or
unpickled state uses ``process_group=None``, resolved to the default (WORLD) group when a hook runs, so a state can
be created and unpickled before ``init_process_group`` (Lightning's spawn strategy pickles it then). Once the state
knows the model's parameter names (:func:`powersgd_triton.integrations.register`, the framework integrations, or
:mod:`powersgd_triton.checkpoint`; or, when none of these named them, the module of the DistributedDataParallel
the state is registered on, found when names are needed: see :meth:`PowerSGDState._name_params`), the state dict
records which parameter each saved matrix belongs to, and loaded memory follows its parameters into the buckets of a
fresh DDP, whose first buckets hold them in registration order, not in the gradient-ready order of the trained DDP's
rebuilt buckets. So PyTorch's own recipe (``state_dict()`` or pickling; a fresh DDP;
``register_comm_hook(loaded_state, hook)``) resumes exactly. The batched hook's memory follows a whole bucket whose
parameters are the same in another order (``order_params`` / ``order``). Memory without names is adopted only by a
bucket with the layout it was saved for (gradient offsets, shapes, dtype), else reset with a warning.
:meth:`PowerSGDState.load_state_dict` checks every tensor against the layout it describes (shape, dtype, finite
values) before it changes anything. The error memory is per rank: save one file per rank
(:func:`powersgd_triton.checkpoint.save_hook_state`); a state saved with another world size is reset with a warning
(refused by ``load_hook_state``).
"""

import logging
import math
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from . import _env, _state_dict
from .layout import BucketLayout

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "torch")
_STATE_DICT_VERSION = 1
_HYPERPARAMETERS = (
    "matrix_approximation_rank",
    "start_powerSGD_iter",
    "min_compression_rate",
    "use_error_feedback",
    "warm_start",
    "orthogonalization_epsilon",
    "random_seed",
    "compression_stats_logging_frequency",
    "batch_tensors_with_same_shape",
    "backend",
    "autotune",
    "communication_dtype",
)
# dtypes P and Q may be all-reduced in (``communication_dtype``); saved by name in the state dict
COMMUNICATION_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                        "float64": torch.float64}


class BucketMemory:
    """Everything the state keeps for one bucket index (see the module docstring)."""

    __slots__ = (
        "layout", "signature", "backend", "configs", "error", "p", "q", "q_work", "q_initialized",
        "phase", "comm", "local", "p_work",
        "params", "param_names", "matrices", "strict", "verified", "order", "order_params", "shapes",
    )

    def __init__(self):
        self.layout: Optional[BucketLayout] = None
        self.signature: Optional[str] = None  # repr(layout.signature); kept when the layout is not (after a load)
        # The bucket's parameters (``bucket.parameters()``, nn.Parameter objects) when the layout was built; None for
        # duck-typed buckets whose parameters are not nn.Parameters. Keys of the per-parameter memory migration.
        self.params: Optional[Tuple[torch.Tensor, ...]] = None
        # What the last full layout check passed with, for real DDP buckets (``params`` not None): the buffer's
        # ``(data_ptr, numel, dtype)``, the rank, min_compression_rate and the parameters' shapes. The same parameter
        # objects with the same shapes in the same order in the same buffer have the same gradient views (DDP places
        # them by the parameters' order and shapes), so the next calls skip the per-gradient check while this key
        # holds. (Shapes too: a parameter reshaped in place, ``w.data = w.data.reshape(...)``, then a new DDP whose
        # bucket buffer reuses the old address, keeps the objects, the numel and the pointer.)
        self.verified: Optional[tuple] = None
        # Loaded, not yet adopted memory only: parameter names per gradient (None where unknown), and the packing
        # table ``(grad_index, n, m, rank, p_offset, q_offset, e_offset)`` per compressed matrix.
        self.param_names: Optional[Tuple[Optional[str], ...]] = None
        self.matrices: Optional[List[Tuple[int, ...]]] = None
        self.strict: bool = False  # loaded with strict checks (powersgd_triton.checkpoint.load_hook_state)
        # Batched hook only: the bucket's parameters in the order its memory was built for (the flat s x s matrix is
        # their gradients back to back), None when unknown; `order`: (offset, numel) of each of their gradients in
        # the live bucket buffer, in that order, when the live bucket holds them in another order (a fresh DDP's
        # first buckets), else None; `shapes`: loaded, not yet adopted memory only, their gradient shapes.
        self.order_params: Optional[Tuple[torch.Tensor, ...]] = None
        self.order: Optional[List[Tuple[int, int]]] = None
        self.shapes: Optional[Tuple[Tuple[int, ...], ...]] = None
        self.backend: str = "torch"  # resolved backend for this bucket's device
        self.configs: Dict[str, Optional[dict]] = {}
        self.error: Optional[torch.Tensor] = None
        self.p: Optional[torch.Tensor] = None
        self.q: Optional[torch.Tensor] = None
        self.q_work: Optional[torch.Tensor] = None
        self.q_initialized: bool = False
        # Alternating hook only (see powersgd_triton.alternating): the half-step the next compressed call takes
        # ("p" or "q"; saved), and three transient float32 buffers allocated on its first call (not saved):
        # `comm` (factor + uncompressed gradients, the one all-reduced buffer), `local` (this rank's factor, for
        # the local-residual error) and `p_work` (the orthogonalized kept P of a Q step; a P step orthogonalizes
        # the kept Q into `q_work`).
        self.phase: str = "p"
        self.comm: Optional[torch.Tensor] = None
        self.local: Optional[torch.Tensor] = None
        self.p_work: Optional[torch.Tensor] = None

    def config(self, kernel: str) -> Optional[dict]:
        return self.configs.get(kernel)

    def nbytes(self) -> int:
        """Persistent bytes held for this bucket (error, P, Q, work and communication buffers)."""
        tensors = (self.error, self.p, self.q, self.q_work, self.comm, self.local, self.p_work)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _check_number(name: str, value: Any, *, integer: bool = False) -> None:
    """``ValueError`` unless ``value`` is an integer (``integer``) or a finite real number: NaN and +-inf are refused
    (an infinite ``orthogonalization_epsilon`` would make every compressed gradient zero)."""
    kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"`{name}` must be {kind}, got {value!r}")
    if isinstance(value, (float, np.floating)) and not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number, got {value!r}")


def _check_communication_dtype(value: Any) -> Optional[torch.dtype]:
    """None or one of :data:`COMMUNICATION_DTYPES` (a dtype, or its name: the state dict saves the name)."""
    if value is None:
        return None
    if isinstance(value, str):
        name = value.replace("torch.", "")
        if name in COMMUNICATION_DTYPES:
            return COMMUNICATION_DTYPES[name]
    elif value in COMMUNICATION_DTYPES.values():
        return value
    raise ValueError(
        f"`communication_dtype` must be None (the bucket's dtype), torch.float32, torch.float16 or torch.bfloat16, "
        f"got {value!r}"
    )


def _check_grad_scaler(scaler: Any) -> None:
    """None or a ``torch.amp.GradScaler`` (``torch.cuda.amp.GradScaler`` is a subclass)."""
    if scaler is None:
        return
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"`grad_scaler` must be None or a torch.amp.GradScaler, got "
            f"{type(scaler).__module__}.{type(scaler).__qualname__}"
        )


def _check_flag(name: str, value: Any) -> None:
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer)) and value in (0, 1)):
        return
    raise ValueError(f"`{name}` must be a bool, got {value!r}")


def _check_process_group(group: Any) -> None:
    """None (the default group, resolved when a hook runs) or a ProcessGroup; anything else fails only at the first
    backward otherwise, inside DDP."""
    if group is None:
        return
    import torch.distributed as dist

    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return
    raise TypeError(
        f"`process_group` must be None (the default group) or a torch.distributed.ProcessGroup, got "
        f"{type(group).__module__}.{type(group).__qualname__}"
    )


def _resolve_backend(backend: str, buffer: torch.Tensor) -> str:
    """The backend that runs this bucket: ``"auto"`` -> Triton where it can run (and is installed), else torch."""
    if backend == "torch":
        return "torch"
    can_run = _env.triton_can_run(buffer.device)
    have_kernels = False
    if can_run:
        try:
            from .kernels import triton_ops  # noqa: F401

            have_kernels = True
        except ImportError:
            have_kernels = False
    if backend == "auto":
        return "triton" if (can_run and have_kernels) else "torch"
    # backend == "triton"
    if not can_run:
        raise RuntimeError(
            f"backend='triton' cannot run on {buffer.device} tensors here: "
            + _env.triton_unavailable_reason(buffer.device)
        )
    if not have_kernels:
        raise RuntimeError("backend='triton': powersgd_triton.kernels.triton_ops cannot be imported")
    return "triton"


def _triton_unusable_reason() -> Optional[str]:
    """Why ``backend="triton"`` cannot run on tensors of any device in this process, when that is known without a
    tensor; None when it may run on some device (then the first hook call checks the bucket's device).

    Known up front: Triton or our kernels cannot be imported; or Triton's interpreter is off (CPU tensors need it)
    and this torch build has no CUDA (no GPU tensors). Does not initialize CUDA (``torch.cuda.is_available()``
    would, which breaks a later ``fork``).
    """
    if not _env.triton_available():
        return _env.triton_unavailable_reason(torch.device("cpu"))  # not installed, or older than the tested floor
    try:
        from .kernels import triton_ops  # noqa: F401
    except ImportError as exc:
        return f"powersgd_triton.kernels.triton_ops cannot be imported ({exc})"
    if _env.interpreter_enabled() or torch.backends.cuda.is_built():
        return None
    return (
        "this torch build has no CUDA, and CPU tensors need TRITON_INTERPRET=1 set before triton is imported "
        "(Triton's interpreter, slow)"
    )


def _bucket_params(bucket) -> Optional[Tuple[torch.Tensor, ...]]:
    """``bucket.parameters()`` when they are ``nn.Parameter`` objects (a real DDP bucket), else None."""
    try:
        params = tuple(bucket.parameters())
    except Exception:  # noqa: BLE001 - duck-typed buckets
        return None
    if not params or not all(isinstance(p, torch.nn.Parameter) for p in params):
        return None
    return params


def _registered_module(state, params) -> Optional[torch.nn.Module]:
    """The module of the DistributedDataParallel that ``state`` is registered on as a comm hook state (DDP keeps the
    ``(hook, state)`` pairs of ``register_comm_hook`` in ``_comm_hooks``) and that holds ``params``; None when there
    is not exactly one (a state registered on an old DDP and on a fresh one is resolved by the parameters)."""
    import gc

    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    classes, todo = set(), [DistributedDataParallel]
    while todo:  # DDP and its subclasses: a set lookup per object is several times cheaper than issubclass
        cls = todo.pop()
        if cls not in classes:
            classes.add(cls)
            todo.extend(cls.__subclasses__())
    found = []
    for obj in gc.get_objects():
        if type(obj) in classes:
            hooks = obj.__dict__.get("_comm_hooks") or ()
            if any(isinstance(h, tuple) and len(h) == 2 and h[1] is state for h in hooks):
                found.append(obj.module)
    wanted = {id(p) for p in params}
    found = [m for m in found if wanted <= {id(p) for p in m.parameters()}]
    return found[0] if len(found) == 1 else None


def _segments(buffer: torch.Tensor, params, gradients) -> Optional[Dict[int, Tuple[int, int]]]:
    """``id(param) -> (offset, numel)`` of each gradient in the bucket buffer when the gradients lie back to back
    and fill it (as DDP's bucket views do); else None."""
    if params is None or gradients is None or len(params) != len(gradients):
        return None
    from .layout import _matrix_segment

    out: Dict[int, Tuple[int, int]] = {}
    pos = 0
    for p, g in zip(params, gradients):
        numel = g.numel()
        if numel:
            off = _matrix_segment(g, buffer)
            if off != pos:
                return None
        out[id(p)] = (pos, numel)
        pos += numel
    return out if pos == buffer.numel() and len(out) == len(params) else None


def _same_params(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class PowerSGDState:
    r"""Hyper-parameters and per-bucket state of :func:`~powersgd_triton.powerSGD_hook`,
    :func:`~powersgd_triton.batched_powerSGD_hook` and :func:`~powersgd_triton.alternating_powerSGD_hook` (one
    state serves one hook).

    Same arguments and defaults as PyTorch's ``PowerSGDState`` (see its documentation for tuning advice), plus:

    Args:
        backend: ``"auto"`` (Triton kernels for CUDA tensors, and for CPU tensors under ``TRITON_INTERPRET=1``;
            torch otherwise), ``"triton"`` or ``"torch"``.
        autotune: time the kernels' candidate block sizes on this GPU the first time a bucket shape class is seen
            (seconds, once; cached per GPU model on disk) instead of using shipped/cached configs or the heuristic.
            Group rank 0 decides for every rank.
        communication_dtype: the dtype P and Q are all-reduced in. ``None`` (default): the bucket's dtype, as
            PyTorch's hook (an fp16/bf16 bucket under ``fp16_compress_wrapper`` / ``bf16_compress_wrapper`` sends
            half-precision factors; an fp32 bucket fp32 ones). ``torch.float16`` or ``torch.bfloat16`` also for fp32
            buckets: half the compressed bytes (accuracy cost: README, "Communication dtype"). ``torch.float32``:
            always fp32 factors. The arithmetic stays float32 in the kernels and the memory (error, warm-start Q,
            P) stays float32: the packed P (and Q) buffer is cast once before its all-reduce and copied back once
            after it. The cast rounds to nearest; a value beyond the dtype's range becomes inf (never a finite
            wrong value), so the step is non-finite and skipped by GradScaler, its memory kept. The uncompressed
            gradients travel in the bucket's dtype (the alternating hook's single buffer: in this dtype too).
        grad_scaler: a ``torch.amp.GradScaler`` (or None). With it, the error memory is kept in unscaled units: the
            hook reads the loss scale ``s`` from the scaler's scale tensor (a one-element float32 device tensor; no
            host synchronization), adds ``s·E`` to the (scaled) gradients and stores ``(M + s·E − P·Qᵀ) / s``, so a
            change of the scale (GradScaler halves it after an overflow, doubles it after ``growth_interval`` clean
            steps) does not mis-scale the carried-over error (PyTorch's hook, without it: off by the scale ratio
            for the next steps). A disabled scaler, or one that has not scaled a loss yet, counts as scale 1. The
            scaler itself is not saved by :meth:`state_dict` (checkpoint it yourself with ``scaler.state_dict()``);
            the state dict records that the error memory is unscaled, and a state unpickled without its scaler
            must get it back (``state.grad_scaler = scaler``, done by the Lightning and Accelerate integrations).

    Raises:
        ValueError: ``start_powerSGD_iter <= 1`` with error feedback or warm start (DDP rebuilds its buckets after
            the first iteration), ``matrix_approximation_rank < 1``, ``min_compression_rate <= 0``, negative
            ``orthogonalization_epsilon``, an unknown ``backend``; and a value of the wrong type: a number that is
            not one (``"4"``, ``True``) or not finite (NaN, +-inf), an integer argument given a float, a flag (``use_error_feedback``,
            ``warm_start``, ``batch_tensors_with_same_shape``, ``autotune``) that is not a bool (or 0/1); a
            ``communication_dtype`` other than None, float32, float16, bfloat16 (float64 also; for float64 models).
        TypeError: ``process_group`` is neither None nor a ``torch.distributed.ProcessGroup``; ``grad_scaler`` is
            neither None nor a ``torch.amp.GradScaler``.
        RuntimeError: ``backend="triton"`` where the Triton kernels cannot run on any device (Triton or the kernels
            not importable; no CUDA in this torch build and ``TRITON_INTERPRET`` unset). Where it depends on the
            bucket's device, the first hook call raises it (step 0, before anything is changed, also in warm-up).

    ``batch_tensors_with_same_shape`` only changes how the initial random Q is drawn (one ``randn`` per shape group,
    as PyTorch draws it): our kernels always process a whole bucket per launch.

    Differences from PyTorch's state (all deliberate): error memory only for compressed gradients, in float32;
    P and Q kept in float32 (float64 buckets: all three in float64, as PyTorch keeps them), all-reduced in
    ``communication_dtype`` (default the bucket's dtype, PyTorch's); a non-finite step leaves the memory as it was; ``error_dict`` / ``p_memory_dict`` /
    ``q_memory_dict`` are read-only views of the flat per-bucket buffers.
    """

    def __init__(
        self,
        process_group,
        matrix_approximation_rank=1,
        start_powerSGD_iter=1_000,
        min_compression_rate=2,
        use_error_feedback=True,
        warm_start=True,
        orthogonalization_epsilon=0,
        random_seed=0,
        compression_stats_logging_frequency=10_000,
        batch_tensors_with_same_shape: bool = False,
        backend: str = "auto",
        autotune: bool = False,
        communication_dtype: Optional[torch.dtype] = None,
        grad_scaler=None,
    ):
        communication_dtype = _check_communication_dtype(communication_dtype)
        _check_grad_scaler(grad_scaler)
        _check_number("matrix_approximation_rank", matrix_approximation_rank, integer=True)
        if matrix_approximation_rank < 1:
            raise ValueError(f"`matrix_approximation_rank` must be >= 1, got {matrix_approximation_rank}")
        _check_number("start_powerSGD_iter", start_powerSGD_iter, integer=True)
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, "
                "because PowerSGD can only be applied after the first two iterations in DDP "
                f"(got start_powerSGD_iter={start_powerSGD_iter})."
            )
        _check_number("min_compression_rate", min_compression_rate)
        if not min_compression_rate > 0:
            raise ValueError(f"`min_compression_rate` must be > 0, got {min_compression_rate}")
        _check_number("orthogonalization_epsilon", orthogonalization_epsilon)
        if not orthogonalization_epsilon >= 0:
            raise ValueError(f"`orthogonalization_epsilon` must be >= 0, got {orthogonalization_epsilon}")
        _check_number("random_seed", random_seed, integer=True)
        _check_number("compression_stats_logging_frequency", compression_stats_logging_frequency, integer=True)
        if backend not in BACKENDS:
            raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}")
        if backend == "triton":
            reason = _triton_unusable_reason()
            if reason is not None:
                raise RuntimeError(f"backend='triton' cannot run in this process: {reason}; use backend='auto'")
        for name, flag in (("use_error_feedback", use_error_feedback), ("warm_start", warm_start),
                           ("batch_tensors_with_same_shape", batch_tensors_with_same_shape), ("autotune", autotune)):
            _check_flag(name, flag)
        _check_process_group(process_group)

        logger.info(
            "PowerSGD config: matrix_approximation_rank = %s; start_powerSGD_iter = %s; min_compression_rate = %s; "
            "orthogonalization_epsilon = %s; use_error_feedback = %s; warm_start = %s; random_seed = %s; "
            "compression_stats_logging_frequency = %s; batch_tensors_with_same_shape = %s; backend = %s",
            matrix_approximation_rank,
            start_powerSGD_iter,
            min_compression_rate,
            orthogonalization_epsilon,
            use_error_feedback,
            warm_start,
            random_seed,
            compression_stats_logging_frequency,
            batch_tensors_with_same_shape,
            backend,
        )
        self.process_group = process_group
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = int(start_powerSGD_iter)
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.random_seed = int(random_seed)
        self.batch_tensors_with_same_shape = bool(batch_tensors_with_same_shape)
        self.backend = backend
        self.autotune = bool(autotune)
        self.communication_dtype = communication_dtype
        self.grad_scaler = grad_scaler
        # Seeds of the random initial Qs: one draw per (re)initialization, in the same order on every rank.
        self.rng = np.random.RandomState(self.random_seed)
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, int(compression_stats_logging_frequency))
        self.next_stats_report = 0
        self.buckets: Dict[int, BucketMemory] = {}
        # Per-parameter memory migration (see _migrate): names of the bound model's parameters, the memories replaced
        # during the current iteration, and what a loaded state was saved with.
        self._names_by_param: Dict[int, str] = {}
        self._params_by_name: Dict[str, torch.Tensor] = {}
        self._retired: List[BucketMemory] = []
        self._seen: set = set()  # bucket indices prepared in the current iteration
        self._layout_changed = False
        self._world_size: Optional[int] = None
        self._rank: Optional[int] = None
        self._loaded_world_size: Optional[int] = None
        self._loaded_rank: Optional[int] = None
        self._backend_devices: set = set()  # devices where backend="triton" was found to run (checked once each)
        self._unnameable: Dict[int, "weakref.ref"] = {}  # parameters _name_params could not name (not retried)

    # ------------------------------------------------------------------ PyTorch-compatible API
    def maybe_increase_iter(self, bucket) -> None:
        """Count one iteration when the last bucket of a backward pass is processed (as PyTorch does)."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                logger.info("Start to apply PowerSGD after %s iterations.", self.iter)

    def compression_stats(self):
        """``(compress_rate, numel_before_compression, numel_after_compression)``, as PyTorch's state returns."""
        rate = (
            self.total_numel_before_compression / self.total_numel_after_compression
            if self.total_numel_after_compression > 0
            else 0
        )
        return rate, self.total_numel_before_compression, self.total_numel_after_compression

    def _report_compression_stats(self, bucket) -> None:
        if bucket.is_last() and self.iter >= self.next_stats_report:
            rate, before, after = self.compression_stats()
            logger.info(
                "Compression stats: iter %s, total before compression %s, total after compression %s, rate %s",
                self.iter,
                before,
                after,
                rate,
            )
            self.next_stats_report = self.iter + self.compression_stats_logging_frequency

    @property
    def error_dict(self) -> Dict[int, torch.Tensor]:
        """Bucket index -> flat float32 error memory of the compressed gradients (read-only view of the state)."""
        return {i: m.error for i, m in self.buckets.items() if m.error is not None}

    @property
    def p_memory_dict(self) -> Dict[int, torch.Tensor]:
        """Bucket index -> flat float32 P (packed in PyTorch's order)."""
        return {i: m.p for i, m in self.buckets.items() if m.p is not None}

    @property
    def q_memory_dict(self) -> Dict[int, torch.Tensor]:
        """Bucket index -> flat float32 warm-start Q, divided by the world size (PyTorch's order and scale)."""
        return {i: m.q for i, m in self.buckets.items() if m.q is not None}

    # PyTorch's state keeps these constructor arguments as attributes of the same names (not random_seed).
    _TORCH_ARGUMENTS = tuple(h for h in _HYPERPARAMETERS
                             if h not in ("random_seed", "backend", "autotune", "communication_dtype"))

    @classmethod
    def from_torch(cls, torch_state, backend: str = "auto", autotune: bool = False) -> "PowerSGDState":
        """A state with the settings of PyTorch's ``PowerSGDState`` (for swapping only the hook import).

        Copies ``process_group``, ``matrix_approximation_rank``, ``start_powerSGD_iter``, ``min_compression_rate``,
        ``use_error_feedback``, ``warm_start``, ``orthogonalization_epsilon``, ``compression_stats_logging_frequency``,
        ``batch_tensors_with_same_shape``, ``iter`` (the warm-up schedule goes on where it was) and the state of its
        RNG (PyTorch's state keeps no ``random_seed``, only the RNG it seeded): a bucket first compressed after the
        conversion draws the same initial Q as PyTorch's hook would have. ``random_seed`` is recorded as ``None``.
        PyTorch's state is not changed. Memory (error, P, Q) is not carried over: a bucket PyTorch's hook already
        compressed starts again from a fresh random Q, as after a bucket rebuild.

        Args:
            torch_state: a ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState``.
            backend, autotune: as in the constructor.

        Returns:
            A new :class:`PowerSGDState`.

        Raises:
            TypeError: ``torch_state`` lacks one of PyTorch's attributes (it is not PyTorch's state).
            ValueError: a setting this class refuses (the constructor's checks).
        """
        missing = [a for a in ("process_group", "iter", "rng") + cls._TORCH_ARGUMENTS if not hasattr(torch_state, a)]
        if missing:
            raise TypeError(
                f"from_torch needs PyTorch's PowerSGDState; {type(torch_state).__qualname__} lacks {missing}"
            )
        new = cls(
            torch_state.process_group,
            **{a: getattr(torch_state, a) for a in cls._TORCH_ARGUMENTS},
            backend=backend,
            autotune=autotune,
        )
        new.rng.set_state(torch_state.rng.get_state())
        new.random_seed = None
        new.iter = int(torch_state.iter)
        return new

    # ------------------------------------------------------------------ internal, used by the hooks
    def _check_backend_runs(self, buffer: torch.Tensor) -> None:
        """``RuntimeError`` when ``backend="triton"`` cannot run on ``buffer``'s device; checked on every hook call
        from step 0 (warm-up included), so the error comes before training, not at ``start_powerSGD_iter``. Free
        after the first call per device."""
        if self.backend != "triton" or buffer.device in self._backend_devices:
            return
        _resolve_backend("triton", buffer)
        self._backend_devices.add(buffer.device)

    def _wire_dtype(self, buffer: torch.Tensor, factor_dtype: torch.dtype) -> Optional[torch.dtype]:
        """The dtype P and Q of ``buffer``'s bucket are all-reduced in, when it is not ``factor_dtype`` (the
        memory's); None when the factors are all-reduced as they are."""
        wire = self.communication_dtype if self.communication_dtype is not None else buffer.dtype
        return None if wire == factor_dtype else wire

    def _loss_scale(self, buffer: torch.Tensor) -> Optional[torch.Tensor]:
        """The grad scaler's current scale (one-element float32 tensor on ``buffer``'s device, read without a host
        synchronization), or None: no scaler, a disabled one, or one that has not scaled a loss yet (scale 1)."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return None
        _check_grad_scaler(scaler)  # the attribute may have been reassigned
        scale = getattr(scaler, "_scale", None)
        if scale is None:
            return None
        if scale.device != buffer.device:
            scale = scale.to(buffer.device, non_blocking=True)
        return scale.reshape(1)

    def _group(self):
        """The process group the hooks use: ``process_group``, or WORLD when it is None (resolved at call time)."""
        if self.process_group is not None:
            return self.process_group
        import torch.distributed as dist

        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if group is None:
            raise RuntimeError(
                "PowerSGDState.process_group is None and the default process group is not initialized: "
                "call torch.distributed.init_process_group() before training"
            )
        return group

    def _skip_bucket(self, bucket) -> None:
        """A bucket the hook all-reduces as it is after the warm-up (a sparse gradient's): count the iteration and,
        for the last bucket, end it as :meth:`_prepare_bucket` does."""
        self.maybe_increase_iter(bucket)
        if bucket.is_last():
            self._end_of_iteration()

    def _prepare_bucket(self, bucket, buffer: torch.Tensor, batched: bool, group) -> BucketMemory:
        """Memory of this bucket with a layout that matches ``buffer``; (re)built when it does not.

        A bucket matches its memory when it has the same gradient offsets, shapes and dtype (the layout signature)
        and, for real DDP buckets, the same parameters in the same order. When it does not (a fresh DDP instance
        after a resume orders its first buckets differently from the rebuilt ones the state was saved with, then
        rebuilds them), the layer-wise memory follows the parameters (:meth:`_migrate`); what cannot be migrated is
        reset with a warning, or raises ``ValueError`` for a state loaded with strict checks.

        Called from the hook body only (building a layout may run the autotuner's collective on first use).
        """
        index = bucket.index()
        if group is not None:
            self._check_world(group)
        self._seen.add(index)
        mem = self.buckets.get(index)
        rank = self.matrix_approximation_rank
        params = _bucket_params(bucket)
        gradients = None
        if mem is not None and mem.layout is not None and _same_params(mem.params, params):
            layout = mem.layout
            if layout.device == buffer.device:
                if batched:
                    ok = layout.batched and layout.signature == ("batched", buffer.numel(), buffer.dtype, rank)
                else:
                    key = (buffer.data_ptr(), buffer.numel(), buffer.dtype, rank, self.min_compression_rate,
                           tuple(p.shape for p in params) if params is not None else None)
                    ok = params is not None and mem.verified == key
                    if not ok:
                        gradients = bucket.gradients()
                        ok = layout.matches_gradients(buffer, gradients, rank, self.min_compression_rate)
                        mem.verified = key if ok and params is not None else None
                if ok:
                    if bucket.is_last():
                        self._end_of_iteration()
                    return mem
        if gradients is None:
            gradients = bucket.gradients()
        if batched:
            layout = BucketLayout.batched(buffer.numel(), rank, buffer.device, buffer.dtype)
        else:
            layout = BucketLayout.from_gradients(buffer, gradients, rank, self.min_compression_rate)
        signature = repr(layout.signature)
        if any(m.layout is None and m.param_names is not None for m in self.buckets.values()):
            self._name_params(params)  # loaded memory that may have to follow its parameters by name
        segments = _segments(buffer, params, gradients) if batched else None
        if (
            mem is not None
            and mem.layout is None
            and mem.signature == signature
            and self._loaded_names_match(mem, params)
            and (mem.shapes is None or params is None or mem.shapes == tuple(tuple(p.shape) for p in params))
        ):
            self._adopt_loaded(mem, layout, buffer)  # first step after load_state_dict / unpickling
            mem.order_params = params if segments is not None else None
            mem.order = None
        else:
            if batched:
                new = self._follow_batched(layout, params, segments, buffer)
            else:
                new = self._migrate(index, layout, params, buffer)
            if new is None:
                if mem is not None and batched:
                    warnings.warn(
                        f"PowerSGD: bucket {index} of the batched hook holds other parameters than its memory was "
                        "built for (DDP partitioned its buckets differently: a fresh DDP's first buckets after a "
                        "resume with several buckets, or another model); the batched hook's memory spans a whole "
                        "bucket and cannot be split between buckets: resetting its error-feedback and warm-start "
                        "memory (use powerSGD_hook for exact resumes with several buckets)",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                elif mem is not None:
                    warnings.warn(
                        f"PowerSGD: bucket {index} no longer matches the layout its memory was built for "
                        f"(DDP rebuilt its buckets, a different model, or a different gradient dtype); rebuilding it "
                        f"and resetting its error-feedback and warm-start memory. New layout: {layout}",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                new = BucketMemory()
                self._allocate(new, layout, buffer)
                new.order_params = params if segments is not None else None
            if mem is not None:
                self._retired.append(mem)  # other buckets of this iteration may migrate from it
            self.buckets[index] = new
            self._layout_changed = True
            mem = new
        mem.layout = layout
        mem.signature = signature
        mem.params = params
        mem.param_names = None
        mem.matrices = None
        mem.shapes = None
        mem.strict = False
        mem.backend = _resolve_backend(self.backend, buffer)
        if mem.backend == "triton" and buffer.dtype == torch.float64:
            # The Triton kernels compute in float32: a float64 bucket runs on the torch backend, in float64.
            message = (
                f"PowerSGD: bucket {index} holds float64 gradients; the Triton kernels compute in float32, so this "
                "bucket runs on the torch backend, in float64 (error memory, P and Q in float64)"
            )
            if self.backend == "triton":
                warnings.warn(message, RuntimeWarning, stacklevel=3)
            else:
                logger.info(message)
            mem.backend = "torch"
        if mem.backend == "triton":
            from .autotune import configs_for_layout

            mem.configs = configs_for_layout(layout, buffer.dtype, buffer.device, group, autotune=self.autotune)
        else:
            mem.configs = {}
        if bucket.is_last():
            self._end_of_iteration()
        return mem

    # ------------------------------------------------------------------ per-parameter memory migration
    def _name_params(self, params) -> None:
        """Make sure the bound model names ``params`` (a bucket's parameters): when one is unnamed, find the
        DistributedDataParallel this state is registered on and bind its module (:func:`_registered_module`).

        This is what lets PyTorch's own resume recipe (``state_dict()`` or pickling, a fresh DDP,
        ``register_comm_hook(loaded_state, hook)``) keep the memory: the saved state records which parameter each
        matrix belongs to, and the loaded memory follows its parameters into the fresh DDP's buckets, whose order
        differs from the trained DDP's. One scan of the garbage collector's objects, only when names are needed
        and missing, and not again for parameters it could not name.
        """
        if params is None:
            return
        unnamed = [p for p in params if self._param_name(p) is None]
        if not unnamed or all(self._unnameable.get(id(p), lambda: None)() is p for p in unnamed):
            return
        module = _registered_module(self, params)
        if module is not None:
            self._bind_model(module)
        for p in params:
            if self._param_name(p) is None:
                self._unnameable[id(p)] = weakref.ref(p)

    def _follow_batched(self, layout: BucketLayout, params, segments, buffer: torch.Tensor) -> Optional[BucketMemory]:
        """The batched hook's memory for a bucket holding exactly the parameters a memory was built for, in any
        order; None when there is none (the caller resets the bucket, with a warning if it had memory).

        The batched hook compresses the bucket's gradients back to back as one matrix, so its memory belongs to the
        parameters in one order (``order_params``). A fresh DDP holds them in registration order on its first
        iteration and in the saved (gradient-ready) order after it rebuilds its buckets: the memory is kept, with
        ``order`` telling the hook where each gradient lies in the live bucket (it computes on a copy in the
        memory's order, then writes the result back), exact as an uninterrupted run. A bucket that holds other
        parameters than any memory (DDP partitioned several buckets differently) cannot be followed.
        """
        if params is None or segments is None:
            return None
        ids = set(segments)
        signature = repr(layout.signature)
        found = None
        for old in list(self.buckets.values()) + list(self._retired):
            if old.p is None or old.signature != signature:
                continue
            if old.layout is not None:
                order = old.order_params if old.layout.batched else None
            elif old.matrices is None and old.param_names is not None:
                order = tuple(self._params_by_name.get(n) if n is not None else None for n in old.param_names)
                if any(p is None or self._param_name(p) is None for p in order):
                    order = None
                elif old.shapes is not None and old.shapes != tuple(tuple(p.shape) for p in order):
                    order = None
            else:
                order = None
            if order is not None and len(order) == len(ids) and {id(p) for p in order} == ids:
                found = (old, order)
                break
        if found is None:
            return None
        old, order = found
        new = BucketMemory()
        new.error, new.p, new.q = old.error, old.p, old.q
        new.q_initialized, new.phase = old.q_initialized, old.phase
        self._adopt_loaded(new, layout, buffer)  # on the bucket's device and dtype; a fresh q_work
        new.order_params = tuple(order)
        runs = [segments[id(p)] for p in order]
        new.order = None if runs == sorted(runs) else runs
        logger.info("PowerSGD: the batched memory of %s parameters followed them into a bucket in %s order",
                    len(order), "the same" if new.order is None else "another")
        return new

    def _bind_model(self, model) -> None:
        """Remember the names of ``model``'s parameters (a DDP module is unwrapped).

        Lets :meth:`state_dict` record which parameter each saved matrix belongs to, and a loaded memory follow its
        parameters into whatever buckets a fresh DDP instance makes. Used by :mod:`powersgd_triton.integrations`
        and :mod:`powersgd_triton.checkpoint`.
        """
        module = getattr(model, "module", model)
        named = list(module.named_parameters())
        self._params_by_name = {name: p for name, p in named}
        self._names_by_param = {id(p): name for name, p in named}

    def _param_name(self, param: Optional[torch.Tensor]) -> Optional[str]:
        if param is None:
            return None
        name = self._names_by_param.get(id(param))
        if name is not None and self._params_by_name.get(name) is param:
            return name
        return None

    def _loaded_names_match(self, mem: BucketMemory, params) -> bool:
        """A loaded memory with the right signature also has the right parameters (when both sides are named)."""
        if mem.param_names is None or params is None or not self._params_by_name:
            return True
        return tuple(self._param_name(p) for p in params) == tuple(mem.param_names)

    def _sources(self) -> Dict[int, Tuple[BucketMemory, Tuple[int, ...]]]:
        """id(parameter) -> (memory, packing row) of every compressed matrix the state holds memory for.

        Rows are ``(grad_index, n, m, rank, p_offset, q_offset, e_offset)``. Live memories are keyed by their
        parameter objects, loaded ones through the bound model's parameter names.
        """
        found: Dict[int, Tuple[BucketMemory, Tuple[int, ...]]] = {}
        for mem in list(self._retired) + list(self.buckets.values()):
            if mem.p is None:
                continue
            if mem.layout is not None:
                if mem.layout.batched or mem.params is None:
                    continue
                for s in mem.layout.matrices:
                    p = mem.params[s.grad_index]
                    found[id(p)] = (mem, (s.grad_index, s.n, s.m, s.rank, s.p_offset, s.q_offset, s.e_offset))
            elif mem.matrices is not None and mem.param_names is not None:
                for row in mem.matrices:
                    name = mem.param_names[row[0]] if row[0] < len(mem.param_names) else None
                    p = self._params_by_name.get(name) if name is not None else None
                    if p is not None:
                        found[id(p)] = (mem, tuple(row))
        return found

    def _migrate(self, index: int, layout: BucketLayout, params, buffer: torch.Tensor) -> Optional[BucketMemory]:
        """New memory for bucket ``index`` assembled, matrix by matrix, from the memory its parameters had.

        Exact: each compressed matrix keeps its own error memory, P and warm-start Q (PowerSGD treats the matrices of
        a bucket independently; only the packing changes). Returns None when there is nothing to migrate from (a
        bucket seen for the first time) or when some matrix has no memory (the caller resets the bucket with a
        warning); raises ValueError instead when that memory was loaded with strict checks.
        """
        if layout.batched or params is None:
            return None  # the batched view mixes all parameters of a bucket: its memory cannot follow them
        old = self.buckets.get(index)
        if layout.num_matrices == 0:
            # Nothing compressed: no memory to carry, only whether the initial Q seed was consumed. A bucket seen for
            # the first time consumes one, as PyTorch's hook does (the RNG stream stays PyTorch's).
            if old is None:
                return None
            new = BucketMemory()
            self._allocate(new, layout, buffer)
            new.q_initialized = old.q_initialized
            new.phase = old.phase
            return new
        strict = any(m.strict for m in list(self._retired) + list(self.buckets.values()))
        sources = self._sources()
        if not sources:
            if strict:
                raise ValueError(
                    f"PowerSGD: bucket {index} has compressed parameters {self._describe_matrices(layout, params)} "
                    "but the loaded hook state holds no memory for them (the state was saved from another model, "
                    "or with other compression settings)"
                )
            return None
        rows, missing, wrong = [], [], []
        for s in layout.matrices:
            src = sources.get(id(params[s.grad_index]))
            if src is None:
                missing.append(self._param_name(params[s.grad_index]) or f"gradient {s.grad_index}")
                continue
            mem, row = src
            if tuple(row[1:4]) != (s.n, s.m, s.rank):
                name = self._param_name(params[s.grad_index]) or f"gradient {s.grad_index}"
                wrong.append(f"{name}: saved {row[1]}x{row[2]} rank {row[3]}, now {s.n}x{s.m} rank {s.rank}")
                continue
            if self.use_error_feedback and mem.error is None:
                missing.append((self._param_name(params[s.grad_index]) or f"gradient {s.grad_index}") + " (error)")
                continue
            rows.append((s, mem, row))
        phases = sorted({mem.phase for _, mem, _ in rows})
        if len(phases) > 1:  # alternating hook: the matrices of one bucket must take the same half-step next
            wrong.append(f"memory from buckets in different alternating phases {phases}")
        if missing or wrong:
            if strict:
                what = []
                if missing:
                    what.append(f"no saved memory for {missing}")
                if wrong:
                    what.append(f"different matrices: {wrong}")
                raise ValueError(
                    f"PowerSGD: the loaded hook state does not match bucket {index} of this model: " + "; ".join(what)
                )
            return None  # the caller resets the bucket (with a warning if it had memory)
        new = BucketMemory()
        self._allocate(new, layout, buffer)
        initialized = []
        for s, mem, (gi, n, m, r, p_off, q_off, e_off) in rows:
            if new.error is not None:
                new.error[s.e_offset : s.e_offset + s.numel].copy_(mem.error[e_off : e_off + n * m])
            new.p[s.p_offset : s.p_offset + s.n * s.rank].copy_(mem.p[p_off : p_off + n * r])
            new.q[s.q_offset : s.q_offset + s.m * s.rank].copy_(mem.q[q_off : q_off + m * r])
            initialized.append(mem.q_initialized)
        new.q_initialized = all(initialized)
        new.phase = phases[0]
        logger.info("PowerSGD: bucket %s changed layout; its memory followed its %s matrices", index, len(rows))
        return new

    def _end_of_iteration(self) -> None:
        """After the last bucket of an iteration: forget replaced memories, and buckets DDP no longer has.

        A bucket not seen in an iteration where layouts changed is dropped when its parameters now belong to a
        bucket that was seen (DDP rebuilt fewer buckets); memory without known parameters is kept.
        """
        if self._retired:
            self._retired.clear()
        if self._layout_changed:
            live = set()
            for i in self._seen:
                mem = self.buckets.get(i)
                if mem is not None and mem.params is not None:
                    live.update(id(p) for p in mem.params)
            for i in [i for i in self.buckets if i not in self._seen]:
                if self._param_ids(self.buckets[i]) & live:
                    del self.buckets[i]
            self._layout_changed = False
        self._seen.clear()

    def _param_ids(self, mem: BucketMemory) -> set:
        """id() of the parameters a memory belongs to: its own, or those its loaded names resolve to."""
        if mem.params is not None:
            return {id(p) for p in mem.params}
        if mem.param_names is not None:
            return {id(self._params_by_name[n]) for n in mem.param_names if n in self._params_by_name}
        return set()

    def _check_world(self, group) -> None:
        """Record rank and world size; a loaded state from another world size is refused (strict) or reset."""
        import torch.distributed as dist

        if self._world_size is None or self._loaded_world_size is not None:
            self._world_size = dist.get_world_size(group)
            self._rank = dist.get_rank(group)
        if self._loaded_world_size is None:
            return
        saved_ws, saved_rank = self._loaded_world_size, self._loaded_rank
        self._loaded_world_size = self._loaded_rank = None
        loaded = [i for i, m in self.buckets.items() if m.layout is None]
        if not loaded:
            return
        strict = any(self.buckets[i].strict for i in loaded)
        if saved_ws != self._world_size:
            msg = (
                f"PowerSGD: the hook state was saved with world size {saved_ws}, this job has world size "
                f"{self._world_size}; error-feedback memory is per rank and the warm-start Q is scaled by the world "
                "size, so it cannot be reused"
            )
            if strict:
                raise ValueError(msg)
            warnings.warn(msg + ": resetting it", RuntimeWarning, stacklevel=4)
            for i in loaded:
                del self.buckets[i]
        elif saved_rank is not None and saved_rank != self._rank and not strict:
            warnings.warn(
                f"PowerSGD: rank {self._rank} resumes from the hook state of rank {saved_rank}: its error-feedback "
                "memory is another rank's (an approximate resume); save one file per rank with "
                "powersgd_triton.checkpoint.save_hook_state for an exact one",
                RuntimeWarning,
                stacklevel=4,
            )

    def _describe_matrices(self, layout: BucketLayout, params) -> List[str]:
        return [self._param_name(params[s.grad_index]) or f"gradient {s.grad_index}" for s in layout.matrices]

    def _allocate(self, mem: BucketMemory, layout: BucketLayout, buffer: torch.Tensor) -> None:
        f32 = dict(device=buffer.device, dtype=_state_dict.memory_dtype(buffer.dtype))
        mem.error = torch.zeros(layout.e_numel, **f32) if self.use_error_feedback else None
        mem.p = torch.zeros(layout.p_numel, **f32)
        mem.q = torch.zeros(layout.q_numel, **f32)
        mem.q_work = torch.empty(layout.q_numel, **f32)
        mem.q_initialized = False

    def _adopt_loaded(self, mem: BucketMemory, layout: BucketLayout, buffer: torch.Tensor) -> None:
        """Move loaded memory onto the bucket's device; allocate whatever the load did not provide."""
        f32 = dict(device=buffer.device, dtype=_state_dict.memory_dtype(buffer.dtype))

        def fit(t: Optional[torch.Tensor], numel: int, zero: bool) -> torch.Tensor:
            if t is not None and t.numel() == numel:
                return t.to(**f32).contiguous()
            return torch.zeros(numel, **f32) if zero else torch.empty(numel, **f32)

        if self.use_error_feedback:
            mem.error = fit(mem.error, layout.e_numel, True)
        else:
            mem.error = None
        mem.p = fit(mem.p, layout.p_numel, True)
        if mem.q is None or mem.q.numel() != layout.q_numel:
            mem.q_initialized = False
        mem.q = fit(mem.q, layout.q_numel, True)
        mem.q_work = torch.empty(layout.q_numel, **f32)

    def _allocate_alternating(self, mem: BucketMemory, buffer: torch.Tensor) -> None:
        """The alternating hook's transient buffers for ``mem`` (once per layout; after a load, on first use)."""
        layout = mem.layout
        factor = max(layout.p_numel, layout.q_numel)
        f32 = dict(device=buffer.device, dtype=_state_dict.memory_dtype(buffer.dtype))
        numel = factor + layout.uncompressed_numel
        if mem.comm is None or mem.comm.numel() != numel or mem.comm.device != buffer.device or \
                mem.comm.dtype != f32["dtype"]:
            mem.comm = torch.empty(numel, **f32)
            mem.local = torch.empty(factor, **f32) if mem.error is not None else None
            mem.p_work = torch.empty(layout.p_numel, **f32)
        if mem.q_work is None:
            mem.q_work = torch.empty(layout.q_numel, **f32)

    def _draw_q(self, mem: BucketMemory, dtype: torch.dtype) -> None:
        """Fill ``mem.q`` with PyTorch's random initial Q (not yet orthogonalized); consumes one seed of ``rng``.

        PyTorch seeds a forked CPU RNG with ``rng.randint(1_000_000_000)`` and draws ``randn`` in the bucket's dtype
        per compressed matrix (``(1, m, r)``), per shape group (``(B, m, r)``) with
        ``batch_tensors_with_same_shape``, or ``(s, r)`` for the batched hook. The draw happens on the CPU and
        reaches the device in ONE copy. The seed is consumed even when the bucket compresses nothing, as PyTorch does.
        """
        seed = int(self.rng.randint(1_000_000_000))
        layout = mem.layout
        mem.q_initialized = True
        if layout.q_numel == 0:
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            chunks = []
            if layout.batched:
                s = layout.matrices[0]
                chunks.append(torch.randn(s.m, s.rank, device="cpu", dtype=dtype))
            elif self.batch_tensors_with_same_shape:
                for g in layout.groups:
                    chunks.append(torch.randn(g.count, g.m, g.rank, device="cpu", dtype=dtype))
            else:
                for s in layout.matrices:
                    chunks.append(torch.randn(1, s.m, s.rank, device="cpu", dtype=dtype))
        host = torch.cat([c.reshape(-1) for c in chunks]).to(mem.q.dtype)
        mem.q.copy_(host)

    # ------------------------------------------------------------------ persistence
    def _config(self) -> Dict[str, Any]:
        """The hyper-parameters as plain Python values (``communication_dtype`` by name, e.g. ``"bfloat16"``)."""
        out = {name: getattr(self, name) for name in _HYPERPARAMETERS}
        if out["communication_dtype"] is not None:
            out["communication_dtype"] = str(out["communication_dtype"]).replace("torch.", "")
        return out

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to resume exactly: iteration counter, statistics, RNG, per-bucket memory.

        Only tensors and plain Python types (``torch.load(..., weights_only=True)`` reads it); the tensors are the
        state's own (not copies), on their devices, like ``nn.Module.state_dict()``. Error memory is per rank: save
        every rank's state to resume exactly. The process group is not saved.
        """
        name, keys, pos, has_gauss, cached = self.rng.get_state()
        buckets = {}
        for index, mem in self.buckets.items():
            shapes = None
            if mem.layout is not None:
                # the parameters the memory belongs to, in its order (the batched hook's may differ from the bucket's)
                params = mem.order_params if mem.layout.batched else mem.params
                self._name_params(params)
                names = None
                if params is not None and self._params_by_name:
                    names = [self._param_name(p) for p in params]
                matrices = None
                if not mem.layout.batched:
                    matrices = [
                        [s.grad_index, s.n, s.m, s.rank, s.p_offset, s.q_offset, s.e_offset] for s in mem.layout.matrices
                    ]
                elif params is not None:
                    shapes = [list(p.shape) for p in params]
            else:  # loaded, not adopted yet: pass through what was loaded
                names = None if mem.param_names is None else list(mem.param_names)
                matrices = None if mem.matrices is None else [list(r) for r in mem.matrices]
                shapes = None if mem.shapes is None else [list(x) for x in mem.shapes]
            buckets[int(index)] = {
                "signature": mem.signature,
                "error": None if mem.error is None else mem.error.detach(),
                "p": None if mem.p is None else mem.p.detach(),
                "q": None if mem.q is None else mem.q.detach(),
                "q_initialized": bool(mem.q_initialized),
                "phase": mem.phase,
                # which parameter each gradient of the bucket is (names of the bound model; None: unknown) and
                # where each compressed matrix's memory lies: lets the memory follow its parameters on resume
                "param_names": names,
                "matrices": matrices,
                # batched hook: the gradient shapes its memory was built for, in order (a memory without names is
                # adopted only by a bucket with these shapes in this order)
                "shapes": shapes,
            }
        return {
            "version": _STATE_DICT_VERSION,
            "config": {k: (v if not isinstance(v, np.generic) else v.item()) for k, v in self._config().items()},
            "iter": int(self.iter),
            "total_numel_before_compression": int(self.total_numel_before_compression),
            "total_numel_after_compression": int(self.total_numel_after_compression),
            "next_stats_report": int(self.next_stats_report),
            # the process group the memory was built in (None before the first compressed step)
            "world_size": self._world_size if self._loaded_world_size is None else self._loaded_world_size,
            "rank": self._rank if self._loaded_rank is None else self._loaded_rank,
            # error memory in unscaled units (a grad_scaler was given); the scaler itself is the user's to save
            "unscaled_error": self.grad_scaler is not None,
            "rng": {
                "name": str(name),
                "keys": [int(k) for k in keys],
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "buckets": buckets,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (the hyper-parameters stay the constructor's).

        Every entry is checked first (:func:`powersgd_triton._state_dict.check_state_dict`): each bucket's error,
        P and Q against the layout its signature describes (shape, dtype, every value finite), its packing table,
        parameter names, phase; the RNG state and the counters. Nothing is changed unless all of it is valid.

        The loaded memory is adopted on each bucket's next compressed step if the bucket still has the layout it
        was saved with, or follows its parameters into the buckets of a fresh DDP (when the saved state knows their
        names); else it is reset, with a warning. Tensors are copied, and moved to the bucket's device then.

        Raises:
            TypeError: ``state_dict`` is not a dict.
            ValueError: a state dict of another format version; a missing or malformed field; a bucket tensor of
                the wrong shape or dtype, or holding NaN/inf (named: bucket index and key).
        """
        self._load(state_dict, warn_units=True)

    def _load(self, state_dict: Dict[str, Any], warn_units: bool) -> None:
        checked = _state_dict.check_state_dict(state_dict, _STATE_DICT_VERSION)
        saved = checked["config"]
        mine = self._config()
        differing = sorted(
            k for k, v in saved.items()
            if k in _HYPERPARAMETERS and mine[k] != v
            and not (k == "random_seed" and None in (v, self.random_seed))  # from_torch: the RNG state is what counts
        )
        if differing:
            warnings.warn(
                "PowerSGDState.load_state_dict: hyper-parameters differ from the saved state "
                f"({', '.join(differing)}); keeping this state's values",
                RuntimeWarning,
                stacklevel=3,
            )
        if warn_units and checked["unscaled_error"] != (self.grad_scaler is not None) and checked["buckets"]:
            saved_units = "unscaled (saved with a grad_scaler)" if checked["unscaled_error"] else "loss-scaled"
            warnings.warn(
                f"PowerSGDState.load_state_dict: the saved error memory is {saved_units}, this state "
                f"{'has a' if self.grad_scaler is not None else 'has no'} grad_scaler: the carried-over error is off by "
                "the loss scale until it decays; give the state the same grad_scaler setting as the saved one",
                RuntimeWarning,
                stacklevel=3,
            )
        self.rng.set_state(checked["rng"])
        self.iter = checked["iter"]
        self.total_numel_before_compression = checked["total_numel_before_compression"]
        self.total_numel_after_compression = checked["total_numel_after_compression"]
        self.next_stats_report = checked["next_stats_report"]
        self.buckets = {}
        self._retired = []
        self._seen = set()
        self._layout_changed = False
        self._loaded_world_size = checked["world_size"]
        self._loaded_rank = checked["rank"]
        for index, entry in checked["buckets"].items():
            mem = BucketMemory()
            mem.signature = entry["signature"]
            mem.param_names = entry["param_names"]
            mem.matrices = entry["matrices"]
            mem.shapes = entry["shapes"]
            mem.error, mem.p, mem.q = entry["error"], entry["p"], entry["q"]
            mem.q_initialized = entry["q_initialized"]
            mem.phase = entry["phase"]
            self.buckets[index] = mem

    def __getstate__(self) -> Dict[str, Any]:
        """Pickle everything but the process group (see :meth:`state_dict`)."""
        logger.info("NOTE: Process group is not serializable and excluded from a saved state.")
        return {"config": self._config(), "state": self.state_dict()}

    def __setstate__(self, pickled: Dict[str, Any]) -> None:
        """Restore a pickled state; the process group becomes None (the default group, resolved when a hook runs).

        Works before ``init_process_group``.
        """
        config = dict(pickled["config"])
        seed = config["random_seed"]  # None for a state made by from_torch: its RNG state comes with the state dict
        PowerSGDState.__init__(self, None, **{**config, "random_seed": 0 if seed is None else seed})
        self.random_seed = seed
        # the scaler is not pickled (it is the training loop's object): set state.grad_scaler again after unpickling
        self._load(pickled["state"], warn_units=False)
        logger.info(
            "NOTE: Process group will be set to the default group (i.e. the world size) when the hook runs. "
            "If a different group is desired, please set `self.process_group` after PowerSGD state is loaded."
        )

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in _HYPERPARAMETERS)
        return f"PowerSGDState({args}, iter={self.iter}, buckets={len(self.buckets)})"
