"""Per-rank checkpoints of the PowerSGD hook state: ``save_hook_state`` / ``load_hook_state``.

The error-feedback memory of PowerSGD is each rank's own: it holds what that rank's compression left out of its own
gradients. PyTorch's documented recipe saves rank 0's ``PowerSGDState`` and loads it on every rank, so after a resume
every rank continues with rank 0's residuals (an approximate resume). Here every rank writes and reads its own file,
``hook_state.rank{r}.pt``, so a resumed run continues exactly as an uninterrupted one.

Each file records the rank, the world size, the names and shapes of the model's parameters, and, per DDP bucket, which
parameter each saved matrix belongs to. Loading checks all of it and raises ``ValueError`` naming what differs:

* another world size, or another rank's file;
* a model whose parameters differ in name or shape, or compression settings that change what is compressed;
* a bucket that, when the hook first sees it, holds compressed parameters the file has no memory for.

A fresh ``DistributedDataParallel`` orders the parameters of its first buckets differently from the rebuilt buckets a
trained one uses; the loaded memory follows its parameters into whatever buckets DDP makes (exactly, matrix by
matrix), so the layout check happens when the hook first sees each bucket.

Example (every rank)::

    from powersgd_triton.checkpoint import load_hook_state, save_hook_state

    save_hook_state(state, ddp_model, "ckpt/")          # writes ckpt/hook_state.rank{r}.pt
    ...
    load_hook_state(state, ddp_model, "ckpt/")          # after init_process_group, before the next backward

Files hold only tensors and plain Python types: ``torch.load(..., weights_only=True)`` reads them.
"""

import os
import pickle
import string
import tempfile
import warnings
from typing import Any, Dict, Optional, Tuple

import torch

from powersgd_triton.state.buckets import bind_model
from powersgd_triton.state.powersgd_state import PowerSGDState

__all__ = ["hook_state_path", "save_hook_state", "load_hook_state", "load_hook_state_if_saved", "FORMAT"]

FORMAT = "powersgd_triton.hook_state"
_VERSION = 1
FILE_PATTERN = "hook_state.rank{rank}.pt"
# Hyper-parameters that decide which matrices are compressed and what the memory means: must match on load.
MUST_MATCH = ("matrix_approximation_rank", "min_compression_rate", "use_error_feedback", "warm_start")


def hook_state_path(path, rank: int) -> str:
    """The file of ``rank``: ``path`` formatted when it contains a ``{rank}`` placeholder (a format spec such as
    ``{rank:03d}`` too; ``{{`` and ``}}`` are literal braces there), else ``path/hook_state.rank{rank}.pt`` (braces
    are then part of the folder's name).

    Raises:
        ValueError: ``path`` has a ``{rank}`` placeholder and another placeholder (``{epoch}``, ``{}``) or a lone
            brace: the message names the path and the one placeholder it accepts.
    """
    path = os.fspath(path)
    if "{rank" not in path:
        return os.path.join(path, FILE_PATTERN.format(rank=rank))
    try:
        others = [f"{{{field}}}" for _, field, _, _ in string.Formatter().parse(path)
                  if field is not None and field != "rank"]
        if not others:
            return path.format(rank=rank)
        problem = "placeholder(s) " + ", ".join(others)
    except (ValueError, KeyError, IndexError, AttributeError) as exc:  # a lone brace, a nested field in a spec
        problem = f"a malformed placeholder ({exc})"
    raise ValueError(
        f"hook state path {path!r} has {problem}: the only placeholder it accepts is {{rank}} (e.g. "
        f"'checkpoints/hook_state.rank{{rank}}.pt'); format the others in before passing the path, or double a "
        "literal brace ('{{', '}}')"
    )


def _rank_and_world(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    import torch.distributed as dist

    if rank is None or world_size is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "the default process group is not initialized: call torch.distributed.init_process_group() first, "
                "or pass rank= and world_size="
            )
        if rank is None:
            rank = dist.get_rank()
        if world_size is None:
            world_size = dist.get_world_size()
    return int(rank), int(world_size)


def _module(model):
    if model is None:
        raise TypeError("model is required: the DDP model (or its module) the hook is registered on")
    return getattr(model, "module", model)


