"""The torch and Triton versions this package is tested with, and every API of theirs that differs between versions.

Each version-dependent call goes through this module, so a new release is adapted in one file. Tested: the whole
suite (``.ci/run``'s main tier) on torch 2.13.0 (CPU build) with triton 3.9.0; the compat tier (``.ci/compat``:
hooks, state, kernels under the interpreter, FSDP2/HSDP, the integrations, the sm_90 compile table, the README's
digits check) on the CUDA wheels of torch 2.8.0 + triton 3.4.0 (the floor), torch 2.11.0 + triton 3.6.0 (the GPU
image ``bench/gpu_check.py`` targets) and torch 2.14.1 + triton 3.8.0, run on CPU (``docs/support.md``). The
floors in ``pyproject.toml`` (``torch>=2.8``, ``triton>=3.4``) are the tested minima.

| API | changed in | gate |
| --- | --- | --- |
| ``tl.dot(a, b, input_precision="ieee")`` (the kernels' fp32 products on FMA units) | triton 3.0 (before: ``allow_tf32=``) | a triton older than :data:`MIN_TRITON` is not used: ``backend="auto"`` runs the torch backend, ``"triton"`` raises naming the version (:func:`triton_too_old`) |
| ``triton.compiler.ASTSource(fn, signature, constexprs=...)``, the signature keyed by argument name | triton 3.2 (3.0/3.1: ``constants=``, keyed by index) | :func:`ast_source` |
| ``triton.backends.compiler.GPUTarget(backend, arch, warp_size)`` | triton 3.0 | :func:`gpu_target` |
| the JIT's argument specialization (16-byte aligned pointers and integers divisible by 16 marked ``tt.divisibility = 16``, an integer 1 a constant) | triton 3.6: ``native_specialize_impl`` (C++; 3.4: ``runtime.jit.create_specialize_impl``, Python, the same rules) | :func:`jit_specialization` (the compile table compiles as the JIT does) |
| smallest inner dimension ``K`` of ``tl.dot`` on NVIDIA (float64: 16 in triton 3.6, 4 in 3.9) | triton 3.7-3.9 | :func:`dot_min_k` (the orthogonalization kernel's float64 products broadcast below it) |
| float64 operands of ``tl.dot`` (the orthogonalization kernel's Gram and products) | after triton 3.4 (3.6 has them) | :func:`dot_float64_supported` (without: broadcast and sum) |
| ``FSDPModule.set_all_reduce_hook`` (FSDP2 over the replicate group of HSDP) | torch 2.7 | :func:`fsdp_all_reduce_hook_missing` |
| ``JITFunction.run``'s last call, ``kernel.run(grid, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *bound_args)`` (the launch of a compiled kernel, bypassing the binding) | read in triton 3.6.0, 3.8.0 and 3.9.0 (``runtime/jit.py``): the same call | :data:`DIRECT_LAUNCH_TRITON`, :func:`_direct_launch_supported`, :func:`_c_launch` (the gate of :class:`powersgd_triton.ops.launch.DirectLaunch`; other versions: the JIT call) |
| FSDP2's parameter groups per module: ``FSDPState._fsdp_param_groups`` (a list) | after torch 2.11 (2.8-2.11: one ``_fsdp_param_group``) | :func:`fsdp_param_groups` |
| a custom gradient divide factor: ``FSDPParamGroup.gradient_divide_factor`` | torch 2.8 (2.7: ``reduce_scatter_reduce_op``) | :func:`fsdp_divide_factor_set` |
| ``FSDPModule.set_reduce_scatter_unused_params`` (zero gradients for unused parameters) | after torch 2.11 | :func:`fsdp_unused_params_option` |
| the byte limits of DDP's bucket rebuild after its first iteration (the first bucket's, the others'): ``DistributedDataParallel._bucket_config`` (``first_bucket_bytes_cap``, ``bucket_bytes_cap``; custom ``per_bucket_bytes_caps``) | after torch 2.11 (2.8-2.11: ``bucket_bytes_cap``, and ``dist._DEFAULT_FIRST_BUCKET_BYTES`` for the first bucket where ``bucket_bytes_cap_default``) | :func:`ddp_rebuild_caps` |
| FSDP2-based ``replicate()`` (``torch.distributed._composable.replicate_with_fsdp``: a ``DDPMeshInfo`` parameter group whose native all-reduce runs over ``mesh_info.replicate_process_group``, read through ``FSDPParamGroup._all_reduce_process_group``, before the all-reduce hook) | after torch 2.8 (read in 2.11, 2.13 and 2.14) | :func:`replicate_with_fsdp_missing`, :func:`fsdp_replicate_group_unknown` |
"""

