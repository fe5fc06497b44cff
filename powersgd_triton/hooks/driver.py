"""The step machinery the PowerSGD hooks share: checks, warm-up, collectives, and the state's per-step services.

Used by the hook modules beside it (each hook a :class:`HookStep` class; the list:
:data:`powersgd_triton.variants.VARIANTS`) and :mod:`powersgd_triton.fsdp.hsdp`, through these named functions only
(the hooks never reach into the state's internals):

* before anything changes: :func:`check_state`, :func:`checked_buffer` (:func:`check_bucket`),
  :func:`check_backend_runs`;
* the skeleton of every hook call: :func:`run` with the hook's :class:`HookStep` class (the iteration is counted
  there, once per call);
* warm-up and sparse buckets: :func:`warm_up` (plain averaging all-reduce, :func:`allreduce_average`);
* the bucket's memory: :func:`prepare_bucket` (layout check, migration: :mod:`powersgd_triton.state.buckets`),
  :func:`draw_q`, :func:`p_work`, :func:`memory_dtype` (:mod:`powersgd_triton.state.memory`), :func:`end_of_iteration`,
  :func:`bind_model`; the warm-start Q orthogonalized one step ahead: :func:`orthogonalize_next_q`,
  :func:`take_next_q`;
* per step: :func:`process_group`, :func:`loss_scale` (``grad_scaler``), :func:`wire_dtype` and
  :func:`allreduce_factor` (``communication_dtype``), :func:`report_compression_stats`;
* the schedule: :func:`use_callback_chain` (``then()`` chain on NCCL, in the hook body elsewhere; see
  :mod:`powersgd_triton.hooks.layerwise`), :func:`completed`, :func:`keep_for_current_stream`.

Stream rule (CUDA). Work the hooks queue on another stream than the hook body's — a ``then()`` callback (NCCL: PyTorch
runs it on a stream from its pool, a fresh one per callback) and the side stream of the next step's Q
(:func:`orthogonalize_next_q`) — may run after the last Python reference to a tensor it reads is gone, and the caching
allocator frees a block back to the stream that allocated it at once. So every tensor such work reads or writes is
either

* owned across the step: the state's memory (error, P, Q, work buffers, the layout's device tables, kept until a
  later hook call, after DDP waited for this step's future), the bucket buffer (DDP's), the future's value; or
* allocated by that work itself, on its stream; or
* recorded on that stream before its last reference goes: the storages of the value of the future a callback is
  chained from (PyTorch records them on the callback's stream), or :func:`keep_for_current_stream` called inside the
  callback (``record_stream``; the hooks' ``packed`` uncompressed gradients, the bucket copy of a resume, a copied loss
  scale). The side stream's work outlives the step (it overlaps the next forward, and a ``load_state_dict`` or rebuild
  can drop the memory without waiting for it), so everything it reads is recorded on it, the state's memory included.

``tests/hooks/test_hooks_streams.py`` checks this on the then() chain (``OPTIONS.callback_chain``) with a test double.
"""

import functools
import itertools
import logging
import operator
from typing import Dict, Optional

import torch
import torch.distributed as dist

from powersgd_triton.ops import verify
from powersgd_triton.ops.backend import device_backend
from powersgd_triton.ops.launch import TRUST  # noqa: F401 - the hooks' steps set it around their launches
# the hooks' entry points into the state
from powersgd_triton.state.buckets import bind_model, end_of_iteration, prepare_bucket  # noqa: F401
from powersgd_triton.state.memory import (  # noqa: F401
    BucketMemory, draw_q, drop_next_q, memory_dtype, p_comm, p_work, q_comm,
)
from powersgd_triton.state.models import check_bucket_group, check_one_model
from powersgd_triton.layout import SUPPORTED_DTYPES, check_gradient_dtype
from powersgd_triton.state.powersgd_state import PowerSGDState, check_grad_scaler

logger = logging.getLogger("powersgd_triton.state")  # the state's messages, under the state's logger as before


