"""``powersgd-triton bench --link``, main tier: the rates, the rows and their statistics, the JSON and the chart, the
crossover, and the refusals (not root, no iproute2, a bad rate, a limit without --netns, --plot without matplotlib),
none of which may start a rank. The namespaces and the rate limit themselves: tests/test_linkbench_netns.py (slow
tier, root and iproute2)."""

import json
import math
import random

import numpy as np
import pytest

from powersgd_triton import cli
from powersgd_triton.linkbench import netns, report
from powersgd_triton.linkbench import run as link_run
from powersgd_triton.linkbench.rates import parse_rate, parse_rates, tbf_args, tbf_burst_bytes

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# ------------------------------------------------------------------------------------------------- rates
@pytest.mark.parametrize("text, bits", [("100mbit", 1e8), ("1gbit", 1e9), ("1Gbit", 1e9), ("2.5gbit", 2.5e9),
                                        ("12.5mbps", 1e8), ("800kbit", 8e5), ("1tbit", 1e12), ("64bps", 512.0)])
def test_rates_read_as_tc_reads_them(text, bits):
    rate = parse_rate(text)
    assert rate.bits_per_second == pytest.approx(bits) and rate.limited and rate.label == text.lower()


def test_unlimited_and_the_order_of_a_list():
    assert parse_rate("unlimited").bits_per_second is None and not parse_rate("unlimited").limited
    assert [r.label for r in parse_rates("unlimited,1gbit,100mbit,10gbit")] == ["100mbit", "1gbit", "10gbit",
                                                                                "unlimited"]


@pytest.mark.parametrize("text", ["100", "100mb", "fast", "0mbit", "-1mbit", "mbit", "1e9bit", "100 mbits", ""])
def test_bad_rates_raise(text):
    with pytest.raises(ValueError, match="link rate|at least one rate"):
        parse_rates(text)


@pytest.mark.parametrize("text", ["1gbit,1000mbit", "unlimited,unlimited", "100mbit,12.5mbps"])
def test_a_rate_listed_twice_raises(text):
    with pytest.raises(ValueError, match="listed twice"):
        parse_rates(text)


def test_tbf_arguments():
    assert tbf_args(1e8) == ["tbf", "rate", "100000000bit", "burst", "65536", "latency", "50ms"]
    assert tbf_burst_bytes(1e10) == 5_000_000  # 4 ms at 10 Gbit/s
    assert tbf_burst_bytes(1e6) == 65536


# ------------------------------------------------------------------------------------------------- rows
def fake_results(rng, rates=("100mbit", "1gbit", "unlimited"), hooks=("allreduce", "reference", "powersgd"),
                 steps=9, workload="mnist5k"):
    out = []
    for rate in rates:
        out.append({"rate": rate, "workload": workload, "world_size": 2,
                    "hooks": {h: {"step_ms": [rng.uniform(1.0, 300.0) for _ in range(steps)],
                                  "bytes_per_step": float(rng.randrange(1, 10**7)), "calls_per_step": 3.0}
                              for h in hooks}})
    return out


def test_rows_have_exactly_the_issues_fields_and_numpys_statistics(tmp_path):
    rng = random.Random()
    results = fake_results(rng)
    rows = report.make_rows(results)
    assert len(rows) == 9
    for row in rows:
        assert list(row) == list(report.ROW_FIELDS)
        run = next(r for r in results if r["rate"] == row["rate"])["hooks"][row["hook"]]
        times = np.array(run["step_ms"], dtype=np.float64)
        assert row["step_ms_median"] == pytest.approx(np.percentile(times, 50), rel=1e-12)
        assert row["step_ms_p10"] == pytest.approx(np.percentile(times, 10), rel=1e-12)
        assert row["step_ms_p90"] == pytest.approx(np.percentile(times, 90), rel=1e-12)
        base = np.percentile(next(r for r in results if r["rate"] == row["rate"])["hooks"]["allreduce"]["step_ms"], 50)
        assert row["ratio_to_allreduce"] == pytest.approx(np.percentile(times, 50) / base, rel=1e-12)
        assert row["bytes_per_step"] == run["bytes_per_step"]
    path = tmp_path / "o.json"
    report.write_json(str(path), rows, {"cpu": "test"})
    doc = json.loads(path.read_text())
    assert doc["rows"] == rows and doc["environment"] == {"cpu": "test"}
    assert all(list(r) == list(report.ROW_FIELDS) for r in doc["rows"])


def test_a_row_with_another_field_is_refused(tmp_path):
    rows = report.make_rows(fake_results(random.Random()))
    rows[1]["speedup"] = 2.0
    with pytest.raises(ValueError, match="exactly the fields"):
        report.write_json(str(tmp_path / "o.json"), rows)
    assert not (tmp_path / "o.json").exists()


