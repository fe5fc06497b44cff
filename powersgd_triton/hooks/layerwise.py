"""The PowerSGD DDP communication hooks: ``powerSGD_hook`` (layer-wise) and ``batched_powerSGD_hook``.

Drop-in for ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``: same signature, registered with
``ddp_model.register_comm_hook(state, hook)``, same numbers as PyTorch's hook (see ``tests/hooks/test_hooks_equivalence.py``).
This module is only the order of the collectives; every numeric step is one call into :mod:`powersgd_triton.ops`
(one Triton launch per step for the whole bucket on the Triton backend), and what the hooks share (checks, warm-up,
the bucket's memory, the factor all-reduce) is in :mod:`powersgd_triton.hooks.driver`.

A compressed step of one bucket (PowerSGD, Vogels et al. 2019, arXiv 1905.13727, Algorithm 1):

1. all-reduce of the uncompressed gradients (async, so that it overlaps the rest): issued first when they are one
   range of the bucket (a view); when they lie in several ranges, project's launch (3.) packs them into one buffer
   and their all-reduce is issued right after it, before P's;
2. ``Q <- orthogonalize(Q memory)`` into a work buffer (a fresh random Q on first use / without warm start); with
   warm start this was done at the end of the previous step (7.), so there is nothing to do;
3. ``P = (M + E)·Q`` into a work buffer, all-reduce it;  4. orthogonalize P from it into the P memory;  5. ``Q = (M + E)ᵀ·P``, all-reduce Q, ``Q /= world``;
6. ``M <- P·Qᵀ`` and ``E <- (M + E) - P·Qᵀ`` in one pass; commit the warm-start Q;
7. (warm start) orthogonalize the kept Q into the work buffer for the next step: on CUDA on a side stream, so that
   it overlaps the rest of the iteration instead of delaying the next step
   (:func:`powersgd_triton.hooks.driver.orthogonalize_next_q`). Same kernel and input as step 2 would have: the same bits.

P and Q are all-reduced in ``state.communication_dtype`` (default: the bucket's dtype, as PyTorch's hook): one cast
of the packed float32 factor before the all-reduce, one copy back after it
(:func:`powersgd_triton.hooks.driver.allreduce_factor`). With ``state.grad_scaler`` the error memory is unscaled: steps 3
and 6 use ``M + s·E`` and store ``E / s``, ``s`` read from the scaler's scale tensor on the device (see :class:`~powersgd_triton.PowerSGDState`).

Step 6's memory updates only happen where the step is finite (all-reduced Q and uncompressed gradients: the step
flags of :func:`powersgd_triton.ops.average`, device tensors), without any host synchronization: a non-finite step
yields a non-finite output (GradScaler skips it) and leaves the error memory and the warm-start Q as they were.

Collective order. Every rank must issue the same collectives in the same order. On NCCL, futures complete at
enqueue and ``then()`` callbacks run in order, so the steps are chained with ``then()`` on
``dist.all_reduce(..., async_op=True).get_future()`` as PyTorch does. On every other backend (gloo, ...), ``then()``
callbacks run on the backend's worker threads whenever a collective completes, so a collective issued from a
callback can be ordered differently on different ranks (PyTorch's hook aborts with "Received data size doesn't
match expected size" on gloo with several buckets). There, the whole step runs in the hook body, waiting for each
all-reduce, and the hook returns an already completed future.

No ``from __future__ import annotations`` here: DDP checks the hooks' annotations as objects.
"""

import torch
import torch.distributed as dist

from powersgd_triton.hooks import driver as _step
from powersgd_triton.state.memory import BucketMemory
from powersgd_triton.state.powersgd_state import PowerSGDState

__all__ = ["powerSGD_hook", "batched_powerSGD_hook"]


