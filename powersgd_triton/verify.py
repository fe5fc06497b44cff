"""First-use verification of the Triton kernels against the torch backend (``PowerSGDState(verify=...)``).

No test of ours runs the Triton kernels on the GPU a user has, with the Triton version they have: a compiler bug at
some ``num_stages``, a race at some tile or a wrong mask there would give finite, wrong gradients without any
error. So the hooks check the kernels where they run, once.

What is checked. The first compressed step of a bucket whose kernels (per kernel: GPU model, Triton version,
kernel-source hash, shape class and config; the autotuner's key, :mod:`powersgd_triton.autotune.keys`) have no
verdict yet runs every numeric launch of the step twice: the Triton launch on the live tensors, and the torch
backend (:mod:`powersgd_triton.kernels.reference`, through :mod:`powersgd_triton.ops`) on copies of the very same
inputs, taken just before the launch. Each launch is compared on its own (its inputs are the Triton path's, so the
all-reduced P and Q every rank holds are the inputs of both: the check adds no collective to the step), and
every tensor the launch was given is compared, so a kernel that writes where it should not is caught too. Then the
ranks agree on the verdict: one all-reduce (MAX) of a few int32 flags, one per kernel (0 agrees, 1 not checkable,
2 disagrees), over the hook's process group; with one rank there is nothing to agree on.
A kernel a step does not launch stays unjudged: the alternating hook's first P step runs no ``project_t``, so its
first Q step is checked too.

Tolerances (worst relative error: ``max |triton - torch|`` over each matrix's slice of a tensor, divided by the
largest ``|torch|`` of that slice; the uncompressed gradients are one slice). Both backends take the same inputs
and accumulate in float32 (Gram matrices in float64), so they differ only by summation order: a few float32 ulps of
the slice's largest value for fp32 gradients (measured: below 1e-5 in ``tests/test_kernels.py``), plus the
rounding of a product's operands to bf16/fp16 where a kernel feeds tensor cores with 2-byte gradients (``SPLIT_BF16``,
2^-8 relative per operand, mostly averaged away), plus one storage ulp where the output is a 2-byte bucket (bf16
2^-8, fp16 2^-11). A wrong kernel (a race, a wrong mask, a miscompiled loop, a launch that did not run) is off by
O(1) in what it got wrong. So the bounds sit far above rounding and far below any error that matters:
``1e-3`` for fp32 buckets; for fp16/bf16 buckets ``1e-2`` for float32 outputs (P, Q, the error memory) and
``2e-2`` (fp16) / ``4e-2`` (bf16) for outputs stored in the bucket's dtype. The communication dtype does not enter:
the all-reduced factors, rounded to it, are the same input of both backends. A false alarm costs speed (the bucket
runs on the torch backend), never a wrong gradient.

Non-finite steps. A launch whose torch result holds NaN or inf anywhere (NaN gradients, an overflow step, or
another rank's: the all-reduced factors) cannot be judged, whatever the Triton result: that kernel's check is
deferred to the bucket's next compressed step, on every rank (the agreed flag says "not checkable"). A NaN or inf
where the torch result is finite is a disagreement.

On disagreement (on any rank): one ``RuntimeWarning`` per rank naming the kernel, its config, the bucket, its
shapes and dtype and the worst relative error (or that another rank found it), the memory of the step is restored
from the copies taken before it (error memory, P, Q, the RNG of the initial Q, the gradients), and the step runs
again on the torch backend on every rank, with its collectives (the Triton path's all-reduced factors hold the
wrong kernel's numbers): its output is the step's output, and the state's bucket stays on the torch backend. Every
rank takes the same path, since the verdict was agreed.

Verdicts are remembered in the process (every state, every bucket with the same kernels) and in
``verify-verdicts.json`` next to the autotune cache (``$POWERSGD_TRITON_CACHE_DIR`` or the user cache dir), under
the same keys, so a later run does not check again: with one rank it uses the file; with several it still agrees
once per kernel set and process (one all-reduce; a rank whose file does not know a kernel checks it, one whose file
says wrong makes every rank use torch). ``powersgd-triton autotune --show`` lists them. A damaged verdict file is
treated as the autotune cache treats its file: a ``CacheWarning``, the file moved aside, checks run again.

Cost: once per set of kernels and process, one extra torch-backend step of that bucket plus copies of its
gradients and memory (on the device), a host synchronization and, with several ranks, one small all-reduce. After
that, one attribute test per bucket step. ``verify="always"`` checks every compressed step (debugging: a torch
step and an all-reduce each); ``"off"`` never checks.
"""

