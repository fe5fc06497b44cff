"""What :meth:`PowerSGDState.state_dict` writes per bucket, and its validation before ``load_state_dict`` adopts it.

:func:`bucket_entries` writes the per-bucket part of a state dict; :func:`loaded_memories` turns checked entries back
into memories that the buckets adopt on their next compressed step (:mod:`powersgd_triton.state.buckets`).

A damaged state dict (a warm-start Q holding one NaN, an error memory of the wrong length, a table that does not
describe its tensors) would otherwise be adopted and fail later: a NaN Q makes every later step non-finite for good
(the finite-step guard never commits a new Q), a short error tensor fails inside backward with a bare size mismatch.
:func:`check_state_dict` checks every entry against what it describes and raises ``ValueError`` naming the bucket and
the key; it changes nothing, so the caller can commit the result in one go.

What a bucket entry describes is its ``signature``: the ``repr`` of the :class:`~powersgd_triton.layout.BucketLayout`
signature (kind, bucket numel, gradient dtype, rank, and for the layer-wise hooks ``min_compression_rate`` and each
gradient's offset and shape). The layout is rebuilt from it on the ``meta`` device (no memory, no data), and gives
the sizes of ``error`` (``e_numel``), ``p`` (``p_numel``) and ``q`` (``q_numel``) and the packing table
``matrices`` must equal.
"""

import ast
import math
import re
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from powersgd_triton.state.buckets import name_params, param_name
from powersgd_triton.state.torch_interop import check_written
from powersgd_triton.state.memory import BucketMemories, BucketMemory, memory_dtype
from powersgd_triton.layout import BucketLayout

_DTYPE = re.compile(r"torch\.(float64|float32|float16|bfloat16)\b")
_NUMPY_SCALAR = re.compile(r"np\.(?:float|int|uint)\d+\(([^()]*)\)")  # numpy 2 reprs: np.float64(2.0) -> 2.0


def _plain(signature: str) -> str:
    return _NUMPY_SCALAR.sub(r"\1", signature)


def layout_from_signature(signature: str) -> BucketLayout:
    """The layout a saved ``signature`` string describes, rebuilt on the ``meta`` device.

    Raises ``ValueError`` when the string is not a signature :class:`BucketLayout` makes.
    """
    if not isinstance(signature, str):
        raise ValueError(f"must be a layout signature string, got {type(signature).__name__}")
    try:
        parsed = ast.literal_eval(_DTYPE.sub(r"'\g<0>'", _plain(signature)))
        kind, numel, dtype_name, rank = parsed[:4]
        dtype = getattr(torch, str(dtype_name).replace("torch.", ""))
        if not isinstance(dtype, torch.dtype) or not isinstance(numel, int) or not isinstance(rank, int):
            raise TypeError
        if kind == "batched" and len(parsed) == 4:
            layout = BucketLayout.batched(numel, rank, "meta", dtype)
        elif kind == "layerwise" and len(parsed) == 6:
            min_rate, grads = parsed[4], parsed[5]
            buffer = torch.empty(numel, device="meta", dtype=dtype)
            views = []
            for gi, (index, off, shape) in enumerate(grads):
                if index != gi:
                    raise TypeError
                shape = tuple(int(d) for d in shape)
                size = math.prod(shape)
                if off < 0:
                    views.append(torch.empty(shape, device="meta", dtype=dtype))
                else:
                    if off + size > numel:
                        raise TypeError
                    views.append(buffer[off : off + size].view(shape))
            layout = BucketLayout.from_gradients(buffer, views, rank, min_rate)
        else:
            raise TypeError
    except (ValueError, TypeError, SyntaxError, AttributeError, RuntimeError, MemoryError, RecursionError):
        raise ValueError(f"is not a bucket layout signature: {signature[:200]!r}") from None
    if _plain(repr(layout.signature)) != _plain(signature):
        raise ValueError(f"is not a bucket layout signature: {signature[:200]!r}")
    return layout


def _int(where: str, value: Any, low: Optional[int] = 0, high: Optional[int] = None) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{where} must be an integer, got {value!r}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{where} must be in [{low}, {high if high is not None else 'inf'}], got {value}")
    return value


