"""The alternating PowerSGD DDP hook: one half power-iteration and ONE all-reduce per bucket per step.

PyTorch's ``powerSGD_hook`` (and our :func:`~powersgd_triton.powerSGD_hook`) runs a full power-iteration step per
SGD step: three all-reduces per bucket, one after the other (uncompressed gradients, P, Q). The PowerSGD authors'
later implementation (epfml/powersgd, and ``HalfRankKReducer`` of the paper code) and ACP-SGD (Zhang et al., ICDCS
2023, arXiv 2306.08881) take one *half* step per SGD step instead, alternating the factor they compute; the
warm-started factors carry the power iteration across SGD steps. Here, for each compressed matrix ``M`` (``n x m``,
rank ``r``) of a bucket, with error memory ``E`` and the kept factors ``P`` (``n x r``) and ``Q`` (``m x r``):

* **P step**: ``Q' = orth(Q)`` (the kept Q is identical on every rank: it came from an all-reduce, or from the
  seeded initial draw); ``P_local = (M + E)·Q'``; all-reduce ``P``; ``M <- (P_sum / W)·Q'ᵀ``;
  ``E <- (M + E) - P_local·Q'ᵀ``; keep ``P <- P_sum / W``.
* **Q step**: ``P' = orth(P)``; ``Q_local = (M + E)ᵀ·P'``; all-reduce ``Q``; ``M <- P'·(Q_sum / W)ᵀ``;
  ``E <- (M + E) - P'·Q_localᵀ``; keep ``Q <- Q_sum / W``.

The output is the average of the ranks' projections of ``M + E`` onto the span of the orthonormal factor; the
error is each rank's *local* residual (the part of its own ``M + E`` outside that span), so every rank's error
memory goes to zero when the gradients are exactly rank r (epfml commit 1707180; ACP-SGD). Error memory is kept for
the compressed gradients only.

One all-reduce per bucket per compressed step. The uncompressed gradients (biases, norms, small matrices) travel
in the same all-reduce as the factor: one buffer per bucket in the memory's dtype (float32; float64 for a float64
bucket), ``comm = [factor | uncompressed]``, allocated on the bucket's first compressed step. The factor
is written straight into ``comm[:F]`` by the projection kernel, the uncompressed gradients into ``comm[F:]`` by one
gather launch (:func:`powersgd_triton.ops.pack_uncompressed`), ``comm[:F + U]`` is all-reduced, then one launch
(:func:`powersgd_triton.ops.average`) divides it by the world size and writes the averaged uncompressed gradients
back. ``comm[:F + U]`` travels in ``state.communication_dtype`` (default: the bucket's dtype, so float16/bfloat16
buckets send half-precision factors and their uncompressed gradients in their own dtype, as PyTorch's hook does):
one cast of it before the all-reduce and one copy back after it when that dtype is not ``comm``'s. A float64 bucket
is computed in float64 (``comm``, the kept factors and the error memory in float64, on the torch backend), so
nothing is rounded.

Order of the numeric work (the cheapest correct one found). The local factor is needed after the all-reduce for the
local residual, so the launch that computes it writes it twice, into ``comm`` and into ``local`` (``F`` floats);
then ONE pass over the bucket (:func:`powersgd_triton.ops.reconstruct` with ``local_p`` / ``local_q``) writes the
output ``P_avg·Q'ᵀ`` (``P'·Q_avgᵀ``) and the error ``(M + E) - P_local·Q'ᵀ`` (``(M + E) - P'·Q_localᵀ``). Computing
the error before the all-reduce instead would need a second pass over the bucket. Bucket passes per step: a P step
reads ``M, E`` and writes ``M + E`` while projecting (``ops.project`` with the error), then reconstructs (read
``M``, write ``M, E``); a Q step needs ``M + E`` before ``ops.project_t``, which has no error input: the error is
folded in by ``ops.project`` with the error (its small P output goes to a scratch buffer and is not used; the fold
is the same memory traffic, only the rank-r multiply is extra), then ``project_t`` reads the bucket once more.

Launches per compressed step and bucket on the Triton backend, whatever the number of matrices (``_HalfStep``):

* P step: 1 orthogonalize (kept Q into ``q_work``) + 1 project (``P_local`` into ``comm[:F]`` and ``local``; the
  bucket becomes ``M + E``) + 1 pack of the uncompressed gradients into ``comm[F:]`` (none when the bucket has none)
  + the all-reduce + 1 average (the factor and the uncompressed gradients divided by the world size, the uncompressed
  ones written back into the bucket, the step flags) + 1 reconstruct (output ``P_avg·Q'ᵀ``, local-residual error,
  and the commit of the averaged P as the kept P where the step is finite and that P is not all zero: the commit is
  part of the reconstruct launch, not a separate op): 5;
* Q step: 1 orthogonalize (kept P into ``p_work``) + with error feedback 1 project that folds ``E`` into the bucket
  + 1 project_t (``Q_local`` into ``comm[:F]`` and ``local``; 2 launches when its plan splits a tall matrix over rows)
  + 1 pack + the all-reduce + 1 average + 1 reconstruct (output ``P'·Q_avgᵀ``, error, commit of the kept Q): 6.

When ``comm`` travels in another dtype (``communication_dtype``; by default a float16/bfloat16 bucket's dtype), one
cast before the all-reduce and one copy back after it (:func:`powersgd_triton.hooks.driver.allreduce_factor`). With
``state.grad_scaler`` the error memory is in unscaled units: the project launches use ``M + s·E`` and reconstruct
stores the residual divided by ``s`` (``s``: the scaler's scale tensor, read on the device), as in
:mod:`powersgd_triton.hooks.layerwise`. A bucket with no compressed matrix is averaged by one plain all-reduce of the bucket
(PyTorch's ``allreduce`` hook: divide, then sum), in the bucket's dtype.

First compressed step of a bucket: a P step, from the initial random Q drawn exactly as the standard hook draws it
(:func:`powersgd_triton.state.memory.draw_q`: same seeds, same RNG consumption), so the first P of both hooks is the same.
epfml/powersgd starts with a Q step from a random P; the two are symmetric.

Scale of the kept factors. They are only ever used through ``orth()``, which is invariant to a positive scale
except for ``orthogonalization_epsilon`` (``col / (norm + eps)``). The averaged factor (sum / world size) is kept,
so that epsilon means the same thing whatever the world size (PyTorch's hook keeps ``Q / world_size`` too); the
division is part of the one launch that averages ``comm``.

Numerics as in :mod:`powersgd_triton.hooks.layerwise`: float32 accumulation, an all-zero layer stays zero (Gram-Schmidt
leaves a zero column zero), deterministic kernels on the all-reduced data, Triton and torch backends.

Zero factors are never kept. A matrix whose averaged factor is exactly zero (its ``M + E`` was zero on every rank:
a layer without gradient at that step, or any layer at the Q step after a non-finite first P step, which leaves the
kept P at its initial zeros) keeps its previous factor. Committing it would be for ever: ``orth(0) = 0``, so every
later factor of that matrix would be zero, the layer would never pass a gradient again and its error memory would
grow without bound. (The standard hooks keep a zero Q in that case; with error feedback it takes a layer that has
no gradient at the first compressed step, without it any step.)

A non-finite step: the step flags (device tensors: the all-reduced factor and uncompressed gradients, i.e. the whole
``comm``, are finite) gate the error update and the commit of the kept factor, without a host synchronization; the
bucket output is non-finite (GradScaler skips the step), the error memory and the kept factors stay as they were.
**The phase still advances** on such a step: which half-step runs is host control flow and must be known without
reading the device flag, and every rank must take the same half-step. Advancing is valid: the next half-step
orthogonalizes the other kept factor, which is exactly the one the last good step left (after a skipped P step,
the Q step orthogonalizes the P kept by the P step before; after a skipped Q step, the P step re-orthogonalizes
the kept Q, bitwise the Q' of the P step before it). After a skipped *first* P step the kept P is still zero: the Q
step then outputs zero for the compressed gradients (they go to the error memory) and keeps nothing, and the next
P step starts from the initial Q again.

Accuracy. Each step projects ``M + E`` onto a subspace the previous step's all-reduce fixed (the standard hook
projects onto ``orth((M + E)·Q)``, computed from the current gradient): the same power iteration at half the speed;
on a fixed gradient without error feedback, step 2k of this hook equals step k of the standard hook. Where gradient
subspaces change from batch to batch it is less accurate at the same rank (measured: a character LSTM 2.6 accuracy
points behind at 600 steps, 0.8 at 1800; a small convnet 0.2), and about as accurate at twice the rank, which sends
the standard hook's bytes in one all-reduce instead of three (``bench/RESULTS.md``, ``bench/alternating_accuracy.py``).

Hyper-parameters: the :class:`~powersgd_triton.PowerSGDState` of the standard hooks, with the same meaning:
``matrix_approximation_rank``, ``min_compression_rate`` (the standard hook's test, so both hooks compress the same
matrices at the same settings), ``start_powerSGD_iter`` (plain averaging all-reduce before, one per bucket),
``use_error_feedback``, ``orthogonalization_epsilon``, ``random_seed``, ``backend``. ``warm_start=False`` is
refused: the kept factors are the algorithm. ``compression_stats()`` counts what is actually sent: per compressed
step the elements of that step's factor (``sum n_i r_i`` on P steps, ``sum m_i r_i`` on Q steps) plus the
uncompressed gradients, so its rate is about twice the standard hook's at the same rank.

Collective order: the single all-reduce is issued from the hook body, so ranks issue collectives in the same order
on every backend. As in :mod:`powersgd_triton.hooks.layerwise`, on NCCL the rest of the step is a ``then()`` callback; on
other backends the hook waits for the all-reduce and finishes in its body (callbacks would run on gloo's worker
threads). The all-reduce is ``torch.distributed.all_reduce`` looked up at call time (the bench and train commands
count calls and bytes by wrapping it).

No ``from __future__ import annotations`` here: DDP checks the hooks' annotations as objects.
"""