import inspect
import json
import logging
import math
import os
import time
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _env, ops
from ._memory import drop_next_q
from .autotune.cache import CacheWarning, atomic_write_json, default_cache_dir
from .autotune.keys import DeviceKey, dtype_name, shape_class

logger = logging.getLogger("powersgd_triton.verify")

MODES = ("first", "always", "off")
VERDICT_FILENAME = "verify-verdicts.json"
FORMAT = 1
# The ops a hook step launches, and the kernel each one's verdict is kept under.
KERNEL_OF = {"project": "project", "orthogonalize": "orthogonalize", "project_t": "project_t",
             "reconstruct": "reconstruct", "average": "average", "pack_uncompressed": "copy_segments",
             "unpack_uncompressed": "copy_segments", "commit_factor": "commit_factor"}
OK, DEFERRED, WRONG = 0, 1, 2
stats = {"checks": 0, "agreements": 0, "fallbacks": 0}  # counts for tests and benchmarks


def check_mode(value) -> str:
    """``value`` if it is one of :data:`MODES`, else ``ValueError``."""
    if not isinstance(value, str) or value not in MODES:
        raise ValueError(f"`verify` must be one of {MODES}, got {value!r}")
    return value


def tolerance(role: str, bucket_dtype: torch.dtype) -> float:
    """Largest worst relative error accepted for an output of ``role`` (``"m"``/``"u"``: stored in the bucket's
    dtype; ``"p"``/``"q"``/``"e"``: float32) of a bucket of ``bucket_dtype`` (module docstring: why)."""
    if bucket_dtype not in (torch.float16, torch.bfloat16):
        return 1e-3
    if role in ("m", "u"):
        return 2e-2 if bucket_dtype == torch.float16 else 4e-2
    return 1e-2


# --------------------------------------------------------------------------------------------------- comparison
_ROLES = {"buffer": "m", "p": "p", "q": "q", "error": "e", "p2": "p", "q2": "q", "local_p": "p", "local_q": "q",
          "unc": "u", "dst": "u", "src": "u", "loss_scale": "u", "new": None, "kept": None, "x": None, "out": None,
          "factor": None, "orthogonalize_kept": "q"}
# Arguments whose content after the call the ops do not specify (scratch): not compared. ``average`` divides the
# packed uncompressed gradients on their way into the bucket (the torch backend in place, the Triton kernel not).
_UNSPECIFIED = {"average": ("unc",)}
_SIGNATURES = {name: inspect.signature(getattr(ops, name)) for name in KERNEL_OF}


def _segments(layout, role: str, numel: int) -> List[Tuple[int, int]]:
    """``(offset, length)`` slices of a tensor of ``role``: one per matrix, the uncompressed gradients as one."""
    mats = layout.matrices
    if role == "p":
        return [(s.p_offset, s.n * s.rank) for s in mats]
    if role == "q":
        return [(s.q_offset, s.m * s.rank) for s in mats]
    if role == "e":
        return [(s.e_offset, s.n * s.m if layout.batched else s.numel) for s in mats]
    if role == "m":
        return [(s.offset, s.numel) for s in mats] + list(layout.uncompressed)
    return [(0, numel)]


def compare(got: torch.Tensor, want: torch.Tensor, layout, role: str) -> Tuple[float, bool]:
    """``(worst relative error, judgeable)`` of ``got`` (Triton) against ``want`` (torch), see the module docstring.
    Not judgeable: ``want`` holds NaN or inf (a non-finite step); then nothing is concluded."""
    a, b = got.detach().reshape(-1).double(), want.detach().reshape(-1).double()
    if not bool(torch.isfinite(b).all()):
        return math.nan, False
    if torch.equal(a, b):
        return 0.0, True
    if not bool(torch.isfinite(a).all()):  # NaN or inf where torch is finite
        return math.inf, True
    diff = (a - b).abs()
    size = b.abs()
    worst = 0.0
    for off, n in _segments(layout, role, a.numel()):
        if n == 0:
            continue
        scale = float(size[off : off + n].max())
        d = float(diff[off : off + n].max())
        if d > 0:
            worst = max(worst, d / scale if scale > 0 else math.inf)
    return worst, True