import inspect
import re
from typing import Optional, Tuple

import torch

MIN_TORCH: Tuple[int, int] = (2, 8)  # pyproject.toml's floor: the oldest torch the compat tier runs (.ci/compat)
MIN_TRITON: Tuple[int, int] = (3, 4)  # pyproject.toml's floor: the Triton torch 2.8's CUDA wheel pins
TESTED = {"torch": ("2.8.0", "2.11.0", "2.13.0", "2.14.1"), "triton": ("3.4.0", "3.6.0", "3.8.0", "3.9.0")}


def version_tuple(text: str) -> Tuple[int, ...]:
    """The leading release numbers of a version string: ``"2.13.0+cpu"`` -> ``(2, 13, 0)``, ``"3.7.0.dev20250101"`` ->
    ``(3, 7, 0)``, ``"3.6"`` -> ``(3, 6)``. Raises ``ValueError`` when the text starts with no number."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(text))
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(x) for x in match.group(1).split("."))


def torch_version() -> Tuple[int, ...]:
    """This torch's release numbers."""
    return version_tuple(torch.__version__)


def triton_version() -> Optional[Tuple[int, ...]]:
    """This triton's release numbers; None when it cannot be imported."""
    try:
        import triton
    except Exception:  # noqa: BLE001 - a broken install is "not available" too
        return None
    return version_tuple(triton.__version__)


def triton_too_old() -> Optional[str]:
    """Why the installed triton is not used (older than :data:`MIN_TRITON`), or None (new enough, or not installed:
    :mod:`powersgd_triton.compat.env` says that)."""
    v = triton_version()
    if v is None or v[:2] >= MIN_TRITON:
        return None
    import triton

    return (f"triton {triton.__version__} is older than {'.'.join(map(str, MIN_TRITON))}, the oldest this package is "
            "tested with (its kernels use tl.dot(input_precision=...) and ASTSource(constexprs=...))")


def untested_versions() -> Tuple[str, ...]:
    """Human-readable notes for a torch or triton below the tested floors (empty when both are at or above them).
    Nothing refuses them here; ``bench/gpu_check.py`` and ``powersgd-triton bench`` record the notes."""
    notes = []
    if torch_version()[:2] < MIN_TORCH:
        notes.append(f"torch {torch.__version__} is below the tested floor {'.'.join(map(str, MIN_TORCH))}")
    reason = triton_too_old()
    if reason:
        notes.append(reason)
    return tuple(notes)


def ast_source(fn, signature: dict, constexprs: dict, attrs: Optional[dict] = None):
    """``triton.compiler.ASTSource`` of a ``@triton.jit`` function for an ahead-of-time compile.

    ``signature``: argument name -> Triton type (``"*fp32"``, ``"i32"``, ``"constexpr"``); ``constexprs``: name ->
    value; ``attrs``: ``{(argument index,): [[attribute, value], ...]}`` (e.g. ``[["tt.divisibility", 16]]``, what
    :func:`jit_specialization` gives the JIT), none by default. Raises ``RuntimeError`` naming the version on a
    triton whose ``ASTSource`` takes ``constants=`` keyed by index (3.0/3.1, below :data:`MIN_TRITON`).
    """
    from triton.compiler import ASTSource

    params = inspect.signature(ASTSource.__init__).parameters
    if "constexprs" not in params:
        import triton

        raise RuntimeError(f"triton {triton.__version__}: ASTSource has no constexprs= (it takes "
                           f"{', '.join(p for p in params if p != 'self')}); ahead-of-time compiles need triton >= "
                           f"{'.'.join(map(str, MIN_TRITON))}")
    if attrs:
        return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs)


