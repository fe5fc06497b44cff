"""The launches of a hook step as Triton's JIT compiles them for a GPU, recorded on a machine without one.

Under :func:`powersgd_triton.benchmarking.host.fake_gpu` (Triton's whole Python path runs against a driver stub for
sm_90: binding, specialization, compile; the C launch is a no-op), :func:`recording` records every launch made
through ``JITFunction.run``: the kernel's name, grid, constexprs, launch options, the specialization facts of its
runtime arguments (per tensor: dtype and 16-byte alignment; per integer: the value) and the ``CompiledKernel`` the
JIT compiled for it. :func:`hook_step_launches` runs the standard hook on a model's DDP-like buckets and returns
one compressed step's launches per bucket; :func:`table_job_for` finds the compile-table job
(:func:`tools.aot_compile.table_jobs`) of a recorded launch, and :func:`compile_like` compiles it ahead of time
with the launch's own argument facts, for a comparison with the JIT's binary (``tests/test_aot_jit_match.py``).
Needs ``TRITON_INTERPRET`` unset.
"""

import contextlib
from typing import Dict, List, Optional

import torch

OPTION_KEYS = ("num_warps", "num_stages", "maxnreg", "num_ctas")


def _kernel_names() -> Dict[int, str]:
    from powersgd_triton.ops.kernels import KERNEL_FUNCTIONS

    return {id(fn): name for name, fn in KERNEL_FUNCTIONS.items()}


def _facts(fn, args) -> Dict[str, object]:
    """Per runtime argument name: ``("tensor", dtype, aligned)`` or the integer / float value."""
    out = {}
    for name, value in zip(fn.arg_names, args):
        if isinstance(value, torch.Tensor):
            out[name] = ("tensor", str(value.dtype).replace("torch.", ""), value.data_ptr() % 16 == 0)
        else:
            out[name] = value
    return out


@contextlib.contextmanager
def recording():
    """Inside (and inside ``fake_gpu()``): every ``JITFunction.run`` launch (not a warm-up) of a kernel of
    :data:`~powersgd_triton.ops.kernels.KERNEL_FUNCTIONS` is appended to the yielded list as a dict: ``kernel``,
    ``grid``, ``constexprs`` (the keyword arguments that are not launch options), ``options``, ``args`` (what
    :func:`_facts` keeps) and ``compiled`` (the ``CompiledKernel``). Replacing ``JITFunction.run`` sends
    :class:`~powersgd_triton.ops.launch.DirectLaunch` through the JIT call on every launch (its documented
    fallback), so each launch is seen."""
    from triton.runtime.jit import JITFunction

    names = _kernel_names()
    launches: List[dict] = []
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=warmup, **kwargs)
        if not warmup and id(self) in names:
            if hasattr(kernel, "result"):  # an async compile's future
                kernel = kernel.result()
            launches.append(dict(
                kernel=names[id(self)], grid=tuple(grid) if not callable(grid) else grid,
                constexprs={k: v for k, v in kwargs.items() if k not in OPTION_KEYS and k in self.arg_names},
                options={k: v for k, v in kwargs.items() if k in OPTION_KEYS},
                args=_facts(self, args), compiled=kernel))
        return kernel

    JITFunction.run = run
    try:
        yield launches
    finally:
        JITFunction.run = original


