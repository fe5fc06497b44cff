"""Choosing block sizes per (GPU model, shape class): lookup, live tuning, and rank 0's choice for every rank.

Lookup order for one kernel of one bucket layout (:meth:`Tuner.choose`):

1. memory (choices already made in this process),
2. the user cache file (:class:`~.cache.ConfigCache`), exact shape class,
3. the shipped ``configs/<gpu>.json`` (or ``$POWERSGD_TRITON_CONFIG_DIR``), exact shape class,
4. live tuning, only when asked (``autotune=True``) and possible (CUDA, not ``TRITON_INTERPRET=1``): every candidate
   of :func:`~powersgd_triton.ops.configs.config_space` plus the heuristic config is timed with
   ``triton.testing.do_bench`` (median, warm-up) on scratch copies of the layout's buffers, rotating through enough
   copies to exceed the L2 cache; the fastest wins and is written to the user cache. Before its time counts, each
   candidate passes the correctness gate it was given (``gate``: the hooks and ``powersgd-triton autotune`` pass
   :func:`powersgd_triton.ops.verify.candidate_gate`, which compares its outputs on seeded inputs with the torch
   backend's, at the first-use check's tolerances; this package does not import the check): one that fails is
   dropped, and the cache entry lists it with the reason (``rejected``; ``powersgd-triton autotune --show``),
5. the nearest size class of the same kernel/dtype/rank/hook kind in the user cache, then in the shipped file,
6. the heuristic (:func:`~powersgd_triton.ops.configs.heuristic_config`).

A cached config that is not a candidate any more (config space changed) is ignored. Under ``TRITON_INTERPRET=1``
nothing is timed, read or written: the interpreter config is used, and a one-time log line (a warning if tuning was
asked for) says so.

Distributed: :meth:`Tuner.configs_for_layout` with a process group of more than one rank lets group rank 0 choose
and broadcasts its choice (``broadcast_object_list``) once per new set of shape classes; every rank then uses
exactly rank 0's configs. This is a collective: every rank of the group must call it for the same layouts in the
same order (the hooks do: the layouts are the same on all ranks).

For tests, ``timer(kernel, config, shape_class) -> ms`` replaces the whole measurement, and ``bench(fn) -> ms``
replaces only ``do_bench`` (the kernels then really run on the scratch buffers, e.g. in the interpreter).
"""

import contextlib
import logging
import math
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from powersgd_triton.compat import env as _env
from powersgd_triton.layout import KERNELS, BucketLayout, padded_rank
from powersgd_triton.autotune import cache as _cache
from powersgd_triton.keys import DeviceKey, ShapeClass, device_key, shape_class

logger = logging.getLogger("powersgd_triton.autotune")

Timer = Callable[[str, dict, ShapeClass], float]
Bench = Callable[[Callable[[], None]], float]
Gate = Callable[[dict], Optional[str]]  # config -> None (agrees) | why it does not
GateFactory = Callable[[str, BucketLayout, torch.dtype], Gate]  # (kernel, layout, dtype) -> its gate


class AutotuneWarning(UserWarning):
    """Tuning was asked for but could not run (no CUDA, interpreter, every candidate failed)."""


