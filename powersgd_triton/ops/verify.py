"""First-use verification of the Triton kernels against the torch backend (``PowerSGDState(verify=...)``).

No test of ours runs the Triton kernels on the GPU a user has, with the Triton version they have: a compiler bug at
some ``num_stages``, a race at some tile or a wrong mask there would give finite, wrong gradients without any
error. So the hooks check the kernels where they run, once per bucket.

What is checked. The first compressed step of every bucket whose kernels (per kernel: GPU model, Triton version,
kernel-source hash, shape class, config, and the bucket's own matrix table: :func:`verdict_key`,
:func:`layout_digest`; project's launch that also packs, ``|packs`` after it; two buckets of one shape class read
different masks and offsets) have no verdict yet runs every numeric launch of the step twice: the Triton launch on the live tensors, and the torch backend
(:mod:`powersgd_triton.ops.reference`, through :mod:`powersgd_triton.ops`) on copies of the very same inputs,
taken just before the launch. Each launch is compared on its own (its inputs are the Triton path's, so the
all-reduced P and Q every rank holds are the inputs of both: the check adds no collective to the step), and every
tensor the launch was given is compared, so a kernel that writes where it should not is caught too. The comparison
rule (backend-invariant quantities, scales from the launch's inputs, tolerances from the bucket's and the compared
tensor's dtypes, ranges an in-flight collective writes left out) is :mod:`powersgd_triton.ops.verify_compare`'s. Then
the ranks agree on the verdict: one all-reduce (MAX) of a few int32 flags, one per kernel (0 agrees, 1 not
checkable, 2 disagrees), over the hook's process group; with one rank there is nothing to agree on. With several
ranks that all-reduce happens at the first compressed step of every bucket memory on every rank, whatever each
rank knew before (from its file or another group's check): no rank-local knowledge decides whether a collective
happens. A kernel a step does not launch stays unjudged: a half-step hook's first P step runs no
``project_t``, so its first Q step is checked too.

Non-finite steps. A launch whose torch result holds NaN or inf (NaN gradients, an overflow step, or another rank's:
the all-reduced factors) cannot be judged, whatever the Triton result: that kernel's check is deferred to the
bucket's next compressed step, on every rank (the agreed flag says "not checkable"). A NaN or inf where the torch
result is finite is a disagreement.

On disagreement (on any rank): one ``RuntimeWarning`` per rank naming the kernel, its config, the bucket, its
shapes and dtype and the worst relative error (or that another rank found it), what was recorded and the command
that clears the verdicts (:data:`CLEAR_COMMAND`); the memory of the step is restored from the copies taken before
it (error memory, P, Q, the RNG of the initial Q, the gradients), and the step runs again on the torch backend on
every rank, with its collectives (the Triton path's all-reduced factors hold the wrong kernel's numbers): its
output is the step's output, and the state's bucket stays on the torch backend for this process. Every rank takes
the same path, since the verdict was agreed.

Verdicts are remembered in the process (every state, every bucket with the same kernels and table) and in
``verify-verdicts.json`` next to the autotune cache (``$POWERSGD_TRITON_CACHE_DIR`` or the user cache dir), under
the same keys, so a later run does not check again: with one rank it uses the file; with several every rank still
takes part in one all-reduce per bucket memory and process (a rank whose file does not know a kernel checks it).
A "wrong" verdict is one strike: the next run checks that kernel again; a second disagreement (in another run)
makes it stick (:data:`STICKY`: later runs use the torch backend for it without checking), an agreement replaces
it. ``powersgd-triton autotune --show`` lists the verdicts, ``--clear-verdicts`` removes the file. A damaged
verdict file is treated as the autotune cache treats its file: a ``CacheWarning``, the file moved aside, checks
run again.

Cost: once per bucket (kernels and table) and process, one extra torch-backend step of that bucket plus copies of
its gradients and memory (on the device), a host synchronization and, with several ranks, one small all-reduce.
After that, one attribute test per bucket step. ``verify="always"`` checks every compressed step (debugging: a
torch step and an all-reduce each); ``"off"`` never checks.
"""

