"""Host overhead of a compressed bucket step, measured on CPU: ``powersgd-triton bench --host-overhead``.

What a GPU step costs the host besides the device work: our Python, Triton's argument binding and launch path, and
the collectives' calls. Measured here without a GPU (and without running a kernel):

* **ours**: the hook (:func:`powersgd_triton.powerSGD_hook`, ``backend="triton"``) on the model's real DDP-like
  buckets (CPU tensors of the real sizes), compressed steps after the warm-up, on the Triton launch path of a GPU
  (``verify="off"``: the stubbed kernels compute nothing to verify; after its verdict verification costs one
  attribute test per step):
  Triton's interpreter off, the kernels compiled for ``sm_90`` (once, Triton's disk cache), launched through
  Triton's own ``JITFunction.run`` / ``CompiledKernel.run`` and its real ``CudaLauncher.__call__`` (scratch
  checks), with **only the C entry point** ``driver.active.utils.launch`` (argument extraction and
  ``cuLaunchKernelEx``) replaced by a no-op. :class:`FakeDriver` is that driver: device 0, stream 0, target
  ``cuda`` sm_90, :data:`FAKE_SMS` SMs, binaries "loaded" as dummy handles. Our tile plans are sized for
  :data:`FAKE_SMS` SMs (an H200's 132), as on the GPU. Where a GPU's driver makes a C call, the stand-in is a C
  call too, so the stub adds no Python frame a GPU does not run: the timed launch is :data:`C_NOOP_LAUNCH` (the
  counting Python launch only while the launches are counted), the current stream ``int`` (stream 0).
* **PyTorch's hook** (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``), same run, interleaved with
  ours: the same buckets' structure with tiny CPU tensors (each compressed gradient an ``4r x 4r`` matrix, each
  uncompressed one at most 16 elements: the same tensors, the same compression decisions and ranks, so the same
  ATen ops in the same order, on data too small to cost compute). Its host cost on a GPU is at least that: each op
  there also pays a CUDA kernel launch (not counted here, as our ``cuLaunchKernelEx`` is not).
* **collectives**: ``dist.all_reduce`` returns a completed work without communicating, for both hooks, whose
  ``get_future()`` is torch's C future (``torch._C.Future``, as a process group's work returns); both run the NCCL
  path (the ``then()`` callback chain, run inline on completed futures). Their call cost is measured
  apart (:func:`collective_call_us`: a gloo all-reduce call of one element, world size 1).

Python function calls (``sys.setprofile`` "call" events: Python frames, not C builtins) of one bucket step are
counted deterministically. Times are medians over ``rounds`` interleaved rounds of every bucket's hook call.
"""

import contextlib
import itertools
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from powersgd_triton.compat import versions as _compat
from powersgd_triton.compat import env as _env
from powersgd_triton.shapes import numel
from powersgd_triton.benchmarking.buckets import FakeGradBucket, _dtype, model_bucket_shapes
from powersgd_triton.benchmarking.collectives import _DoneWork
from powersgd_triton.benchmarking.environment import environment

# The launch stand-in while timing: a C callable that takes any positional arguments and does nothing with them
# (itertools.chain is lazy: it keeps the argument tuple and iterates nothing), so a launch costs the host one C call,
# as the real C entry's call would, without its argument extraction and cuLaunchKernelEx.
C_NOOP_LAUNCH = itertools.chain
FAKE_SMS = 132  # an H200's (and H100's) SMs: the tile plans of ours are sized for them
FAKE_ARCH = 90
STUBBED = ("stubbed: the C launch entry driver.active.utils.launch (argument extraction + cuLaunchKernelEx) -> "
           "a C no-op; the current stream -> int (C); dist.all_reduce -> a completed work (no communication) with "
           "torch's C future. Runs: our hook, Triton's "
           "JITFunction.run / CompiledKernel.run / CudaLauncher.__call__ (kernels compiled for sm_90), the NCCL "
           "then() chain. PyTorch's hook: tiny CPU tensors of the same buckets (same ops, no compute). torch on 1 "
           "CPU thread (ours' few torch ops on CPU tensors, e.g. the bf16 casts of P and Q, do compute: counted).")