class HookOptions:
    """The hooks' test seams, in one object (:data:`OPTIONS`); production code never changes them. Tests set a field
    with ``monkeypatch.setattr(driver.OPTIONS, "callback_chain", True)``.

    * ``callback_chain``: True / False force the ``then()`` chain / the in-body schedule (:func:`use_callback_chain`);
      None (default) decides by the process group's backend;
    * ``orthogonalize_ahead``: False orthogonalizes the warm-start Q at the start of each step instead of at the end
      of the last one (:func:`orthogonalize_next_q`; the schedule before 2026-12);
    * ``wire_in_kernels``: False makes the Triton backend all-reduce float32 P and Q through a cast and a copy back, as
      the torch backend does (the oracle of the kernels writing and reading them in the communication dtype).
    """

    __slots__ = ("callback_chain", "orthogonalize_ahead", "wire_in_kernels")

    def __init__(self):
        self.callback_chain: Optional[bool] = None
        self.orthogonalize_ahead = True
        self.wire_in_kernels = True


OPTIONS = HookOptions()


def use_callback_chain(group, buffer: torch.Tensor) -> bool:
    """Whether the hook chains its steps with ``then()`` (NCCL on CUDA tensors) instead of running them in its body
    (every other backend; see :mod:`powersgd_triton.hooks.layerwise`, "Collective order")."""
    if OPTIONS.callback_chain is not None:
        return bool(OPTIONS.callback_chain)
    if buffer.device.type != "cuda":
        return False
    try:
        backend = str(dist.get_backend(group))
    except Exception:  # pragma: no cover - exotic groups
        return False
    return backend.lower() == "nccl" or "cuda:nccl" in backend.lower()


# One side stream per CUDA device for the orthogonalization of the next step's Q.
_SIDE_STREAMS: Dict[torch.device, "torch.cuda.Stream"] = {}


class NextQ:
    """``mem.q_next``: ``mem.q_work`` holds ``orthogonalize(mem.q)`` made with ``epsilon`` and ``config`` from these
    very ``q`` and ``q_work`` tensors at these version counters; ``event`` (CUDA) marks the end of that work on the
    side stream. The tensors are held (not their ids, which Python may reuse), so a replaced tensor never matches."""

    __slots__ = ("q", "q_version", "q_work", "q_work_version", "epsilon", "config", "event")

    def __init__(self, mem: BucketMemory, epsilon: float, config, event):
        self.q, self.q_version = mem.q, mem.q._version
        self.q_work, self.q_work_version = mem.q_work, mem.q_work._version
        self.epsilon, self.config, self.event = epsilon, config, event

    def matches(self, mem: BucketMemory, epsilon: float, config) -> bool:
        return (self.q is mem.q and self.q_work is mem.q_work and self.q_version == mem.q._version
                and self.q_work_version == mem.q_work._version and self.epsilon == epsilon and self.config == config)

    def wait(self) -> bool:
        """Make the current stream of the tensors' device wait for the work (nothing on the CPU); True when the
        work may be used. False, without waiting, while the current stream is being captured into a CUDA graph and
        the work ran outside the capture (on the side stream): a capturing stream must not wait on an event
        recorded outside its capture (CUDA: cudaErrorStreamCaptureIsolation, the capture is invalidated).
        ``torch.cuda.graph`` synchronizes the device before it starts capturing, so that work is done."""
        if self.event is None:
            return True
        if torch.cuda.is_current_stream_capturing():
            return False
        torch.cuda.current_stream(self.q.device).wait_event(self.event)
        return True


def _side_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    """The side stream of a CUDA ``device``, or None (CPU, or a stream being captured into a CUDA graph, which must
    not fork): the work then runs in order on the current stream."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def next_q_target(state, mem: BucketMemory, epsilon: float) -> Optional[torch.Tensor]:
    """``mem.q_work`` when :func:`orthogonalize_next_q` will follow this step's commit with epsilon 0 (what
    ``ops.reconstruct``'s ``orthogonalize_kept`` may do itself: the torch backend on CPU), else None."""
    if state.warm_start and OPTIONS.orthogonalize_ahead and epsilon == 0.0 and mem.layout.num_matrices:
        return mem.q_work
    return None