def jit_specialization(value, target=None) -> Tuple[str, Optional[str], list]:
    """What Triton's JIT makes of one runtime argument ``value`` of a launch on a GPU (every parameter of our kernels
    is specialized: none is ``do_not_specialize``): ``(type, key, attributes)``.

    ``type``: the signature type (``"*fp32"`` for a float32 tensor, ``"i32"``/``"i64"``, ``"fp32"``, or
    ``"constexpr"`` for the integer 1, which the JIT compiles in as a constant); ``key``: ``"D"`` for a tensor whose
    ``data_ptr()`` is a multiple of 16 bytes or an integer that is a multiple of 16 (0 included), ``""`` for
    another tensor or integer, None for floats and bools (not specialized); ``attributes``: the key as the compiler
    takes it (``[["tt.divisibility", 16]]`` for ``"D"``, else ``[]``), by the backend of ``target``
    (a ``GPUTarget``; default sm_90). Read in triton 3.4, 3.6, 3.8 and 3.9 (``runtime/jit.py``): 3.6 to 3.9's
    binder calls ``native_specialize_impl(backend, arg, is_const, specialize, align)`` (C++), 3.4's the Python
    ``create_specialize_impl(backend.get_arg_specialization)``; both with the same rules, then
    ``backend.parse_attr`` (the base backend's, which the NVIDIA backend keeps). Raises ``RuntimeError`` on a triton
    with neither."""
    from triton.backends.compiler import BaseBackend
    from triton.compiler.compiler import make_backend

    backend = make_backend(target if target is not None else gpu_target(90))
    try:
        from triton._C.libtriton import native_specialize_impl
    except ImportError:  # triton 3.4: the binder's specializer is Python
        try:
            from triton.runtime.jit import create_specialize_impl
        except ImportError as exc:
            import triton

            raise RuntimeError(f"triton {triton.__version__}: neither native_specialize_impl nor "
                               "create_specialize_impl (read in 3.4-3.9): cannot specialize arguments as its JIT "
                               "does") from exc
        ty, key = create_specialize_impl(type(backend).get_arg_specialization)(value, False, True, True)[:2]
    else:
        ty, key = native_specialize_impl(BaseBackend, value, False, True, True)[:2]
    return ty, key, (backend.parse_attr(key) if isinstance(key, str) else [])


def gpu_target(arch: int, backend: str = "cuda", warp_size: int = 32):
    """``triton.backends.compiler.GPUTarget`` for ``sm_<arch>`` (e.g. 80, 90): what ``triton.compile(src,
    target=...)`` compiles for without a GPU."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget(backend, int(arch), warp_size)


def fsdp_all_reduce_hook_missing() -> Optional[str]:
    """Why FSDP2's all-reduce hook cannot be used with this torch (no FSDP2, or no ``set_all_reduce_hook``: before
    torch 2.7), or None when it can."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor, Shard  # noqa: F401
    except ImportError as exc:
        return f"torch {torch.__version__} has no FSDP2 (torch.distributed.fsdp.FSDPModule): {exc}"
    if not callable(getattr(FSDPModule, "set_all_reduce_hook", None)):
        return (f"torch {torch.__version__}: FSDPModule has no set_all_reduce_hook (FSDP2 has it from torch 2.7); "
                "PowerSGD over the replicate group needs a torch whose FSDP2 has it")
    return None


NO_DOT_K = 1 << 30  # dot_min_k of a width tl.dot does not take: no inner dimension reaches it


def dot_float64_supported() -> bool:
    """Whether this Triton's ``tl.dot`` takes float64 operands: not in triton 3.4 (its semantic asserts int8, uint8,
    float16, bfloat16 or float32), yes in 3.6 and later; for a version in between, its ``dot`` is read. False
    without triton."""
    v = triton_version()
    if v is None or v[:2] <= (3, 4):
        return False
    if v[:2] >= (3, 6):
        return True
    try:
        from triton.language import semantic

        src = inspect.getsource(semantic)
        start = src.index("def dot(")
        return "float64" in src[start:start + 3000]
    except Exception:  # noqa: BLE001 - unreadable: broadcast (slower, never wrong)
        return False


def dot_min_k(bits: int) -> int:
    """The smallest inner dimension ``K`` that this Triton's NVIDIA backend accepts in ``tl.dot`` for operands of
    ``bits`` width (``min_dot_size``: 16 for every width but 8-bit in triton 3.6; 4 for float64 and 8 for float32 in
    3.9); :data:`NO_DOT_K` for float64 on a Triton whose ``tl.dot`` has no float64 (:func:`dot_float64_supported`).
    16 when the backend cannot be asked (no NVIDIA backend, another API)."""
    from types import SimpleNamespace

    if int(bits) == 64 and not dot_float64_supported():
        return NO_DOT_K
    try:
        from triton.backends.nvidia.compiler import min_dot_size

        operand = SimpleNamespace(scalar=SimpleNamespace(primitive_bitwidth=int(bits)))
        return int(min_dot_size(gpu_target(90))(operand, operand)[2])
    except Exception:  # noqa: BLE001 - any other layout of the backend: the conservative bound
        return 16