def _parameter_shapes(model) -> Dict[str, list]:
    return {name: list(p.shape) for name, p in _module(model).named_parameters()}


def save_hook_state(state: PowerSGDState, model, path, *, rank: Optional[int] = None,
                    world_size: Optional[int] = None) -> str:
    """Write this rank's hook state to :func:`hook_state_path` ``(path, rank)``; returns the file name.

    Call it on **every** rank (each writes its own file), between two iterations. ``model`` is the DDP model the
    hook is registered on (or its module): it names the parameters of the saved matrices. ``rank`` and
    ``world_size`` default to the default process group's. The file is written atomically (temporary file, then
    rename), and its folder is created.
    """
    if not isinstance(state, PowerSGDState):
        raise TypeError(f"state must be a powersgd_triton.PowerSGDState, got {type(state).__name__}")
    rank, world_size = _rank_and_world(rank, world_size)
    bind_model(state, model)
    hook_state = state.state_dict()
    saved_ws = hook_state.get("world_size")
    if saved_ws is not None and saved_ws != world_size:
        raise ValueError(f"the hook state was built in a world of {saved_ws} ranks, not {world_size}")
    payload = {
        "format": FORMAT,
        "version": _VERSION,
        "rank": rank,
        "world_size": world_size,
        "parameters": _parameter_shapes(model),
        "torch_version": str(torch.__version__),
        "hook_state": hook_state,
    }
    file = hook_state_path(path, rank)
    folder = os.path.dirname(os.path.abspath(file))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".hook_state.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
        os.replace(tmp, file)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return file


def _differences(saved: Dict[str, list], current: Dict[str, list], limit: int = 8) -> list:
    out = []
    for name in saved:
        if name not in current:
            out.append(f"{name} (saved {tuple(saved[name])}) is not in the model")
        elif list(saved[name]) != list(current[name]):
            out.append(f"{name}: saved {tuple(saved[name])}, model {tuple(current[name])}")
    for name in current:
        if name not in saved:
            out.append(f"{name} {tuple(current[name])} is not in the saved state")
    if len(out) > limit:
        out = out[:limit] + [f"... and {len(out) - limit} more"]
    return out


def _read(file: str, map_location) -> Any:
    """``torch.load(file, weights_only=True)``; a file that is not a readable checkpoint raises ``ValueError``
    naming it and what is wrong (empty, truncated or not a torch.save archive, objects other than tensors and plain
    Python types), instead of torch's own errors (which advise the unsafe ``weights_only=False``)."""
    size = os.path.getsize(file)
    if size == 0:
        raise ValueError(f"{file} is empty (0 bytes): not a PowerSGD hook state; was its save interrupted?")
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except (PermissionError, IsADirectoryError):
        raise
    except pickle.UnpicklingError as exc:
        what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{file} ({size} bytes) holds something other than tensors and plain Python types, or is not a "
            f"torch.save file ({what[:200]}); PowerSGD hook states never do: not loading it"
        ) from None
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError, OSError, EOFError, ... for damaged files
        what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{file} ({size} bytes) is not a readable PowerSGD hook state: truncated, damaged or not a torch.save "
            f"file ({type(exc).__name__}: {what[:200]})"
        ) from None