def orthogonalize_next_q(mem: BucketMemory, epsilon: float, done: bool = False) -> None:
    """After a step that kept its Q in ``mem.q`` (warm start; ``reconstruct`` commits it where the step is finite):
    ``mem.q_work <- orthogonalize(mem.q)`` now, the next step's first computation, and ``mem.q_next`` says so.

    On CUDA it runs on a side stream that waits for the current one (the commit), so it overlaps whatever the
    device does next (later buckets, the optimizer, the next forward) instead of delaying the next step's
    ``project``: Q is known a whole iteration before it is needed. It reads ``q`` and writes ``q_work``, which
    nothing else touches until the next step of this bucket (:func:`take_next_q`, which makes its stream wait for
    it) or a writer of either tensor (:func:`powersgd_triton.state.memory.drop_next_q`, called by the allocation,
    adoption and random draw of the memory). Same kernel, config and input as at the start of the next step:
    bitwise the same Q. ``done``: ``ops.reconstruct`` wrote it already (its ``orthogonalize_kept``, with
    :func:`next_q_target`); only ``mem.q_next`` is set. Through ``mem.steps.orthogonalize`` always, also where a
    step plan holds the launch bound (``bench/gpucheck`` delays that call on the side stream, and its CPU dry run
    the call inside this function)."""
    if not OPTIONS.orthogonalize_ahead or mem.layout.num_matrices == 0:
        return
    if mem.q_next is not None:
        drop_next_q(mem)
    config = mem.configs.get("orthogonalize")
    device = mem.q.device
    stream = None if done or device.type != "cuda" else _side_stream(device)
    event = None
    steps = mem.steps
    if stream is None:
        if not done:
            steps.orthogonalize(mem.q, mem.layout, "q", epsilon, out=mem.q_work)
    else:
        stream.wait_stream(torch.cuda.current_stream(mem.q.device))
        with torch.cuda.stream(stream):
            steps.orthogonalize(mem.q, mem.layout, "q", epsilon, out=mem.q_work)
        # the caching allocator must not hand these out to another stream while the side stream uses them: Q, its
        # output, and what the Triton launcher keeps per layout (task tables, Gram workspace), all allocated on
        # other streams and freed without waiting for this one when the memory is dropped (rebuild, load)
        mem.q.record_stream(stream)
        mem.q_work.record_stream(stream)
        for kept in steps.kept_tensors(mem.q, mem.layout, "q", mem.q_work):
            kept.record_stream(stream)
        event = stream.record_event()
    mem.q_next = NextQ(mem, epsilon, config, event)


def take_next_q(mem: BucketMemory, epsilon: float) -> bool:
    """True when ``mem.q_work`` holds ``orthogonalize(mem.q)`` made ahead (:func:`orthogonalize_next_q`) from the
    same ``q`` and ``q_work`` unchanged since (same tensors, same version counters: a ``load_state_dict``, a new
    draw or an in-place torch write to ``q`` in between makes it False), with this ``epsilon`` and orthogonalize
    config; the current stream then waits for that work. Clears ``mem.q_next`` either way (after waiting for it;
    while a CUDA graph is being captured, work made outside the capture is neither waited for nor used:
    :meth:`NextQ.wait`)."""
    ahead = mem.q_next
    if ahead is None:
        return False
    mem.q_next = None
    return (ahead.event is None or ahead.wait()) and ahead.matches(mem, epsilon, mem.configs.get("orthogonalize"))


def keep_for_current_stream(*tensors: Optional[torch.Tensor]) -> None:
    """``record_stream`` each CUDA tensor on the current stream of its device (inside a ``then()`` callback: the
    callback's pool stream), so that the caching allocator does not reuse its memory before the work queued on that
    stream is done (see the stream rule in the module docstring). None and CPU tensors are skipped (nothing is
    asynchronous there). Call it inside the callback, before queuing the work that reads the tensors."""
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


def completed(value: torch.Tensor) -> torch.futures.Future:
    """An already completed future holding ``value`` (what a hook that finished in its body returns)."""
    fut = torch.futures.Future(devices=[value.device] if value.device.type == "cuda" else None)
    fut.set_result(value)
    return fut


