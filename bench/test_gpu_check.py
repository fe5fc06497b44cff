"""bench/gpu_check.py runs end to end before it meets a GPU: its dry run (CPU, Triton interpreter, tiny shapes).

The GPU run has one try in a short device lease; this catches typos, API slips and broken sections here. Not a
benchmark (skipped under ``--benchmark-only``); part of the ``--quick`` CI smoke set. The second test runs the GPU
run's branches that need no CUDA: the compile-phase workers (in the interpreter, where they compile nothing), the
verify and streams sections as on a GPU but for the sleep, the side-stream test and NCCL.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _deadline import scaled

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, *args, timeout=360):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OUT=str(tmp_path), PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself for --dry-run
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(timeout))
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    return proc, data, (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow  # slow tier (docs/development.md)
def test_gpu_check_dry_run(tmp_path):
    proc, data, md = _run(tmp_path, "--budget", "220")
    out = proc.stdout + proc.stderr
    bad = [f"{c['variant']} {c['dtype']}: {c.get('checks') or c.get('error')}"
           for c in data["sections"].get("nonfinite", {}).get("cases", []) if not c.get("ok")]
    assert not bad, "outputs finite where the float64 oracle's are not (or an error):\n" + "\n".join(bad)
    assert proc.returncode == 0, out[-4000:] + json.dumps(data["errors"])[:2000]
    assert data["dry_run"] is True
    assert data["errors"] == {}, data["errors"]
    for noise in ("USDT:", "profiler_start", "CPUAllocator.cpp"):  # torch.profiler's chatter stays out
        assert noise not in out, noise
    # benchmark history: the dry run's timings, correctness-gated, keyed by commit and device, in $OUT only
    from powersgd_triton import history as H

    if H.git_commit(str(ROOT))[0]:
        recs = H.load(str(tmp_path / "history.jsonl"))
        assert {r["source"] for r in recs} == {"gpu_check.kernels.dry", "gpu_check.hooks.dry"}, data.get("history")
        assert all(r["commit"] == H.git_commit(str(ROOT))[0] and r["device"].startswith("cpu: ") for r in recs)
        assert any(r["key"].get("kernel") == "project" and r["metrics"]["median_ms"] > 0 for r in recs)
    sections = data["sections"]
    assert {"env", "compile", "model", "copy", "correctness", "paths", "nonfinite", "kernels", "hooks",
            "streams"} <= set(sections)
    # GPU paths: the heuristic configs took the split tensor-core path, tl.dot, the float64 Gram launch, APPLY_ROWS
    paths = sections["paths"]
    assert paths["failed"] == 0 and paths["passed"] > 0, paths
    taken = {k for c in paths["cases"] for k, v in c["path"].items() if v}
    assert {"SPLIT_BF16", "USE_DOT"} <= taken, taken
    # the performance model's compiles are a section of their own (none in the dry run), never inside a timed one
    assert not sections["model"].get("missed"), sections["model"]
    # sleep injection: the GPU check is skipped with the reason; its plumbing ran on the Triton backend (callbacks
    # and the next-Q orthogonalizations delayed, values equal)
    assert any(s.startswith("streams: sleep injection on a world of 1 NCCL (dry run") for s in data["skipped"])
    st = sections["streams"]
    assert st["failed"] == 0 and st["rows"] and all(r["callbacks_delayed"] > 0 and r["side_stream_delayed"] > 0
                                                    for r in st["rows"]), st
    # the first-use check ran, or is listed as skipped with the reason
    assert "verify" in sections and (sections["verify"].get("cases") or any(
        s.startswith("verify: the first-use check (") for s in data["skipped"]))
    # compile phase: sm_90 binaries with their registers, spills, shared memory and occupancy
    comp = sections["compile"]
    assert comp["binaries"] and all(b["ok"] for b in comp["binaries"])
    usage = [b["usage"] for b in comp["binaries"] if b.get("usage")]
    assert usage and all(0 < u["registers"] <= 255 and u["blocks_per_sm"] >= 1 for u in usage)
    assert set(comp["per_kernel"]) == {b["kernel"] for b in comp["binaries"]}
    corr = sections["correctness"]
    assert corr["failed"] == 0 and corr["passed"] == corr["planned"] > 0
    # non-finite inputs: every case run checks where its outputs must be non-finite, and each one passed
    nf = sections["nonfinite"]
    assert nf["failed"] == 0 and nf["passed"] == nf["planned"] > 0, [c for c in nf["cases"] if not c.get("ok")][:3]
    assert all(c["checks"] and sum(x["nonfinite_expected"] for x in c["checks"].values()) > 0 for c in nf["cases"])
    assert {"float32", "bfloat16", "float16"} <= {c["dtype"] for c in nf["cases"]}
    kernels = {(r["kernel"], r["impl"]) for r in sections["kernels"]["rows"]}
    assert kernels >= {(k, i) for k in ("project", "orthogonalize", "project_t", "reconstruct")
                       for i in ("ours", "pytorch")}
    hooks = {r["impl"]: r for r in sections["hooks"]["rows"]}
    assert set(hooks) == {"pytorch", "ours"}
    assert hooks["pytorch"]["allreduce_calls"] == 3 * hooks["pytorch"]["buckets"]
    assert hooks["ours"]["triton_launches"] > 0 and all(r["finite"] for r in hooks.values())
    for title in ("Compile phase", "Registers, spills, shared memory", "Correctness vs float64",
                  "Non-finite inputs", "nan 0xFFFFFFFF", "Whole hook step"):
        assert title in md, title
    assert "Whole hook step" in proc.stdout  # the summary is printed too
    # whatever did not fit the budgets is named, with the reason
    assert all("(" in s and ")" in s for s in data["skipped"])


def test_gpu_check_compile_workers_plumbing(tmp_path):
    """The GPU run's branches that run without CUDA, in the interpreter: the compile phase's worker processes run the
    later sections' items once (one kernels item, the verify section's steps, the streams section's four rows), then
    the verify and streams sections run what they run on a GPU (the streams rows: both hooks, fp32 and bf16, the
    Triton backend against the torch backend, every row with delayed callbacks and next-Q orthogonalizations; only
    the sleep, the side-stream test and NCCL are the CPU stand-ins)."""
    proc, data, md = _run(tmp_path, "--sections", "env,compile,verify,streams,kernels", "--compile-mode", "workers",
                          "--jobs", "2", "--compile-budget", "150", timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    comp = data["sections"]["compile"]
    assert comp["mode"].startswith("JIT warm-up") and comp["items"] == comp["items_warmed"] == 6, comp
    assert comp["item_errors"] == [] and data["errors"] == {}
    assert data["sections"]["kernels"]["rows"]
    assert any("section hooks: not asked for" in s for s in data["skipped"])
    rows = data["sections"]["streams"]["rows"]
    assert {(r["hook"], r["dtype"]) for r in rows} == {(h, d) for h in ("powerSGD", "batched")
                                                      for d in ("float32", "bfloat16")}
    assert all(r["ok"] and r["callbacks_delayed"] > 0 and r["side_stream_delayed"] > 0 for r in rows), rows
    verify = data["sections"]["verify"]
    assert verify.get("failed") == 0 and verify.get("passed") == 2 or any(
        s.startswith("verify: the first-use check (") for s in data["skipped"]), verify