class _FakeUtils:
    """``driver.active.utils`` of :class:`FakeDriver`: dummy binaries, an H200's properties, a no-op launch.

    The launch is the counting Python :meth:`launch` while :attr:`counting` is True (the default: ``launches``
    counts, ``record`` keeps the arguments); :meth:`set_counting` (False) makes every launcher's launch the C no-op
    :data:`C_NOOP_LAUNCH` instead, as timed and call-counted (on a GPU the launch entry is C: a Python stand-in
    would add a Python call per launch that a GPU does not make)."""

    def __init__(self):
        self.launches = 0
        self.record = None  # a list: each launch's arguments are appended (tests)
        self.counting = True
        self.launchers = []  # every FakeLauncher made: their ``launch`` follows set_counting

    def load_binary(self, name, kernel, shared, device):
        return 1, 1, 32, 0, 1024  # module, function, registers, spills, max threads

    def unload_module(self, module):
        return None

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": FAKE_SMS, "max_num_regs": 65536, "warpSize": 32,
                "sm_clock_rate": 1980000, "mem_clock_rate": 2619000, "mem_bus_width": 6144}

    def launch(self, *args):
        self.launches += 1
        if self.record is not None:
            self.record.append(args)

    def launch_entry(self):
        """What a launcher's ``launch`` is now: :meth:`launch` while counting, else :data:`C_NOOP_LAUNCH`."""
        return self.launch if self.counting else C_NOOP_LAUNCH

    def set_counting(self, counting: bool) -> None:
        """Count (and record) launches in Python (True), or launch through the C no-op (False), every launcher."""
        self.counting = bool(counting)
        for launcher in self.launchers:
            launcher.launch = self.launch_entry()


class FakeDriver:
    """A Triton driver for CPU tensors with no GPU: everything Triton does in Python runs (binding, cache key,
    compile for ``sm_90``, ``CompiledKernel.run``, ``CudaLauncher.__call__``); the C launch is a counting no-op
    (``utils.launches``)."""

    def __init__(self):
        from triton.backends.nvidia.driver import CudaLauncher

        self.utils = utils = _FakeUtils()
        self._target = _compat.gpu_target(FAKE_ARCH)

        class FakeLauncher(CudaLauncher):
            """The installed CudaLauncher's ``__call__`` with the C ``launch`` a no-op (its ``__init__`` would
            build the C launcher, which needs libcuda)."""

            def __init__(self, src, metadata):
                self.num_ctas = getattr(metadata, "num_ctas", 1)
                for k in ("global_scratch_size", "global_scratch_align", "profile_scratch_size",
                          "profile_scratch_align", "launch_cooperative_grid", "launch_pdl"):
                    setattr(self, k, getattr(metadata, k, 0))
                self.gsan_enabled = False
                self.arg_annotations = self.kernel_signature = None
                self.launch = utils.launch_entry()
                utils.launchers.append(self)

        self.launcher_cls = FakeLauncher
        # the current stream as a C call, as on a GPU (torch's _cuda_getCurrentRawStream): int(0) is stream 0 of
        # device 0 (the only device); int() is 0 as well, for callers that pass no device
        self.get_current_stream = int

    def is_active(self):
        return True

    def get_current_device(self):
        return 0

    def get_current_target(self):
        return self._target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_capability(self, device=None):
        return divmod(FAKE_ARCH, 10)

    def allocate_default_profile_scratch(self, size, alignment, stream):
        return None


@contextlib.contextmanager
def fake_gpu():
    """Inside: Triton launches on CPU tensors through :class:`FakeDriver` (no kernel runs), our ``backend="triton"``
    accepts CPU tensors, and the tile plans see :data:`FAKE_SMS` SMs. Raises ``RuntimeError`` under
    ``TRITON_INTERPRET=1`` (the kernels are interpreted functions then). Yields the driver."""
    if _env.interpreter_enabled():
        raise RuntimeError("the host benchmark needs TRITON_INTERPRET unset (compiled launch path)")
    from triton.runtime import driver

    from powersgd_triton.state import powersgd_state as state_module
    from powersgd_triton.ops import launch as _launch

    fake = FakeDriver()
    sms_globals = _launch.device_sms.__globals__
    saved = (driver._active, _env.triton_can_run, sms_globals["DEFAULT_NUM_SMS"], state_module.triton_unusable_reason)
    driver.set_active(fake)
    _env.triton_can_run = lambda device: True
    state_module.triton_unusable_reason = lambda: None
    sms_globals["DEFAULT_NUM_SMS"] = FAKE_SMS
    try:
        yield fake
    finally:
        (driver._active, _env.triton_can_run, sms_globals["DEFAULT_NUM_SMS"],
         state_module.triton_unusable_reason) = saved


