"""How the launchers launch: :class:`DirectLaunch` (one kernel launch with a fixed grid and fixed constexprs, which
calls the compiled kernel itself where this Triton allows), its one switch :data:`DIRECT_LAUNCH`, and what every
launcher shares: the SM count (:func:`device_sms`), launch options, loop steps per trip, the programs per SM the
plans aim at.

Imports no kernel. The Triton versions whose launch path :class:`DirectLaunch` knows, and the C entry of their
launcher, are version gates of :mod:`powersgd_triton.compat.versions` (``DIRECT_LAUNCH_TRITON``,
``_direct_launch_supported``, ``_c_launch``).
"""

import functools
import inspect
import threading

import torch

from powersgd_triton.compat.versions import _c_launch, _direct_launch_supported, _direct_state
from powersgd_triton.layout import COLS, P_OFF, Q_OFF, ROWS, BucketLayout, padded_rank

# Tests set this to False to launch every kernel through JITFunction.run (the JIT path DirectLaunch replaces).
DIRECT_LAUNCH = True


class _Trust(threading.local):
    """:data:`TRUST`: per thread, ``key`` is None or the object a caller sets around its launches to vouch that every
    tensor it passes has the dtype and 16-byte alignment (the specialization facts) the tensors at the same
    positions had in any earlier call made under the same key object."""

    key = None


# Set by a caller that vouches for its tensors' facts around its launches: the layer-wise and batched hooks' bucket
# step (powersgd_triton.hooks.layerwise), with the key powersgd_triton.hooks.driver.launch_trust computes once per
# step from the facts of the tensors it passes. A DirectLaunch whose tensors were checked under that very key object
# checks only its other arguments (their types and values) and launches. None (the default, every other caller and
# thread): every fact is checked.
TRUST = _Trust()


# The tile plans aim at this many programs per SM (>= 2: while one program waits for memory another issues loads).
PROGRAMS_PER_SM = 2


# SM count used for plans when the device has none to ask (CPU, interpreter): 1 keeps interpreted grids small. The
# GPU's own count is read from CUDA (132 on H100/H200).
DEFAULT_NUM_SMS = 1


class DirectLaunch:
    """One kernel launch of a ``@triton.jit`` function with a fixed grid and fixed keyword arguments (constexprs and
    launch options), called with the positional (runtime) arguments: ``launch(*args)``.

    The first call, and any call where the direct path does not apply, is the JIT call ``fn[grid](*args,
    **kwargs)`` (binding, cache key, compile on a miss). It keeps the compiled kernel it returns and the
    specialization-relevant facts of ``args`` (their number; per tensor: its dtype and ``data_ptr() % 16 == 0``;
    every other argument's type and value, compared by ``==``, None by identity). A later call with the same facts
    calls the compiled kernel itself, as ``JITFunction.run`` ends (triton 3.6, 3.8 and 3.9,
    :data:`DIRECT_LAUNCH_TRITON`):
    ``kernel.run(grid, stream, kernel.function, kernel.packed_metadata, None, None, None, *args, *constexprs)`` on
    the current stream of the device the kernel was launched on first, the constexprs in parameter order; where
    that launcher is Triton's NVIDIA ``CudaLauncher`` with no scratch memory, the C ``launch`` it forwards to,
    with the arguments its ``__call__`` passes (:data:`_C_LAUNCH`, per version). It falls back to the JIT call
    (which sees everything as usual) when: Triton is another version, ``fn`` is not a ``JITFunction`` (the
    interpreter), ``JITFunction.run`` has been replaced (a launch counter, a profiler), a launch enter/exit hook
    is set (``triton.knobs.runtime``), :data:`DIRECT_LAUNCH` is False, or the facts changed. Not checked on the
    direct path: Triton's "used global values have not changed" test (our kernels' globals are constants).
    Under a :data:`TRUST` key its tensors' dtype and alignment were already checked under (same key object), only
    the other arguments are compared: the hook step that sets the key has checked its tensors once for all its
    launches (:func:`powersgd_triton.hooks.driver.launch_trust`).
    Raises whatever the JIT call raises (a missing argument, a compile error).
    """

    __slots__ = ("fn", "grid", "kwargs", "tail", "kernel", "facts", "stream", "device", "g", "run", "c_launch",
                 "trusted", "loose")

    def __init__(self, fn, grid, kwargs: dict):
        self.fn, self.grid, self.kwargs = fn, tuple(grid), dict(kwargs)
        self.g = (self.grid + (1, 1))[:3]
        self.kernel = None
        self.facts = None
        self.tail = None
        self.c_launch = None
        self.trusted = None  # the TRUST key under which the tensors' facts were last checked

    @staticmethod
    def _facts(args) -> tuple:
        out = []
        for a in args:
            if isinstance(a, torch.Tensor):
                out.append((a.dtype, a.data_ptr() % 16 == 0))
            else:
                out.append(a)
        return tuple(out)

    def __call__(self, *args) -> None:
        kernel = self.kernel
        if kernel is not None and DIRECT_LAUNCH and len(args) == len(self.facts):
            facts = self.facts
            trust = TRUST.key
            ok = trust is not None and trust is self.trusted  # the caller vouches for the tensors (TRUST)
            if ok:
                for i, f in self.loose:  # the other arguments only (Triton specializes on ints)
                    a = args[i]
                    if a is not f and (type(a) is not type(f) or a != f):
                        ok = False
                        break
            if not ok:
                i = 0
                for a in args:  # the specialization facts, inline (no Python call per argument)
                    f = facts[i]
                    if type(f) is tuple:  # a tensor: (dtype, 16-byte aligned)
                        if (not isinstance(a, torch.Tensor) or a.dtype is not f[0]
                                or (a.data_ptr() % 16 == 0) is not f[1]):
                            break
                    elif a is not f and (type(a) is not type(f) or a != f):
                        break
                    i += 1
                else:
                    ok = True
                    self.trusted = trust
            if ok:
                run = _direct_state
                enter, exit_ = run["hooks"]
                if run["cls"].run is run["run"] and not enter.calls and not exit_.calls:
                    g = self.g
                    if self.c_launch is not None:
                        self.c_launch(self.run, g, self.stream(self.device), kernel.function, kernel.packed_metadata,
                                      args + self.tail)
                    else:
                        self.run(g[0], g[1], g[2], self.stream(self.device), kernel.function,
                                 kernel.packed_metadata, None, None, None, *args, *self.tail)
                    return
        self._jit(args)

    def _jit(self, args) -> None:
        self.trusted = None
        kernel = self.fn[self.grid](*args, **self.kwargs)
        if not DIRECT_LAUNCH or not _direct_launch_supported() or type(self.fn) is not _direct_state.get("cls"):
            return
        if hasattr(kernel, "result"):  # an async compile's future (triton 3.6 / 3.9)
            kernel = kernel.result()
        if kernel is None or not hasattr(kernel, "packed_metadata"):
            return
        from triton.runtime import driver

        params = list(self.fn.signature.parameters.values())
        tail = []
        for p in params[len(args):]:  # the bound values after the positional ones, in parameter order
            if p.name in self.kwargs:
                tail.append(self.kwargs[p.name])
            elif p.default is not inspect.Parameter.empty:
                tail.append(p.default)
            else:  # pragma: no cover - the JIT call above raised already
                return
        active = driver.active
        self.device = active.get_current_device()
        self.stream = active.get_current_stream
        self.tail = tuple(tail)
        self.facts = self._facts(args)
        self.loose = tuple((i, f) for i, f in enumerate(self.facts) if type(f) is not tuple)  # not tensors
        self.run = kernel.run  # the launcher (CompiledKernel.run is a property: made once, then kept)
        self.c_launch = _c_launch(self.run)
        self.kernel = kernel


