"""``powersgd-triton train --hook alternating`` and its row in ``--compare``: short 2-rank digits runs through the CLI
(the acceptance runs themselves are longer: see the issue note for the measured tables)."""

import json

import pytest

from test_train_cli import SHORT, check_schema, run_cli

pytestmark = pytest.mark.timeout(150)


def test_compare_row_counts_one_all_reduce_per_step(tmp_path):
    """Same seed: identical losses while both hooks still all-reduce plainly; once compressing, the alternating hook
    issues one all-reduce per step (digits is one DDP bucket) instead of three, with about half the bytes."""
    out = tmp_path / "m.json"
    proc = run_cli("train", "--compare", "powersgd,alternating", "--steps", "8", "--start-iter", "4",
                   "--kernels", "torch", "--no-progress", "--out", str(out), timeout=140)
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(out.read_text())
    check_schema(payload, ["powersgd", "alternating"], steps=8)
    std, alt = payload["runs"]["powersgd"], payload["runs"]["alternating"]
    assert alt["hook_function"] == "powersgd_triton.alternating.alternating_powerSGD_hook"
    assert alt["kernel_backend"] == "torch"
    assert alt["loss"][:5] == std["loss"][:5]  # steps 0-3 plain all-reduce, step 4 computed before the hook
    assert alt["allreduce_calls_per_step"] == 1 and std["allreduce_calls_per_step"] == 3
    assert alt["allreduce_bytes_per_warmup_step"] == std["allreduce_bytes_per_warmup_step"] == alt["gradient_bytes"]
    ratio = alt["allreduce_bytes_per_step"] / std["allreduce_bytes_per_step"]
    assert 0.45 < ratio < 0.6, ratio
    assert alt["compression_rate"] > 1.8 * std["compression_rate"]
    assert "| powersgd_triton.alternating_powerSGD_hook (torch kernels)" in proc.stdout


def test_short_run_with_triton_kernels(tmp_path):
    """``--hook alternating`` with the default kernels (Triton, in the interpreter under the tests)."""
    out = tmp_path / "m.json"
    # --verify off: the first-use check's verdict all-reduce falls in both (checked) compressed steps of this run
    proc = run_cli("train", "--hook", "alternating", *SHORT, "--verify", "off", "--out", str(out), timeout=140)
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(out.read_text())
    check_schema(payload, ["alternating"], steps=4)
    run = payload["runs"]["alternating"]
    assert run["compressed_steps"] == 2 and run["allreduce_calls_per_step"] == 1
    assert run["allreduce_bytes_per_step"] < run["gradient_bytes"] / 10


def test_no_warm_start_is_refused_up_front(capsys):
    from powersgd_triton.cli import main

    assert main(["train", "--hook", "alternating", "--no-warm-start", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "powersgd-triton train: error: --hook alternating needs warm start" in err, err
