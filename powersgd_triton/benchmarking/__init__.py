"""Benchmark infrastructure, reusable from ``bench/``, ``bench/gpu_check.py``, the CLI and notebooks.

Nothing here asserts a speed: it builds inputs, runs both hooks the same way, times them and *counts* what they do.
Every name is importable from this package (``from powersgd_triton import benchmarking as B; B.OpCounter``); the
modules group them by concern:

* :mod:`.buckets`: :class:`FakeGradBucket` stands in for ``torch.distributed.GradBucket`` (``buffer()``,
  ``gradients()``, ``index()``, ``is_last()``, ``parameters()``, ``set_buffer()``) over one flat buffer whose
  gradients are views; :func:`model_buckets`: the DDP-like buckets of a real model's gradient shapes
  (:mod:`powersgd_triton.shapes`), filled with random numbers (never zeros: zeros hide unwritten outputs and can run
  faster than real data); :func:`bucket_layout`, :func:`model_bucket_layouts` (the layouts of those buckets, what
  the autotuner tunes).
* :mod:`.hooks`: :func:`ensure_process_group` (an in-process world of size 1, gloo, or nccl on a GPU, over a
  ``HashStore``); :func:`make_hook`; :class:`HookStep`: one step of a hook over every bucket of a model, PyTorch's
  ``powerSGD_hook`` (``impl="pytorch"``) or ours (``impl="ours"``), created with the same arguments; the hook is
  called for every bucket in index order.
* Counting, measured not computed: :class:`OpCounter` (:mod:`.opcount`: ATen ops through a ``TorchDispatchMode``),
  :func:`synchronous_collectives` (:mod:`.collectives`: all-reduce calls and bytes, per bucket; also makes every
  ``then()`` callback run inline so that the op counter sees it), :func:`count_triton_launches` (:mod:`.launches`:
  launch hook on Triton's ``run``), :func:`count_cuda_kernels` (:mod:`.launches`: ``torch.profiler`` device events),
  :func:`count_step` (:mod:`.counts`: all of them over one step), :func:`held_bytes` (:mod:`.memory`: tensors a hook
  state keeps, per bucket), :func:`peak_extra_bytes` (:mod:`.memory`: CUDA allocator peak, or the CPU profiler's
  allocation trace), :func:`quiet_profiler` (:mod:`.profiler`).
* :mod:`.kernels`: :class:`KernelBench`: the four bucket steps alone on one bucket, ours (:mod:`powersgd_triton.ops`)
  and PyTorch's hook's equivalent code, with the byte model :func:`kernel_bytes` (bytes read + written, each once).
* :mod:`.timing`: :func:`time_cpu`, :func:`time_interleaved` (several functions in turn: fair on a machine whose load
  drifts); :mod:`.compare`: :func:`compare_hooks` (both hooks on a model, interleaved, with counts: what
  ``powersgd-triton bench`` prints), :func:`check_against_pytorch`; :mod:`.environment`: :func:`environment`;
  :mod:`.tables`: :func:`markdown_table`, :func:`fmt_bytes`.
"""

from powersgd_triton.layout import KERNELS
from powersgd_triton.shapes import numel
from powersgd_triton.benchmarking.buckets import (
    DDP_FIRST_BUCKET_MB,
    DTYPES,
    FakeGradBucket,
    _dtype,
    bucket_layout,
    model_bucket_layouts,
    model_bucket_shapes,
    model_buckets,
    random_buffer,
    shrink_shapes,
)
from powersgd_triton.benchmarking.collectives import CollectiveRecord, synchronous_collectives
from powersgd_triton.benchmarking.compare import AGREEMENT_TOL, check_against_pytorch, compare_hooks
from powersgd_triton.benchmarking.counts import StepCounts, count_step
from powersgd_triton.benchmarking.environment import environment
from powersgd_triton.benchmarking.hooks import ALL_IMPLS, IMPLS, HookStep, ensure_process_group, make_hook
from powersgd_triton.benchmarking.kernels import KernelBench, kernel_bytes
from powersgd_triton.benchmarking.launches import count_cuda_kernels, count_triton_launches
from powersgd_triton.benchmarking.memory import held_bytes, peak_extra_bytes
from powersgd_triton.benchmarking.opcount import OpCounter
from powersgd_triton.benchmarking.profiler import quiet_profiler
from powersgd_triton.benchmarking.tables import fmt_bytes, markdown_table
from powersgd_triton.benchmarking.timing import time_cpu, time_interleaved

__all__ = [
    "AGREEMENT_TOL", "ALL_IMPLS", "CollectiveRecord", "DDP_FIRST_BUCKET_MB", "DTYPES", "FakeGradBucket", "HookStep",
    "IMPLS", "KERNELS", "KernelBench", "OpCounter", "StepCounts", "bucket_layout", "check_against_pytorch",
    "compare_hooks", "count_cuda_kernels", "count_step", "count_triton_launches", "ensure_process_group",
    "environment", "fmt_bytes", "held_bytes", "kernel_bytes", "make_hook", "markdown_table", "model_bucket_layouts",
    "model_bucket_shapes", "model_buckets", "numel", "peak_extra_bytes", "quiet_profiler", "random_buffer", "shrink_shapes",
    "synchronous_collectives", "time_cpu", "time_interleaved",
]