def _tensor(where: str, t: Any, numel: int, bucket_dtype: torch.dtype, unread: bool = False) -> Optional[torch.Tensor]:
    """A copy of the saved tensor, checked: 1-D, ``numel`` elements, the memory dtype, every element finite.
    ``unread``: a tensor the next step does not read (P at phase "p"): its non-finite elements are loaded as zeros
    instead of refused (powerSGD_hook's P after a non-finite step, which GradScaler skips, is NaN or inf)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where} must be a tensor, got {type(t).__name__}")
    want = memory_dtype(bucket_dtype)
    # float32 memory of a float64 bucket: saved before float64 buckets were computed in float64; widened exactly.
    allowed = (want, torch.float32)
    if t.dtype not in allowed:
        raise ValueError(f"{where} must be {want} for a {bucket_dtype} bucket, got {t.dtype}")
    if t.layout != torch.strided or t.dim() != 1 or t.numel() != numel:
        raise ValueError(f"{where} must be a flat tensor of {numel} elements for its layout, got shape {tuple(t.shape)}")
    t = t.detach().clone()
    if unread:
        t.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    if t.numel() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(
            f"{where} holds {bad} non-finite value{'s' if bad != 1 else ''} (NaN or inf): adopting it would make "
            "every later step of this bucket non-finite"
        )
    return t.to(want)


def check_bucket(index: Any, saved: Any) -> Dict[str, Any]:
    """One bucket entry of ``state_dict()["buckets"]``, checked; returns its fields (tensors copied)."""
    where = f"PowerSGDState.load_state_dict: bucket {index!r}"
    if isinstance(index, (bool, np.bool_)) or not isinstance(index, (int, np.integer)) or index < 0:
        raise ValueError(f"{where}: bucket indices must be non-negative integers")
    if not isinstance(saved, dict):
        raise ValueError(f"{where} must be a dict, got {type(saved).__name__}")
    missing = [k for k in ("signature", "error", "p", "q", "q_initialized") if k not in saved]
    if missing:
        raise ValueError(f"{where} lacks {missing}")
    try:
        layout = layout_from_signature(saved["signature"])
    except ValueError as exc:
        raise ValueError(f"{where}, 'signature' {exc}") from None
    dtype = layout.signature[2]
    out: Dict[str, Any] = {"signature": saved["signature"]}
    phase = saved.get("phase", "p")  # absent in state dicts saved before the half-step hook
    if phase not in ("p", "q"):
        raise ValueError(f"{where}, 'phase' must be 'p' or 'q', got {phase!r}")
    out["phase"] = phase
    predrawn = saved.get("predrawn", False)
    if not isinstance(predrawn, bool):
        raise ValueError(f"{where}, 'predrawn' must be a bool, got {predrawn!r}")
    out["predrawn"] = predrawn
    out["error"] = _tensor(f"{where}, 'error'", saved["error"], layout.e_numel, dtype)
    # P is read by the next step only at phase "q" (a half-step hook's kept P); powerSGD_hook's memories stay
    # at phase "p" and recompute P every step
    out["p"] = _tensor(f"{where}, 'p'", saved["p"], layout.p_numel, dtype, unread=phase == "p")
    out["q"] = _tensor(f"{where}, 'q'", saved["q"], layout.q_numel, dtype)
    if out["p"] is None or out["q"] is None:
        raise ValueError(f"{where}: 'p' and 'q' must be tensors, got None")
    flag = saved["q_initialized"]
    if not isinstance(flag, (bool, np.bool_)):
        raise ValueError(f"{where}, 'q_initialized' must be a bool, got {flag!r}")
    out["q_initialized"] = bool(flag)
    names = saved.get("param_names")
    grads = 0 if layout.batched else len(layout.signature[5])
    if names is not None:
        if not isinstance(names, (list, tuple)) or not all(n is None or isinstance(n, str) for n in names):
            raise ValueError(f"{where}, 'param_names' must be a list of parameter names (or None)")
        if not layout.batched and len(names) != grads:
            raise ValueError(f"{where}, 'param_names' names {len(names)} gradients, its signature has {grads}")
        names = tuple(names)
    out["param_names"] = names
    matrices = saved.get("matrices")
    if matrices is not None:
        want = [[s.grad_index, s.n, s.m, s.rank, s.p_offset, s.q_offset, s.e_offset] for s in layout.matrices]
        try:
            rows = [[_int("", v) for v in row] for row in matrices]
        except (TypeError, ValueError):
            rows = None
        if layout.batched or rows != want:
            raise ValueError(f"{where}, 'matrices' does not describe the layout of its signature")
        matrices = [tuple(r) for r in rows]
    out["matrices"] = matrices
    shapes = saved.get("shapes")  # batched hook, absent in older state dicts
    if shapes is not None:
        try:
            shapes = tuple(tuple(_int("", d) for d in shape) for shape in shapes)
        except (TypeError, ValueError):
            shapes = None
        if shapes is None or not layout.batched or sum(math.prod(x) for x in shapes) != layout.numel or (
            names is not None and len(names) != len(shapes)
        ):
            raise ValueError(f"{where}, 'shapes' does not describe the gradients of its signature")
    out["shapes"] = shapes
    return out


def check_rng(rng: Any) -> Tuple[str, np.ndarray, int, int, float]:
    """The saved ``numpy.random.RandomState`` state, checked by loading it into a scratch generator."""
    where = "PowerSGDState.load_state_dict: 'rng'"
    if not isinstance(rng, dict):
        raise ValueError(f"{where} must be a dict, got {type(rng).__name__}")
    try:
        state = (
            str(rng["name"]),
            np.asarray(rng["keys"], dtype=np.uint32),
            _int(f"{where}, 'pos'", rng["pos"]),
            _int(f"{where}, 'has_gauss'", rng["has_gauss"], 0, 1),
            float(rng["cached_gaussian"]),
        )
        if list(state[1].tolist()) != [int(k) for k in rng["keys"]] or not math.isfinite(state[4]):
            raise ValueError("keys out of range or non-finite cached Gaussian")
        np.random.RandomState().set_state(state)
    except Exception as exc:  # noqa: BLE001 - numpy raises several kinds for a malformed state
        raise ValueError(f"{where} is not a numpy RandomState state ({type(exc).__name__}: {exc})") from None
    return state


def check_state_dict(state_dict: Any, version: int) -> Dict[str, Any]:
    """Everything :meth:`PowerSGDState.load_state_dict` needs from ``state_dict``, checked; nothing is changed.

    Raises:
        TypeError: ``state_dict`` is not a dict.
        ValueError: another format version, a missing or malformed field, a bucket tensor whose shape, dtype or
            values (NaN, inf) do not fit what its signature describes; the message names the bucket and the key.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"load_state_dict needs the dict that state_dict() returned, got {type(state_dict).__name__}")
    if state_dict.get("version") != version:
        raise ValueError(f"unsupported PowerSGDState state_dict version {state_dict.get('version')!r}")
    where = "PowerSGDState.load_state_dict"
    missing = [k for k in ("rng", "iter", "total_numel_before_compression", "total_numel_after_compression",
                           "next_stats_report", "buckets") if k not in state_dict]
    if missing:
        raise ValueError(f"{where}: the state dict lacks {missing}")
    config = state_dict.get("config", {})
    if not isinstance(config, dict):
        raise ValueError(f"{where}: 'config' must be a dict, got {type(config).__name__}")
    out: Dict[str, Any] = {"config": config, "rng": check_rng(state_dict["rng"])}
    for key in ("iter", "total_numel_before_compression", "total_numel_after_compression", "next_stats_report"):
        out[key] = _int(f"{where}: {key!r}", state_dict[key])
    world, rank = state_dict.get("world_size"), state_dict.get("rank")
    if world is not None:
        world = _int(f"{where}: 'world_size'", world, 1)
    if rank is not None:
        rank = _int(f"{where}: 'rank'", rank, 0, None if world is None else world - 1)
    out["world_size"], out["rank"] = world, rank
    unscaled = state_dict.get("unscaled_error", False)  # absent in state dicts saved before grad_scaler existed
    if not isinstance(unscaled, bool):
        raise ValueError(f"{where}: 'unscaled_error' must be a bool, got {unscaled!r}")
    out["unscaled_error"] = unscaled
    buckets = state_dict["buckets"]
    if not isinstance(buckets, dict):
        raise ValueError(f"{where}: 'buckets' must be a dict, got {type(buckets).__name__}")
    out["buckets"] = {}
    for index, entry in buckets.items():
        entry = check_bucket(index, entry)
        out["buckets"][int(index)] = entry
    # what PyTorch's own hook wrote into the memory dicts of this state (absent unless it ran on it)
    out["torch_hook_memory"] = check_written(state_dict.get("torch_hook_memory"))
    return out


