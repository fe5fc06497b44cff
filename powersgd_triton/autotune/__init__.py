"""Block-size selection for the Triton kernels, per GPU model, remembered, and the same on every rank.

``configs_for_layout(layout, dtype, device, process_group=None, autotune=False)`` returns ``{kernel name: config}``
for the four bucket kernels, to be passed as ``config=`` to :mod:`powersgd_triton.ops`; ``{}`` where the Triton
backend cannot run (the torch backend needs no config). The hooks call it once per bucket layout, from the hook body:
with a process group of more than one rank it is a collective (rank 0 chooses, the others receive its choice), so
every rank must call it for the same layouts in the same order.

Where the configs come from (:class:`~.tuner.Tuner`): memory, the user cache file (``$POWERSGD_TRITON_CACHE_DIR``
or the user cache dir), shipped ``configs/<gpu>.json`` defaults, live tuning with ``autotune=True`` (CUDA only),
the nearest tuned size class, the heuristic. Under ``TRITON_INTERPRET=1`` the fixed interpreter configs, no timing.

Live tuning checks each candidate with the correctness gate its caller passes (``gate=``; the hooks and
``powersgd-triton autotune`` pass :func:`powersgd_triton.ops.verify.candidate_gate`): the tuner sits beside the
kernels (it imports their config spaces and launchers to time them) and imports neither the first-use check nor the
hooks nor the state.

Modules: :mod:`.keys` (shape classes, device keys: re-exported from :mod:`powersgd_triton.keys`), :mod:`.cache`
(JSON files), :mod:`.tuner` (selection, timing, broadcast). The command ``powersgd-triton autotune`` is
:mod:`powersgd_triton.cli.autotune_run`; the AOT compile of every candidate is ``tools/aot.py`` of the repository.
"""

import threading
from typing import Dict, Optional

import torch

from powersgd_triton.compat import env as _env
from powersgd_triton.layout import BucketLayout
from powersgd_triton.autotune.cache import CacheWarning, ConfigCache
from powersgd_triton.autotune.keys import DeviceKey, ShapeClass, device_key, normalize_gpu_name, shape_class
from powersgd_triton.autotune.tuner import KERNELS, AutotuneWarning, Choice, GateFactory, Tuner

__all__ = [
    "KERNELS",
    "AutotuneWarning",
    "CacheWarning",
    "Choice",
    "ConfigCache",
    "DeviceKey",
    "ShapeClass",
    "Tuner",
    "configs_for_layout",
    "device_key",
    "get_tuner",
    "normalize_gpu_name",
    "set_tuner",
    "shape_class",
]

_TUNER: Optional[Tuner] = None
_TUNER_LOCK = threading.Lock()


def get_tuner() -> Tuner:
    """The process-wide :class:`Tuner` used by :func:`configs_for_layout` (created on first use)."""
    global _TUNER
    with _TUNER_LOCK:
        if _TUNER is None:
            _TUNER = Tuner()
        return _TUNER


def set_tuner(tuner: Optional[Tuner]) -> Optional[Tuner]:
    """Replace the process-wide tuner (None: a fresh default one on next use); returns the previous one."""
    global _TUNER
    with _TUNER_LOCK:
        previous, _TUNER = _TUNER, tuner
        return previous


def configs_for_layout(
    layout: BucketLayout,
    dtype: torch.dtype,
    device: torch.device,
    process_group=None,
    autotune: bool = False,
    gate: Optional[GateFactory] = None,
) -> Dict[str, Optional[dict]]:
    """Config per kernel for this bucket layout; identical on every rank of ``process_group``.

    Args:
        layout: the bucket's layout (its device is where tuning would run).
        dtype: the gradient dtype of the bucket.
        device: the bucket's device; ``{}`` is returned where the Triton kernels cannot run on it.
        process_group: the hook's group; with more than one rank, group rank 0's choice is broadcast (collective).
        autotune: time the candidates on the device when no tuned config is known (first call of a shape class
            then costs seconds); otherwise shipped/cached configs or the heuristic.
        gate: ``gate(kernel, layout, dtype) -> (config -> None | why)``, the correctness check a candidate passes
            before its time counts (the hooks pass :func:`powersgd_triton.ops.verify.candidate_gate`; this package
            does not import the check); None: the tuner's own (none by default).
    """
    if not _env.triton_can_run(torch.device(device)):
        return {}
    return get_tuner().configs_for_layout(layout, dtype, process_group=process_group, autotune=autotune, gate=gate)