import hashlib
import json
import logging
import math
import os
import time
import warnings
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from powersgd_triton.compat import env as _env
from powersgd_triton import ops
from powersgd_triton.ops.verify_compare import (
    DEFERRED, KERNEL_OF, OK, WRONG, Differential, compare, compare_orthogonal, tolerance,
)
from powersgd_triton.cache_files import CacheWarning, atomic_write_json, default_cache_dir
from powersgd_triton.keys import DeviceKey, device_key_of, dtype_name, shape_class

logger = logging.getLogger("powersgd_triton.verify")

MODES = ("first", "always", "off")
VERDICT_FILENAME = "verify-verdicts.json"
FORMAT = 1
stats = {"checks": 0, "agreements": 0, "fallbacks": 0}  # counts for tests and benchmarks


def check_mode(value) -> str:
    """``value`` if it is one of :data:`MODES`, else ``ValueError``."""
    if not isinstance(value, str) or value not in MODES:
        raise ValueError(f"`verify` must be one of {MODES}, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------- verdict store
STICKY = 2  # a kernel found wrong in this many runs stays wrong (until the verdicts are cleared)
CLEAR_COMMAND = "powersgd-triton autotune --clear-verdicts"


def strikes(entry: dict) -> int:
    """The number of runs that found the kernel of a wrong verdict ``entry`` wrong (1 for files written before
    strikes were counted); 0 for an ok one."""
    if entry.get("ok"):
        return 0
    n = entry.get("strikes", 1)
    return n if isinstance(n, int) and n > 0 else 1


def _entry_problem(entry) -> Optional[str]:
    if not isinstance(entry, dict):
        return f"not an object ({type(entry).__name__})"
    if not isinstance(entry.get("ok"), bool):
        return "ok is not true/false"
    if not isinstance(entry.get("kernel"), str) or not isinstance(entry.get("config"), dict):
        return "kernel or config missing"
    return None


class VerdictStore:
    """``verify-verdicts.json`` in ``directory`` (default: the autotune cache's folder)::

        {"format": 1, "devices": {"<device key>": {"device": {...},
                                                   "verdicts": {"<verdict key>": {
                                                       "ok": bool, "kernel": ..., "config": {...},
                                                       "worst": ..., "detail": ..., "checked_at": ...,
                                                       "strikes": 1 or 2 (wrong verdicts)}}}}}

    Written as the autotune cache is (lock, re-read, merge, atomic replace; a "wrong" verdict found twice, in two
    runs, is never replaced: :data:`STICKY`). Damage: a :class:`~powersgd_triton.autotune.cache.CacheWarning`, the file moved aside (and its
    valid entries written back); never raises on bad files or folders."""

    def __init__(self, directory: Optional[str] = None):
        self.directory = os.path.abspath(directory if directory is not None else default_cache_dir())
        self.path = os.path.join(self.directory, VERDICT_FILENAME)
        self._data: Optional[dict] = None
        self._first: Optional[dict] = None  # the devices' verdicts as this process first read them

    def _aside(self, reason: str) -> None:
        aside = f"{self.path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        try:
            os.replace(self.path, aside)
            where = f"moved to {aside}"
        except OSError as exc:
            where = f"could not be moved aside ({exc})"
        warnings.warn(f"powersgd_triton verdict file {self.path} is damaged ({reason}); it was {where} and the "
                      "kernels are checked again", CacheWarning, stacklevel=4)

    def _read(self) -> dict:
        empty = {"format": FORMAT, "devices": {}}
        try:
            with open(self.path) as f:
                data = json.loads(f.read())
        except FileNotFoundError:
            return empty
        except (OSError, ValueError) as exc:
            self._aside(f"{type(exc).__name__}: {exc}")
            return empty
        if not (isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("devices"), dict)
                and all(isinstance(d, dict) and isinstance(d.get("verdicts"), dict) for d in data["devices"].values())):
            self._aside(f"not a format-{FORMAT} verdict file")
            return empty
        bad = [f"{k}: {why}" for d in data["devices"].values() for k, e in list(d["verdicts"].items())
               if (why := _entry_problem(e)) is not None and d["verdicts"].pop(k, None) is not None]
        if bad:
            self._aside(f"{len(bad)} invalid entries: {'; '.join(bad[:3])}")
            try:
                atomic_write_json(self.path, data)
            except OSError:
                pass
        return data

    def load(self, refresh: bool = False) -> dict:
        if self._data is None or refresh:
            try:
                with _env.file_lock(self.path + ".lock", 60.0):
                    self._data = self._read()
            except OSError:  # an unusable folder: read without the lock (or nothing)
                self._data = self._read() if os.path.isfile(self.path) else {"format": FORMAT, "devices": {}}
        if self._first is None:
            self._first = json.loads(json.dumps(self._data["devices"]))
        return self._data

    def prior_verdicts(self, device: DeviceKey) -> Dict[str, dict]:
        """``device``'s verdicts as the file held them when this process first read it (before this run's checks
        wrote anything: every rank judges a run's second strike from the same earlier runs)."""
        self.load()
        dev = self._first.get(device.key)
        return dev["verdicts"] if dev else {}

    def clear(self) -> Optional[int]:
        """Remove the file (``powersgd-triton autotune --clear-verdicts``); the number of verdicts it held, or None
        when the folder could not be used (an ``OSError`` there is logged as a warning, not raised; nothing was
        removed)."""
        try:
            with _env.file_lock(self.path + ".lock", 60.0):
                n = sum(len(d["verdicts"]) for d in self._read()["devices"].values())
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass
        except OSError as exc:
            logger.warning("powersgd_triton verify: %s not cleared (%s)", self.path, exc)
            return None
        self._data = self._first = None
        return n

    def verdicts(self, device: DeviceKey) -> Dict[str, dict]:
        dev = self.load()["devices"].get(device.key)
        return dev["verdicts"] if dev else {}

    def put_many(self, device: DeviceKey, entries: Dict[str, dict]) -> bool:
        """Merge ``entries`` under ``device``; False when the file could not be written (kept in memory)."""
        def merge(data):
            dev = data["devices"].setdefault(device.key, {"device": device.as_dict(), "verdicts": {}})
            for k, e in entries.items():
                old = dev["verdicts"].get(k)
                if old is not None and not old["ok"]:
                    if e["ok"] and strikes(old) >= STICKY:
                        continue  # a kernel found wrong in two runs stays wrong
                    if not e["ok"]:
                        e = dict(e, strikes=max(strikes(old), strikes(e)))
                dev["verdicts"][k] = e
            return data
        try:
            os.makedirs(self.directory, exist_ok=True)
            with _env.file_lock(self.path + ".lock", 60.0):
                self._data = merge(self._read())
                atomic_write_json(self.path, self._data)
            return True
        except OSError as exc:
            logger.warning("powersgd_triton verify: verdicts not saved to %s (%s)", self.path, exc)
            self._data = merge(self._data if self._data is not None else {"format": FORMAT, "devices": {}})
            return False


