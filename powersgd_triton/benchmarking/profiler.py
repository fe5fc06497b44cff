"""``torch.profiler`` without its chatter: :func:`quiet_profiler` (used by the CUDA kernel count and the CPU
allocation trace).
"""

import contextlib
import os
import re
import sys
import tempfile


# What torch.profiler itself prints on every use, which a table must not be buried under: kineto's
# ``USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start`` / ``profiler_stop`` (logged at kineto's highest
# level, so KINETO_LOG_LEVEL=5 still shows it) and, with ``profile_memory=True``, c10's ``[W... CPUAllocator.cpp:245]
# Memory block of unknown size was allocated before the profiling started`` (a LOG(WARNING) when the step frees a
# tensor allocated before the profiler started -- a hook step always does; its level is fixed at import by
# TORCH_CPP_LOG_LEVEL).
_PROFILER_NOISE = re.compile(r"SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)"
                             r"|CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before the profiling")


@contextlib.contextmanager
def quiet_profiler():
    """Run ``torch.profiler`` without its own chatter on stderr (see ``_PROFILER_NOISE``); everything else written
    to stderr meanwhile is passed on afterwards, in order.

    Kineto reads ``KINETO_LOG_LEVEL`` once, when the process first profiles: unless the user set it, it is set to 6
    (above kineto's levels; kineto's own errors are hidden too, the measurement then reports nothing) for that
    first start and removed again. The c10 warning cannot be turned off once torch is imported: file descriptor 2 is
    sent to a temporary file for the duration and the known lines are dropped from it.
    """
    set_level = "KINETO_LOG_LEVEL" not in os.environ
    if set_level:
        os.environ["KINETO_LOG_LEVEL"] = "6"
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # pragma: no cover - a closed or odd stream
            pass
    try:
        saved = os.dup(2)
    except OSError:  # pragma: no cover - no file descriptor 2
        saved = None
    with tempfile.TemporaryFile() as tmp:
        if saved is not None:
            os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except Exception:  # pragma: no cover
                pass
            if saved is not None:
                os.dup2(saved, 2)
                os.close(saved)
            if set_level:
                os.environ.pop("KINETO_LOG_LEVEL", None)
            tmp.seek(0)
            kept = [line for line in tmp.read().decode(errors="replace").splitlines(True)
                    if not _PROFILER_NOISE.search(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