def test_no_allreduce_no_ratio():
    rows = report.make_rows(fake_results(random.Random(), hooks=("reference", "powersgd")))
    assert all(r["ratio_to_allreduce"] is None for r in rows)
    with pytest.raises(ValueError):
        report.percentile([], 50)


def rows_with_ratios(ratios, hook="powersgd", workload="mnist5k"):
    rows = []
    for rate, ratio in ratios.items():
        for h, med in (("allreduce", 100.0), (hook, 100.0 * ratio)):
            rows.append({"rate": rate, "workload": workload, "hook": h, "step_ms_median": med, "step_ms_p10": med * 0.9,
                         "step_ms_p90": med * 1.1, "bytes_per_step": 1.0, "ratio_to_allreduce": med / 100.0})
    return rows


def test_the_crossover_is_interpolated_on_log_rate_and_log_ratio():
    lo, hi = random.uniform(0.05, 0.9), random.uniform(1.1, 5.0)
    c = report.crossover(rows_with_ratios({"100mbit": lo, "1gbit": hi, "unlimited": hi * 2}), "mnist5k")
    t = -math.log(lo) / (math.log(hi) - math.log(lo))
    assert c["kind"] == "below" and c["between"] == ("100mbit", "1gbit")
    assert c["bits_per_second"] == pytest.approx(10 ** (8 + t), rel=1e-9)
    assert "slower than" in report.crossover_text(c)
    # unlimited has no rate: a crossing next to it is only located between the two
    c = report.crossover(rows_with_ratios({"100mbit": 0.2, "1gbit": 0.5, "unlimited": 2.0}), "mnist5k")
    assert c == {"kind": "below", "bits_per_second": None, "between": ("1gbit", "unlimited")}
    assert report.crossover_text(c) == "powersgd pays at 1gbit, not at unlimited: the crossover lies between them"
    assert report.crossover(rows_with_ratios({"100mbit": 0.2, "unlimited": 0.9}), "mnist5k")["kind"] == "always"
    assert report.crossover(rows_with_ratios({"100mbit": 1.2, "unlimited": 3.0}), "mnist5k")["kind"] == "never"
    assert report.crossover(rows_with_ratios({"100mbit": 1.2, "unlimited": 0.5}), "mnist5k")["kind"] == "above"


def test_the_chart_is_a_png_with_the_crossover(tmp_path):
    pytest.importorskip("matplotlib")
    rows = rows_with_ratios({"100mbit": 0.1, "1gbit": 0.8, "unlimited": 1.5})
    rows += rows_with_ratios({"100mbit": 0.5, "1gbit": 1.5, "unlimited": 2.0}, workload="resnet18")
    path = tmp_path / "o.png"
    notes = report.plot(str(path), rows, title="test")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert notes[0] == "mnist5k: powersgd pays at 1gbit, not at unlimited: the crossover lies between them"
    assert notes[1].startswith("resnet18: powersgd pays on links slower than") and "100mbit and 1gbit" in notes[1]


def test_the_chart_without_matplotlib_says_so(tmp_path, monkeypatch):
    real = report.importlib.util.find_spec
    monkeypatch.setattr(report.importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib"
                        else real(name, *a))
    with pytest.raises(RuntimeError, match="--plot needs matplotlib.*pip install matplotlib"):
        report.plot(str(tmp_path / "o.png"), rows_with_ratios({"100mbit": 0.1}))
    assert not (tmp_path / "o.png").exists()


def test_the_table_names_the_hooks_and_the_speedup():
    table = report.format_table(rows_with_ratios({"100mbit": 0.1}))
    assert "powersgd (ours, layer-wise)" in table and "allreduce (plain all-reduce)" in table
    assert "0.100 (10.0x faster)" in table


# ------------------------------------------------------------------------------------------------- refusals
@pytest.fixture
def no_launch(monkeypatch):
    """Not under torchrun, and any attempt to start ranks or make namespaces fails the test."""
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)

    def forbidden(*args, **kwargs):
        raise AssertionError("a refused command line started something")

    monkeypatch.setattr(link_run, "launch_pair", forbidden)
    monkeypatch.setattr(netns.LinkPair, "create", forbidden)


def bench(capsys, *args):
    try:
        code = cli.main(["bench", *args])
    except SystemExit as exc:  # argparse's refusals
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.err.strip()