# ------------------------------------------------------------------------------------------ writing and adopting
def saved_world(buckets: BucketMemories) -> Tuple[Optional[int], Optional[int]]:
    """``(world_size, rank)`` the memory belongs to: of the process group it was built in, or what a loaded, not yet
    checked state was saved with (None before the first compressed step)."""
    if buckets.loaded_world_size is not None:
        return buckets.loaded_world_size, buckets.loaded_rank
    return buckets.world_size, buckets.rank


def bucket_entries(state) -> Dict[int, Dict[str, Any]]:
    """The ``"buckets"`` entry of :meth:`PowerSGDState.state_dict`: per bucket index :func:`bucket_entry` of its
    memory."""
    return {int(index): bucket_entry(state, mem) for index, mem in state.buckets.items()}


def bucket_entry(state, mem: BucketMemory) -> Dict[str, Any]:
    """One bucket's memory tensors (the memory's own, detached, not copies), its layout signature and what lets it
    follow its parameters on resume (names of the bound model, packing table, gradient shapes); a loaded, not yet
    adopted memory passes through as loaded."""
    shapes = None
    if mem.layout is not None:
        # the parameters the memory belongs to, in its order (the batched hook's may differ from the bucket's)
        params = mem.order_params if mem.layout.batched else mem.params
        name_params(state, params)
        names = None
        if params is not None and state.buckets.params_by_name:
            names = [param_name(state, p) for p in params]
        matrices = None
        if not mem.layout.batched:
            matrices = [
                [s.grad_index, s.n, s.m, s.rank, s.p_offset, s.q_offset, s.e_offset] for s in mem.layout.matrices
            ]
        elif params is not None:
            shapes = [list(p.shape) for p in params]
    else:  # loaded, not adopted yet: pass through what was loaded
        names = None if mem.param_names is None else list(mem.param_names)
        matrices = None if mem.matrices is None else [list(r) for r in mem.matrices]
        shapes = None if mem.shapes is None else [list(x) for x in mem.shapes]
    return {
        "signature": mem.signature,
        "error": None if mem.error is None else mem.error.detach(),
        "p": None if mem.p is None else mem.p.detach(),
        "q": None if mem.q is None else mem.q.detach(),
        "q_initialized": bool(mem.q_initialized),
        # q is the random Q the next step draws, drawn ahead (powersgd_triton.state.predraw): that step takes it
        **({"predrawn": True} if mem.q_predrawn else {}),
        "phase": mem.phase,
        # which parameter each gradient of the bucket is (names of the bound model; None: unknown) and
        # where each compressed matrix's memory lies: lets the memory follow its parameters on resume
        "param_names": names,
        "matrices": matrices,
        # batched hook: the gradient shapes its memory was built for, in order (a memory without names is
        # adopted only by a bucket with these shapes in this order)
        "shapes": shapes,
    }


def loaded_memories(buckets: Dict[int, Dict[str, Any]]) -> Dict[int, BucketMemory]:
    """Memories (no layout yet: adopted on each bucket's next compressed step) from the bucket entries of a state
    dict checked by :func:`check_state_dict`."""
    out = {}
    for index, entry in buckets.items():
        mem = BucketMemory()
        mem.signature = entry["signature"]
        mem.param_names = entry["param_names"]
        mem.matrices = entry["matrices"]
        mem.shapes = entry["shapes"]
        mem.error, mem.p, mem.q = entry["error"], entry["p"], entry["q"]
        mem.q_initialized = entry["q_initialized"]
        mem.q_predrawn = entry["predrawn"] and mem.q_initialized
        mem.phase = entry["phase"]
        out[index] = mem
    return out
