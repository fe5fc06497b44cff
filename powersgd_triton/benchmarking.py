"""Benchmark infrastructure, reusable from ``bench/``, ``bench/gpu_check.py``, the CLI and notebooks.

Nothing here asserts a speed: it builds inputs, runs both hooks the same way, times them and *counts* what they do.

* :class:`FakeGradBucket`: stands in for ``torch.distributed.GradBucket`` (``buffer()``, ``gradients()``,
  ``index()``, ``is_last()``, ``parameters()``, ``set_buffer()``) over one flat buffer whose gradients are views.
* :func:`model_buckets`: the DDP-like buckets of a real model's gradient shapes (:mod:`powersgd_triton.shapes`),
  filled with random numbers (never zeros: zeros hide unwritten outputs and can run faster than real data).
* :func:`ensure_process_group`: an in-process world of size 1 (gloo, or nccl on a GPU) over a ``HashStore``.
* :class:`HookStep`: one step of a hook over every bucket of a model, PyTorch's ``powerSGD_hook`` (``impl="pytorch"``)
  or ours (``impl="ours"``), created with the same arguments; the hook is called for every bucket in index order.
* Counting, measured not computed: :class:`OpCounter` (ATen ops through a ``TorchDispatchMode``),
  :func:`synchronous_collectives` (all-reduce calls and bytes, per bucket; also makes every ``then()`` callback run
  inline so that the op counter sees it), :func:`count_triton_launches` (launch hook on Triton's ``run``),
  :func:`count_cuda_kernels` (``torch.profiler`` device events), :func:`held_bytes` (tensors a hook state keeps, per
  bucket), :func:`peak_extra_bytes` (CUDA allocator peak, or the CPU profiler's allocation trace).
* :class:`KernelBench`: the four bucket steps alone on one bucket, ours (:mod:`powersgd_triton.ops`) and PyTorch's
  hook's equivalent code, with the byte model :func:`kernel_bytes` (bytes read + written, each once).
* :func:`time_cpu`, :func:`time_interleaved` (several functions in turn: fair on a machine whose load drifts),
  :func:`compare_hooks` (both hooks on a model, interleaved, with counts: what ``powersgd-triton bench`` prints),
  :func:`environment`, :func:`markdown_table`.
"""

import contextlib
import datetime
import math
import os
import platform
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .layout import KERNELS, BucketLayout
from .shapes import Shape, ddp_buckets, model_shapes, numel

IMPLS = ("pytorch", "ours")  # what compare_hooks and bench/ run by default
ALL_IMPLS = IMPLS + ("alternating",)  # make_hook also knows powersgd_triton.alternating_powerSGD_hook
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DDP_FIRST_BUCKET_MB = 1.0  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES, also used after DDP rebuilds its buckets