class _Step(_step.HookStep):
    """One compressed step of one bucket (``powerSGD_hook``): the pieces between its all-reduces, for
    :func:`powersgd_triton.hooks.driver.run`.

    Device work per step and bucket besides the three all-reduces, on the Triton backend: 1 project (which also
    packs the uncompressed gradients into one buffer when they lie in several ranges of the bucket: its pack
    programs after its tiles, ``project(..., packed=)``; on the torch backend a pack, then the projection), 1
    orthogonalize of P, 1 project_t (2 when its plan splits a tall matrix over rows), 1 average (Q and the
    uncompressed gradients divided by the world size, unpacked, step flags), 1 reconstruct (output, error memory
    and warm-start Q where the step is finite) and 1 orthogonalize of the kept Q for the next step (with warm start;
    on the first step and without warm start it runs before ``project`` instead): 6 or 7 launches whatever the
    number of matrices (orthogonalize: 2 when its plan splits a tall factor over rows). A bucket with no matrix to
    compress packs with a launch of its own (``pack_uncompressed``). When P and Q
    travel in another dtype than the memory's (``communication_dtype``; by default fp16/bf16 buckets), project and
    project_t write them in that dtype into the buffers they are all-reduced in (``p_send``, ``q_raw``: rounded to
    nearest even, overflowing to inf, as ``Tensor.to`` does), P is copied back into float32 after its all-reduce
    and average divides Q from there into the float32 ``q_work``: one torch op. On the torch backend, one cast and
    one copy back per factor (4 element-wise torch ops per bucket and step, whatever the number of matrices).

    Step plans: on the Triton backend, a steady step without a loss scale makes these launches through the memory's
    :meth:`~powersgd_triton.ops.backend.TritonSteps.plan_step` (each launch with its arguments bound once, while
    the step's tensors are the same objects and its settings equal; the next step's Q is orthogonalized through
    ``steps.orthogonalize`` as before): the same launches with the same arguments, without the layers between the
    step and Triton's launch (issue 39's host line). The first-use check, the torch backend, a loss scale: the
    methods of ``steps`` as before.

    The batched memory's gradient order differs from the bucket's for one step after a resume (see
    :mod:`powersgd_triton.state.buckets`): the step computes on a copy in the memory's order (``buffer``), and
    :meth:`output` writes each gradient back into DDP's ``bucket_buffer``.
    """

    name, batched = "powerSGD_hook", False

    __slots__ = ("state", "mem", "layout", "buffer", "bucket_buffer", "order", "remap", "group", "world_size", "unc",
                 "packed", "unc_work", "backend", "eps", "loss_scale", "p_raw", "p_send", "q_raw", "steps", "check",
                 "pending", "kept", "trust", "plan", "fused")

    def __init__(self, state: PowerSGDState, mem: BucketMemory, buffer: torch.Tensor, group, world_size: int,
                 work=None):
        self.state = state
        self.mem = mem
        self.layout = mem.layout
        self.bucket_buffer = buffer
        self.order = order = mem.order
        self.remap = order is not None
        if work is None:
            work = buffer if order is None else torch.cat([buffer[o : o + n] for o, n in order])
        self.buffer = work
        self.group = group
        self.world_size = world_size
        self.backend = mem.backend
        # the numeric steps: the bucket memory's (Triton or torch), or the first-use check's (begin_check)
        self.steps = mem.steps
        self.check = None
        self.eps = float(state.orthogonalization_epsilon)
        # error memory in unscaled units (state.grad_scaler): the scale of this step's gradients, a device tensor
        self.loss_scale = (_step.loss_scale(state, buffer) if mem.error is not None and state.grad_scaler is not None
                           else None)
        self.unc = None
        self.packed = None
        # the uncompressed gradients lie in several ranges and there is a matrix to project: project's launch packs
        # them (on every backend: the torch backend packs, then projects), and their all-reduce is issued after it
        # (from the layout only: every rank issues the same collectives in the same order)
        self.fused = mem.layout.num_matrices > 0 and len(mem.layout.uncompressed) > 1
        self.unc_work = self.pending = None
        # P = (M + E)·Q is all-reduced in p_send and orthogonalized from p_raw into mem.p (out of place; see
        # _memory.p_work); Q is all-reduced in q_raw and averaged into mem.q_work. On the Triton backend, when the
        # communication dtype is not float32, p_send and q_raw are in it, written so by project and project_t (no
        # cast before the all-reduces), and P is copied back into the float32 p_raw (orthogonalize reads float32:
        # triton 3.6 cannot compile its float64 tl.dot of a 16-bit load), while average divides Q from q_raw into
        # float32 itself
        self.p_raw = self.p_send = self.q_raw = None
        self.trust = None  # the TRUST key of this step's launches (begin)
        self.plan = None  # the memory's bound launches for this step, when it has them (begin)
        if mem.layout.num_matrices:
            in_kernels = self.backend == "triton" and _step.OPTIONS.wire_in_kernels
            wire = _step.wire_dtype(state, buffer, mem.p.dtype) if in_kernels else None
            self.p_raw = _step.p_work(mem)
            self.p_send = self.p_raw if wire is None else _step.p_comm(mem, wire)
            self.q_raw = mem.q_work if wire is None else _step.q_comm(mem, wire)

    def begin(self, bucket):
        """Compression statistics, the first-use check, the work of :meth:`start`; returns :meth:`rounds`."""
        state, layout = self.state, self.layout
        state.total_numel_before_compression += layout.numel_before_compression
        state.total_numel_after_compression += layout.numel_after_compression
        if state.iter >= state.next_stats_report:  # its first test, without a call
            _step.report_compression_stats(state, bucket)
        mem = self.mem
        if mem.verify_pending:  # copy_segments: a pack of its own (none when project's launch packs)
            self.begin_check(len(layout.uncompressed) > 1 and not self.fused, bucket.index(), self.fused)
        if self.check is None and layout.num_matrices:  # the memory's own steps, on the memory's own tensors
            self.trust = _step.launch_trust(self.steps, (self.buffer, mem.q, mem.q_work, mem.p, self.p_raw,
                                                         self.p_send, self.q_raw, mem.error, self.loss_scale))
            if self.trust is not None and self.loss_scale is None:  # the launches bound once per memory
                self.plan = self.steps.plan_step(
                    (self.buffer, layout, mem.q, mem.q_work, mem.p, self.p_raw, self.p_send, self.q_raw, mem.error),
                    (self.eps, self.world_size, len(layout.uncompressed) > 1,
                     mem.error is not None or state.warm_start, state.warm_start))
        _step.TRUST.key = self.trust
        try:
            self.start()
        finally:
            _step.TRUST.key = None
        # Inside a then() callback (its own pool stream on NCCL): what the hook body allocated and the callback reads
        # is recorded on the callback's stream (see the stream rule in powersgd_triton.hooks.driver)
        self.kept = (self.packed, self.loss_scale, None if self.order is None else self.buffer)
        return self.rounds()

    def start(self) -> None:
        """The all-reduce of the uncompressed gradients issued first (it overlaps the rest), then P; when project's
        launch packs them (``fused``), P first and their all-reduce right after it."""
        self.start_uncompressed()
        self.compute_p()
        if self.fused:
            self.unc_work = dist.all_reduce(self.unc, group=self.group, async_op=True)

    def rounds(self):
        """P, then (after orthogonalizing it and computing Q) Q; none when the bucket has no matrix to compress."""
        if self.layout.num_matrices == 0:
            self.pending = self.unc_work
            return []
        return [(self.p_send, self.compute_q), (self.q_raw, None)]

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """DDP's bucket buffer, the gradients copied back from the memory's order (``remap``)."""
        pos = 0
        for o, n in self.order:
            self.bucket_buffer[o : o + n].copy_(self.buffer[pos : pos + n])
            pos += n
        return self.bucket_buffer

    def again(self) -> "_Step":
        return type(self)(self.state, self.mem, self.bucket_buffer, self.group, self.world_size, work=self.buffer)

    def start_uncompressed(self) -> None:
        """Issue the all-reduce of the uncompressed gradients: a view of the bucket when they are one range, else
        packed into one buffer of the bucket's dtype (one launch; with ``fused``, the buffer only: project's launch
        packs it, and :meth:`start` issues the all-reduce after it)."""
        layout = self.layout
        if layout.uncompressed_numel == 0:
            return
        if len(layout.uncompressed) == 1:
            o, n = layout.uncompressed[0]
            self.unc = self.buffer[o : o + n]
        else:
            self.packed = self.buffer.new_empty(layout.uncompressed_numel)
            self.unc = self.packed
            if self.fused:
                return
            self.steps.pack_uncompressed(self.buffer, layout, self.packed)
        self.unc_work = dist.all_reduce(self.unc, group=self.group, async_op=True)

    def compute_p(self) -> None:
        """Q from memory (or a fresh random Q), orthogonalized into ``q_work``; ``P = (M + E)·Q``."""
        state, mem, layout = self.state, self.mem, self.layout
        ahead = _step.take_next_q(mem, self.eps)  # orthogonalized at the end of the last step
        if not mem.q_initialized or not (state.warm_start or mem.q_predrawn):  # predrawn: see _predraw
            _step.draw_q(state, mem, self.buffer.dtype)
            ahead = False
        mem.q_predrawn = False
        if layout.num_matrices == 0:
            return
        plan = self.plan
        if plan is not None:
            if not ahead:
                plan.orth_q()
            if self.fused:
                plan.project(self.packed)
            else:
                plan.project()
            return
        if not ahead:
            self.steps.orthogonalize(mem.q, layout, "q", self.eps, out=mem.q_work)
        self.steps.project(self.buffer, layout, mem.q_work, self.p_send, mem.error, loss_scale=self.loss_scale,
                           packed=self.packed if self.fused else None)

    def compute_q(self) -> None:
        """Orthogonalize the all-reduced P (``p_raw``) into ``mem.p``; ``Q = (M + E)ᵀ·P`` into ``q_raw``."""
        mem, layout = self.mem, self.layout
        if self.p_send is not self.p_raw:
            self.p_raw.copy_(self.p_send)  # the all-reduced P in float32 (exact)
        _step.TRUST.key = self.trust
        try:
            if self.plan is not None:
                self.plan.orth_p()
                self.plan.project_t()
                return
            self.steps.orthogonalize(self.p_raw, layout, "p", self.eps, out=mem.p)
            self.steps.project_t(self.buffer, layout, mem.p, self.q_raw,
                                 error=mem.error if layout.batched else None,
                                 loss_scale=self.loss_scale if layout.batched else None)
        finally:
            _step.TRUST.key = None

    def finish(self) -> torch.Tensor:
        """Average, reconstruct, update the memory where the step is finite; the bucket buffer is the output."""
        state, mem, layout = self.state, self.mem, self.layout
        if self.unc is not None:
            self.unc_work.wait()
        if layout.num_matrices == 0:
            if self.unc is not None:
                self.unc.div_(self.world_size)
                if self.packed is not None:
                    self.steps.unpack_uncompressed(self.packed, layout, self.buffer)
            return self.buffer
        _step.TRUST.key = self.trust
        try:
            plan = self.plan
            if plan is not None:  # the same launches, bound once (TritonSteps.plan_step)
                flags = plan.average(self.packed)  # Q /= world, uncompressed /= world and unpacked, step flags
                plan.reconstruct(flags if plan.settings[3] else None)
                if state.warm_start:
                    _step.orthogonalize_next_q(mem, self.eps)
                return self.buffer
            # Q /= world, uncompressed /= world and unpacked, step flags: one launch
            flags = self.steps.average(self.q_raw, layout, "q", self.buffer, self.packed, self.world_size,
                                       out=None if self.q_raw is mem.q_work else mem.q_work)
            keep_memory = mem.error is not None or state.warm_start
            next_q = _step.next_q_target(state, mem, self.eps)
            done = self.steps.reconstruct(
                self.buffer,
                layout,
                mem.p,
                mem.q_work,
                1.0,
                mem.error,
                flags if keep_memory else None,
                # keep Q per matrix where the step is finite and Q is not all zero
                commit=("q", mem.q) if state.warm_start else None,
                # CPU torch backend: the next step's Q orthogonalized here, from the Gram matrices that tell the
                # status
                orthogonalize_kept=next_q,
                loss_scale=self.loss_scale,
            )
            if state.warm_start:  # the next step's first computation, off its critical path
                _step.orthogonalize_next_q(mem, self.eps, done=done)
        finally:
            _step.TRUST.key = None
        return self.buffer