def allreduce_average(group, world_size: int, buffer: torch.Tensor) -> torch.futures.Future:
    """Plain averaging all-reduce (PyTorch's ``default._allreduce_fut``: divide first, then sum)."""
    buffer.div_(world_size)
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def allreduce_factor(state: PowerSGDState, factor: torch.Tensor, buffer: torch.Tensor, group) -> torch.futures.Future:
    """Sum-all-reduce of a packed factor (P or Q), in ``state.communication_dtype`` (default: the bucket's dtype):
    a factor already in that dtype (the Triton backend's ``p_send`` / ``q_raw``, written so by the kernels) as it
    is; a float32 one (the torch backend's) with one cast of the whole packed buffer before the all-reduce and one
    copy back into ``factor`` after it (no per-matrix work). Either way the values round to nearest and overflow to
    inf, never to a finite wrong value: such a step is non-finite (its memory is kept, GradScaler skips it). The
    future completes when ``factor`` holds the sum."""
    wire = wire_dtype(state, buffer, factor.dtype)
    if wire is None:
        return dist.all_reduce(factor, group=group, async_op=True).get_future()
    sent = factor.to(wire)
    fut = dist.all_reduce(sent, group=group, async_op=True).get_future()
    return fut.then(lambda f: factor.copy_(f.value()[0]))


_PRESENT = functools.partial(operator.is_not, None)
_DTYPE = operator.attrgetter("dtype")
_SIXTEEN = itertools.repeat(16)  # endless: map() stops at its other iterable's end


def launch_trust(steps, tensors: tuple):
    """The :data:`powersgd_triton.ops.launch.TRUST` key of a hook step's launches: the facts
    Triton specializes a kernel on (type, dtype, data pointer modulo 16 bytes) of ``tensors`` (None allowed), read
    once per step in C calls (no Python call per tensor). Every tensor the step's launches take is one of them, a
    table of the bucket's layout (made once, never written), or one the step or a launcher allocates (its dtype fixed
    by the code, its address aligned by the allocator: 64 bytes on CPU, 512 on CUDA); a launch plan that checked its
    tensors under the same key object then skips that check (``DirectLaunch``). The key is kept in ``steps.facts``
    (:class:`~powersgd_triton.ops.backend.TritonSteps`): the same object while the facts stay equal, a new one when
    they change. None for the torch backend."""
    if getattr(steps, "backend", None) != "triton":
        return None
    present = tuple(filter(_PRESENT, tensors))
    facts = (tuple(map(type, tensors)), tuple(map(_DTYPE, present)),
             tuple(map(operator.mod, map(torch.Tensor.data_ptr, present), _SIXTEEN)))
    if facts != steps.facts:  # TritonSteps.facts: the same object while the facts stay equal
        steps.facts = facts
    return steps.facts


def check_backend_runs(state, buffer: torch.Tensor) -> None:
    """``RuntimeError`` when ``backend="triton"`` cannot run on ``buffer``'s device; checked on every hook call
    from step 0 (warm-up included), so the error comes before training, not at ``start_powerSGD_iter``. Free
    after the first call per device."""
    if state.backend != "triton" or buffer.device in state.buckets.backend_devices:
        return
    device_backend("triton", buffer.device)
    state.buckets.backend_devices.add(buffer.device)


def wire_dtype(state, buffer: torch.Tensor, factor_dtype: torch.dtype) -> Optional[torch.dtype]:
    """The dtype P and Q of ``buffer``'s bucket are all-reduced in, when it is not ``factor_dtype`` (the
    memory's); None when the factors are all-reduced as they are."""
    wire = state.communication_dtype if state.communication_dtype is not None else buffer.dtype
    return None if wire == factor_dtype else wire


def loss_scale(state, buffer: torch.Tensor) -> Optional[torch.Tensor]:
    """The grad scaler's current scale (one-element float32 tensor on ``buffer``'s device, read without a host
    synchronization), or None: no scaler, a disabled one, or one that has not scaled a loss yet (scale 1)."""
    scaler = state.grad_scaler
    if scaler is None or not scaler.is_enabled():
        return None
    check_grad_scaler(scaler)  # the attribute may have been reassigned
    scale = getattr(scaler, "_scale", None)
    if scale is None:
        return None
    if scale.device != buffer.device:
        scale = scale.to(buffer.device, non_blocking=True)
    return scale.reshape(1)


_GRADIENT_DTYPES = frozenset(SUPPORTED_DTYPES) | {torch.float64}  # check_gradient_dtype's accepted dtypes
_DIST = dist.is_available()  # torch.distributed built in (fixed for the process)
_PROCESS_GROUP = dist.ProcessGroup if _DIST else ()


def process_group(state):
    """The process group the hooks use: ``process_group``, or WORLD when it is None (resolved at call time:
    ``dist.group.WORLD``, None until ``init_process_group``)."""
    group = state.process_group
    if group is not None:
        return group
    group = dist.group.WORLD if _DIST else None
    if group is None:
        raise RuntimeError(
            "PowerSGDState.process_group is None and the default process group is not initialized: "
            "call torch.distributed.init_process_group() before training"
        )
    return group