# ============================================================================================ buckets
class FakeGradBucket:
    """A ``GradBucket`` stand-in: one flat 1-D buffer, the gradients are row-major views into it, back to back.

    Args:
        buffer: flat 1-D tensor holding every gradient.
        shapes: gradient shapes, in buffer order.
        index: bucket index (DDP: bucket 0 holds the last layers, its gradients are ready first).
        num_buckets: number of buckets of the model; ``is_last()`` is ``index == num_buckets - 1`` like DDP's.
        parameters: optional parameter tensors; by default ``meta`` parameters of the gradients' shapes (no memory).
    Raises:
        ValueError: the shapes do not fill the buffer exactly, or the buffer is not 1-D.
    """

    def __init__(self, buffer: torch.Tensor, shapes: Sequence[Shape], index: int = 0, num_buckets: int = 1,
                 parameters: Optional[List[torch.Tensor]] = None):
        self._shapes = [tuple(int(d) for d in s) for s in shapes]
        self._index = int(index)
        self._num_buckets = int(num_buckets)
        if not 0 <= self._index < self._num_buckets:
            raise ValueError(f"bucket index {index} outside 0..{num_buckets - 1}")
        self._parameters = parameters
        self._set(buffer)

    def _set(self, buffer: torch.Tensor) -> None:
        if buffer.dim() != 1:
            raise ValueError(f"bucket buffer must be 1-D, got {tuple(buffer.shape)}")
        total = sum(numel(s) for s in self._shapes)
        if total != buffer.numel():
            raise ValueError(f"shapes hold {total} elements, the buffer {buffer.numel()}")
        views, off = [], 0
        for s in self._shapes:
            views.append(buffer[off : off + numel(s)].view(s))
            off += numel(s)
        self._buffer = buffer
        self._gradients = views

    # -- the GradBucket API
    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> List[torch.Tensor]:
        return list(self._gradients)

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._num_buckets - 1

    def parameters(self) -> List[torch.Tensor]:
        if self._parameters is None:
            self._parameters = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in self._shapes]
        return list(self._parameters)

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the buffer (same number of elements); the gradients become views of the new one."""
        self._set(tensor)

    # -- helpers
    @property
    def shapes(self) -> List[Shape]:
        return list(self._shapes)

    @property
    def nbytes(self) -> int:
        return self._buffer.numel() * self._buffer.element_size()

    def __repr__(self) -> str:
        return (f"FakeGradBucket(index={self._index}/{self._num_buckets}, tensors={len(self._shapes)}, "
                f"numel={self._buffer.numel()}, dtype={self._buffer.dtype}, device={self._buffer.device})")


def _dtype(dtype) -> torch.dtype:
    return DTYPES[dtype] if isinstance(dtype, str) else dtype


def random_buffer(n: int, dtype, device, generator: Optional[torch.Generator] = None, scale: float = 1.0):
    """``n`` standard normal numbers times ``scale`` in ``dtype`` on ``device`` (drawn on ``generator``'s device)."""
    dtype, device = _dtype(dtype), torch.device(device)
    gen_device = generator.device if generator is not None else device
    x = torch.randn(n, generator=generator, device=gen_device, dtype=torch.float32)
    if scale != 1.0:
        x.mul_(scale)
    return x.to(device=device, dtype=dtype)


def shrink_shapes(shapes: Sequence[Shape], div: int) -> List[Shape]:
    """Divide channel/feature dims by ``div`` (not 3x3/7x7 kernel dims) for quick runs; same tensor count."""
    if div <= 1:
        return [tuple(s) for s in shapes]
    out = []
    for s in shapes:
        if len(s) == 4:
            out.append((max(1, s[0] // div), max(1, s[1] // div), s[2], s[3]))
        else:
            out.append(tuple(max(1, d // div) for d in s))
    return out


def model_bucket_shapes(model: str, dtype=torch.float32, bucket_cap_mb: float = 25.0,
                        first_bucket_mb: float = DDP_FIRST_BUCKET_MB, shrink: int = 1) -> List[List[Shape]]:
    """``model``'s gradient shapes split like DDP (reverse order, ``bucket_cap_mb`` MiB, bytes of ``dtype``)."""
    dtype = _dtype(dtype)
    shapes = shrink_shapes(model_shapes(model), shrink)
    esize = torch.empty((), dtype=dtype).element_size()
    return ddp_buckets(shapes, bucket_cap_mb, element_size=esize, first_bucket_mb=first_bucket_mb)


def model_buckets(model: str, dtype=torch.float32, device="cpu", bucket_cap_mb: float = 25.0,
                  first_bucket_mb: float = DDP_FIRST_BUCKET_MB, shrink: int = 1,
                  generator: Optional[torch.Generator] = None) -> List[FakeGradBucket]:
    """Random-filled :class:`FakeGradBucket` s of ``model`` (see :func:`model_bucket_shapes`), bucket 0 first."""
    groups = model_bucket_shapes(model, dtype, bucket_cap_mb, first_bucket_mb, shrink)
    out = []
    for i, shapes in enumerate(groups):
        buf = random_buffer(sum(numel(s) for s in shapes), dtype, device, generator)
        out.append(FakeGradBucket(buf, shapes, index=i, num_buckets=len(groups)))
    return out


def bucket_layout(bucket: FakeGradBucket, rank: int, min_compression_rate: float = 2.0) -> BucketLayout:
    """The layer-wise :class:`BucketLayout` of a bucket, with the hooks' default ``min_compression_rate``."""
    return BucketLayout.from_gradients(bucket.buffer(), bucket.gradients(), rank, min_compression_rate)


# ============================================================================================ process group
def ensure_process_group(backend: Optional[str] = None) -> str:
    """Initialise an in-process world of size 1 (``HashStore``) if none is; returns the backend in use.

    ``backend=None``: nccl when CUDA and NCCL are there, else gloo. An already initialised group is kept.
    """
    if dist.is_initialized():
        return str(dist.get_backend())
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return backend


# ============================================================================================ hooks
def make_hook(impl: str, rank: int, *, batched: bool = False, backend: str = "auto", start_powerSGD_iter: int = 2,
              **state_kwargs):
    """``(state, hook)`` for ``impl`` ("pytorch": torch's own, "ours", "alternating": our
    ``alternating_powerSGD_hook``, layer-wise only), same PowerSGD arguments for all.

    Defaults are PyTorch's (``min_compression_rate=2``, error feedback and warm start on, epsilon 0) except
    ``start_powerSGD_iter=2`` (the smallest allowed with error feedback). ``backend`` only applies to ours.
    Raises ``ValueError`` for an unknown impl, ``RuntimeError`` for the alternating hook with ``batched=True``.
    """
    kwargs = dict(process_group=None, matrix_approximation_rank=int(rank), start_powerSGD_iter=start_powerSGD_iter)
    kwargs.update(state_kwargs)
    if impl == "pytorch":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as m

        return m.PowerSGDState(**kwargs), (m.batched_powerSGD_hook if batched else m.powerSGD_hook)
    if impl == "ours":
        import powersgd_triton as pkg

        return pkg.PowerSGDState(backend=backend, **kwargs), (pkg.batched_powerSGD_hook if batched else pkg.powerSGD_hook)
    if impl == "alternating":
        import powersgd_triton as pkg

        if batched:
            raise RuntimeError("the alternating hook is layer-wise only")
        return pkg.PowerSGDState(backend=backend, **kwargs), pkg.alternating_powerSGD_hook
    raise ValueError(f"unknown impl {impl!r}; expected one of {ALL_IMPLS}")


class HookStep:
    """One DDP-like step of a hook over all ``buckets``: the hook is called for each bucket in index order.

    ``wait_each``: wait for each bucket's future before calling the hook on the next bucket (default on every
    backend but nccl). With gloo, PyTorch's hook runs its ``then()`` callbacks on gloo's worker threads and each
    callback blocks on a new all-reduce: with several buckets in flight every worker thread can end up blocked and
    the step deadlocks (seen here with world size 1 and ResNet-50's 5 buckets). With nccl (futures complete at
    enqueue) all hooks are called first and the futures waited for at the end, as DDP does.

    The buffers are updated in place by the hook; with error feedback the next step's input is the previous one
    (``M + E`` = approximation + new error), so repeated steps keep their magnitude and never reach zeros.
    ``current_bucket`` tells :func:`synchronous_collectives` which bucket a collective belongs to.
    """

    def __init__(self, impl: str, buckets: Sequence[FakeGradBucket], rank: int, *, batched: bool = False,
                 backend: str = "auto", wait_each: Optional[bool] = None, **state_kwargs):
        self.impl = impl
        self.buckets = list(buckets)
        self.rank = rank
        self.state, self.hook = make_hook(impl, rank, batched=batched, backend=backend, **state_kwargs)
        self.current_bucket: Optional[int] = None
        if wait_each is None:
            wait_each = not (dist.is_initialized() and "nccl" in str(dist.get_backend()).lower())
        self.wait_each = wait_each

    def __call__(self) -> None:
        futs = []
        for b in self.buckets:
            self.current_bucket = b.index()
            fut = self.hook(self.state, b)
            if self.wait_each:
                fut.wait()
            else:
                futs.append(fut)
        self.current_bucket = None
        for f in futs:
            f.wait()

    def warmup(self, compressed_steps: int = 1) -> "HookStep":
        """Run the plain all-reduce iterations, then ``compressed_steps`` compressed ones (allocations, first Q)."""
        guard = 0
        while self.state.iter < self.state.start_powerSGD_iter:
            self()
            guard += 1
            if guard > self.state.start_powerSGD_iter + 2:
                raise RuntimeError("hook state does not advance its iteration counter")
        for _ in range(compressed_steps):
            self()
        return self

    def memory(self) -> Dict[Optional[int], int]:
        """Bytes of tensors the hook's state keeps, per bucket index (:func:`held_bytes`)."""
        return held_bytes(self.state)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


# ============================================================================================ counting
_ALLOC_OPS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "resize_", "set_"}


def _op_kind(func) -> str:
    name = str(func)  # "aten.add.Tensor"
    if name.startswith("c10d."):
        return "collective"
    packet = name.split(".")[1] if "." in name else name
    if packet in _ALLOC_OPS:
        return "alloc"
    try:
        if func.is_view:
            return "view"
    except Exception:  # pragma: no cover
        pass
    if packet in ("detach", "alias", "lift_fresh", "_unsafe_view", "view", "as_strided", "t", "unsqueeze"):
        return "view"
    return "compute"


try:
    from torch.utils._python_dispatch import TorchDispatchMode
except Exception:  # pragma: no cover
    TorchDispatchMode = object  # type: ignore


class OpCounter(TorchDispatchMode):
    """Counts the ATen (and c10d) ops run on this thread while active.

    ``by_kind``: ``compute`` (everything that touches data), ``view``, ``alloc`` (empty tensors), ``collective``.
    ``by_op``: counts per overload name. Thread-local like every dispatch mode: run the code under
    :func:`synchronous_collectives` so that ``then()`` callbacks run on this thread.
    """

    def __init__(self):
        super().__init__()
        self.by_op: Counter = Counter()
        self.by_kind: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_op[str(func)] += 1
        self.by_kind[_op_kind(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(v for k, v in self.by_kind.items() if k != "collective")

    @property
    def compute(self) -> int:
        return self.by_kind["compute"]


class _DoneWork:
    """A finished ``Work``: ``wait()`` returns at once, ``get_future()`` is a completed future of ``[tensor]``."""

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self):
        return [self._tensor]

    def get_future(self):
        t = self._tensor
        fut = torch.futures.Future(devices=[t.device]) if t.device.type == "cuda" else torch.futures.Future()
        fut.set_result([t])
        return fut


@dataclass
class CollectiveRecord:
    bucket: Optional[int]
    numel: int
    nbytes: int
    dtype: str


@contextlib.contextmanager
def synchronous_collectives(step: Optional[HookStep] = None):
    """Run every ``dist.all_reduce`` synchronously and record it (bucket, elements, bytes, dtype).

    Returned works and futures are already complete, so ``then()`` callbacks run inline on the calling thread (for
    :class:`OpCounter`). The numbers are unchanged (the real all-reduce still runs). Only for counting, not timing.
    Yields the list of :class:`CollectiveRecord`.
    """
    records: List[CollectiveRecord] = []
    original = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        records.append(CollectiveRecord(step.current_bucket if step is not None else None, tensor.numel(),
                                        tensor.numel() * tensor.element_size(), str(tensor.dtype).replace("torch.", "")))
        original(tensor, op=op, group=group, async_op=False)
        return _DoneWork(tensor) if async_op else None

    dist.all_reduce = all_reduce
    try:
        yield records
    finally:
        dist.all_reduce = original


@contextlib.contextmanager
def count_triton_launches(execute: bool = True):
    """Count Triton kernel launches (interpreted or compiled) inside the block; yields ``{"n": count, "by": {}}``.

    ``execute=False`` (interpreter only) counts without running the kernels: for launch counts of big shapes on a
    CPU. That is valid for our hooks because nothing they do depends on the numbers (no host synchronisation); the
    outputs are then garbage.
    """
    count = {"n": 0, "by": Counter()}
    patches = []
    try:
        from triton.runtime.interpreter import InterpretedFunction

        orig_i = InterpretedFunction.run

        def run_i(self, *args, **kwargs):
            count["n"] += 1
            count["by"][getattr(self.fn, "__name__", "?")] += 1
            if execute:
                return orig_i(self, *args, **kwargs)
            return None

        patches.append((InterpretedFunction, "run", orig_i))
        InterpretedFunction.run = run_i
    except Exception:  # pragma: no cover - no triton
        pass
    try:
        from triton.runtime.jit import JITFunction

        orig_j = JITFunction.run

        def run_j(self, *args, **kwargs):
            # warmup=True compiles without launching
            if not kwargs.get("warmup", False):
                count["n"] += 1
                count["by"][getattr(self.fn, "__name__", "?")] += 1
            return orig_j(self, *args, **kwargs)

        patches.append((JITFunction, "run", orig_j))
        JITFunction.run = run_j
    except Exception:  # pragma: no cover
        pass
    try:
        yield count
    finally:
        for cls, name, orig in patches:
            setattr(cls, name, orig)


@dataclass
class StepCounts:
    """What one step did, measured (see :func:`count_step`)."""

    aten_compute: int = 0
    aten_total: int = 0
    by_op: Dict[str, int] = field(default_factory=dict)
    collectives: List[CollectiveRecord] = field(default_factory=list)
    triton_launches: Optional[int] = None
    triton_by_kernel: Dict[str, int] = field(default_factory=dict)

    @property
    def allreduce_calls(self) -> int:
        return len(self.collectives)

    @property
    def allreduce_bytes(self) -> int:
        return sum(c.nbytes for c in self.collectives)

    def per_bucket(self) -> Dict[int, Tuple[int, int]]:
        """``{bucket: (all-reduce calls, bytes)}``."""
        out: Dict[int, Tuple[int, int]] = {}
        for c in self.collectives:
            calls, nbytes = out.get(c.bucket, (0, 0))
            out[c.bucket] = (calls + 1, nbytes + c.nbytes)
        return out

    def as_dict(self) -> dict:
        return {
            "aten_compute": self.aten_compute,
            "aten_total": self.aten_total,
            "allreduce_calls": self.allreduce_calls,
            "allreduce_bytes": self.allreduce_bytes,
            "allreduce_per_bucket": {str(k): list(v) for k, v in self.per_bucket().items()},
            "triton_launches": self.triton_launches,
            "triton_by_kernel": dict(self.triton_by_kernel),
            "top_ops": dict(Counter(self.by_op).most_common(12)),
        }


def count_step(step: Callable[[], None], *, hook_step: Optional[HookStep] = None, triton_execute: bool = True) -> StepCounts:
    """Run ``step()`` once with the op counter, synchronous collectives and the Triton launch hook."""
    with synchronous_collectives(hook_step) as records, count_triton_launches(execute=triton_execute) as launches:
        with OpCounter() as ops:
            step()
    return StepCounts(
        aten_compute=ops.compute,
        aten_total=ops.total,
        by_op=dict(ops.by_op),
        collectives=list(records),
        triton_launches=launches["n"],
        triton_by_kernel=dict(launches["by"]),
    )


# What torch.profiler itself prints on every use, which a table must not be buried under: kineto's
# ``USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start`` / ``profiler_stop`` (logged at kineto's highest
# level, so KINETO_LOG_LEVEL=5 still shows it) and, with ``profile_memory=True``, c10's ``[W... CPUAllocator.cpp:245]
# Memory block of unknown size was allocated before the profiling started`` (a LOG(WARNING) when the step frees a
# tensor allocated before the profiler started -- a hook step always does; its level is fixed at import by
# TORCH_CPP_LOG_LEVEL).
_PROFILER_NOISE = re.compile(r"SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)"
                             r"|CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before the profiling")


@contextlib.contextmanager
def quiet_profiler():
    """Run ``torch.profiler`` without its own chatter on stderr (see ``_PROFILER_NOISE``); everything else written
    to stderr meanwhile is passed on afterwards, in order.

    Kineto reads ``KINETO_LOG_LEVEL`` once, when the process first profiles: unless the user set it, it is set to 6
    (above kineto's levels; kineto's own errors are hidden too, the measurement then reports nothing) for that
    first start and removed again. The c10 warning cannot be turned off once torch is imported: file descriptor 2 is
    sent to a temporary file for the duration and the known lines are dropped from it.
    """
    set_level = "KINETO_LOG_LEVEL" not in os.environ
    if set_level:
        os.environ["KINETO_LOG_LEVEL"] = "6"
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # pragma: no cover - a closed or odd stream
            pass
    try:
        saved = os.dup(2)
    except OSError:  # pragma: no cover - no file descriptor 2
        saved = None
    with tempfile.TemporaryFile() as tmp:
        if saved is not None:
            os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except Exception:  # pragma: no cover
                pass
            if saved is not None:
                os.dup2(saved, 2)
                os.close(saved)
            if set_level:
                os.environ.pop("KINETO_LOG_LEVEL", None)
            tmp.seek(0)
            kept = [line for line in tmp.read().decode(errors="replace").splitlines(True)
                    if not _PROFILER_NOISE.search(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def count_cuda_kernels(step: Callable[[], None]) -> dict:
    """Device-side activity of one ``step()`` from ``torch.profiler`` (CUDA): kernels, memcpys, memsets.

    Counts every device event whatever thread launched it. Raises ``RuntimeError`` without CUDA.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("count_cuda_kernels needs CUDA")
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels, memcpy, memset, launches_api = 0, 0, 0, 0
    names: Counter = Counter()
    for e in prof.events():
        dev = str(getattr(e, "device_type", "")).split(".")[-1]
        name = e.name
        if dev == "CUDA":
            low = name.lower()
            if low.startswith("memcpy"):
                memcpy += 1
            elif low.startswith("memset"):
                memset += 1
            else:
                kernels += 1
                names[name[:60]] += 1
        elif name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"):
            launches_api += 1
    return {"kernels": kernels, "memcpy": memcpy, "memset": memset, "launch_api_calls": launches_api,
            "top_kernels": dict(names.most_common(8))}


def _tensor_bytes_by_owner(obj, owner, seen_objs, seen_storage, out, depth=0):
    if depth > 8 or id(obj) in seen_objs:
        return
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "meta":
            return
        try:
            st = obj.untyped_storage()
            key = (st.data_ptr(), obj.device)
            nbytes = st.nbytes()
        except Exception:  # pragma: no cover
            return
        if key in seen_storage or nbytes == 0:
            return
        seen_storage.add(key)
        out[owner] = out.get(owner, 0) + nbytes
        return
    seen_objs.add(id(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            child = k if (owner is None and isinstance(k, int) and not isinstance(k, bool)) else owner
            _tensor_bytes_by_owner(v, child, seen_objs, seen_storage, out, depth + 1)
        return
    if isinstance(obj, (list, tuple, set)):
        for v in obj:
            _tensor_bytes_by_owner(v, owner, seen_objs, seen_storage, out, depth + 1)
        return
    if isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)):
        return
    if isinstance(obj, (dist.ProcessGroup,)) or callable(obj) and not hasattr(obj, "__dict__"):
        return
    attrs = {}
    if hasattr(obj, "__dict__"):
        attrs.update(vars(obj))
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if isinstance(slot, str) and hasattr(obj, slot):
                attrs.setdefault(slot, getattr(obj, slot))
    for v in attrs.values():
        _tensor_bytes_by_owner(v, owner, seen_objs, seen_storage, out, depth + 1)


def held_bytes(state) -> Dict[Optional[int], int]:
    """Bytes of tensor storage a hook state keeps, per bucket index (``None``: not tied to a bucket).

    Walks the state's attributes, dicts keyed by bucket index (PyTorch's ``error_dict``/``p_memory_dict``/
    ``q_memory_dict``, our per-bucket memory), lists and slots; each storage is counted once.
    """
    out: Dict[Optional[int], int] = {}
    _tensor_bytes_by_owner(state, None, set(), set(), out)
    return out


def peak_extra_bytes(step: Callable[[], None], device) -> Optional[int]:
    """Peak memory allocated during ``step()`` above what was allocated before it.

    CUDA: the caching allocator's peak statistics. CPU: the allocator's running total carried by the profiler's
    allocation events (a private profiler API; run under :func:`synchronous_collectives` so that callbacks stay on
    this thread). ``None`` if it cannot be measured.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    try:
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile

        with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        events = []

        def walk(nodes):
            for n in nodes:
                if n.tag == _EventType.Allocation:
                    ef = n.extra_fields
                    events.append((n.start_time_ns, int(ef.alloc_size), int(ef.total_allocated)))
                walk(n.children)

        walk(prof.profiler.kineto_results.experimental_event_tree())
        if not events:
            return 0
        events.sort()
        base = events[0][2] - events[0][1]  # allocated before the first event
        return max(0, max(total for _, _, total in events) - base)
    except Exception:  # pragma: no cover - private profiler API moved
        return None


# ============================================================================================ kernels alone
def kernel_bytes(kernel: str, layout: BucketLayout, grad_dtype, *, error: bool = True, factor_size: int = 4) -> int:
    """Fewest bytes a bucket step must move (each input read once, each output written once).

    ``M``: the compressed matrices (``layout.e_numel`` elements of ``grad_dtype``); ``E``: their float32 error
    memory; ``P``/``Q``: ``factor_size`` bytes per element.

    =================  ===================================================
    project            read M (+ E), write M + E if error, read Q, write P
    orthogonalize      read P, write P
    project_t          read M, read P, write Q
    reconstruct        read P, Q (+ M), write M (+ E)
    =================  ===================================================
    """
    es = torch.empty((), dtype=_dtype(grad_dtype)).element_size()
    mn, p, q = layout.e_numel, layout.p_numel * factor_size, layout.q_numel * factor_size
    if kernel == "project":
        return mn * es + q + p + ((mn * 4 + mn * es) if error else 0)
    if kernel == "orthogonalize":
        return 2 * p
    if kernel == "project_t":
        return mn * es + p + q
    if kernel == "reconstruct":
        return p + q + mn * es + ((mn * es + mn * 4) if error else 0)
    raise ValueError(f"unknown kernel {kernel!r}")


class KernelBench:
    """The four bucket steps alone, on one bucket: ours (:mod:`powersgd_triton.ops`) and PyTorch's hook's code.

    Ours: float32 ``P``/``Q``/error of the compressed matrices; the bucket's matrices are views (no copies).
    PyTorch's equivalents (``batch_tensors_with_same_shape=False``, its default) work per matrix in the bucket's
    dtype:

    * ``project``: ``input += error`` (whole bucket), ``clone()`` of the bucket, one ``bmm`` per matrix;
    * ``orthogonalize``: ``_orthogonalize`` per matrix (Gram-Schmidt for r <= 2 or 16-bit, else ``linalg.qr``);
    * ``project_t``: one ``bmm`` per matrix;
    * ``reconstruct``: one ``bmm`` per matrix, then ``error = clone - input``.

    All inputs are random (never zeros); the error memory is small so that repeated ``project`` calls stay finite.
    """

    def __init__(self, bucket: FakeGradBucket, rank: int, *, min_compression_rate: float = 2.0,
                 generator: Optional[torch.Generator] = None, epsilon: float = 0.0):
        self.bucket = bucket
        self.rank = rank
        self.epsilon = epsilon
        buf = bucket.buffer()
        self.device, self.dtype = buf.device, buf.dtype
        self.layout = bucket_layout(bucket, rank, min_compression_rate)
        lay = self.layout
        f32 = torch.float32
        self.p = random_buffer(lay.p_numel, f32, self.device, generator)
        self.q = random_buffer(lay.q_numel, f32, self.device, generator)
        self.error = random_buffer(lay.e_numel, f32, self.device, generator, scale=1e-3)
        self.flag = torch.ones((), dtype=torch.bool, device=self.device)
        # PyTorch's side
        self.pt_error = random_buffer(buf.numel(), self.dtype, self.device, generator, scale=1e-3)
        self.pt_p = random_buffer(lay.p_numel, self.dtype, self.device, generator)
        self.pt_q = random_buffer(lay.q_numel, self.dtype, self.device, generator)
        self.pt_clone = buf.clone()
        self._mats, self._ps, self._qs = [], [], []
        for s in lay.matrices:
            self._mats.append(buf[s.offset : s.offset + s.n * s.m].view(1, s.n, s.m))
            self._ps.append(self.pt_p[s.p_offset : s.p_offset + s.n * s.rank].view(1, s.n, s.rank))
            self._qs.append(self.pt_q[s.q_offset : s.q_offset + s.m * s.rank].view(1, s.m, s.rank))

    def bytes(self, kernel: str) -> int:
        return kernel_bytes(kernel, self.layout, self.dtype, error=True)

    def ours(self, kernel: str, backend: str = "torch", config: Optional[dict] = None) -> Callable[[], None]:
        from . import ops

        buf, lay = self.bucket.buffer(), self.layout
        if kernel == "project":
            return lambda: ops.project(buf, lay, self.q, self.p, self.error, backend=backend, config=config)
        if kernel == "orthogonalize":
            return lambda: ops.orthogonalize(self.p, lay, "p", self.epsilon, backend=backend, config=config)
        if kernel == "project_t":
            return lambda: ops.project_t(buf, lay, self.p, self.q, backend=backend, config=config)
        if kernel == "reconstruct":
            return lambda: ops.reconstruct(buf, lay, self.p, self.q, 1.0, self.error, self.flag, backend=backend,
                                           config=config)
        raise ValueError(f"unknown kernel {kernel!r}")

    def pytorch(self, kernel: str) -> Callable[[], None]:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

        buf = self.bucket.buffer()
        mats, ps, qs = self._mats, self._ps, self._qs

        def project():
            buf.add_(self.pt_error)
            self.pt_clone = buf.detach().clone()
            for m, q, p in zip(mats, qs, ps):
                torch.bmm(m, q, out=p)

        def orthogonalize():
            for p in ps:
                _orthogonalize(p, self.epsilon)

        def project_t():
            for m, p, q in zip(mats, ps, qs):
                torch.bmm(m.transpose(1, 2), p, out=q)

        def reconstruct():
            for p, q, m in zip(ps, qs, mats):
                torch.bmm(p, q.transpose(1, 2), out=m)
            self.pt_error = self.pt_clone - buf

        table = {"project": project, "orthogonalize": orthogonalize, "project_t": project_t,
                 "reconstruct": reconstruct}
        if kernel not in table:
            raise ValueError(f"unknown kernel {kernel!r}")
        return table[kernel]


# ============================================================================================ timing
def _quantiles(times: Sequence[float]) -> dict:
    s = sorted(times)

    def q(f):
        if len(s) == 1:
            return s[0]
        pos = f * (len(s) - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return {"median_ms": q(0.5), "p20_ms": q(0.2), "p80_ms": q(0.8), "min_ms": s[0], "reps": len(s)}


def time_cpu(fn: Callable[[], None], reps: int = 5, warmup: int = 1, sync: Optional[Callable[[], None]] = None,
             max_seconds: Optional[float] = None) -> dict:
    """Wall-clock timing: ``warmup`` calls, then up to ``reps`` timed calls; median and quantiles in ms."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times = []
    start = time.perf_counter()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append((time.perf_counter() - t0) * 1e3)
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
    return _quantiles(times)


def time_interleaved(fns: Dict[str, Callable[[], None]], rounds: int = 5, warmup: int = 1,
                     sync: Optional[Callable[[], None]] = None) -> Dict[str, dict]:
    """Wall-clock medians of several functions timed in turn (order reversed every other round), so that a
    machine whose load drifts (a shared CPU) biases none of them. Returns :func:`time_cpu`-like stats per name."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    if sync:
        sync()
    times: Dict[str, List[float]] = {n: [] for n in names}
    for rnd in range(rounds):
        for n in (names if rnd % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            fns[n]()
            if sync:
                sync()
            times[n].append((time.perf_counter() - t0) * 1e3)
    return {n: _quantiles(v) for n, v in times.items()}


def compare_hooks(model: str, rank: int, dtype="fp32", device="cpu", *, backend: str = "auto", rounds: int = 5,
                  counts: bool = True, shrink: int = 1, bucket_cap_mb: float = 25.0,
                  first_bucket_mb: float = DDP_FIRST_BUCKET_MB, seed: int = 0,
                  impls: Sequence[str] = IMPLS) -> List[dict]:
    """PyTorch's hook against ours on ``model``'s buckets, timed in turn (:func:`time_interleaved`), with counts.

    Each hook gets its own copy of the buckets (same random numbers). On CPU the timing includes no device work;
    on CUDA each call is followed by a synchronisation (wall clock; ``bench/gpu_check.py`` uses ``do_bench``).
    Returns one row per implementation of ``impls`` (``impl``, ``variant``, ``matrix_approximation_rank``, times,
    counts, memory; "pytorch" first), ``speedup`` on every other row: PyTorch's median over that row's. With
    ``counts``: ``aten_compute`` (data-touching ATen ops of one step: PyTorch's hook, or our torch backend's where
    ours runs it), ``triton_launches`` and ``ops_backend`` ("torch" or "triton": which of our backends ran, told
    by the launches counted; "pytorch" for PyTorch's hook). Needs a process group (:func:`ensure_process_group`).
    """
    impls = ["pytorch"] + [i for i in impls if i != "pytorch"]
    device = torch.device(device)
    steps = {}
    for impl in impls:
        gen = torch.Generator(device=device).manual_seed(seed)
        buckets = model_buckets(model, dtype, device, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb,
                                shrink=shrink, generator=gen)
        steps[impl] = HookStep(impl, buckets, rank, backend=backend).warmup(1)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    stats = time_interleaved(steps, rounds=rounds, sync=sync)
    rows = []
    for impl, st in steps.items():
        row = dict(model=model, matrix_approximation_rank=rank, dtype=str(_dtype(dtype)).replace("torch.", ""), impl=impl,
                   variant=st.impl, buckets=len(st.buckets), grad_bytes=st.nbytes, **stats[impl])
        if counts:
            c = count_step(st, hook_step=st if isinstance(st, HookStep) else None)
            held = st.memory()
            with synchronous_collectives(st if isinstance(st, HookStep) else None):
                peak = peak_extra_bytes(st, device)
            row.update(aten_compute=c.aten_compute, triton_launches=c.triton_launches or 0,
                       ops_backend="pytorch" if impl == "pytorch" else ("triton" if c.triton_launches else "torch"),
                       allreduce_calls=c.allreduce_calls,
                       allreduce_bytes=c.allreduce_bytes, held_bytes=sum(held.values()), peak_extra_bytes=peak)
        rows.append(row)
    for row in rows[1:]:
        row["speedup"] = rows[0]["median_ms"] / row["median_ms"]
    return rows


AGREEMENT_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


def check_against_pytorch(model: str, rank: int, dtype="fp32", device="cpu", *, backend: str = "auto",
                          compressed_steps: int = 2, shrink: int = 1, bucket_cap_mb: float = 25.0,
                          first_bucket_mb: float = DDP_FIRST_BUCKET_MB, seed: int = 1) -> dict:
    """Ours against PyTorch's ``powerSGD_hook`` on the same buckets: the correctness gate of a benchmark record.

    Each hook gets fresh copies of the same random buckets (``seed``) and the same state arguments (same
    ``random_seed``, so the same initial Q), runs the plain all-reduce steps and ``compressed_steps`` compressed ones;
    then each bucket's contents are compared. Returns ``{"max_rel_diff", "tolerance", "finite", "ok", "steps"}``:
    ``max_rel_diff`` is the largest ``||ours - theirs|| / ||theirs||`` (float64) over the buckets, ``tolerance``
    :data:`AGREEMENT_TOL` of the dtype (float32 1e-4; bfloat16/float16 5e-2: PyTorch's hook keeps P and Q in the
    bucket's dtype there, ours in float32). A few steps only: over many steps two runs drift apart as PyTorch's hook
    does from itself after a one-ulp change. Needs a process group (:func:`ensure_process_group`).
    """
    device = torch.device(device)
    out = {}
    for impl in ("pytorch", "ours"):
        gen = torch.Generator(device=device).manual_seed(seed)
        buckets = model_buckets(model, dtype, device, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb,
                                shrink=shrink, generator=gen)
        HookStep(impl, buckets, rank, backend=backend).warmup(compressed_steps)
        out[impl] = [b.buffer() for b in buckets]
    worst, finite = 0.0, True
    for mine, theirs in zip(out["ours"], out["pytorch"]):
        finite = finite and bool(torch.isfinite(mine).all())
        a, b = mine.double(), theirs.double()
        diff = float((a - b).norm() / b.norm().clamp_min(1e-30))
        worst = diff if diff != diff else max(worst, diff)  # NaN stays
    tol = AGREEMENT_TOL[_dtype(dtype)]
    return {"max_rel_diff": worst, "tolerance": tol, "finite": finite, "ok": bool(finite and worst < tol),
            "steps": compressed_steps}


# ============================================================================================ reporting
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover
        pass
    return platform.processor() or platform.machine()


def environment(device=None) -> dict:
    """Date, machine, versions, threads and (on CUDA) the GPU's name, SMs, L2, memory and driver."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
    }
    from . import _compat

    info["untested_versions"] = list(_compat.untested_versions())  # below pyproject's floors: said, not refused
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # pragma: no cover
        info["triton"] = None
    try:
        import numpy

        info["numpy"] = numpy.__version__
    except Exception:  # pragma: no cover
        pass
    try:
        info["load_avg"] = os.getloadavg()
    except OSError:  # pragma: no cover
        pass
    if device is not None and torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            sms=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
            cuda=torch.version.cuda,
        )
        try:
            import subprocess

            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
            info["nvidia_smi"] = out.stdout.strip()
        except Exception:
            pass
    return info


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def markdown_table(rows: Iterable[dict], columns: Sequence[Tuple[str, str]]) -> str:
    """A markdown table of ``rows``; ``columns`` are ``(key, header)``; missing values print as ``-``."""
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    for r in rows:
        cells = []
        for key, _ in columns:
            v = r.get(key)
            if v is None:
                cells.append("-")
            elif isinstance(v, float):
                cells.append(f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}")
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = [
    "CollectiveRecord", "DTYPES", "FakeGradBucket", "HookStep", "IMPLS", "KERNELS", "KernelBench",
    "OpCounter", "StepCounts", "bucket_layout", "check_against_pytorch", "quiet_profiler", "count_cuda_kernels", "count_step", "count_triton_launches",
    "compare_hooks", "ensure_process_group", "environment", "time_interleaved", "fmt_bytes", "held_bytes", "kernel_bytes", "make_hook", "markdown_table",
    "model_bucket_shapes", "model_buckets", "peak_extra_bytes", "random_buffer", "shrink_shapes",
    "synchronous_collectives", "time_cpu",
]
