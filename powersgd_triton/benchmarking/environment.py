"""The machine a measurement ran on: :func:`environment` (date, versions, CPU, threads, load and, on CUDA, the GPU).
"""

import datetime
import os
import platform

import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover
        pass
    return platform.processor() or platform.machine()


def environment(device=None) -> dict:
    """Date, machine, versions, threads and (on CUDA) the GPU's name, SMs, L2, memory and driver."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
    }
    from powersgd_triton.compat import versions as _compat

    info["untested_versions"] = list(_compat.untested_versions())  # below pyproject's floors: said, not refused
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # pragma: no cover
        info["triton"] = None
    try:
        import numpy

        info["numpy"] = numpy.__version__
    except Exception:  # pragma: no cover
        pass
    try:
        info["load_avg"] = os.getloadavg()
    except OSError:  # pragma: no cover
        pass
    if device is not None and torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            sms=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
            cuda=torch.version.cuda,
        )
        try:
            import subprocess

            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
            info["nvidia_smi"] = out.stdout.strip()
        except Exception:
            pass
    return info
