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
  bucket's dtype: on the torch backend through a transient cast, on the Triton backend in ``p_comm`` / ``q_comm``
  below, which the kernels write in that dtype; the error is in unscaled units with a ``grad_scaler``); ``q_work``:
  the Q of the step in flight, committed to ``q``
  only when the step's all-reduced values are finite (no host sync), and with warm start, between steps, the
  next step's Q orthogonalized ahead; ``p_work``: the P of the step in flight, all-reduced there and orthogonalized
  into ``p`` (from ``p_comm`` on the Triton backend: one copy); ``p_comm`` / ``q_comm``: on the Triton backend when
  the communication dtype is not float32, P and Q of the step in flight in that dtype, all-reduced there (no work
  buffer is saved);
* for a hook of half-steps (one factor all-reduced per step; :data:`powersgd_triton.variants.VARIANTS`): ``p`` /
  ``q`` are the kept factors (the averaged P of the last P step, the averaged Q of the last Q step or the initial
  random Q), ``error`` the local residual, and ``phase`` (``"p"`` or ``"q"``) the half-step the bucket takes next;
  its communication buffers (``comm``, ``local``) are transient.

Persistence: :meth:`PowerSGDState.state_dict` holds only tensors and plain Python types (``torch.load(...,
weights_only=True)`` reads it); pickling goes through it too. The process group is never saved: a loaded or
unpickled state uses ``process_group=None``, resolved to the default (WORLD) group when a hook runs, so a state can
be created and unpickled before ``init_process_group`` (Lightning's spawn strategy pickles it then). Once the state
knows the model's parameter names (:func:`powersgd_triton.integrations.register`, the framework integrations, or
:mod:`powersgd_triton.checkpoint`; or, when none of these named them, the module of the DistributedDataParallel
the state is registered on, found when names are needed: see :func:`powersgd_triton.state.buckets.name_params`), the state dict
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