class _BatchedStep(_Step):
    """``batched_powerSGD_hook``'s step: the layer-wise step on a layout of one ``s x s`` matrix (the whole
    bucket, its padding masked)."""

    __slots__ = ()
    name, batched = "batched_powerSGD_hook", True


def powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""Layer-wise PowerSGD (drop-in for PyTorch's ``powerSGD_hook``).

    Each gradient of the bucket is viewed as a matrix ``(shape[0], -1)`` and compressed to rank
    ``min(n, m, state.matrix_approximation_rank)`` when that saves ``state.min_compression_rate``; the other
    gradients (biases, small tensors) are all-reduced as they are. Plain averaging all-reduce for the first
    ``state.start_powerSGD_iter`` iterations, and always for a sparse gradient's bucket (as DDP averages it without a
    hook). A float64 bucket is computed in float64 (torch backend).

    Args:
        state: a :class:`~powersgd_triton.PowerSGDState`.
        bucket: the DDP ``GradBucket`` (its buffer may be fp16/bf16, e.g. under ``fp16_compress_wrapper``).

    Returns:
        A future whose value is the bucket buffer, holding the averaged (approximated) gradients.

    Raises:
        TypeError: complex or integer gradients, or ``state`` is not a :class:`~powersgd_triton.PowerSGDState`
            (PyTorch's state: convert it with ``PowerSGDState.from_torch``); before anything is changed.
        RuntimeError: ``state.backend == "triton"`` and the Triton kernels cannot run on the bucket's device: on the
            first call (step 0, in the warm-up too), before anything is changed. ``state`` is registered on two DDP
            models: at the second model's first call, naming both.

    Example::

        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        >>> ddp_model.register_comm_hook(state, powerSGD_hook)
    """
    return _step.run(state, bucket, _Step)


def batched_powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""Batched PowerSGD (drop-in for PyTorch's ``batched_powerSGD_hook``).

    The whole flat bucket of N elements is compressed as one ``s x s`` matrix, ``s = ceil(sqrt(N))``, zero-padded
    (the padding is masked, never stored: the bucket is not resized). As PyTorch's batched hook, the error memory
    covers the whole padded matrix (``s * s`` floats, at most ``2s - 1`` more than the bucket). Faster than
    :func:`powerSGD_hook` but usually much less accurate unless ``matrix_approximation_rank`` is 1. Unlike
    PyTorch's, it uses ``state.orthogonalization_epsilon``.

    Args and returns as :func:`powerSGD_hook`.
    """
    return _step.run(state, bucket, _BatchedStep)