def test_not_root_is_refused_in_one_line(no_launch, capsys, monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    code, err = bench(capsys, "--link", "100mbit", "--netns")
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("powersgd-triton bench: error: --netns needs root")


def test_no_iproute2_is_refused_in_one_line(no_launch, capsys, monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/" + tool)
    code, err = bench(capsys, "--link", "100mbit", "--netns")
    assert code == 2 and len(err.splitlines()) == 1
    assert "--netns needs iproute2 (tc not found on PATH): apt-get install iproute2" in err


@pytest.mark.parametrize("rates, message", [("100mbitt", "bad link rate '100mbitt'"),
                                            ("1gbit,1000mbit", "listed twice"),
                                            ("0kbit", "at least 1 bit per second"), (",", "at least one rate")])
def test_bad_rates_are_refused(no_launch, capsys, rates, message):
    code, err = bench(capsys, "--link", rates, "--netns")
    assert code == 2 and message in err and err.startswith("powersgd-triton bench: error: argument --link")


def test_a_limit_without_netns_is_refused(no_launch, capsys):
    code, err = bench(capsys, "--link", "100mbit,unlimited")
    assert code == 2 and "a rate limit needs --netns" in err


def test_plot_without_matplotlib_is_refused_before_anything_runs(no_launch, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(report, "plot_missing", lambda: "--plot needs matplotlib, which is not installed")
    code, err = bench(capsys, "--link", "unlimited", "--plot", str(tmp_path / "o.png"))
    assert code == 2 and err.endswith("--plot needs matplotlib, which is not installed")


@pytest.mark.parametrize("args, message", [
    (["--out", "/nonexistent-folder/o.json"], "--out /nonexistent-folder/o.json: its folder"),
    (["--matrix-approximation-ranks", "2,4"], "one --matrix-approximation-ranks value"),
    (["--model-only"], "not with --model-only"),
    (["--workload", "mnist5k,cifar"], "unknown workload 'cifar'"),
    (["--hooks", "powersgd,powersdg"], "did you mean 'powersgd'"),
])
def test_other_refusals(no_launch, capsys, args, message):
    code, err = bench(capsys, "--link", "unlimited", *args)
    assert code == 2 and message in err


def test_netns_under_torchrun_is_refused(no_launch, capsys, monkeypatch):
    for var, value in zip(TORCHRUN_VARS, ("0", "2", "0", "127.0.0.1", "29500")):
        monkeypatch.setenv(var, value)
    code, err = bench(capsys, "--link", "unlimited", "--netns")
    assert code == 2 and "not under torchrun" in err
    code, err = bench(capsys, "--link", "1gbit,unlimited")
    assert code == 2 and "names the one link" in err


# ------------------------------------------------------------------------------------------------- one rank
def test_one_rank_measures_every_hook_on_the_same_steps(tmp_path):
    """``python -m powersgd_triton.linkbench.ranks`` as a world of one: a row of step times per hook, all-reduce's
    bytes are the model's gradient bytes, ours sends what PyTorch's hook sends (same buckets), and ours runs its torch
    backend although TRITON_INTERPRET=1 is set here (the interpreter is never timed)."""
    import os
    import subprocess
    import sys

    from _deadline import scaled
    from powersgd_triton.linkbench.names import Spec
    from powersgd_triton.train.launch import free_port
    from powersgd_triton.train.models import DigitsConvNet

    steps = random.randint(2, 4)
    spec = Spec(workload="digits", hooks=["allreduce", "reference", "powersgd", "powersgd_bf16"], rate="unlimited",
                steps=steps, start_iter=2, threads=1, seed=random.randrange(1000))
    (tmp_path / "spec.json").write_text(spec.to_json())
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "powersgd_triton.linkbench.ranks", str(tmp_path / "spec.json"),
                           str(tmp_path / "out.json")], env=env, capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    assert list(result["hooks"]) == spec.hooks and result["world_size"] == 1
    runs = result["hooks"]
    assert all(len(r["step_ms"]) == steps and min(r["step_ms"]) > 0 for r in runs.values())
    assert runs["allreduce"]["bytes_per_step"] == sum(p.numel() * 4 for p in DigitsConvNet().parameters())
    assert runs["powersgd"]["bytes_per_step"] == runs["reference"]["bytes_per_step"]
    assert runs["powersgd"]["calls_per_step"] == runs["reference"]["calls_per_step"] == 3
    assert runs["powersgd"]["bucket_cap_mb"] == runs["reference"]["bucket_cap_mb"]
    assert runs["allreduce"]["bucket_cap_mb"] is None
    # bf16 factors: P and Q in half the bytes, the uncompressed part as it is
    assert runs["powersgd_bf16"]["bytes_per_step"] < runs["powersgd"]["bytes_per_step"]
    assert runs["powersgd"]["kernel_backend"] == runs["powersgd_bf16"]["kernel_backend"] == "torch"
    assert runs["reference"]["kernel_backend"] is None