_STORE: Optional[VerdictStore] = None
# (device key, verdict key) -> the verdict every rank agreed on in this process: True (agrees), False (wrong)
_SETTLED: Dict[Tuple[str, str], bool] = {}
# > 0 while launches are counted without being run (benchmarking.count_triton_launches(execute=False)): the kernels
# compute nothing then, so no step is checked (the buckets stay pending and the next real step is checked)
PAUSED = 0


def store() -> VerdictStore:
    """The process's verdict file (created on first use, in the autotune cache's folder at that time)."""
    global _STORE
    if _STORE is None or _STORE.directory != os.path.abspath(default_cache_dir()):
        _STORE = VerdictStore()
    return _STORE


def forget() -> None:
    """Forget the verdicts agreed in this process and the file read (tests); the file is untouched."""
    global _STORE
    _SETTLED.clear()
    _STORE = None
    for k in stats:
        stats[k] = 0


def layout_digest(layout) -> str:
    """A digest of the bucket's matrix table (offsets, shapes, ranks, factor and error offsets, uncompressed ranges):
    the masks and offsets the kernels read. Two buckets of one shape class with different tables are two checks."""
    def build():
        table = (layout.batched, layout.numel, list(layout.uncompressed),
                 [(s.offset, s.n, s.m, s.numel, s.rank, s.p_offset, s.q_offset, s.e_offset) for s in layout.matrices])
        return hashlib.sha1(repr(table).encode()).hexdigest()[:16]

    return layout.memo(("verify_layout_digest",), build)