# Triton versions whose JITFunction.run ends in the call DirectLaunch makes (runtime/jit.py read for each: 3.6.0, 3.8.0
# and 3.9.0 all call kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata,
# launch_metadata, launch_enter_hook, launch_exit_hook, *bound_args.values()); the hooks are hook chains, unused while
# they hold no call, and DirectLaunch passes None for them and for the launch metadata, which only the hooks read).
DIRECT_LAUNCH_TRITON = ((3, 6), (3, 8), (3, 9))
_direct_state = {}


def _direct_launch_supported() -> bool:
    """Whether :class:`~powersgd_triton.ops.launch.DirectLaunch` may call compiled kernels itself here: a triton of
    :data:`DIRECT_LAUNCH_TRITON` whose launch hooks are hook chains (decided once per process, when
    ``JITFunction.run`` is Triton's own: not while a launch counter or a profiler has replaced it)."""
    ok = _direct_state.get("ok")
    if ok is None:
        try:
            from triton import knobs
            from triton.runtime.jit import JITFunction

            run = JITFunction.run
            if getattr(run, "__qualname__", "") != "JITFunction.run":
                return False  # replaced for now: ask again later
            v = triton_version()
            hooks = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
            ok = v is not None and v[:2] in DIRECT_LAUNCH_TRITON and all(hasattr(h, "calls") for h in hooks)
            if ok:
                _direct_state.update(run=run, cls=JITFunction, hooks=hooks)
        except Exception:  # noqa: BLE001 - another layout of triton: the JIT call
            ok = False
        _direct_state["ok"] = ok
    return ok


def _c_launch_v39(launcher, g, stream, function, packed, args):
    """triton 3.9's ``CudaLauncher.__call__`` without scratch memory, launch hooks or GSan: its C ``launch`` with
    the arguments it passes (``backends/nvidia/driver.py``)."""
    launcher.launch(g[0], g[1], g[2], stream, function, launcher.launch_cooperative_grid, launcher.launch_pdl, packed,
                    None, None, None, None, None, launcher.arg_annotations, launcher.kernel_signature, args)


def _c_launch_v36(launcher, g, stream, function, packed, args):
    """triton 3.6's ``CudaLauncher.__call__`` without scratch memory or launch hooks: its C ``launch`` with the
    arguments it passes (``backends/nvidia/driver.py``: the launch metadata and hooks lead the kernel's arguments)."""
    launcher.launch(g[0], g[1], g[2], stream, function, launcher.launch_cooperative_grid, launcher.launch_pdl, None,
                    None, packed, None, None, None, *args)


# The C entry of the NVIDIA launcher, per Triton version whose CudaLauncher.__call__ was read (3.6.0, 3.8.0, 3.9.0;
# 3.8.0 passes what 3.9.0 does).
_C_LAUNCH = {(3, 6): _c_launch_v36, (3, 8): _c_launch_v39, (3, 9): _c_launch_v39}


def c_launch_layout() -> Optional[str]:
    """How this Triton's C launcher takes a kernel's arguments: ``"v39"`` (one tuple last: 3.8, 3.9), ``"v36"``
    (spread after the launch metadata: 3.6), None where :class:`~powersgd_triton.ops.launch.DirectLaunch` does not
    launch directly (the tests' gates read this, so a new Triton is this table)."""
    fn = _C_LAUNCH.get((triton_version() or ())[:2])
    return None if fn is None else ("v39" if fn is _c_launch_v39 else "v36")