def group_size(group) -> int:
    """``dist.get_world_size(group)``: for a ProcessGroup (WORLD included) its ``size()``, which is what
    ``get_world_size`` returns for one, in one call instead of its eight Python calls; anything else through
    ``get_world_size``."""
    if isinstance(group, _PROCESS_GROUP):
        return group.size()
    return dist.get_world_size(group)


def report_compression_stats(state, bucket) -> None:
    """Log ``state.compression_stats()`` after the last bucket of an iteration, every
    ``compression_stats_logging_frequency`` iterations (as PyTorch's hook does)."""
    if bucket.is_last() and state.iter >= state.next_stats_report:
        rate, before, after = state.compression_stats()
        logger.info(
            "Compression stats: iter %s, total before compression %s, total after compression %s, rate %s",
            state.iter,
            before,
            after,
            rate,
        )
        state.next_stats_report = state.iter + state.compression_stats_logging_frequency


# What works instead of compiled DDP's python reducer / compiled autograd (torch's own error for compiled autograd with
# DDP's C++ reducer points at the python reducer; ours must not point back).
COMPILED_AUTOGRAD_WAY_OUT = (
    "PowerSGD needs whole DDP buckets, which only DDP's C++ reducer gives; compiled autograd works only with the "
    "python reducer, so the two cannot be combined: run the backward without compiled autograd "
    "(torch._dynamo.config.compiled_autograd = False, no torch._dynamo.compiled_autograd.enable()) and keep "
    "optimize_ddp='ddp_optimizer' (the default: torch.compile of the model with DDPOptimizer, which these hooks "
    "support) or 'no_optimization'"
)


def check_bucket(bucket) -> None:
    """Refuse callers that are not DDP's C++ reducer with a clear error (a bucket check of a few isinstance calls)."""
    if isinstance(bucket, tuple):
        raise TypeError(
            "PowerSGD hook called with a (grad, param) tuple instead of a torch.distributed.GradBucket: this is "
            "compiled DDP's python reducer (torch._dynamo.config.optimize_ddp='python_reducer'), which calls comm "
            "hooks once per parameter. " + COMPILED_AUTOGRAD_WAY_OUT
        )
    if isinstance(bucket, torch.Tensor):
        raise TypeError(
            "PowerSGD hook called with a tensor instead of a torch.distributed.GradBucket: this is FSDP's "
            "register_comm_hook (FullyShardedDataParallel), which is not supported. The powersgd_triton hooks work "
            "with torch.nn.parallel.DistributedDataParallel only"
        )
    if not callable(getattr(bucket, "buffer", None)):
        raise TypeError(
            f"PowerSGD hook expects a torch.distributed.GradBucket (DistributedDataParallel.register_comm_hook), "
            f"got {type(bucket).__name__}"
        )


def check_state(state, hook: str) -> None:
    """``TypeError`` unless ``state`` is our :class:`PowerSGDState` (PyTorch's own state is the likely mistake)."""
    if isinstance(state, PowerSGDState):
        return
    kind = f"{type(state).__module__}.{type(state).__qualname__}"
    hint = ""
    if type(state).__name__ == "PowerSGDState":
        hint = (
            " (PyTorch's); import PowerSGDState from powersgd_triton as well, or convert it once with "
            "powersgd_triton.PowerSGDState.from_torch(state) and register that"
        )
    raise TypeError(f"{hook} needs a powersgd_triton.PowerSGDState as its state, got {kind}{hint}")


def checked_buffer(bucket) -> torch.Tensor:
    """The bucket's flat buffer, after the checks every hook makes before it changes anything.

    Raises the caller-mode error of :func:`check_bucket` (compiled DDP's python reducer, FSDP), ``TypeError`` for
    complex or integer gradients and ``ValueError`` for a dense buffer that is not 1-D. A sparse buffer (DDP gives
    a sparse gradient, ``nn.Embedding(..., sparse=True)``, a bucket of its own, whose buffer is that gradient) is
    returned as it is: :func:`warm_up` averages it with a plain all-reduce.
    """
    check_bucket(bucket)
    buffer = bucket.buffer()
    if buffer.dtype not in _GRADIENT_DTYPES:
        check_gradient_dtype(buffer.dtype)
    if buffer.is_sparse:
        return buffer
    if buffer.dim() != 1:
        raise ValueError(f"bucket buffer must be 1-D, got shape {tuple(buffer.shape)}")
    return buffer


