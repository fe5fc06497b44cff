"""Count what one compressed step of a hook launches: bucket kernels, other device ops, collectives.

The four bucket steps of :mod:`powersgd_triton.ops` are one Triton launch each on the GPU; here they run on the torch
backend, so each call into them is counted as one kernel launch and what happens inside is not counted. Every
other ATen op that is not a view is counted as one launch (on CUDA each is one kernel, or none for metadata ops);
``c10d`` ops are counted as collectives. PyTorch's hook is counted the same way (its QR is one ATen op here, several
kernels on a GPU).
"""

import contextlib
import types
from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

import powersgd_triton.ops as ops_module

_FREE = {"aten::lift_fresh", "aten::empty.memory_format", "aten::empty_strided", "aten::_local_scalar_dense"}


class CountLaunches(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()
        self.collectives = Counter()
        self.kernels = Counter()
        self.all_reduces = 0
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            name = func.name()
            if func.namespace == "c10d" or name.startswith("c10d::"):
                self.collectives[name] += 1
            elif not getattr(func, "is_view", False) and name not in _FREE:
                self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())


@contextlib.contextmanager
def synchronous_all_reduce(counter: CountLaunches):
    """Within the block, ``dist.all_reduce`` is counted and completes before it returns.

    Its future is then already complete, so ``then()`` callbacks (PyTorch's hook issues its P and Q steps from
    them) run inline on the calling thread, where the (thread-local) dispatch mode sees their ops.
    """
    import torch.distributed as dist

    original = dist.all_reduce

    def wrapped(tensor, *args, **kwargs):
        counter.all_reduces += 1
        counter.paused += 1
        try:
            work = original(tensor, *args, **kwargs)
            if work is not None:
                work.wait()
            return work
        finally:
            counter.paused -= 1

    dist.all_reduce = wrapped
    try:
        yield counter
    finally:
        dist.all_reduce = original


@contextlib.contextmanager
def counting_bucket_kernels(counter: CountLaunches):
    """Within the block, each call of a bucket step of :mod:`powersgd_triton.ops` counts as one launch (project,
    orthogonalize, project_t, reconstruct, pack_uncompressed, unpack_uncompressed, average, commit_factor), and so
    does each call of :class:`powersgd_triton.ops.backend.TritonSteps`' methods (the hooks' unchecked calls on the Triton backend, which go
    to the launchers, not through ``ops``) and of the bound steps of its step plans (``plan_step``: each as the method
    it stands for)."""
    from powersgd_triton.ops.backend import TritonSteps as _hook_ops

    saved = {}
    names = ("project", "orthogonalize", "project_t", "reconstruct", "pack_uncompressed", "unpack_uncompressed",
             "average", "commit_factor")
    targets = [(ops_module, name) for name in names] + [(_hook_ops, n) for n in names if hasattr(_hook_ops, n)]
    plan_names = dict(orth_q="orthogonalize", project="project", orth_p="orthogonalize",
                      project_t="project_t", average="average", reconstruct="reconstruct")

    def counted_plan(plan):  # the hooks' step plans (TritonSteps.plan_step): each bound step counts as its method
        fields = {"settings": plan.settings}
        for field, name in plan_names.items():
            bound = getattr(plan, field)

            def wrapped(*args, __bound=bound, __name=name):
                counter.kernels[__name] += 1
                counter.paused += 1
                try:
                    return __bound(*args)
                finally:
                    counter.paused -= 1

            fields[field] = None if bound is None else wrapped
        return types.SimpleNamespace(**fields)

    original_plan_step = _hook_ops.plan_step
    saved[(_hook_ops, "plan_step")] = original_plan_step
    _hook_ops.plan_step = lambda self, tensors, settings: counted_plan(original_plan_step(self, tensors, settings))
    for module, name in targets:
        original = getattr(module, name)
        saved[(module, name)] = original

        def wrapped(*args, __original=original, __name=name, **kwargs):
            counter.kernels[__name] += 1
            counter.paused += 1
            try:
                return __original(*args, **kwargs)
            finally:
                counter.paused -= 1

        setattr(module, name, wrapped)
    try:
        yield counter
    finally:
        for (module, name), original in saved.items():
            setattr(module, name, original)


@contextlib.contextmanager
def interpreted_launches(execute=True):
    """Every interpreted Triton launch inside the block, as ``(kernel function name, grid, keyword arguments)`` (the
    constexprs and launch options); ``execute=False`` records without running them."""
    # GridExecutor runs every interpreted launch in triton 3.4 (kernel[grid] builds it directly) and 3.6+ (through
    # InterpretedFunction.run)
    from triton.runtime.interpreter import GridExecutor

    calls, original = [], GridExecutor.__call__

    def run(self, *args, **kwargs):
        calls.append((self.fn.__name__, self.grid, kwargs))
        if execute:
            return original(self, *args, **kwargs)
        return None

    GridExecutor.__call__ = run
    try:
        yield calls
    finally:
        GridExecutor.__call__ = original