class _CDoneWork(_DoneWork):
    """A finished ``Work`` whose ``get_future()`` is torch's C future (``torch._C.Future``, completed with
    ``[tensor]``), as a process group's ``Work.get_future()`` returns: its ``then``, ``wait`` and ``value`` are C
    calls (``torch.futures.Future``, the Python subclass, adds Python frames a real all-reduce's future does not).
    CPU tensors only (the host benchmark's)."""

    def get_future(self):
        fut = torch._C.Future([])
        fut.set_result([self._tensor])
        return fut


@contextlib.contextmanager
def no_collectives():
    """``dist.all_reduce`` returns a completed work (no communication) whose future is torch's C future; the hooks
    take the NCCL ``then()`` chain."""
    from powersgd_triton.hooks import driver as _step

    original, chain = dist.all_reduce, _step.OPTIONS.callback_chain

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return _CDoneWork(tensor) if async_op else None

    dist.all_reduce, _step.OPTIONS.callback_chain = all_reduce, True
    try:
        yield
    finally:
        dist.all_reduce, _step.OPTIONS.callback_chain = original, chain


def python_calls(fn) -> int:
    """Python function calls (``sys.setprofile`` "call" events, every thread's profile but this one's untouched)
    made by ``fn()``, counted while it runs."""
    count = [0]

    def prof(frame, event, arg):
        if event == "call":
            count[0] += 1

    old = sys.getprofile()
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(old)
    return count[0] - 1  # python_calls' own setprofile return is not an event; the profiler's first is fn itself


def _tiny_shapes(shapes, rank: int, rate: float = 2.0):
    """PyTorch-side stand-ins: a compressed gradient (PyTorch's ``_should_compress``) -> ``(4r, 4r)`` (compressed at
    rank ``r`` too), an uncompressed one -> at most 16 elements, 1-D (never compressed)."""
    out = []
    side = 4 * rank
    for s in shapes:
        n = s[0]
        m = numel(s) // n if n else 0
        k = min(n, m, rank)
        if k and n * m >= rate * (n + m) * k:
            out.append((side, side))
        else:
            out.append((min(numel(s), 16),))
    return out


def _buckets(groups, dtype, device="cpu") -> List[FakeGradBucket]:
    out = []
    for i, shapes in enumerate(groups):
        n = sum(numel(s) for s in shapes)
        buf = torch.empty(n, dtype=dtype, device=device) if device == "meta" else torch.randn(n).to(dtype)
        out.append(FakeGradBucket(buf, shapes, index=i, num_buckets=len(groups)))
    return out


def _bucket_step(state, hook, bucket):
    def step():
        hook(state, bucket).wait()
    return step