def hook_step_launches(model: str, rank: int, dtype: torch.dtype, *, shrink: int = 1, hook: str = "powerSGD",
                       shapes=None, min_fraction: float = 0.0) -> List[dict]:
    """One compressed step of ``powerSGD_hook`` (``hook="batched"``: ``batched_powerSGD_hook``) on the Triton backend
    over ``model``'s DDP-like 25 MB buckets (``shapes``: a list of buckets' parameter shapes instead), after three
    steps of warm-up (launch plans built, kernels compiled), under a fake GPU of 132 SMs with the collectives
    stubbed (:mod:`powersgd_triton.benchmarking.host`): per bucket holding compressed matrices and at least
    ``min_fraction`` of the largest bucket's elements, ``{"index", "numel", "layout", "launches"}`` (the
    :func:`recording` dicts of that bucket's step, in launch order). Runs in this process; needs a process group
    (:func:`powersgd_triton.benchmarking.hooks.ensure_process_group`)."""
    from powersgd_triton import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
    from powersgd_triton.benchmarking import host
    from powersgd_triton.benchmarking.buckets import model_bucket_shapes
    from powersgd_triton.layout import BucketLayout

    fn = {"powerSGD": powerSGD_hook, "batched": batched_powerSGD_hook}[hook]
    with host.fake_gpu(), host.no_collectives():
        groups = shapes if shapes is not None else model_bucket_shapes(model, dtype, shrink=shrink)
        buckets = host._buckets(groups, dtype)
        state = PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                              backend="triton", verify="off")  # the stubbed kernels compute nothing to verify
        for _ in range(3):
            for b in buckets:
                fn(state, b).wait()
        largest = max(b.buffer().numel() for b in buckets)
        out = []
        for b in buckets:
            layout = BucketLayout.from_gradients(b.buffer(), b.gradients(), rank, 2.0)
            if layout.num_matrices == 0 or b.buffer().numel() < min_fraction * largest:
                continue
            with recording() as launches:
                fn(state, b).wait()
            out.append(dict(index=b.index(), numel=b.buffer().numel(), layout=layout, launches=launches))
    return out


def _dtype_of(launch: dict) -> torch.dtype:
    """The gradient dtype of a launch: the dtype of its bucket-side pointer (the first one that is not float32,
    else float32)."""
    dtypes = [v[1] for k, v in launch["args"].items() if isinstance(v, tuple) and k in (
        "buf_ptr", "src_ptr", "dst_ptr", "x_ptr", "new_ptr")]
    for name in dtypes:
        if name != "float32":
            return getattr(torch, name)
    return torch.float32


def table_job_for(launch: dict, jobs=None) -> Optional[tuple]:
    """The job of :func:`tools.aot_compile.table_jobs` (``(kernel, config, dtype, rank, variant)``) compiling the
    binary of a recorded launch: the same kernel, argument types (pointee dtypes) and constexprs and launch options;
    None when the table has none (a launch it does not cover)."""
    from tools import aot_compile as A

    jobs = A.table_jobs() if jobs is None else jobs
    kernel = launch["kernel"]
    want_const = dict(launch["constexprs"])
    want_types = {k: v[1] for k, v in launch["args"].items() if isinstance(v, tuple)}
    for job in jobs:
        k, cfg, dtype, rank, variant = job
        if k != kernel:
            continue
        sig, const, opts = A._compile_args(k, cfg, dtype, rank, variant)
        if {n: v for n, v in const.items()} != want_const:
            continue
        if {n: v for n, v in opts.items()} != {n: v for n, v in launch["options"].items()}:
            continue
        types = {n: A._POINTEE[t[1:]] for n, t in sig.items() if t.startswith("*")}
        if {n: str(t).replace("torch.", "") for n, t in types.items()} != want_types:
            continue
        return job
    return None


def compile_like(launch: dict, job: tuple, arch: int = 90):
    """:func:`tools.aot_compile.compile_aot` of ``job`` with the recorded launch's argument facts (which pointers
    are 16-byte aligned, the integers' values): the binary the compile table makes of that launch."""
    from tools import aot_compile as A

    kernel, cfg, dtype, rank, variant = job
    aligned = [k for k, v in launch["args"].items() if isinstance(v, tuple) and v[2]]
    ints = {k: v for k, v in launch["args"].items() if isinstance(v, int) and not isinstance(v, bool)}
    return A.compile_aot(kernel, cfg, dtype, rank, arch, dict(variant, WITH_GRAM=False)
                         if kernel == "orthogonalize" else variant, aligned=aligned, ints=ints)


def ptx_body(compiled) -> str:
    """A compiled kernel's PTX code (:func:`tools.aot.ptx_code`: no comments, file names, line numbers or debug
    sections), so that the same code compares equal wherever it was compiled from."""
    from tools.aot import ptx_code

    return ptx_code(compiled.asm["ptx"])