def verdict_key(kernel: str, layout, dtype: torch.dtype, config: Optional[dict]) -> str:
    """``"<shape class key>|<config as sorted JSON>|<layout digest>"``: what one kernel's verdict on one bucket
    table (:func:`layout_digest`) is remembered under."""
    cfg = json.dumps(config or {}, sort_keys=True, separators=(",", ":"))
    return f"{shape_class(kernel, layout, dtype).key}|{cfg}|{layout_digest(layout)}"


# ------------------------------------------------------------------------------------------------ the hooks' check
def _device_key(layout) -> DeviceKey:
    return device_key_of(layout.device)


def _switch_to_torch(mem) -> None:
    mem.drop_next_q()
    mem.use("torch", {})
    mem.verify_pending = False


def _file_verdict(entry: Optional[dict]) -> Optional[bool]:
    """What a verdict file entry (as this run first read it) tells: True (agreed), False (found wrong in
    :data:`STICKY` runs), None (unknown, or found wrong once: checked again)."""
    if entry is None:
        return None
    if entry["ok"]:
        return True
    return False if strikes(entry) >= STICKY else None


def begin(state, mem, buffer: torch.Tensor, group, world_size: int, index: int, packs: bool,
          project_packs: bool = False):
    """Called by a hook before a compressed step of a bucket whose memory is ``verify_pending``: a :class:`Check`
    of this step, or None (nothing to check: ``verify="off"``, the torch backend; with one rank, verdicts known
    already: a bucket with a kernel found wrong then switches to the torch backend). ``packs``: the step packs
    uncompressed gradients (the ``copy_segments`` kernel runs); ``project_packs``: project's launch packs them
    (``project(..., packed=)``: another variant of project's kernel, so its verdict has a key of its own).

    With several ranks every pending bucket's step is a :class:`Check` on every rank, whatever each rank knows
    already (its verdict all-reduce is then the same collective on every rank: what one rank settled in another
    group or read from its own file never decides whether the all-reduce happens); a rank compares only the
    kernels it has no verdict for."""
    mode = state.verify
    layout = mem.layout
    if PAUSED:
        return None
    if mode == "off" or mem.backend != "triton" or layout.num_matrices == 0:
        mem.verify_pending = False
        return None
    dk = _device_key(layout)
    kernels = ["project", "orthogonalize", "project_t", "reconstruct", "average"] + (["copy_segments"] if packs else [])
    keys = {k: verdict_key(k, layout, buffer.dtype, mem.configs.get(k)) for k in kernels}
    if project_packs:
        keys["project"] += "|packs"
    prior = store().prior_verdicts(dk)
    local = {}
    for k in kernels:
        settled = _SETTLED.get((dk.key, keys[k]))
        local[k] = settled if settled is not None else _file_verdict(prior.get(keys[k]))
    known_wrong = [k for k in kernels if local[k] is False]
    if world_size <= 1:
        if known_wrong:
            from_file = [k for k in known_wrong if (dk.key, keys[k]) not in _SETTLED]
            for k in known_wrong:
                _SETTLED[(dk.key, keys[k])] = False
            if from_file:
                warnings.warn(f"PowerSGD: bucket {index} runs on the torch backend: {store().path} records that "
                              f"{', '.join(from_file)} computed wrong values on this GPU with these configs in "
                              f"{STICKY} runs (`{CLEAR_COMMAND}` forgets the verdicts)", RuntimeWarning, stacklevel=4)
            _switch_to_torch(mem)
            return None
        if mode == "first" and None not in local.values():
            for k in kernels:  # one rank: the file's verdicts are the agreed ones
                _SETTLED[(dk.key, keys[k])] = True
            mem.verify_pending = False
            return None
    compare_here = (mode == "always" or None in local.values()) and not known_wrong
    return Check(state, mem, buffer, group, world_size, index, dk, keys, local, compare_here, prior)