def host_overhead(model: str, rank: int, dtype="fp32", *, rounds: int = 30, shrink: int = 1,
                  bucket_cap_mb: float = 25.0) -> Dict[str, object]:
    """Host time and Python calls per compressed bucket step of ours and PyTorch's hook on ``model``'s buckets (see
    the module docstring for what runs and what is stubbed). Call inside :func:`fake_gpu` and
    :func:`no_collectives`, with a process group (:func:`~.hooks.ensure_process_group`).

    Returns ``{"buckets": [per bucket: index, matrices, ours_us, pytorch_us, ours_calls, pytorch_calls,
    launches], "ours_us", "pytorch_us", "ours_calls", "pytorch_calls", "launches"}``: microseconds (median over
    ``rounds`` of each bucket's hook call, the two hooks interleaved), means over the compressed buckets.
    """
    from powersgd_triton import PowerSGDState, powerSGD_hook
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as pt

    from powersgd_triton.layout import BucketLayout

    dtype = _dtype(dtype)
    groups = model_bucket_shapes(model, dtype, bucket_cap_mb, shrink=shrink)
    ours_b = _buckets(groups, dtype)
    theirs_b = _buckets([_tiny_shapes(g, rank) for g in groups], dtype)
    # verify="off": the stubbed launches compute nothing, so first-use verification would find every kernel wrong,
    # switch the buckets to the torch backend and record those verdicts in the user's cache
    ours = PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2, backend="triton",
                         verify="off")
    theirs = pt.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
    from triton.runtime import driver

    fake = driver.active
    for _ in range(4):  # warm-up and 2 compressed steps: allocations, compiles, first Q
        for a, b in zip(ours_b, theirs_b):
            powerSGD_hook(ours, a).wait()
            pt.powerSGD_hook(theirs, b).wait()
    rows = []
    for a, b in zip(ours_b, theirs_b):
        layout = BucketLayout.from_gradients(a.buffer(), a.gradients(), rank, 2.0)
        if layout.num_matrices == 0:
            continue
        f_ours, f_theirs = _bucket_step(ours, powerSGD_hook, a), _bucket_step(theirs, pt.powerSGD_hook, b)
        fake.utils.set_counting(True)
        before = fake.utils.launches
        f_ours()
        launches = fake.utils.launches - before
        fake.utils.set_counting(False)  # timed and call-counted with the C no-op launch
        rows.append(dict(index=a.index(), matrices=layout.num_matrices, launches=launches,
                         ours_calls=python_calls(f_ours), pytorch_calls=python_calls(f_theirs),
                         _fns=(f_ours, f_theirs), _t=([], [])))
    for rnd in range(rounds):
        for r in rows:
            pair = list(zip(r["_fns"], r["_t"]))
            for fn, times in (pair if rnd % 2 == 0 else pair[::-1]):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
    for r in rows:
        t_ours, t_theirs = r.pop("_t")
        r.pop("_fns")
        r["ours_us"], r["pytorch_us"] = statistics.median(t_ours), statistics.median(t_theirs)
    n = max(1, len(rows))
    return dict(buckets=rows, **{k: sum(r[k] for r in rows) / n
                                 for k in ("ours_us", "pytorch_us", "ours_calls", "pytorch_calls", "launches")})


def launch_call_us(reps: int = 400) -> float:
    """Host time of one launch through its launch plan: ``projection.project`` (error feedback) on ResNet-50's
    second bucket at rank 4, fp32 (plan lookup, :class:`~powersgd_triton.ops.launch.DirectLaunch`, the stubbed C
    launch), median in microseconds. Call inside :func:`fake_gpu`."""
    from powersgd_triton.ops import projection
    from powersgd_triton.layout import BucketLayout

    bucket = _buckets(model_bucket_shapes("resnet50", torch.float32)[1:2], torch.float32)[0]
    layout = BucketLayout.from_gradients(bucket.buffer(), bucket.gradients(), 4, 2.0)
    q, p, e = torch.randn(layout.q_numel), torch.empty(layout.p_numel), torch.zeros(layout.e_numel)
    buf = bucket.buffer()
    for _ in range(3):
        projection.project(buf, layout, q, p, e)
    from triton.runtime import driver

    driver.active.utils.set_counting(False)  # the C no-op launch, as timed in host_overhead
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        projection.project(buf, layout, q, p, e)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def collective_call_us(reps: int = 200) -> float:
    """Host time of one async ``dist.all_reduce`` call of one float32 element and its ``get_future()`` on the
    current process group (gloo, world size 1, real), median in microseconds."""
    t = torch.zeros(1)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dist.all_reduce(t, async_op=True).get_future().wait()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def run(models, ranks, dtypes, *, rounds: int = 30, shrink: int = 1, history: Optional[str] = None,
        record: bool = True) -> int:
    """What ``powersgd-triton bench --host-overhead`` runs: the table, one summary line per model and
    configuration, the rows into the benchmark history. Re-runs itself without ``TRITON_INTERPRET`` when it is set."""
    if _env.interpreter_enabled():
        import subprocess

        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        argv = [sys.executable, "-m", "powersgd_triton", "bench", "--host-overhead", "--models", ",".join(models),
                "--matrix-approximation-ranks", ",".join(map(str, ranks)), "--dtypes", ",".join(dtypes),
                "--rounds", str(rounds), "--shrink", str(shrink)]
        if history:
            argv += ["--history", history]
        if not record:
            argv.append("--no-history")
        return subprocess.call(argv, env=env)

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, without its warning
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the host issues work; a parallel CPU op on a loaded machine waits for its threads
    try:
        return _run(models, ranks, dtypes, rounds, shrink, history, record)
    finally:
        torch.set_num_threads(threads)