def load_hook_state(state: PowerSGDState, model, path, *, rank: Optional[int] = None,
                    world_size: Optional[int] = None, map_location="cpu") -> Dict[str, Any]:
    """Load this rank's file written by :func:`save_hook_state` into ``state``; returns the file's metadata.

    Call it on every rank, after ``init_process_group`` and before the next backward pass (before or after
    ``register_comm_hook``). Tensors are loaded onto ``map_location`` and moved to the bucket's device when the hook
    first sees the bucket.

    Raises:
        FileNotFoundError: no file for this rank (the message lists the ranks that have one).
        ValueError: the file is empty, truncated, damaged or not a hook state file (a damaged hook state inside:
            a tensor of the wrong size or dtype, NaN or inf in the memory); the file is another rank's, or from
            another world size; the model's parameters differ from the saved ones; the compression settings (rank,
            ``min_compression_rate``, error feedback, warm start) differ. Each message names the file; ``state`` is
            left as it was. Later, from the hook: a bucket whose compressed parameters have no saved memory.
    """
    if not isinstance(state, PowerSGDState):
        raise TypeError(f"state must be a powersgd_triton.PowerSGDState, got {type(state).__name__}")
    rank, world_size = _rank_and_world(rank, world_size)
    file = hook_state_path(path, rank)
    if not os.path.exists(file):
        others = []
        if "{rank}" not in os.fspath(path) and os.path.isdir(os.fspath(path)):
            others = sorted(n for n in os.listdir(os.fspath(path)) if n.startswith("hook_state.rank"))
        hint = f" (found: {', '.join(others)})" if others else ""
        raise FileNotFoundError(f"no PowerSGD hook state for rank {rank}: {file} does not exist{hint}")
    payload = _read(file, map_location)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{file} is not a PowerSGD hook state written by powersgd_triton.checkpoint.save_hook_state")
    if payload.get("version") != _VERSION:
        raise ValueError(f"{file}: unsupported hook state version {payload.get('version')!r}")
    missing = [k for k in ("rank", "world_size", "parameters", "hook_state") if k not in payload]
    if missing:
        raise ValueError(f"{file} is damaged: it lacks {missing}")
    parameters = payload["parameters"]
    if not isinstance(parameters, dict) or not isinstance(payload["hook_state"], dict) or not all(
        isinstance(k, str) and isinstance(v, (list, tuple)) and all(isinstance(d, int) for d in v)
        for k, v in parameters.items()
    ):
        raise ValueError(f"{file} is damaged: its parameter table or hook state is malformed")
    if not all(isinstance(payload[k], int) and not isinstance(payload[k], bool) for k in ("rank", "world_size")):
        raise ValueError(f"{file} is damaged: rank and world_size must be integers")
    if payload["world_size"] != world_size:
        raise ValueError(
            f"{file} was saved by rank {payload['rank']} of a world of {payload['world_size']} ranks; this job has "
            f"{world_size}. Error-feedback memory is per rank and cannot be mapped to another world size: start "
            "the hook state afresh (keep a new PowerSGDState) to change the number of ranks"
        )
    if payload["rank"] != rank:
        raise ValueError(f"{file} holds the hook state of rank {payload['rank']}, not of rank {rank}")
    differences = _differences(payload["parameters"], _parameter_shapes(model))
    if differences:
        raise ValueError(f"{file} was saved for another model; parameters differ: " + "; ".join(differences))
    hook_state = payload["hook_state"]
    config = hook_state.get("config", {})
    differing = [
        f"{k}: saved {config[k]!r}, state {getattr(state, k)!r}"
        for k in MUST_MATCH
        if k in config and config[k] != getattr(state, k)
    ]
    if differing:
        raise ValueError(f"{file} was saved with other compression settings: " + "; ".join(differing))
    try:
        state.load_state_dict(hook_state)  # warns when other hyper-parameters differ (this state's values are kept)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{file} holds a damaged hook state: {exc}") from None
    for mem in state.buckets.values():
        mem.strict = True
    bind_model(state, model)
    return {k: v for k, v in payload.items() if k != "hook_state"}


def load_hook_state_if_saved(state: PowerSGDState, model, path, *, rank: int, world_size: int,
                             checkpoint: Optional[str] = None) -> bool:
    """:func:`load_hook_state` when ``path`` has this rank's file; else a ``RuntimeWarning`` that the hook starts
    afresh (iteration 0, empty error-feedback memory), naming ``checkpoint`` (default ``path``). Returns whether it
    loaded. For the framework integrations, whose checkpoints may predate the hook. Raises as :func:`load_hook_state`.
    """
    file = hook_state_path(path, rank)
    if os.path.exists(file):
        load_hook_state(state, model, path, rank=rank, world_size=world_size)
        return True
    warnings.warn(
        f"{checkpoint or path} has no PowerSGD hook state for rank {rank} ({file}): the hook starts afresh "
        "(iteration 0, empty error-feedback memory)",
        RuntimeWarning,
        stacklevel=3,
    )
    return False
