"""The performance model's arithmetic on hand-worked launches, its step plan, and its CLI (no GPU, no compile)."""

import pytest
import torch

from powersgd_triton import perfmodel as M
from powersgd_triton.kernels import triton_ops as T
from powersgd_triton.layout import BucketLayout

SPEC = M.GPUSpec("test", 90, sms=10, hbm_bandwidth=1e12, copy_fraction=1.0, l2_bandwidth=1e13, fp32_flops=1e15,
                 dram_latency_s=1e-6, l2_latency_s=1e-7, launch_overhead_s=1e-6, fma_efficiency=1.0)
USAGE = dict(registers=64, spill_bytes=0, shared_bytes=0, num_warps=4, num_stages=2, blocks_per_sm=2, pipelined=False)


def _launch(**kw):
    base = dict(kernel="project", programs=40, iterations=10, bytes_read=30_000_000, bytes_written=10_000_000,
                config={}, variant={}, flops=0, l2_bytes=0)
    base.update(kw)
    return base


def test_bandwidth_bound_launch():
    # 40 programs on 10 SMs x 2 blocks: 2 waves of 20 MB each at 1 TB/s = 20 us, longer than the latency chain
    # (10 iterations x 1 us + 2 us of table look-ups); plus 1 us launch overhead
    r = M.predict(_launch(), SPEC, USAGE)
    assert r["waves"] == 2 and r["bound"] == "bandwidth"
    assert r["time_s"] == pytest.approx(41e-6)
    assert r["copy_fraction"] == pytest.approx(40e6 / 41e-6 / 1e12)
    assert r["occupancy"] == pytest.approx(2 * 4 / 64)


def test_latency_bound_and_pipelined_launch():
    small = _launch(bytes_read=3_000_000, bytes_written=1_000_000)  # 2 MB per wave: 2 us < 12 us chain
    r = M.predict(small, SPEC, USAGE)
    assert r["bound"] == "latency" and r["time_s"] == pytest.approx(2 * 12e-6 + 1e-6)
    piped = M.predict(small, SPEC, dict(USAGE, pipelined=True))  # 2 stages in flight: 10 x 0.5 us + 2 us
    assert piped["stages"] == 2 and piped["time_s"] == pytest.approx(2 * 7e-6 + 1e-6)


def test_compute_and_l2_bound_launches():
    r = M.predict(_launch(flops=1e11), SPEC, USAGE)  # 5e10 flop per wave at 1e15 flop/s = 50 us
    assert r["bound"] == "compute" and r["time_s"] == pytest.approx(2 * 50e-6 + 1e-6)
    spill = dict(USAGE, spill_bytes=100)  # 2 x 100 B x 128 threads x 40 programs x 10 iterations of L2 traffic
    r = M.predict(_launch(l2_bytes=1e9), SPEC, spill)
    assert r["bound"] == "l2"
    assert r["time_s"] == pytest.approx((1e9 + 2 * 100 * 128 * 40 * 10) / 1e13 + 1e-6)


def _layout(shapes, rank=4):
    total = sum(torch.Size(s).numel() for s in shapes)
    buf = torch.empty(total, device="meta")
    grads, off = [], 0
    for s in shapes:
        n = torch.Size(s).numel()
        grads.append(buf[off : off + n].view(s))
        off += n
    return BucketLayout.from_gradients(buf, grads, rank, 2.0)


def test_step_plan_is_the_hooks_launch_sequence_and_moves_the_floor_bytes():
    layout = _layout([(512, 4608), (512,), (2048, 512), (2048,), (4096, 2048), (7,)])
    plan = M.step_plan(layout, torch.bfloat16, num_sms=132)
    steps = [p["step"] for p in plan]
    assert steps[:3] == ["pack", "orthogonalize Q", "project"] and steps[-2:] == ["average", "reconstruct"]
    assert all(p["kernel"] in T.KERNEL_FUNCTIONS for p in plan)
    by = {p["kernel"]: p for p in plan}
    g = sum(s.numel for s in layout.matrices)
    # the streaming launches move at least the 7-pass floor: 5 passes of bf16 gradients, 2 of float32 error
    streaming = sum(by[k]["bytes_read"] + by[k]["bytes_written"] for k in T.STREAMING_KERNELS)
    assert streaming >= M.floor_bytes(layout, torch.bfloat16) == 5 * 2 * g + 2 * 4 * g
    assert by["project_t"]["programs"] >= 2 * 132 and by["reconstruct"]["programs"] >= 2 * 132


def test_model_table_and_cli(monkeypatch, capsys):
    usage = lambda launch, arch: dict(USAGE, blocks_per_sm=4)  # noqa: E731 - stands in for the compiled metadata
    rows = M.model_table(["resnet50"], [4], ["bf16"], "h200", usage=usage)
    steps = [r for r in rows if r["kernel"] == "step"]
    assert steps and all(0 < r["of_floor"] <= 1 for r in steps)
    text = M.format_table(rows)
    assert "whole step" in text and "| resnet50 | bf16 | 4 | project |" in text
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(M, "compiled_usage", usage)
    assert M.main(["--models", "resnet50", "--matrix-approximation-ranks", "1", "--dtypes", "fp32"]) == 0
    assert "H200" in capsys.readouterr().out