def _run(models, ranks, dtypes, rounds, shrink, history, record) -> int:
    from powersgd_triton.benchmarking.hooks import ensure_process_group
    from powersgd_triton.benchmarking.tables import markdown_table

    pg = ensure_process_group("gloo")
    coll = collective_call_us()
    env = environment()
    rows, lines = [], []
    with fake_gpu(), no_collectives():
        launch = launch_call_us()
        for model in models:
            for dtype in dtypes:
                for rank in ranks:
                    res = host_overhead(model, rank, dtype, rounds=rounds, shrink=shrink)
                    for b in res["buckets"]:
                        rows.append(dict(model=model, matrix_approximation_rank=rank, dtype=dtype, **b))
                    lines.append(f"{model} r={rank} {dtype}: host per bucket step: ours {res['ours_us']:.0f} us, "
                                 f"pytorch {res['pytorch_us']:.0f} us, ours {res['ours_calls']:.0f} python calls")
                    rows.append(dict(model=model, matrix_approximation_rank=rank, dtype=dtype, index="mean",
                                     **{k: res[k] for k in ("ours_us", "pytorch_us", "ours_calls",
                                                            "pytorch_calls", "launches")}, matrices=None))
    import triton

    load = tuple(round(x, 1) for x in os.getloadavg())
    print(f"{env['date']}; {env['cpu']} ({env['cpus_usable']} CPUs usable, load {load}); python {env['python']}, "
          f"torch {env['torch']}, triton {triton.__version__}; fake sm_{FAKE_ARCH} GPU ({FAKE_SMS} SMs); process "
          f"group {pg}; {rounds} rounds, the two hooks interleaved; medians per bucket\n{STUBBED}\ncollective call "
          f"(gloo all_reduce of 1 element + get_future + wait, world 1): {coll:.1f} us; one launch through its "
          f"launch plan (projection.project, ResNet-50 bucket 1): {launch:.1f} us\n")
    for r in rows:
        for k in ("ours_us", "pytorch_us"):
            r[k + "_h"] = f"{r[k]:.0f}"
        r["ratio_h"] = f"{r['pytorch_us'] / r['ours_us']:.1f}x" if r["ours_us"] else ""
        r["ours_calls_h"] = f"{r['ours_calls']:.0f}"
        r["pytorch_calls_h"] = f"{r['pytorch_calls']:.0f}"
    cols = [("model", "model"), ("matrix_approximation_rank", "r"), ("dtype", "dtype"), ("index", "bucket"),
            ("matrices", "matrices"), ("launches", "Triton launches"), ("ours_us_h", "ours us"),
            ("pytorch_us_h", "PyTorch us"), ("ratio_h", "PyTorch/ours"), ("ours_calls_h", "ours Python calls"),
            ("pytorch_calls_h", "PyTorch Python calls")]
    print(markdown_table(rows, cols))
    print("\n" + "\n".join(lines))
    if record:
        _record(rows, env, history, coll, launch)
    return 0


def _record(rows, env, path, coll, launch):
    from powersgd_triton import history as H

    path = path or H.default_path()
    commit, dirty = H.git_commit()
    if not path or not commit:
        print("not recorded in the history: no git checkout here")
        return
    out = []
    for r in rows:
        if r["index"] != "mean":
            continue
        for impl in ("ours", "pytorch"):
            out.append(dict(model=r["model"], matrix_approximation_rank=r["matrix_approximation_rank"],
                            dtype=r["dtype"], impl=impl, variant="host-overhead",
                            host_us=r[impl + "_us"], python_calls=r[impl + "_calls"],
                            triton_launches=r["launches"] if impl == "ours" else None,
                            launch_call_us=launch if impl == "ours" else None,
                            collective_call_us=coll if impl == "ours" else None))
    # no numbers are computed (launches stubbed): nothing to check against PyTorch's hook
    n = H.append(path, H.make_records(out, source="bench-host", env=env, commit=commit, dirty=dirty), correct=True)
    print(f"recorded {n} rows in {path} (commit {commit[:10]}{', dirty work tree' if dirty else ''})")
