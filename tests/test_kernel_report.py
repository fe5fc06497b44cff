"""``powersgd-triton bench --kernel-report`` (tools/kernel_report.py, issue 39): each launch of a compressed bucket
step compiled for sm_90 as the JIT compiles it, read from the compiled code: registers, spills, the widest global
access (PTX), warp instructions per element and the issue ratio (SASS), and the launches per bucket step counted on
the hook itself under a fake GPU driver."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ("kernel", "model", "dtype", "triton", "registers", "spill_bytes", "load_bytes", "store_bytes",
        "sass_instructions_per_element", "issue_ratio")


def _bench(*args, interpret=False, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-m", "powersgd_triton", "bench", "--kernel-report", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_kernel_report_refuses_the_interpreter_and_several_ranks():
    proc = _bench("--models", "resnet50", interpret=True)
    assert proc.returncode == 2 and "unset TRITON_INTERPRET" in proc.stderr, proc.stderr
    proc = _bench("--models", "resnet50", "--matrix-approximation-ranks", "1,4")
    assert proc.returncode == 2 and "one --matrix-approximation-ranks value" in proc.stderr, proc.stderr


def test_issue_ratio_formula():
    """The documented formula on hand-made numbers: 1.0452e12 warp instructions per second (132 x 4 x 1.98 GHz)
    against 4.32e12 bytes per second."""
    from powersgd_triton import perfmodel

    spec = perfmodel.GPUS["h200"]
    usage = dict(registers=64, spill_bytes=0, num_warps=4, blocks_per_sm=4, pipelined=False,
                 loop=dict(instructions=500, trip_latencies=1.0))
    launch = dict(kernel="project", programs=1000, iterations=30, program_iterations=[30] * 1000, steps_per_trip=3,
                  bytes_read=80_000_000, bytes_written=40_000_000, config={}, variant={})
    r = perfmodel.predict(launch, spec, usage)
    issued = 500 * 10 * 1000 * 4
    assert r["issued"] == issued
    expect = (issued / (132 * 4 * 1.98e9)) / (120e6 / (4.8e12 * 0.9))
    assert r["issue_ratio"] == pytest.approx(expect)


@pytest.mark.slow  # a fake-GPU hook step and ~10 sm_90 compiles: 1-3 minutes on 2 cores
@pytest.mark.timeout(1200)
def test_kernel_report_resnet50_fp32(tmp_path):
    out = tmp_path / "report.json"
    proc = _bench("--models", "resnet50", "--dtypes", "fp32", "--matrix-approximation-ranks", "4", "--json",
                  str(out), timeout=1100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rep = json.loads(out.read_text())
    rows = rep["rows"]
    assert {"project", "project_t", "reconstruct", "orthogonalize", "average"} <= {r["kernel"] for r in rows}
    for r in rows:
        assert all(k in r for k in KEYS), r
        assert r["spill_bytes"] == 0 and r["registers"] > 0
        assert r["load_bytes"] in (1, 2, 4, 8, 16) and r["store_bytes"] in (0, 1, 2, 4, 8, 16)
        # every planned launch is one the hook made, compiled to the JIT's own PTX
        assert r["as_launched"] is True and r["jit_ptx_match"] is True, r
        assert r["issue_ratio"] == pytest.approx(r["issue_us"] / r["bytes_us"])
        assert r["sass_instructions_per_element"] > 0
    streaming = [r for r in rows if r["kernel"] in ("project", "project_t", "reconstruct")]
    assert all(0.05 < r["issue_ratio"] < 20 for r in streaming), streaming
    n = rep["launches_per_bucket_step"]["resnet50/fp32"]
    assert n == rep["launches_planned"]["resnet50/fp32"] and n >= 3
    step = rep["steps"]["resnet50/fp32"]
    assert 0 < step["floor_us"] < step["device_us"] and step["device_fma_us"] > 0
    assert "issue ratio" in proc.stdout and "Whole step" in proc.stdout
