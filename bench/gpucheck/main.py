"""The run: every section in order, the summary, the exit status (``bench/gpu_check.py`` calls :func:`main`)."""

import torch

from .common import (ARGS, BUDGET, COMPILE_BUDGET, DEVICE, QUICK, RESULTS, SECTIONS, WORKER, log, run_section, save,
                     set_summary)
from .compile_phase import section_compile, warm_worker
from .correctness import section_correctness
from .env import section_copy, section_env
from .hooks import section_hooks, section_hooks_extra
from .kernels import section_kernels, section_kernels_extra
from .model_phase import section_model
from .nonfinite import section_nonfinite
from .paths import section_paths
from .streams import section_streams
from .summary import record_history, summary
from .verify import section_verify

# sections whose cases count as checks: a failed case fails the run (exit status 1) and keeps the history out
CHECKED = ("correctness", "paths", "verify", "nonfinite", "streams")


def main() -> int:
    if WORKER:
        return warm_worker()
    set_summary(summary)
    log(f"gpu_check: device {DEVICE}, {'quick, ' if QUICK else ''}budget {BUDGET:.0f}s (compile "
        f"{COMPILE_BUDGET:.0f}s), out {ARGS.out or '(none)'}")
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a machine without GPU", flush=True)
        RESULTS["errors"]["setup"] = "no CUDA device"
        save()
        return 2
    chosen = ARGS.sections.split(",")
    unknown = [x for x in chosen if x not in SECTIONS]
    if unknown:
        print(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}", flush=True)
        return 2
    RESULTS["skipped"] += [f"section {x}: not asked for (--sections)" for x in SECTIONS if x not in chosen]
    if QUICK:
        RESULTS["skipped"] += ["quick run: GPT-2 buckets, ranks 1 and 16 of the kernels and hooks sections, the "
                               "extra sections and most ragged/batched/fp16 correctness cases are the full run's"]
    run_section("env", section_env, 0)
    run_section("compile", section_compile, 10)
    run_section("model", section_model, 5)
    run_section("copy", section_copy, 5)
    run_section("correctness", section_correctness, 10)
    run_section("paths", section_paths, 5)
    run_section("verify", section_verify, 5)
    run_section("streams", section_streams, 5)
    run_section("nonfinite", section_nonfinite, 5)
    run_section("kernels", section_kernels, 10)
    run_section("hooks", section_hooks, 15)
    run_section("kernels-extra", section_kernels_extra, 15)
    run_section("hooks-extra", section_hooks_extra, 15)
    save()
    text = summary()
    print("\n" + text, flush=True)
    failed = bool(any(RESULTS["sections"].get(name, {}).get("failed") for name in CHECKED) or RESULTS["errors"])
    ran = [name for name in RESULTS.get("section_seconds", {})]
    log("sections run: " + ", ".join(f"{n} ({RESULTS['section_seconds'][n]} s)" for n in ran))
    for s in RESULTS["skipped"]:
        log(f"skipped: {s}")
    record_history(failed)
    return 1 if failed else 0