Where the code lives, one responsibility each: this module holds the settings, their validation and the public
methods (PyTorch's API, ``from_torch``, ``state_dict`` / ``load_state_dict``, pickling);
:mod:`powersgd_triton.state.memory` what is kept per bucket (``state.buckets``) and how it is allocated;
:mod:`powersgd_triton.state.buckets` matching that memory to DDP's buckets (layout checks, migration after DDP rebuilds
its buckets, adoption of loaded memory, parameter names); :mod:`powersgd_triton.state.state_dict` the per-bucket part of
the state dict and the checks of a loaded one; :mod:`powersgd_triton.hooks.driver` what the hooks call on every step;
:mod:`powersgd_triton.ops.backend` which backend runs a bucket.
"""

import logging
import math
import warnings
from typing import Any, Dict, Optional

import numpy as np
import torch

from powersgd_triton.state import predraw as _predraw
from powersgd_triton.state import state_dict as _state_dict
from powersgd_triton.ops.backend import BACKENDS, check_backend, triton_unusable_reason  # noqa: F401 - BACKENDS: importable here
from powersgd_triton.state.memory import BucketMemories, BucketMemory  # noqa: F401 - BucketMemory: importable from here as before
from powersgd_triton.state.torch_interop import MemoryDict, memory_dicts, written_entries

logger = logging.getLogger("powersgd_triton.state")  # the public module's name, as before the re-seat

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
    "verify",
)
# dtypes P and Q may be all-reduced in (``communication_dtype``); saved by name in the state dict
COMMUNICATION_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                        "float64": torch.float64}


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


def check_grad_scaler(scaler: Any) -> None:
    """None or a ``torch.amp.GradScaler`` (``torch.cuda.amp.GradScaler`` is a subclass)."""
    if scaler is None:
        return
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"`grad_scaler` must be None or a torch.amp.GradScaler, got "
            f"{type(scaler).__module__}.{type(scaler).__qualname__}"
        )


def _check_verify(value: Any) -> None:
    from powersgd_triton.ops.verify import check_mode  # imported here: powersgd_triton.ops.verify imports the ops and the autotuner

    check_mode(value)


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


class PowerSGDState:
    r"""Hyper-parameters and per-bucket state of :func:`~powersgd_triton.powerSGD_hook` and our other hooks
    (:data:`powersgd_triton.variants.VARIANTS`; one state serves one hook).

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
            buckets: half the compressed bytes (accuracy cost: docs/guides/communication-dtype.md). ``torch.float32``:
            always fp32 factors. The arithmetic stays float32 in the kernels and the memory (error, warm-start Q,
            P) stays float32: the packed P (and Q) buffer is cast once before its all-reduce and copied back once
            after it. The cast rounds to nearest; a value beyond the dtype's range becomes inf (never a finite
            wrong value), so the step is non-finite and skipped by GradScaler, its memory kept. The uncompressed
            gradients travel in the bucket's dtype (a one-all-reduce hook's single buffer: in this dtype too).
        grad_scaler: a ``torch.amp.GradScaler`` (or None). With it, the error memory is kept in unscaled units: the
            hook reads the loss scale ``s`` from the scaler's scale tensor (a one-element float32 device tensor; no
            host synchronization), adds ``s·E`` to the (scaled) gradients and stores ``(M + s·E − P·Qᵀ) / s``, so a
            change of the scale (GradScaler halves it after an overflow, doubles it after ``growth_interval`` clean
            steps) does not mis-scale the carried-over error (PyTorch's hook, without it: off by the scale ratio
            for the next steps). A disabled scaler, or one that has not scaled a loss yet, counts as scale 1. The
            scaler itself is not saved by :meth:`state_dict` (checkpoint it yourself with ``scaler.state_dict()``);
            the state dict records that the error memory is unscaled, and a state unpickled without its scaler
            must get it back (``state.grad_scaler = scaler``, done by the Lightning and Accelerate integrations).
        verify: ``"first"`` (default), ``"always"`` or ``"off"``: on the Triton backend (GPU or interpreter), the
            first compressed step of every bucket whose kernels (GPU model, Triton version, kernel sources, shape
            class, config, the bucket's matrix table) have no verdict yet is also computed on the torch backend from
            copies of the same inputs and compared launch by launch, in backend-invariant quantities (the output,
            the error memory, P and Q products; orthogonalized factors by span and Gram matrix); on a disagreement
            the bucket runs on the torch backend on every rank from that step on, with a ``RuntimeWarning``.
            Verdicts are kept in the process and next to the autotune cache (``powersgd-triton autotune --show``;
            a wrong one is checked again by the next run and sticks at the second; ``--clear-verdicts`` forgets
            them). Cost: one extra torch-backend step per bucket, once (plus one small all-reduce per bucket with
            several ranks).
            ``"always"``: every compressed step (debugging). Details, tolerances: :mod:`powersgd_triton.ops.verify`.
            Settable on a live state (``state.verify = "always"``), checked.

    Raises:
        ValueError: ``start_powerSGD_iter <= 1`` with error feedback or warm start (DDP rebuilds its buckets after
            the first iteration), ``matrix_approximation_rank < 1``, ``min_compression_rate <= 0``, negative
            ``orthogonalization_epsilon``, an unknown ``backend``; and a value of the wrong type: a number that is
            not one (``"4"``, ``True``) or not finite (NaN, +-inf), an integer argument given a float, a flag (``use_error_feedback``,
            ``warm_start``, ``batch_tensors_with_same_shape``, ``autotune``) that is not a bool (or 0/1); a
            ``communication_dtype`` other than None, float32, float16, bfloat16 (float64 also; for float64 models); a
            ``verify`` other than ``"first"``, ``"always"``, ``"off"`` (also when set later).
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
    ``q_memory_dict`` are live mappings over the flat per-bucket buffers (assigning, ``del`` and ``clear()`` act;
    PyTorch's own ``powerSGD_hook`` given this state keeps its memory there: :mod:`powersgd_triton.state.torch_interop`).

    Settings changed on a live state (between steps): ``use_error_feedback`` is read at every compressed step, as
    PyTorch's hook reads it (turned on, a zero error memory starts; turned off, the error memory is freed, so it is
    neither added nor updated and ``state_dict()`` holds none; turned on again, it starts from zero where PyTorch's
    hook would add the error it kept from before). ``matrix_approximation_rank`` and ``min_compression_rate``: each
    bucket keeps the error memory of the matrices it compresses before and after, re-allocates P and Q (a fresh
    initial Q where a rank changed) and warns once, naming the change. ``orthogonalization_epsilon``,
    ``warm_start``, ``communication_dtype`` and ``grad_scaler`` take effect at the next step. A state serves one
    model: registered on two DDP models, the second one's first hook call raises ``RuntimeError`` naming both.
    """

    # As PyTorch's state: a misspelt attribute (``state.warmstart = False``) raises instead of doing nothing.
    __slots__ = (
        "process_group", "matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
        "use_error_feedback", "warm_start", "orthogonalization_epsilon", "random_seed", "batch_tensors_with_same_shape",
        "backend", "autotune", "communication_dtype", "grad_scaler", "_verify", "rng", "iter",
        "total_numel_before_compression", "total_numel_after_compression", "compression_stats_logging_frequency",
        "next_stats_report", "buckets", "_memory_dicts", "__weakref__",
    )

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
        verify: str = "first",
    ):
        _check_verify(verify)
        communication_dtype = _check_communication_dtype(communication_dtype)
        check_grad_scaler(grad_scaler)
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
        if not 0 <= random_seed <= 2**32 - 1:  # numpy.random.RandomState's range (its own error names no argument)
            raise ValueError(f"`random_seed` must be in [0, 2**32 - 1] (a numpy RandomState seed), got {random_seed}")
        _check_number("compression_stats_logging_frequency", compression_stats_logging_frequency, integer=True)
        check_backend(backend)
        if backend == "triton":
            reason = triton_unusable_reason()
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
        self._verify = verify
        # Seeds of the random initial Qs: one draw per (re)initialization, in the same order on every rank.
        self.rng = np.random.RandomState(self.random_seed)
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, int(compression_stats_logging_frequency))
        self.next_stats_report = 0
        # bucket index -> BucketMemory, with the bookkeeping that keeps it matched to DDP's buckets (_buckets.py)
        self.buckets: BucketMemories = BucketMemories()
        # error_dict / p_memory_dict / q_memory_dict: live mappings over self.buckets, also holding what PyTorch's
        # own hook writes when it is given this state (powersgd_triton.state.torch_interop)
        self._memory_dicts = memory_dicts(self)

    @property
    def verify(self) -> str:
        """First-use verification of the Triton kernels (see the class docstring); settable, checked."""
        return self._verify

    @verify.setter
    def verify(self, value: str) -> None:
        _check_verify(value)
        self._verify = value
        for mem in self.buckets.values():  # the next step of each bucket reads the new mode
            mem.verify_pending = True

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

    @property
    def error_dict(self) -> MemoryDict:
        """Bucket index -> flat error memory: our hooks' (float32, compressed gradients only), or what PyTorch's
        hook wrote when it runs on this state (it is handed ours in its whole-bucket form). A live mapping: assigning,
        ``del`` and ``clear()`` act as on PyTorch's state (:mod:`powersgd_triton.state.torch_interop`)."""
        return self._memory_dicts["error"]

    @error_dict.setter
    def error_dict(self, value) -> None:
        self._memory_dicts["error"].assign(value)

    @property
    def p_memory_dict(self) -> MemoryDict:
        """Bucket index -> flat P (float32, packed in PyTorch's order); live, as :attr:`error_dict`."""
        return self._memory_dicts["p"]

    @p_memory_dict.setter
    def p_memory_dict(self, value) -> None:
        self._memory_dicts["p"].assign(value)

    @property
    def q_memory_dict(self) -> MemoryDict:
        """Bucket index -> flat warm-start Q divided by the world size (PyTorch's order and scale); live, as
        :attr:`error_dict`."""
        return self._memory_dicts["q"]

    @q_memory_dict.setter
    def q_memory_dict(self, value) -> None:
        self._memory_dicts["q"].assign(value)

    # PyTorch's state keeps these constructor arguments as attributes of the same names (not random_seed).
    _TORCH_ARGUMENTS = tuple(h for h in _HYPERPARAMETERS
                             if h not in ("random_seed", "backend", "autotune", "communication_dtype", "verify"))

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
        every rank's state to resume exactly. The process group is not saved. Warns (``RuntimeWarning``) at iteration
        1 with ``start_powerSGD_iter=1`` where the buckets DDP rebuilds cannot be told
        (:mod:`powersgd_triton.state.rebuild`).
        """
        # saved at iter == start_powerSGD_iter: the first compressed step's Qs, drawn now (powersgd_triton.state.predraw)
        first, rng_after = _predraw.first_draws(self)
        name, keys, pos, has_gauss, cached = self.rng.get_state() if rng_after is None else rng_after
        world_size, rank = _state_dict.saved_world(self.buckets)
        return {
            "version": _STATE_DICT_VERSION,
            "config": {k: (v if not isinstance(v, np.generic) else v.item()) for k, v in self._config().items()},
            "iter": int(self.iter),
            "total_numel_before_compression": int(self.total_numel_before_compression),
            "total_numel_after_compression": int(self.total_numel_after_compression),
            "next_stats_report": int(self.next_stats_report),
            # the process group the memory was built in (None before the first compressed step)
            "world_size": world_size,
            "rank": rank,
            # error memory in unscaled units (a grad_scaler was given); the scaler itself is the user's to save
            "unscaled_error": self.grad_scaler is not None,
            "rng": {
                "name": str(name),
                "keys": [int(k) for k in keys],
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "buckets": {**_state_dict.bucket_entries(self), **first},
            # what PyTorch's own hook wrote into error_dict / p_memory_dict / q_memory_dict (it ran on this state)
            **({"torch_hook_memory": written} if (written := written_entries(self)) else {}),
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (the hyper-parameters stay the constructor's).

        Every entry is checked first (:func:`powersgd_triton.state.state_dict.check_state_dict`): each bucket's error,
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
        self.buckets.replace_loaded(_state_dict.loaded_memories(checked["buckets"]), checked["world_size"],
                                    checked["rank"])
        for kind, d in self._memory_dicts.items():
            d.written = checked["torch_hook_memory"].get(kind, {})

    def __getstate__(self) -> Dict[str, Any]:
        """Pickle everything but the process group (see :meth:`state_dict`)."""
        logger.info("NOTE: Process group is not serializable and excluded from a saved state.")
        return {"config": self._config(), "state": self.state_dict()}

    def __setstate__(self, pickled: Dict[str, Any]) -> None:
        """Restore a pickled state; the process group becomes None (the default group, resolved when a hook runs).

        Works before ``init_process_group``.
        """
        if isinstance(pickled, dict) and "config" not in pickled:
            self._set_torch_pickled(pickled)
            return
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

    def _set_torch_pickled(self, pickled: Dict[str, Any]) -> None:
        """``__setstate__`` of what PyTorch's ``PowerSGDState.__getstate__`` returns (its slots but the process group):
        its settings, RNG, counters (as :meth:`from_torch`) and its memory dicts, kept in ours for PyTorch's hook."""
        needed = ("rng", "iter", "error_dict", "p_memory_dict", "q_memory_dict") + self._TORCH_ARGUMENTS
        missing = [k for k in needed if k not in pickled]
        if missing:
            raise TypeError(
                f"cannot unpickle a PowerSGDState from this state: it lacks {missing} (neither ours nor PyTorch's "
                "PowerSGDState.__getstate__); for a live PyTorch state use PowerSGDState.from_torch(state)"
            )
        PowerSGDState.__init__(self, None, **{a: pickled[a] for a in self._TORCH_ARGUMENTS})
        self.rng.set_state(pickled["rng"].get_state())
        self.random_seed = None
        self.iter = int(pickled["iter"])
        for key in ("total_numel_before_compression", "total_numel_after_compression", "next_stats_report"):
            setattr(self, key, int(pickled.get(key, 0)))
        for kind, key in (("error", "error_dict"), ("p", "p_memory_dict"), ("q", "q_memory_dict")):
            self._memory_dicts[kind].written = dict(pickled[key])
        if any(pickled[k] for k in ("error_dict", "q_memory_dict")):
            logger.warning(
                "NOTE: PyTorch's PowerSGDState unpickled into powersgd_triton's: its error-feedback and warm-start "
                "memory stays in error_dict / q_memory_dict for PyTorch's hook; powersgd_triton's hooks start their "
                "own memory (a fresh random Q per bucket), as PowerSGDState.from_torch does"
            )

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in _HYPERPARAMETERS)
        return f"PowerSGDState({args}, iter={self.iter}, buckets={len(self.buckets)})"