def _c_launch(launcher):
    """The C-entry launch of ``launcher`` (the compiled kernel's ``run``) when it is this Triton's own NVIDIA
    ``CudaLauncher`` (or a subclass keeping its ``__call__``) with no scratch memory and no GSan: then its
    ``__call__`` only forwards to ``launcher.launch``; else None (``kernel.run`` is called)."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher
    except Exception:  # noqa: BLE001 - no NVIDIA backend
        return None
    fn = _C_LAUNCH.get((triton_version() or ())[:2])
    if (fn is None or not isinstance(launcher, CudaLauncher) or type(launcher).__call__ is not CudaLauncher.__call__
            or getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1)
            or getattr(launcher, "gsan_enabled", False) or not hasattr(launcher, "launch")):
        return None
    return fn



def fsdp_param_groups(fsdp_state) -> list:
    """The FSDP parameter groups of one module's ``FSDPState``: ``_fsdp_param_groups`` (a list, after torch 2.11),
    else the single ``_fsdp_param_group`` (torch 2.8-2.11; empty when it is None)."""
    groups = getattr(fsdp_state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(fsdp_state, "_fsdp_param_group", None)
        groups = [] if one is None else [one]
    return list(groups)


def fsdp_divide_factor_set(fsdp_group) -> bool:
    """Whether an FSDP parameter group has a custom gradient divide factor: ``gradient_divide_factor`` (torch >= 2.8,
    ``set_gradient_divide_factor``) or a custom ``reduce_scatter_reduce_op`` (torch 2.7's
    ``set_reduce_scatter_divide_factor``)."""
    return (getattr(fsdp_group, "gradient_divide_factor", None) is not None
            or getattr(fsdp_group, "reduce_scatter_reduce_op", None) is not None)


def fsdp_unused_params_option(module) -> bool:
    """Whether this torch's FSDP2 module has ``set_reduce_scatter_unused_params`` (zero gradients for parameters
    unused in the forward; after torch 2.11)."""
    return callable(getattr(module, "set_reduce_scatter_unused_params", None))


def replicate_with_fsdp_missing() -> Optional[str]:
    """Why FSDP2-based ``replicate()`` cannot be used with this torch (torch 2.8 has only the DDP-based
    ``torch.distributed._composable.replicate``), or None when it can."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate  # noqa: F401
        from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo  # noqa: F401
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError as exc:
        return (f"torch {torch.__version__} has no FSDP2-based replicate() "
                f"(torch.distributed._composable.replicate_with_fsdp, after torch 2.8: {exc}); for the DDP-based "
                "torch.distributed._composable.replicate, register the DDP hook: model.register_comm_hook(state, "
                "powerSGD_hook)")
    prop = getattr(FSDPParamGroup, "_all_reduce_process_group", None)
    if not isinstance(prop, property):
        return (f"torch {torch.__version__}: FSDPParamGroup has no _all_reduce_process_group property (read in torch "
                "2.11-2.14); powersgd_triton.fsdp.replicate does not know this FSDP2")
    return None


def fsdp_replicate_group_unknown(fsdp_group) -> Optional[str]:
    """What differs from the replicate() parameter group that torch 2.11-2.14 build (``mesh_info`` exactly a
    ``DDPMeshInfo`` with a ``replicate_process_group``, the group FSDP all-reduces over), or None."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

    info = getattr(fsdp_group, "mesh_info", None)
    if type(info) is not DDPMeshInfo:
        return f"FSDPParamGroup.mesh_info is a {type(info).__name__}, not a DDPMeshInfo"
    if getattr(info, "replicate_process_group", None) is None:
        return "DDPMeshInfo.replicate_process_group is missing"
    try:
        if fsdp_group._all_reduce_process_group is not info.replicate_process_group:
            return "FSDPParamGroup._all_reduce_process_group is not mesh_info.replicate_process_group"
    except Exception as exc:  # noqa: BLE001 - any failure: unknown internals
        return f"FSDPParamGroup._all_reduce_process_group raised {type(exc).__name__}: {exc}"
    return None


def ddp_rebuild_caps(ddp) -> Optional[Tuple[int, int]]:
    """``(first bucket's bytes, other buckets' bytes)``: the limits a ``DistributedDataParallel`` passes its reducer
    for the bucket rebuild after its first iteration (read in torch 2.8, 2.11, 2.13 and 2.14; the reducer rebuilds with
    ``[first, other]``); None where this torch's DDP has custom per-bucket limits (``bucket_cap_mb`` a list) or
    neither attribute set."""
    import torch.distributed as dist

    config = getattr(ddp, "_bucket_config", None)
    if config is not None:
        if getattr(config, "per_bucket_bytes_caps", ()):
            return None
        return int(config.first_bucket_bytes_cap), int(config.bucket_bytes_cap)
    cap = getattr(ddp, "bucket_bytes_cap", None)
    default = getattr(ddp, "bucket_bytes_cap_default", None)
    if cap is None or default is None:
        return None
    return int(dist._DEFAULT_FIRST_BUCKET_BYTES if default else cap), int(cap)