class Check:
    """One checked compressed step of one bucket (see the module docstring): the copies of what the step changes,
    the steps the step calls (``steps``: a :class:`Differential` where this rank compares, else the memory's), the
    verdict at its end (:meth:`end`)."""

    def __init__(self, state, mem, buffer, group, world_size, index, dk, keys, local, compare_here, prior=None):
        self.state, self.mem, self.buffer, self.group, self.world_size = state, mem, buffer, group, world_size
        self.index, self.dk, self.keys, self.local = index, dk, keys, local
        self.prior = prior or {}  # the verdict file's entries as this run first read them
        self.strikes: Dict[str, int] = {}  # kernel -> the strikes its wrong verdict was saved with
        mem.drop_next_q()  # "always": the Q made ahead is made again, through the checked ops, from the same input
        self.saved = {name: (None if getattr(mem, name) is None else getattr(mem, name).clone())
                      for name in ("error", "p", "q", "q_work")}
        self.saved_buffer = buffer.clone()
        self.saved_flags = (mem.q_initialized, mem.q_predrawn, mem.phase, state.rng.get_state())
        self.diff = Differential(mem.layout, buffer.dtype, mem.configs) if compare_here else None
        self.steps = self.diff if compare_here else mem.steps
        if compare_here:
            stats["checks"] += 1

    def restore(self) -> None:
        """The bucket's gradients and memory as they were before the step."""
        mem = self.mem
        mem.drop_next_q()
        if self.buffer.device.type == "cuda":  # copied on this stream (NCCL: a callback's), allocated on another
            stream = torch.cuda.current_stream(self.buffer.device)
            for t in [self.saved_buffer, *self.saved.values()]:
                if t is not None:
                    t.record_stream(stream)
        self.buffer.copy_(self.saved_buffer)
        for name, value in self.saved.items():
            if value is not None:
                getattr(mem, name).copy_(value)
        mem.q_initialized, mem.q_predrawn, mem.phase, rng = self.saved_flags
        self.state.rng.set_state(rng)

    def end(self, out: torch.Tensor, replay) -> torch.Tensor:
        """The verdict, agreed by every rank; on a disagreement the step again on the torch backend (``replay()``,
        after :meth:`restore`, returns its output). Returns the step's output."""
        kernels = list(self.keys)
        found = self.diff.codes() if self.diff is not None else {}
        codes = []
        for k in kernels:
            if self.local[k] is False:
                codes.append(WRONG)
            elif self.diff is not None:
                codes.append(found.get(k, DEFERRED))
            else:
                codes.append(OK)
        agreed = codes
        if self.world_size > 1:
            flags = torch.tensor(codes, dtype=torch.int32, device=self.buffer.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            agreed = [int(v) for v in flags.tolist()]
            stats["agreements"] += 1
        self._save(kernels, found)
        for k, code in zip(kernels, agreed):
            if code != DEFERRED:
                _SETTLED[(self.dk.key, self.keys[k])] = code == OK
        if WRONG not in agreed:
            if DEFERRED not in agreed and self.state.verify == "first":
                self.mem.verify_pending = False
            return out
        self._warn(kernels, codes, agreed)
        stats["fallbacks"] += 1
        self.restore()
        _switch_to_torch(self.mem)
        return replay()

    def _save(self, kernels, found) -> None:
        if self.diff is None:
            return
        entries = {}
        for k in kernels:
            if found.get(k, DEFERRED) == DEFERRED:
                continue
            _, _, detail, config, err = self.diff.results[k]
            entry = {"ok": found[k] == OK, "kernel": k, "config": dict(config or {}),
                     "worst": err if math.isfinite(err) else None, "detail": detail,
                     "checked_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
            before = self.prior.get(self.keys[k])
            if found[k] == WRONG:  # one strike per run: this run's, plus the earlier runs' (as this run read them)
                entry["strikes"] = self.strikes[k] = (strikes(before) if before is not None else 0) + 1
            elif before is not None and not before["ok"]:
                entry["earlier"] = f"found wrong before ({before.get('detail') or ''}), agreed when checked again"
            entries[self.keys[k]] = entry
        if entries:
            store().put_many(self.dk, entries)

    def _warn(self, kernels, codes, agreed) -> None:
        layout = self.mem.layout
        shapes = ", ".join(f"{s.n}x{s.m} r{s.rank}" for s in layout.matrices[:6])
        if len(layout.matrices) > 6:
            shapes += f", ... ({len(layout.matrices)} matrices)"
        where = f"bucket {self.index} ({dtype_name(self.buffer.dtype)} gradients, {shapes})"
        mine = [k for k, c in zip(kernels, codes) if c == WRONG]
        if mine:
            what = "; ".join(
                f"{k} with config {self.mem.configs.get(k) or {}}: "
                + (self.diff.results[k][2] if self.diff is not None and k in self.diff.results
                   else f"recorded wrong in {store().path}") for k in mine)
            head = f"the Triton kernels disagree with the torch backend on {where}: {what}"
            if self.diff is not None:
                sticky = [k for k in mine if self.strikes.get(k, 0) >= STICKY]
                head += (f". Recorded in {store().path}: " + (
                    f"{', '.join(sticky)} found wrong in {STICKY} runs, the torch backend stays" if sticky else
                    "the next run checks again, and a second disagreement makes the verdict stick"))
            head += f" (`{CLEAR_COMMAND}` forgets the verdicts)"
        else:
            theirs = [k for k, c in zip(kernels, agreed) if c == WRONG]
            head = (f"another rank's first-use check found Triton kernel(s) {', '.join(theirs)} wrong on {where} "
                    f"(configs {[self.mem.configs.get(k) for k in theirs]}); they agree here")
        warnings.warn(f"PowerSGD: {head}. This step was recomputed on the torch backend and the bucket stays on it "
                      f"on every rank (GPU {self.dk.gpu}, triton {self.dk.triton}); please report it",
                      RuntimeWarning, stacklevel=2)


# ------------------------------------------------------------------------------------------ the autotuner's gate
def candidate_gate(kernel: str, layout, dtype: torch.dtype):
    """For the autotuner: a function ``config -> None | why`` that runs ``kernel`` with ``config`` on seeded random
    inputs for ``layout`` (on its device) and compares every tensor with the torch backend on copies of the same
    inputs (:func:`compare`, :func:`tolerance`); ``why`` says what disagreed. The inputs are made once here."""
    gen = torch.Generator(device=layout.device).manual_seed(0)
    dev = layout.device
    base = dict(buffer=torch.randn(layout.numel, generator=gen, device=dev, dtype=dtype),
                p=torch.randn(layout.p_numel, generator=gen, device=dev),
                q=torch.randn(layout.q_numel, generator=gen, device=dev),
                error=torch.randn(layout.e_numel, generator=gen, device=dev).mul_(0.01))
    flag = torch.ones(1, dtype=torch.bool, device=dev) if dev.type == "cuda" else None

    def gate(config: dict) -> Optional[str]:
        s = {k: v.clone() for k, v in base.items()}
        diff = Differential(layout, dtype)
        if kernel == "project":
            diff.project(s["buffer"], layout, s["q"], s["p"], s["error"], config=config)
        elif kernel == "project_t":
            diff.project_t(s["buffer"], layout, s["p"], s["q"], config=config)
        elif kernel == "orthogonalize":
            diff.orthogonalize(s["p"], layout, "p", 0.0, torch.zeros_like(s["p"]), config=config)
        elif kernel == "reconstruct":
            diff.reconstruct(s["buffer"], layout, s["p"], s["q"], 0.5, s["error"], flag, config=config)
        else:
            raise ValueError(f"unknown kernel {kernel!r}")
        code = diff.codes().get(kernel, DEFERRED)
        return diff.results[kernel][2] or "disagrees with the torch backend" if code == WRONG else None

    return gate