class Differential:
    """Runs :mod:`powersgd_triton.ops` calls on the Triton backend (the given tensors) and on the torch backend
    (copies made before the Triton call) and keeps per kernel ``[worst error / tolerance, judgeable, detail]``.
    The :class:`~powersgd_triton.ops.StepFlags` of a Triton ``average`` stand for its torch twin in later calls."""

    def __init__(self, layout, bucket_dtype: torch.dtype):
        self.layout, self.dtype = layout, bucket_dtype
        self.results: Dict[str, list] = {}
        self.twins: Dict[int, object] = {}

    def __getattr__(self, name):
        if name not in KERNEL_OF:
            raise AttributeError(name)
        return lambda *args, **kwargs: self.call(name, *args, **kwargs)

    def call(self, name: str, *args, **kwargs):
        bound = _SIGNATURES[name].bind(*args, **kwargs)
        which = bound.arguments.get("which")
        copies: Dict[int, tuple] = {}  # id -> (argument name, live tensor, copy, role)

        def twin(arg, value, role):
            if isinstance(value, torch.Tensor):
                if id(value) not in copies:
                    copies[id(value)] = (arg, value, value.clone(), role or which)
                return copies[id(value)][2]
            if isinstance(value, ops.StepFlags):
                return self.twins.get(id(value), value)
            if isinstance(value, tuple):  # commit=(which, kept)
                return tuple(twin(arg, v, value[0]) for v in value)
            return value

        torch_args = {k: twin(k, v, _ROLES.get(k)) for k, v in bound.arguments.items()}
        torch_args["backend"] = "torch"
        torch_args.pop("config", None)
        if name == "reconstruct":
            torch_args["orthogonalize_kept"] = None  # the Triton backend never fills it: nothing to compare
        config = bound.arguments.get("config")
        result = getattr(ops, name)(*args, **kwargs)
        try:
            torch_result = getattr(ops, name)(**torch_args)
        except Exception as exc:  # noqa: BLE001 - our reference failing must not stop training: not judged
            logger.warning("powersgd_triton verify: the torch reference of %s failed (%s: %s); not judged",
                           name, type(exc).__name__, exc)
            self._record(name, (0.0, 0.0, ""), False, config)
            return result
        if isinstance(result, ops.StepFlags):
            self.twins[id(result)] = torch_result
        worst = (0.0, 0.0, "")  # error / tolerance, error, detail
        judged = True
        for arg, live, copy, role in copies.values():
            if arg in _UNSPECIFIED.get(name, ()):
                continue
            err, ok = compare(live, copy, self.layout, role)
            judged &= ok
            tol = tolerance(role, self.dtype)
            if ok and err / tol > worst[0]:
                worst = (err / tol, err, f"{arg}: worst relative error {err:.3g} (tolerance {tol:g})")
        self._record(name, worst, judged, config)
        return result

    def _record(self, name, worst, judged, config):
        """``results[kernel] = [error / tolerance, judgeable, detail, config, error]``, the worst call's."""
        r = self.results.setdefault(KERNEL_OF[name], [0.0, True, "", config, 0.0])
        if not judged:
            r[1] = False
        elif worst[0] > r[0]:
            r[0], r[4], r[2] = worst

    def codes(self) -> Dict[str, int]:
        """Per kernel seen: :data:`OK`, :data:`DEFERRED` (not judgeable) or :data:`WRONG` (beyond tolerance)."""
        return {k: WRONG if r[0] > 1.0 else (OK if r[1] else DEFERRED) for k, r in self.results.items()}


# ---------------------------------------------------------------------------------------------- verdict store
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
                                                   "verdicts": {"<shape class key>|<config JSON>": {
                                                       "ok": bool, "kernel": ..., "config": {...},
                                                       "worst": ..., "detail": ..., "checked_at": ...}}}}}

    Written as the autotune cache is (lock, re-read, merge, atomic replace; a "wrong" verdict is never replaced by
    an "ok" one). Damage: a :class:`~powersgd_triton.autotune.cache.CacheWarning`, the file moved aside (and its
    valid entries written back); never raises on bad files or folders."""

    def __init__(self, directory: Optional[str] = None):
        self.directory = os.path.abspath(directory if directory is not None else default_cache_dir())
        self.path = os.path.join(self.directory, VERDICT_FILENAME)
        self._data: Optional[dict] = None

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
        return self._data

    def verdicts(self, device: DeviceKey) -> Dict[str, dict]:
        dev = self.load()["devices"].get(device.key)
        return dev["verdicts"] if dev else {}

    def put_many(self, device: DeviceKey, entries: Dict[str, dict]) -> bool:
        """Merge ``entries`` under ``device``; False when the file could not be written (kept in memory)."""
        def merge(data):
            dev = data["devices"].setdefault(device.key, {"device": device.as_dict(), "verdicts": {}})
            for k, e in entries.items():
                if e["ok"] and k in dev["verdicts"] and not dev["verdicts"][k]["ok"]:
                    continue  # a kernel found wrong stays wrong
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


def verdict_key(kernel: str, layout, dtype: torch.dtype, config: Optional[dict]) -> str:
    """``"<shape class key>|<config as sorted JSON>"``: what one kernel's verdict is remembered under."""
    cfg = json.dumps(config or {}, sort_keys=True, separators=(",", ":"))
    return f"{shape_class(kernel, layout, dtype).key}|{cfg}"