def warm_up(state: PowerSGDState, bucket, buffer: torch.Tensor, hook: Optional[type] = None):
    """``(group, world_size, future)``: ``future`` is the plain averaged all-reduce while
    ``iter < start_powerSGD_iter`` (PyTorch's warm-up) and, at every step, for a sparse bucket (as DDP's default
    hook averages it: PowerSGD compresses dense matrices); else None and the hook compresses. The iteration is
    counted by :func:`run`, not here.

    What the state dict's draws ahead need of ``hook`` (the :class:`HookStep` class; None: ``powerSGD_hook``'s), its
    ``batched`` and ``draws_q_each_step``, is recorded with the bucket's dtype in warm-up calls (the first compressed
    step's Qs drawn ahead for a state dict: :mod:`powersgd_triton.state.predraw`).

    Raises ``RuntimeError`` (before anything is changed, from step 0) when ``backend="triton"`` cannot run on the
    bucket's device."""
    if state.backend == "triton" and buffer.device not in state.buckets.backend_devices:
        check_backend_runs(state, buffer)
    group = process_group(state)
    world_size = group.size() if isinstance(group, _PROCESS_GROUP) else group_size(group)
    if state.buckets.group_checked is not group:  # the state's group is DDP's: checked again when it changed
        check_bucket_group(state, bucket, group)
    if state.iter < state.start_powerSGD_iter:
        check_one_model(state, bucket)  # a second DDP model on this state: refused at its first call
        hook = HookStep if hook is None else hook  # for powersgd_triton.state.predraw:
        state.buckets.index_dtypes[bucket.index()] = (buffer.dtype, hook.batched, hook.draws_q_each_step)
        return group, world_size, allreduce_average(group, world_size, buffer)
    if buffer.is_sparse:
        return group, world_size, allreduce_average(group, world_size, buffer)
    return group, world_size, None


