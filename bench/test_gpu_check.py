"""bench/gpu_check.py runs end to end before it meets a GPU: its dry run (CPU, Triton interpreter, tiny shapes).

The GPU run has one try in a short device lease; this catches typos, API slips and broken sections here. Not a
benchmark (skipped under ``--benchmark-only``); part of the ``--quick`` CI smoke set.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OUT=str(tmp_path), PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself for --dry-run
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--budget", "150"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["dry_run"] is True
    assert data["errors"] == {}, data["errors"]
    sections = data["sections"]
    assert {"env", "copy", "correctness", "kernels", "hooks"} <= set(sections)
    corr = sections["correctness"]
    assert corr["failed"] == 0 and corr["passed"] == corr["planned"] > 0
    kernels = {(r["kernel"], r["impl"]) for r in sections["kernels"]["rows"]}
    assert kernels >= {(k, i) for k in ("project", "orthogonalize", "project_t", "reconstruct")
                       for i in ("ours", "pytorch")}
    hooks = {r["impl"]: r for r in sections["hooks"]["rows"]}
    assert set(hooks) == {"pytorch", "ours"}
    assert hooks["pytorch"]["allreduce_calls"] == 3 * hooks["pytorch"]["buckets"]
    assert hooks["ours"]["triton_launches"] > 0 and all(r["finite"] for r in hooks.values())
    md = (tmp_path / "gpu_check.md").read_text()
    assert "Correctness vs float64" in md and "Whole hook step" in md
    assert "Whole hook step" in proc.stdout  # the summary is printed too
