"""bench/alternating_accuracy.py runs end to end (short runs on digits): its accuracy table and its approximation
table. Not a benchmark; part of the ``--quick`` CI smoke set. The figures it prints are in bench/RESULTS.md."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _deadline import scaled

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)  # as a user runs it: torch kernels on CPU
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "alternating_accuracy.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


@pytest.mark.slow  # slow tier (docs/development.md)
def test_accuracy_table_runs_every_variant(tmp_path):
    out = _run("--workloads", "digits", "--seeds", "0", "--steps", "14", "--json", str(tmp_path / "rows.json"))
    rows = [line for line in out.splitlines() if line.startswith("| powersgd |") or line.startswith("| alternating |")]
    assert [r.split("|")[1:3] for r in rows] == [[" powersgd ", " 4 "], [" alternating ", " 4 "],
                                                  [" alternating ", " 8 "], [" powersgd ", " 2 "]]
    # measured calls per compressed step: three all-reduces for the standard hook, one for the alternating hook
    assert [r.split("|")[7].strip() for r in rows] == ["3", "1", "1", "3"]
    assert rows[0].split("|")[8].strip() == "+0.00 points"
    import json

    data = json.loads((tmp_path / "rows.json").read_text())
    assert len(data) == 4 and all(0 <= d["accuracy"] <= 1 and d["steps"] == 14 for d in data)
    # the alternating hook at rank 4 sends about half the standard hook's bytes, at rank 8 about the same
    std, alt4, alt8 = (d["bytes_per_step"] for d in data[:3])
    assert 0.4 < alt4 / std < 0.65 and 0.85 < alt8 / std < 1.25


def test_approximation_table():
    out = _run("--approximation", "--workloads", "digits", "--approximation-steps", "14")
    line = next(x for x in out.splitlines() if x.startswith("| all layers |"))
    ours, alt_p, alt_q, svd = (float(c) for c in line.split("|")[3:7])
    assert svd <= ours <= alt_p + 1e-6 and svd <= alt_q  # no hook beats the SVD; the standard hook is best of the three