import torch
import torch.distributed as dist

from powersgd_triton.hooks import driver as _step
from powersgd_triton.state.memory import BucketMemory
from powersgd_triton.state.powersgd_state import PowerSGDState

__all__ = ["alternating_powerSGD_hook"]


class _HalfStep(_step.HookStep):
    """One compressed half-step of one bucket: the work before and after its all-reduce, for
    :func:`powersgd_triton.hooks.driver.run`."""

    name, batched, draws_q_each_step = "alternating_powerSGD_hook", False, False

    __slots__ = ("state", "mem", "layout", "buffer", "bucket_buffer", "group", "world_size", "eps", "phase", "factor",
                 "unc", "sent", "local", "loss_scale", "steps", "check", "pending", "kept")
    remap = False

    def __init__(self, state: PowerSGDState, mem: BucketMemory, buffer: torch.Tensor, group, world_size: int):
        self.state = state
        self.mem = mem
        self.layout = mem.layout
        self.buffer = self.bucket_buffer = buffer
        self.group = group
        self.world_size = world_size
        self.eps = float(state.orthogonalization_epsilon)
        # the numeric steps: the bucket memory's (Triton or torch), or the first-use check's (begin_check)
        self.steps = mem.steps
        self.check = self.pending = None
        self.phase = self.factor = self.unc = self.sent = self.local = self.loss_scale = None
        self.kept = ()

    @staticmethod
    def check_settings(state) -> None:
        if not state.warm_start:
            raise ValueError(
                "alternating_powerSGD_hook needs warm_start=True: the factors kept between steps carry its power "
                "iteration"
            )

    def begin(self, bucket):
        """A bucket with nothing to compress is all-reduced as it is (its uncompressed gradients: the future is
        returned); else the memory's ``comm`` buffer, the first-use check, the statistics of what is sent,
        :meth:`start`, and the one round (:meth:`rounds`)."""
        state, mem, layout, buffer = self.state, self.mem, self.layout, self.buffer
        state.total_numel_before_compression += layout.numel_before_compression
        if layout.num_matrices == 0:  # nothing to compress: the bucket is its uncompressed gradients
            state.total_numel_after_compression += layout.uncompressed_numel
            _step.report_compression_stats(state, bucket)
            return _step.allreduce_average(self.group, self.world_size, buffer)
        self.allocate()
        if mem.verify_pending:
            self.begin_check(layout.uncompressed_numel > 0, bucket.index())
        self.setup()
        state.total_numel_after_compression += self.sent.numel()
        _step.report_compression_stats(state, bucket)
        self.start()
        return [(self.sent, None)]

    def allocate(self) -> None:
        """This hook's transient buffers in the bucket's memory (once per layout; after a load, on first use):
        ``comm`` (factor + uncompressed gradients, the one all-reduced buffer), ``local`` (this rank's factor, for the
        local-residual error; with error feedback), ``p_work`` (the orthogonalized kept P of a Q step; a P step
        orthogonalizes the kept Q into ``q_work``), in the memory's dtype."""
        mem, layout, buffer = self.mem, self.layout, self.buffer
        factor = max(layout.p_numel, layout.q_numel)
        f32 = dict(device=buffer.device, dtype=_step.memory_dtype(buffer.dtype))
        numel = factor + layout.uncompressed_numel
        comm = mem.comm
        if comm is None or comm.numel() != numel or comm.device != buffer.device or comm.dtype != f32["dtype"]:
            mem.comm = torch.empty(numel, **f32)
            mem.local = torch.empty(factor, **f32) if mem.error is not None else None
            _step.p_work(mem)
        if mem.error is not None and mem.local is None:  # error feedback turned on since
            mem.local = torch.empty(factor, **f32)
        if mem.q_work is None:
            mem.q_work = torch.empty(layout.q_numel, **f32)

    def setup(self) -> None:
        """This half-step's views of the memory's ``comm`` buffer (``[factor | uncompressed]``) and ``local``."""
        mem, layout = self.mem, self.layout
        self.phase = mem.phase
        f = layout.p_numel if self.phase == "p" else layout.q_numel
        u = layout.uncompressed_numel
        self.factor = mem.comm[:f]
        self.unc = mem.comm[f : f + u]
        self.sent = mem.comm[: f + u]
        self.local = mem.local[:f] if mem.local is not None else None
        # error memory in unscaled units (state.grad_scaler): the scale of this step's gradients, a device tensor
        self.loss_scale = _step.loss_scale(self.state, self.buffer) if mem.error is not None else None
        # a then() callback records the loss scale (a copy made in the hook body when the scaler's is on another
        # device) on its stream (the stream rule of powersgd_triton.hooks.driver); all else it reads is the state's
        self.kept = (self.loss_scale,)

    def start(self) -> None:
        """:meth:`compute`, then the phase advances (host-side schedule, the same on every rank; also on a
        non-finite step: see the module docstring)."""
        self.compute()
        self.mem.phase = "q" if self.phase == "p" else "p"

    def rounds(self):
        """One all-reduce: ``comm[:F + U]``, in ``state.communication_dtype`` (cast once and copied back once)."""
        return [(self.sent, None)]

    def again(self) -> "_HalfStep":
        again = type(self)(self.state, self.mem, self.buffer, self.group, self.world_size)
        again.setup()
        return again

    def compute(self) -> None:
        """This rank's factor into ``comm[:F]`` (and ``local``), the uncompressed gradients into ``comm[F:]``."""
        state, mem, layout, buffer, steps = self.state, self.mem, self.layout, self.buffer, self.steps
        # A Q that powerSGD_hook orthogonalized ahead in this memory (a state that served it before): this half-step
        # writes q_work (P step) or commits Q (Q step) with kernels that move no version counter, so forget it
        # now, after the current stream waits for its side stream (powersgd_triton.hooks.driver.take_next_q)
        _step.drop_next_q(mem)
        if self.phase == "p":
            if not mem.q_initialized:
                _step.draw_q(state, mem, buffer.dtype)
            steps.orthogonalize(mem.q, layout, "q", self.eps, out=mem.q_work)
            # P_local = (M + E)·Q' into comm and local; the bucket now holds M + E.
            steps.project(buffer, layout, mem.q_work, self.factor, mem.error, p2=self.local, loss_scale=self.loss_scale)
        else:
            steps.orthogonalize(mem.p, layout, "p", self.eps, out=mem.p_work)
            if mem.error is not None:
                # Fold E into the bucket (project_t has no error input); the P it computes is scratch.
                steps.project(buffer, layout, mem.q, mem.local[: layout.p_numel], mem.error, loss_scale=self.loss_scale)
            # Q_local = (M + E)ᵀ·P' into comm and local
            steps.project_t(buffer, layout, mem.p_work, self.factor, q2=self.local)
        if self.unc.numel():
            steps.pack_uncompressed(buffer, layout, self.unc)

    def finish(self) -> torch.Tensor:
        """Average, write the output and the local residual, commit the kept factor where the step is finite."""
        mem, layout, buffer, steps = self.mem, self.layout, self.buffer, self.steps
        # factor /= world, uncompressed /= world and unpacked, step flags: one launch
        flags = steps.average(self.factor, layout, self.phase, buffer, self.unc if self.unc.numel() else None,
                              self.world_size)
        error = mem.error
        local = self.local if error is not None else None
        kept = (self.phase, mem.p if self.phase == "p" else mem.q)
        if self.phase == "p":
            steps.reconstruct(buffer, layout, self.factor, mem.q_work, 1.0, error, flags, local_p=local, commit=kept,
                              loss_scale=self.loss_scale)
        else:
            steps.reconstruct(buffer, layout, mem.p_work, self.factor, 1.0, error, flags, local_q=local, commit=kept,
                              loss_scale=self.loss_scale)
        return buffer