class HookStep:
    """One compressed step of one bucket, as a hook defines it for :func:`run` (the hooks' step classes:
    :data:`powersgd_triton.variants.VARIANTS`, ``step``).

    Class attributes: ``name`` (the hook's name in messages), ``batched`` (the whole bucket as one matrix),
    ``draws_q_each_step`` (without warm start, each compressed step draws a fresh random Q per bucket, as PyTorch's
    hooks do; False for a hook whose factors are kept: it draws once), ``check_settings`` (None, or a function of
    the state that refuses settings the hook cannot run with, before anything is changed). Made with ``(state, mem,
    buffer, group, world_size)`` after the bucket's memory is prepared; then :func:`run` calls

    * :meth:`begin` (the compression statistics, the first-use check, the work before the first all-reduce): the
      step's rounds ``[(factor, after), ...]``: each ``factor`` is sum-all-reduced in turn (:func:`allreduce_factor`)
      and ``after()`` (or None) runs once it holds the sum, before the next one; or a future, when the bucket is
      all-reduced plainly after all (nothing to compress, where the hook does that);
    * :meth:`finish`: the work after the last all-reduce; returns the output (checked by the first-use check); with
      ``remap`` set, :meth:`output` maps it to the future's value;
    * ``kept`` (an attribute, set by :meth:`begin`): the tensors a ``then()`` callback records on its stream (the
      stream rule above);
    * :meth:`start` and :meth:`rounds` again on :meth:`again` (a fresh step on the same memory and tensors) for the
      torch replay of a failed first-use check.

    Attributes the subclasses set: ``state``, ``mem``, ``buffer`` (what the step computes on), ``bucket_buffer``
    (DDP's), ``group``, ``world_size``, ``check`` (the first-use check or None), ``steps`` (the numeric steps:
    ``mem.steps``, or the check's), ``pending`` (an all-reduce still in flight when the rounds are empty), ``remap``,
    ``kept``.
    """

    __slots__ = ()
    name = "powerSGD_hook"
    batched = False
    draws_q_each_step = True
    check_settings = None

    def begin(self, bucket):
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def rounds(self):
        raise NotImplementedError

    def finish(self) -> torch.Tensor:
        raise NotImplementedError

    def output(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def again(self) -> "HookStep":
        raise NotImplementedError

    def begin_check(self, packs: bool, index: int, project_packs: bool = False) -> None:
        """The first-use check of this bucket's Triton kernels, when one is due (``mem.verify_pending``; after its
        verdict the caller's one attribute test): :mod:`powersgd_triton.ops.verify`; sets ``check`` and ``steps``."""
        mem = self.mem
        self.check = verify.begin(self.state, mem, self.buffer, self.group, self.world_size, index, packs,
                                  project_packs)
        # the memory's steps may have changed (a kernel known wrong: the bucket moved to torch)
        self.steps = mem.steps if self.check is None else self.check.steps

    def replay(self) -> torch.Tensor:
        """The whole step again on the torch backend, in the caller: the first-use check found a kernel wrong and
        put the memory back as it was before the step (:meth:`powersgd_triton.ops.verify.Check.end`); every rank runs
        it, in the same order of collectives."""
        again = self.again()
        again.start()
        for factor, after in again.rounds():
            allreduce_factor(again.state, factor, again.bucket_buffer, again.group).wait()
            if after is not None:
                after()
        return again.finish()


def run(state: PowerSGDState, bucket, hook) -> torch.futures.Future:
    """THE skeleton of every hook call: checks, warm-up, the bucket's memory, the step's phases between its
    all-reduces, the future. ``hook`` is the hook's :class:`HookStep` class.

    Order: the checks that change nothing (state, bucket, the hook's settings); the warm-up or a sparse bucket (a plain
    averaging all-reduce); else the bucket's memory (:func:`prepare_bucket`), the step's :meth:`~HookStep.begin` (its
    work before the first all-reduce); the iteration counted (here only, in the hook body: ``iter`` is exact whatever
    the backend); then the all-reduces of the step's rounds and :meth:`~HookStep.finish`: chained with ``then()`` on
    NCCL (:func:`use_callback_chain`), in the hook body elsewhere (the collectives' order is then the same on every
    rank: "Collective order" in :mod:`powersgd_triton.hooks.layerwise`)."""
    if not isinstance(state, PowerSGDState):
        check_state(state, hook.name)
    buffer = checked_buffer(bucket)
    if hook.check_settings is not None:
        hook.check_settings(state)
    group, world_size, plain = warm_up(state, bucket, buffer, hook)
    # a sparse bucket after the warm-up: the hook does not see it, and if it is the last one it ends the iteration
    skipped = plain is not None and buffer.is_sparse and state.iter >= state.start_powerSGD_iter
    if plain is None:
        mem = prepare_bucket(state, bucket, buffer, hook.batched, group)
        mem.draws_q_each_step = hook.draws_q_each_step  # for powersgd_triton.state.predraw
        step = hook(state, mem, buffer, group, world_size)
        rounds = step.begin(bucket)
        if not isinstance(rounds, list):
            plain = rounds
    state.maybe_increase_iter(bucket)  # the one place the iteration is counted
    if plain is not None:
        if skipped and bucket.is_last():
            end_of_iteration(state)  # as prepare_bucket does for the last bucket it prepares
        return plain

    # the step's all-reduces and its finish: a then() chain (NCCL) or in the hook body (elsewhere)
    def finish() -> torch.Tensor:
        out = step.finish()
        if step.check is not None:
            out = step.check.end(out, step.replay)
        return step.output(out) if step.remap else out

    if not use_callback_chain(group, buffer):
        for factor, after in rounds:
            allreduce_factor(state, factor, buffer, group).wait()
            if after is not None:
                after()
        return completed(finish())

    kept = step.kept  # allocated in the hook body, read by the callbacks: recorded on their streams

    def finish_chained(fut) -> torch.Tensor:
        keep_for_current_stream(*kept)
        return finish()

    if not rounds:
        return completed(finish()) if step.pending is None else step.pending.get_future().then(finish_chained)
    fut = allreduce_factor(state, rounds[0][0], buffer, group)
    for (_, after), (factor, _) in zip(rounds, rounds[1:]):

        def chained(fut, after=after, factor=factor):
            keep_for_current_stream(*kept)
            after()
            return allreduce_factor(state, factor, buffer, group).wait()

        fut = fut.then(chained)
    return fut.then(finish_chained)