def bind_launches(*launches):
    """One callable of no argument for the ``(launch, args)`` pairs given (None skipped), made in their order: a
    ``functools.partial`` of the one launch (a C call into :meth:`DirectLaunch.__call__`), else a function calling
    each. The launchers' ``*_bound`` forms (the hooks' step plans) bind their launches with it."""
    parts = tuple(functools.partial(launch, *args) for launch, args in filter(None, launches))
    if len(parts) == 1:
        return parts[0]

    def run() -> None:
        for part in parts:
            part()

    return run


def device_sms(device) -> int:
    """SM count of ``device`` (CUDA), else :data:`DEFAULT_NUM_SMS`."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return DEFAULT_NUM_SMS


def _launch_options(cfg: dict) -> dict:
    """Triton launch options of a config (``num_warps``, ``num_stages``, ``maxnreg``). Raises ``ValueError`` for a
    ``PREFETCH`` other than 0, 1 or 2 (the kernels unroll at most three register sets; the plans count trips of
    ``1 + PREFETCH`` steps)."""
    _check_prefetch(cfg)
    out = {"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 1)}
    if cfg.get("maxnreg"):
        out["maxnreg"] = cfg["maxnreg"]
    return out


def _check_prefetch(cfg: dict) -> int:
    prefetch = cfg.get("PREFETCH", 0)
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or not 0 <= prefetch <= 2:
        raise ValueError(f"config PREFETCH must be 0, 1 or 2, got {prefetch!r}")
    return prefetch


def steps_per_trip(cfg: dict) -> int:
    """Loop steps (``BLOCK_K`` rows of project_t, columns of project and reconstruct) one trip of the kernel's loop
    does: ``1 + PREFETCH`` on the broadcast path (the loop is unrolled once per step in flight), 1 with ``tl.dot``
    (project's ``PREFETCH`` there is the loop-carried form) or the loop-carried ``CARRY`` form. Raises
    ``ValueError`` for a ``PREFETCH`` other than 0, 1 or 2."""
    prefetch = _check_prefetch(cfg)
    return 1 if cfg.get("USE_DOT") or cfg.get("CARRY") else 1 + prefetch


def factor_columns(which: str) -> dict:
    """The layout-table columns of factor ``which`` ("p" or "q") as the constexprs of the commit_factor kernel:
    ``ROWS_COL`` (its row count: ``ROWS`` n for P, ``COLS`` m for Q) and ``OFF_COL`` (its offset in the flat factor:
    ``P_OFF``, ``Q_OFF``). Raises ``ValueError`` for another ``which``."""
    if which == "p":
        return dict(ROWS_COL=ROWS, OFF_COL=P_OFF)
    if which == "q":
        return dict(ROWS_COL=COLS, OFF_COL=Q_OFF)
    raise ValueError(f"which must be 'p' or 'q', got {which!r}")


def _factor_rank(layout: BucketLayout, cfg: dict) -> int:
    return padded_rank(layout.max_rank, cfg.get("USE_DOT", False))


def _flag_bytes(flags):
    if flags.dtype == torch.bool:
        return flags.view(torch.uint8)
    return flags