# the hook's settings check, for the registrations that run it outside DDP (powersgd_triton.fsdp.checks)
check_settings = _HalfStep.check_settings


def alternating_powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""Layer-wise PowerSGD with one half power-iteration and ONE all-reduce per bucket per step.

    Compressed steps alternate between a P step (all-reduce ``P = (M + E)·orth(Q)``) and a Q step (all-reduce
    ``Q = (M + E)ᵀ·orth(P)``); the uncompressed gradients travel in the same all-reduce; the error memory is the
    local residual. See the module documentation for the algorithm, the order of the work, the numerics and the
    accuracy (use about twice the standard hook's rank for the same accuracy at the same bytes).
    Uses the same :class:`~powersgd_triton.PowerSGDState` as :func:`~powersgd_triton.powerSGD_hook` (a state must
    serve one hook); the next half-step is part of the state (``state_dict()``, pickling).

    Args:
        state: a :class:`~powersgd_triton.PowerSGDState` with ``warm_start=True``.
        bucket: the DDP ``GradBucket`` (its buffer may be fp16/bf16, e.g. under ``fp16_compress_wrapper``).

    Returns:
        A future whose value is the bucket buffer, holding the averaged (approximated) gradients.

    Raises:
        ValueError: ``state.warm_start`` is False (on the first call, before anything is changed).
        TypeError: complex or integer gradients, or ``state`` is not a :class:`~powersgd_triton.PowerSGDState`
            (before anything is changed).
        RuntimeError: ``state.backend == "triton"`` and the Triton kernels cannot run on the bucket's device (first
            call, step 0, before anything is changed); ``state`` registered on two DDP models (at the second one's
            first call).

    A sparse gradient's bucket is averaged with a plain all-reduce (as DDP does without a hook); a float64 bucket is
    computed in float64.

    Example::

        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10)
        >>> ddp_model.register_comm_hook(state, alternating_powerSGD_hook)
    """
    return _step.run(state, bucket, _HalfStep)