@dataclass
class Choice:
    """The config chosen for one kernel and shape class, and where it came from.

    ``source``: ``"tuned"`` (timed now), ``"cache"``/``"shipped"`` (exact class), ``"cache-nearest"``/
    ``"shipped-nearest"`` (closest size class), ``"heuristic"``, ``"interpreter"``.
    """

    kernel: str
    shape_class: ShapeClass
    config: dict
    source: str
    time_ms: Optional[float] = None
    heuristic_ms: Optional[float] = None
    note: str = ""
    timings: List[Tuple[dict, float]] = field(default_factory=list)
    raw: Optional[dict] = None  # the stored entry this choice was read from
    rejected: List[Tuple[dict, str]] = field(default_factory=list)  # candidates that disagreed with torch, and why

    @property
    def speedup(self) -> Optional[float]:
        """Heuristic time / chosen time (None when either was not measured)."""
        if self.time_ms and self.heuristic_ms and math.isfinite(self.time_ms) and math.isfinite(self.heuristic_ms):
            return self.heuristic_ms / self.time_ms
        return None

    def entry(self) -> dict:
        """The JSON entry written to the cache / shipped files (the stored one for a cached choice)."""
        if self.raw is not None:
            return dict(self.raw)
        out = {"config": dict(self.config), "time_ms": self.time_ms, "heuristic_ms": self.heuristic_ms}
        if self.timings:
            out["candidates"] = len(self.timings)
        if self.rejected:
            out["rejected"] = [{"config": dict(c), "why": why} for c, why in self.rejected]
        out["tuned_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        out["torch"] = torch.__version__
        return out

    @classmethod
    def from_entry(cls, kernel: str, sc: ShapeClass, entry: dict, source: str, note: str = "") -> "Choice":
        return cls(kernel, sc, dict(entry["config"]), source, entry.get("time_ms"), entry.get("heuristic_ms"), note,
                   raw=dict(entry))


def _configs():
    """:mod:`powersgd_triton.ops.configs` (config spaces, heuristics), imported on first use."""
    from powersgd_triton.ops import configs

    return configs


def candidates(kernel: str, layout: BucketLayout, dtype: torch.dtype) -> Tuple[List[dict], dict]:
    """``(candidate configs, heuristic config)`` for ``kernel`` on ``layout``; the heuristic is always a candidate."""
    configs = _configs()
    rank = padded_rank(layout.max_rank)
    space = [dict(c) for c in configs.config_space(kernel, rank, dtype)]
    heuristic = dict(configs.heuristic_config(kernel, layout, dtype))
    if heuristic not in space:
        space.append(heuristic)
    return space, heuristic


class _Workload:
    """Scratch copies of a layout's buffers on its device, cycled through so the L2 cache does not flatter timings.

    The kernels write in place (``project`` with error feedback, ``orthogonalize``, ``reconstruct``); they only ever
    touch these scratch tensors, never a real gradient.
    """

    def __init__(self, layout: BucketLayout, dtype: torch.dtype, rotate_bytes: int, max_copies: int = 16):
        self.layout = layout
        dev = layout.device
        elem = torch.empty((), dtype=dtype).element_size()
        per_set = layout.numel * elem + 4 * (layout.p_numel + layout.q_numel + layout.e_numel)
        copies = max(1, min(max_copies, -(-int(rotate_bytes) // max(1, per_set))))
        gen = torch.Generator(device=dev)
        gen.manual_seed(0)
        self.sets = []
        for _ in range(copies):
            try:
                self.sets.append(
                    dict(
                        buffer=torch.randn(layout.numel, generator=gen, device=dev, dtype=dtype),
                        p=torch.randn(layout.p_numel, generator=gen, device=dev),
                        q=torch.randn(layout.q_numel, generator=gen, device=dev),
                        error=torch.randn(layout.e_numel, generator=gen, device=dev).mul_(0.01),
                    )
                )
            except torch.cuda.OutOfMemoryError:
                if not self.sets:
                    raise
                break  # fewer copies than wished: timings of small layouts may be a little optimistic
        # reconstruct is timed with the non-finite-step flag the hooks pass. Not on CPU: Triton 3.9's interpreter
        # rejects the kernel's `block_mask & scalar_flag` store mask ("mask has unsupported dtype").
        self.flag = torch.ones(1, dtype=torch.bool, device=dev) if dev.type == "cuda" else None
        self.calls = 0

    def runner(self, kernel: str, config: dict) -> Callable[[], None]:
        from powersgd_triton.ops import orthogonalization, projection, projection_t, reconstruction

        layout = self.layout

        def run() -> None:
            s = self.sets[self.calls % len(self.sets)]
            self.calls += 1
            if kernel == "project":
                projection.project(s["buffer"], layout, s["q"], s["p"], s["error"], config=config)
            elif kernel == "project_t":
                projection_t.project_t(s["buffer"], layout, s["p"], s["q"], config=config)
            elif kernel == "orthogonalize":
                # out of place, as the hooks call it (in place ignores APPLY_ROWS)
                if "p_out" not in s:
                    s["p_out"] = torch.empty_like(s["p"])
                orthogonalization.orthogonalize(s["p"], layout, "p", 0.0, s["p_out"], config=config)
            elif kernel == "reconstruct":
                reconstruction.reconstruct(s["buffer"], layout, s["p"], s["q"], 0.5, s["error"], self.flag, config=config)
            else:
                raise ValueError(f"unknown kernel {kernel!r}")

        return run


def cuda_bench(fn: Callable[[], None], warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median time of ``fn`` in ms with ``triton.testing.do_bench`` (which also flushes L2 between runs)."""
    from triton.testing import do_bench

    try:
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    except TypeError:  # very old triton without return_mode
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5])[0])


def _group_info(process_group) -> Tuple[int, int, object, object]:
    """``(world size, group rank, group, group key)``; world 1 when torch.distributed is not initialized."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0, None, None
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    name = getattr(group, "group_name", None)
    return world, rank, group, (name if name else id(group))


def broadcast_from_rank0(obj, group, device: Optional[torch.device] = None):
    """``obj`` of group rank 0, on every rank of ``group`` (``broadcast_object_list``)."""
    import torch.distributed as dist

    payload = [obj]
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    dist.broadcast_object_list(payload, src=src, group=group, device=device)
    return payload[0]


class Tuner:
    """Config selection with caches and live tuning (see module docstring).

    Args:
        cache: a :class:`~.cache.ConfigCache`; None for the default one (created on first use); False for none.
        config_dirs: folders of shipped-format ``<gpu>.json`` files (default: ``$POWERSGD_TRITON_CONFIG_DIR``
            and the package's ``configs/``).
        timer: ``timer(kernel, config, shape_class) -> ms`` replacing the device measurement (tests).
        bench: ``bench(fn) -> ms`` replacing ``do_bench`` only (tests; the kernels really run).
        device: a fixed :class:`~.keys.DeviceKey` (default: from the layout's device).
        warmup_ms, rep_ms: ``do_bench`` warm-up and measurement time per candidate.
        rotate_bytes: scratch data cycled through per measurement (default 4x the L2 cache, at least 64 MiB).
        nearest_distance: largest size-class distance accepted by the nearest-class lookup (0 disables it).
        gate: ``gate(kernel, layout, dtype) -> (config -> None | why)``, the correctness check each candidate
            passes before its time counts (:func:`powersgd_triton.ops.verify.candidate_gate`); None: candidates are
            not checked, unless the call passes one (:meth:`configs_for_layout`, :meth:`choose`, :meth:`tune`).
        check: run the gate before timing (default: when the kernels really run, i.e. without ``timer``; ``True``
            also with a ``timer``, the kernels then run for the check).
    """

    def __init__(
        self,
        cache=None,
        config_dirs: Optional[List[str]] = None,
        timer: Optional[Timer] = None,
        bench: Optional[Bench] = None,
        device: Optional[DeviceKey] = None,
        warmup_ms: float = 25.0,
        rep_ms: float = 100.0,
        rotate_bytes: Optional[int] = None,
        nearest_distance: int = 3,
        check: Optional[bool] = None,
        gate: Optional[GateFactory] = None,
    ):
        self.check = check
        self.gate = gate
        self._cache = cache
        self.config_dirs = config_dirs
        self.timer = timer
        self.bench = bench
        self.fixed_device = device
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms
        self.rotate_bytes = rotate_bytes
        self.nearest_distance = nearest_distance
        self.memory: Dict[Tuple[str, str], Choice] = {}
        self._agreed: Dict[Tuple[object, str], dict] = {}
        self._devices: Dict[str, DeviceKey] = {}
        self._shipped: Dict[str, Dict[str, dict]] = {}
        self._said = set()
        self._lock = threading.RLock()
        self._depth = 0  # nesting of select()/configs_for_layout(): scratch buffers live while > 0
        self._scratch: Optional[Tuple[tuple, _Workload]] = None
        self.stats = {"broadcasts": 0, "tuned": 0, "measured": 0}

    # ------------------------------------------------------------------ sources
    @property
    def cache(self) -> Optional[_cache.ConfigCache]:
        if self._cache is None:
            self._cache = _cache.ConfigCache()
        return self._cache or None

    def device_key(self, device) -> DeviceKey:
        if self.fixed_device is not None:
            return self.fixed_device
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        k = str(dev)
        if k not in self._devices:
            self._devices[k] = device_key(dev)
        return self._devices[k]

    def shipped_entries(self, dk: DeviceKey) -> Dict[str, dict]:
        if dk.gpu not in self._shipped:
            path = _cache.find_device_file(dk.gpu, self.config_dirs)
            self._shipped[dk.gpu] = _cache.load_device_file(path) if path else {}
            if path:
                logger.info("powersgd_triton autotune: shipped configs for %s from %s", dk.gpu, path)
        return self._shipped[dk.gpu]

    def _cache_entries(self, dk: DeviceKey) -> Dict[str, dict]:
        c = self.cache
        return c.entries(dk) if c is not None else {}

    def interpreter_mode(self) -> bool:
        """True under TRITON_INTERPRET=1 without an injected timer/bench: fixed interpreter configs, nothing else."""
        return _env.interpreter_enabled() and self.timer is None and self.bench is None

    def timing_available(self, device) -> Tuple[bool, str]:
        """Whether configs can be timed for ``device``, and why not."""
        if self.timer is not None or self.bench is not None:
            return True, ""
        if _env.interpreter_enabled():
            return False, "TRITON_INTERPRET=1 (no timing in the interpreter)"
        if not torch.cuda.is_available():
            return False, "no CUDA device"
        if torch.device(device).type != "cuda":
            return False, f"tensors on {device}, not CUDA"
        return True, ""

    def _say_once(self, msg: str, warn: bool = False) -> None:
        if msg in self._said:
            return
        self._said.add(msg)
        if warn:
            warnings.warn(msg, AutotuneWarning, stacklevel=4)
        else:
            logger.info(msg)

    # ------------------------------------------------------------------ selection
    @staticmethod
    def _lookup(
        sc: ShapeClass, entries: Dict[str, dict], cands: List[dict], nearest: int
    ) -> Optional[Tuple[str, dict]]:
        """Exact (``nearest=0``) or nearest valid entry for ``sc``: ``(key, entry)`` or None."""
        if nearest <= 0:
            e = entries.get(sc.key)
            return (sc.key, e) if e is not None and e.get("config") in cands else None
        best = None
        for key, e in entries.items():
            try:
                other = ShapeClass.parse(key)
            except ValueError:
                continue
            if not other.same_family(sc) or e.get("config") not in cands:
                continue
            d = other.distance(sc)
            if d <= nearest and (best is None or (d, key) < best[0]):
                best = ((d, key), e)
        return (best[0][1], best[1]) if best else None

    def choose(
        self, kernel: str, layout: BucketLayout, dtype: torch.dtype, autotune: bool = False, force: bool = False,
        gate: Optional[GateFactory] = None,
    ) -> Choice:
        """The config for ``kernel`` on ``layout`` (lookup order in the module docstring); ``force`` re-tunes;
        ``gate``: the correctness gate of live tuning (default: the tuner's)."""
        with self._lock:
            sc = shape_class(kernel, layout, dtype)
            if self.interpreter_mode():
                if autotune or force:
                    self._say_once("powersgd_triton autotune: TRITON_INTERPRET=1, no timing; interpreter configs used",
                                   warn=True)
                return Choice(kernel, sc, _configs().heuristic_config(kernel, layout, dtype), "interpreter",
                              note="TRITON_INTERPRET=1")
            dk = self.device_key(layout.device)
            mkey = (dk.key, sc.key)
            if not force and mkey in self.memory:
                return self.memory[mkey]
            cands, heuristic = candidates(kernel, layout, dtype)
            if not force:
                for source, entries in (("cache", self._cache_entries(dk)), ("shipped", self.shipped_entries(dk))):
                    hit = self._lookup(sc, entries, cands, 0)
                    if hit is not None:
                        choice = Choice.from_entry(kernel, sc, hit[1], source)
                        self.memory[mkey] = choice
                        return choice
            reason = ""
            if autotune or force:
                ok, reason = self.timing_available(layout.device)
                if ok:
                    choice = self.tune(kernel, layout, dtype, sc=sc, cands=cands, heuristic=heuristic, gate=gate)
                    self.memory[mkey] = choice  # also a failed tuning: not retried in this process
                    if choice.source == "tuned":
                        c = self.cache
                        if c is not None:
                            c.put(dk, sc.key, choice.entry())
                    return choice
                self._say_once(f"powersgd_triton autotune: tuning asked for but {reason}; not tuned", warn=True)
            for source, entries in (("cache", self._cache_entries(dk)), ("shipped", self.shipped_entries(dk))):
                hit = self._lookup(sc, entries, cands, self.nearest_distance)
                if hit is not None:
                    return Choice.from_entry(kernel, sc, hit[1], source + "-nearest", note=hit[0])
            if not reason:
                ok, reason = self.timing_available(layout.device)
                reason = "not tuned (autotune=False)" if ok else reason
            self._say_once(f"powersgd_triton autotune: heuristic configs for {dk.gpu} ({reason})")
            return Choice(kernel, sc, heuristic, "heuristic", note=reason)

    # ------------------------------------------------------------------ timing
    def _workload(self, layout: BucketLayout, dtype: torch.dtype) -> _Workload:
        """Scratch buffers for ``layout``, shared by its four kernels while one :meth:`select` runs."""
        key = (id(layout), dtype)
        if self._scratch is not None and self._scratch[0] == key:
            return self._scratch[1]
        rotate = self.rotate_bytes
        if rotate is None:
            rotate = 64 << 20
            if layout.device.type == "cuda":
                props = torch.cuda.get_device_properties(layout.device)
                rotate = max(rotate, 4 * int(getattr(props, "L2_cache_size", 0) or 0))
        self._scratch = None  # free the previous layout's buffers first
        workload = _Workload(layout, dtype, rotate)
        if self._depth > 0:
            self._scratch = (key, workload)
        return workload

    def measure(self, kernel: str, config: dict, sc: ShapeClass, workload: Optional[_Workload]) -> float:
        """Time of one candidate in ms (``inf`` if it fails to compile or launch)."""
        self.stats["measured"] += 1
        if self.timer is not None:
            return float(self.timer(kernel, dict(config), sc))
        fn = workload.runner(kernel, config)
        fn()  # compile and build the tile tables outside the timed region; errors surface here
        if self.bench is not None:
            return float(self.bench(fn))
        torch.cuda.synchronize(workload.layout.device)
        return cuda_bench(fn, self.warmup_ms, self.rep_ms)

    def tune(
        self,
        kernel: str,
        layout: BucketLayout,
        dtype: torch.dtype,
        sc: Optional[ShapeClass] = None,
        cands: Optional[List[dict]] = None,
        heuristic: Optional[dict] = None,
        workload: Optional[_Workload] = None,
        gate: Optional[GateFactory] = None,
    ) -> Choice:
        """Time every candidate of ``kernel`` on ``layout`` now; the fastest wins (ties: the earlier candidate).

        Each candidate first passes ``gate`` (default: the tuner's; see :class:`Tuner`), when checking is on.

        Candidates that fail (out of resources, compile error) count as infinitely slow; if all fail the heuristic is
        returned with a warning. Nothing is stored (see :meth:`choose`).
        """
        sc = sc or shape_class(kernel, layout, dtype)
        if cands is None:
            cands, heuristic = candidates(kernel, layout, dtype)
        if workload is None and self.timer is None:
            try:
                workload = self._workload(layout, dtype)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory for the scratch buffers
                self._say_once(f"powersgd_triton autotune: no scratch buffers for {sc} ({type(exc).__name__}: "
                               f"{exc}); heuristic used", warn=True)
                return Choice(kernel, sc, dict(heuristic), "heuristic", note="no scratch memory")
        timings: List[Tuple[dict, float]] = []
        rejected: List[Tuple[dict, str]] = []
        make_gate = gate if gate is not None else self.gate
        gate = None
        if make_gate is not None and (self.check if self.check is not None else self.timer is None):
            try:
                gate = make_gate(kernel, layout, dtype)
            except Exception as exc:  # noqa: BLE001 - e.g. no memory for its inputs: the hooks' first-use check remains
                self._say_once(f"powersgd_triton autotune: candidates of {sc} not checked against the torch backend "
                               f"({type(exc).__name__}: {exc})", warn=True)
        for cfg in cands:
            try:
                why = gate(cfg) if gate is not None else None
                if why is not None:  # wrong numbers: dropped before its time can count
                    rejected.append((cfg, why))
                    logger.warning("powersgd_triton autotune: %s %s disagrees with the torch backend (%s); dropped",
                                   kernel, cfg, why)
                    continue
                t = self.measure(kernel, cfg, sc, workload)
            except Exception as exc:  # noqa: BLE001 - any failing candidate is just not chosen
                logger.info("powersgd_triton autotune: %s %s failed: %s: %s", kernel, cfg, type(exc).__name__, exc)
                t = math.inf
            if not (t >= 0):  # NaN
                t = math.inf
            timings.append((cfg, t))
        self.stats["tuned"] += 1
        if not timings:
            self._say_once(f"powersgd_triton autotune: every candidate of {kernel} disagreed with the torch backend "
                           f"for {sc}; heuristic used (the hooks' first-use check decides)", warn=True)
            return Choice(kernel, sc, dict(heuristic), "heuristic", note="every candidate disagreed", rejected=rejected)
        best_i = min(range(len(timings)), key=lambda i: (timings[i][1], i))
        best, best_t = timings[best_i]
        h_t = next((t for c, t in timings if c == heuristic), None)
        if not math.isfinite(best_t):
            self._say_once(f"powersgd_triton autotune: every candidate of {kernel} failed for {sc}; heuristic used",
                           warn=True)
            return Choice(kernel, sc, dict(heuristic), "heuristic", note="all candidates failed", timings=timings,
                          rejected=rejected)
        return Choice(kernel, sc, dict(best), "tuned", best_t, h_t, timings=timings, rejected=rejected)

    # ------------------------------------------------------------------ per layout, all ranks
    def select(
        self, layout: BucketLayout, dtype: torch.dtype, autotune: bool = False, force: bool = False, kernels=KERNELS,
        gate: Optional[GateFactory] = None,
    ) -> Dict[str, Choice]:
        """:meth:`choose` for each kernel of ``layout`` (this rank only)."""
        with self.session():
            return {k: self.choose(k, layout, dtype, autotune=autotune, force=force, gate=gate) for k in kernels}

    @contextlib.contextmanager
    def session(self):
        """Within this block, the scratch buffers of the last layout tuned are kept for its other kernels."""
        with self._lock:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._scratch = None

    def configs_for_layout(
        self, layout: BucketLayout, dtype: torch.dtype, process_group=None, autotune: bool = False,
        gate: Optional[GateFactory] = None,
    ) -> Dict[str, dict]:
        """``{kernel: config}`` for ``layout``; identical on every rank of ``process_group`` (rank 0's choice);
        ``gate``: the correctness gate of live tuning (default: the tuner's).

        With more than one rank this is a collective over ``process_group`` the first time a layout brings a new
        shape class (one ``broadcast_object_list``); afterwards it is a dictionary lookup.
        """
        with self.session():
            if self.interpreter_mode() or layout.num_matrices == 0:
                # Same on every rank by construction (the interpreter configs / nothing to launch): no broadcast.
                return {k: dict(self.choose(k, layout, dtype, autotune=autotune, gate=gate).config) for k in KERNELS}
            world, rank, group, gkey = _group_info(process_group)
            if world <= 1:
                return {k: dict(c.config) for k, c in self.select(layout, dtype, autotune=autotune, gate=gate).items()}
            classes = {k: shape_class(k, layout, dtype).key for k in KERNELS}
            missing = [k for k in KERNELS if (gkey, classes[k]) not in self._agreed]
            if missing:
                payload = None
                if rank == 0:
                    payload = {}
                    for k in missing:
                        try:
                            payload[classes[k]] = dict(
                                self.choose(k, layout, dtype, autotune=autotune, gate=gate).config)
                        except Exception as exc:  # noqa: BLE001 - the other ranks wait in the broadcast
                            self._say_once(f"powersgd_triton autotune: choosing {k} failed ({exc}); heuristic used",
                                           warn=True)
                            payload[classes[k]] = dict(_configs().heuristic_config(k, layout, dtype))
                device = None
                if layout.device.type == "cuda" and "nccl" in str(_backend(group)).lower():
                    device = layout.device
                payload = broadcast_from_rank0(payload, group, device)
                self.stats["broadcasts"] += 1
                for k in missing:
                    self._agreed[(gkey, classes[k])] = payload[classes[k]]
            return {k: dict(self._agreed[(gkey, classes[k])]) for k in KERNELS}

    def forget(self) -> None:
        """Drop what this process remembers (memory, rank agreements, shipped files); files are untouched."""
        with self._lock:
            self.memory.clear()
            self._agreed.clear()
            self._shipped.clear()
            self._said.clear()
            if self._cache:
                self._cache._data = None


def _backend(group) -> str:
    import torch.distributed as dist

    try:
        return dist.get_backend(group)
    except Exception:  # noqa: BLE001
        return ""