# ------------------------------------------------------------------------------------------------ the hooks' check
def _device_key(layout) -> DeviceKey:
    from .autotune import get_tuner

    return get_tuner().device_key(layout.device)


def _switch_to_torch(mem) -> None:
    drop_next_q(mem)
    mem.backend = "torch"
    mem.configs = {}
    mem.verify_pending = False


def begin(state, mem, buffer: torch.Tensor, group, world_size: int, index: int, packs: bool):
    """Called by a hook before a compressed step of a bucket whose memory is ``verify_pending``: a :class:`Check`
    of this step, or None (nothing to check: ``verify="off"``, the torch backend, verdicts agreed already; a bucket
    with a kernel found wrong then switches to the torch backend). ``packs``: the step packs uncompressed
    gradients (the ``copy_segments`` kernel runs)."""
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
    settled = [_SETTLED.get((dk.key, keys[k])) for k in kernels]
    if False in settled:
        _switch_to_torch(mem)
        return None
    if mode == "first" and all(s is True for s in settled):
        mem.verify_pending = False
        return None
    saved = store().verdicts(dk)
    local = {k: (saved[keys[k]]["ok"] if keys[k] in saved else None) for k in kernels}
    known_wrong = [k for k in kernels if local[k] is False]
    if world_size <= 1 and (known_wrong or (mode == "first" and None not in local.values())):
        for k in kernels:  # one rank: the file's verdicts are the agreed ones
            if local[k] is not None:
                _SETTLED[(dk.key, keys[k])] = local[k]
        if known_wrong:
            warnings.warn(f"PowerSGD: bucket {index} runs on the torch backend: {store().path} records that "
                          f"{', '.join(known_wrong)} computed wrong values on this GPU with these configs",
                          RuntimeWarning, stacklevel=4)
            _switch_to_torch(mem)
        else:
            mem.verify_pending = False
        return None
    # several ranks agree at the end of the step; a rank whose file knows a kernel wrong has nothing to compare
    compare_here = (mode == "always" or None in local.values()) and not known_wrong
    return Check(state, mem, buffer, group, world_size, index, dk, keys, local, compare_here)


class Check:
    """One checked compressed step of one bucket (see the module docstring): the copies of what the step changes,
    the ops the step calls (``ops``: a :class:`Differential` where this rank compares, else :mod:`ops`), the
    verdict at its end (:meth:`end`)."""

    def __init__(self, state, mem, buffer, group, world_size, index, dk, keys, local, compare_here):
        self.state, self.mem, self.buffer, self.group, self.world_size = state, mem, buffer, group, world_size
        self.index, self.dk, self.keys, self.local = index, dk, keys, local
        drop_next_q(mem)  # "always": the Q made ahead is made again, through the checked ops, from the same input
        self.saved = {name: (None if getattr(mem, name) is None else getattr(mem, name).clone())
                      for name in ("error", "p", "q", "q_work")}
        self.saved_buffer = buffer.clone()
        self.saved_flags = (mem.q_initialized, mem.q_predrawn, mem.phase, state.rng.get_state())
        self.diff = Differential(mem.layout, buffer.dtype) if compare_here else None
        self.ops = self.diff if compare_here else ops
        if compare_here:
            stats["checks"] += 1

    def restore(self) -> None:
        """The bucket's gradients and memory as they were before the step."""
        mem = self.mem
        drop_next_q(mem)
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
            entries[self.keys[k]] = {"ok": found[k] == OK, "kernel": k, "config": dict(config or {}),
                                     "worst": err if math.isfinite(err) else None, "detail": detail,
                                     "checked_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
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
