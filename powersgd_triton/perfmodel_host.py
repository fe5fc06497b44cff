"""The host side of the performance model (:mod:`powersgd_triton.perfmodel`): what a compressed bucket step costs
the host (:class:`HostSpec`, measured by ``powersgd-triton bench --host-overhead``: :data:`HOSTS`), and the step as
host and device work per segment between its collectives (:func:`predict_host`)."""

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from powersgd_triton.layout import BucketLayout

__all__ = ["HostSpec", "HOSTS", "SEGMENTS", "predict_host", "default_host"]


@dataclass(frozen=True)
class HostSpec:
    """Host costs of a compressed bucket step, in seconds, measured on one machine by ``powersgd-triton bench
    --host-overhead`` (:mod:`powersgd_triton.benchmarking.host`: the C launch and the collectives stubbed) with one
    Triton version: ``launch_s`` one kernel launch through its launch plan (our launcher and Triton's
    ``CompiledKernel.run``), ``step_s`` the hook's own Python per bucket step besides its launches, ``collective_s``
    one async all-reduce call and its future (gloo, world size 1: NCCL's call is of the same order)."""

    name: str
    triton: str
    launch_s: float
    step_s: float
    collective_s: float


# Measured on this project's CPU machine by `powersgd-triton bench --host-overhead`'s functions
# (powersgd_triton.benchmarking.host: host_overhead, launch_call_us, collective_call_us): AMD EPYC, 2 cores, the C
# launch entry a C no-op and the collectives' futures torch's C futures. launch_s: one projection.project through
# its launch plan; step_s: ResNet-50 r4 fp32's mean host time per bucket step (3.9: 54 us, 3.6: 68 us) less its 7.8
# launches, medians of 7 runs (triton 3.9, torch 2.13 CPU) and 5 runs (triton 3.6, torch 2.11) on an idle machine
# (load < 1.6; bench/RESULTS.md, "C-level stand-ins ...", 2026-12-02); collective_s: a gloo all_reduce call of one
# element with its future, world size 1 (collective_call_us), median of 5 x 200 calls, 3 runs, 2026-12-05 (issue
# 39; the 50-54 us of 2026-12-02 was 3-5x the call the host bench itself measures today): 18.5 us (3.9) and
# 18.3 us (3.6) with the machine loaded (load 7-12), so an upper bound; bench/RESULTS.md, "Kernel report".
HOSTS: Dict[str, HostSpec] = {
    "epyc-2core-t39": HostSpec("AMD EPYC, 2 cores", "3.9.0", launch_s=2.1e-6, step_s=38e-6, collective_s=18.5e-6),
    "epyc-2core-t36": HostSpec("AMD EPYC, 2 cores", "3.6.0", launch_s=2.7e-6, step_s=47e-6, collective_s=18.3e-6),
}

# The step's segments between its collectives, by step_plan's step names, and the all-reduce calls ending each
# (the uncompressed gradients' in the first segment: first, or right after project where project packs them).
SEGMENTS = (("pack", "project"), ("orthogonalize P", "project_t"), ("average", "reconstruct", "orthogonalize Q"))


def predict_host(launches: Sequence[dict], layout: BucketLayout, dtype: torch.dtype, host: HostSpec,
                 wire_dtype: Optional[torch.dtype] = None) -> dict:
    """The step of one bucket as host and device work per segment between collectives (:data:`SEGMENTS`).

    ``launches``: :func:`predict`'s rows of the step (with their ``step`` names); ``wire_dtype``: the dtype P and Q
    are all-reduced in (default the bucket's; on the Triton backend project and project_t write the factors in it
    and average reads Q from it; when it is not float32, P's copy back into float32 before orthogonalize P is one
    torch op, charged ``launch_s``). Returns ``segments`` (per segment: ``host_s``, ``device_s``, ``time_s`` = the larger, ``bound``),
    ``host_s``, ``device_s``, ``time_s`` (the sum of the segments' times) and ``bound`` ("host" when the host's total
    is the larger, else "device")."""
    wire = dtype if wire_dtype is None else wire_dtype
    collectives = [1 + (1 if layout.uncompressed_numel else 0), 1, 0]
    torch_ops = [0, 1 if wire != torch.float32 else 0, 0]  # P's copy back, in the orthogonalize P segment
    segments = []
    for names, calls, ops in zip(SEGMENTS, collectives, torch_ops):
        rows = [r for r in launches if r["step"] in names]
        host_s = host.step_s / len(SEGMENTS) + (len(rows) + ops) * host.launch_s + calls * host.collective_s
        device_s = sum(r["time_s"] for r in rows)
        segments.append(dict(host_s=host_s, device_s=device_s, time_s=max(host_s, device_s),
                             bound="host" if host_s > device_s else "device"))
    host_s = sum(g["host_s"] for g in segments)
    device_s = sum(g["device_s"] for g in segments)
    return dict(segments=segments, host_s=host_s, device_s=device_s, time_s=sum(g["time_s"] for g in segments),
                bound="host" if host_s > device_s else "device")


def default_host() -> HostSpec:
    """The :data:`HOSTS` entry measured with the installed Triton's version, else the first."""
    from powersgd_triton.compat.versions import triton_version

    v = ".".join(map(str, triton_version() or ()))
    return next((h for h in HOSTS.values() if h.triton == v), next(iter(HOSTS.values())))
