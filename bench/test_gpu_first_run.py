"""bench/gpu_first_run.sh, the first GPU run as one command, rehearsed end to end on CPU (``--dry-run``).

The GPU run gets one call on a lent machine; this runs every step of it here first (preflight, ``gpu_check.py`` in
its dry run, the 1-rank DDP training run on gloo, the timing sections, the autotuner) with the packages the GPU image
lacks hidden (platformdirs, tqdm, scikit-learn, mlxtend: the script makes them raise ImportError), and checks that
each step exited 0 and wrote its output under ``$OUT``. About two to three minutes on 2 cores: the slow tier.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _deadline import scaled

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # slow tier (docs/development.md): ~2-3 minutes
@pytest.mark.timeout(900)
def test_gpu_first_run_dry_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OUT=str(tmp_path), PYTHON=sys.executable)
    env.pop("TRITON_INTERPRET", None)  # each step sets what it needs
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_first_run.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=scaled(600))
    out = proc.stdout + proc.stderr
    steps = [json.loads(line) for line in (tmp_path / "first_run.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == ["preflight", "gpu_check", "train", "timing", "autotune"], out[-3000:]
    assert all(s["rc"] == 0 for s in steps), (steps, out[-4000:])
    assert proc.returncode == 0, out[-4000:]
    pre = json.loads((tmp_path / "preflight" / "preflight.json").read_text())
    assert pre["blocking"] == [] and pre["checks"]["trivial_launch"]["ok"]
    hidden = pre["checks"]["versions"]["value"]["optional_importable"]
    assert hidden["platformdirs"] is False and hidden["tqdm"] is False, hidden  # as on the GPU image
    check = json.loads((tmp_path / "gpu_check" / "gpu_check.json").read_text())
    assert check["dry_run"] and check["quick"] and check["errors"] == {}, check["errors"]
    train = json.loads((tmp_path / "train" / "train.json").read_text())
    run = train["runs"]["powersgd"]
    assert run["compressed_steps"] > 0 and run["final_test_loss"] == run["final_test_loss"]  # finite, not NaN
    timing = json.loads((tmp_path / "timing" / "gpu_check.json").read_text())
    assert timing["sections"]["kernels"]["rows"] and timing["sections"]["hooks"]["rows"]
    summary = (tmp_path / "first_run.md").read_text()
    assert "every step exited 0" in summary and "| autotune | 0 |" in summary
