"""The performance model's arithmetic on hand-worked launches, its step plan, and its CLI (no GPU); the sm_90
targets of issue 15 on the compiled kernels (a subprocess without the interpreter: one GPT-2 bucket at ranks 1 and 4
in the default run, the whole table behind ``-m aot_matrix``)."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from _deadline import scaled

from powersgd_triton import perfmodel as M
from powersgd_triton.ops import configs, kernels, orthogonalization, plans, projection_t, tables
from powersgd_triton.layout import padded_rank
from powersgd_triton.compat import env as _env
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


def test_table_lookups_before_the_loop():
    """A program waits for ``lookups`` dependent table loads before its loop (default 2: a tile row, then the
    layout table's row); orthogonalize's self-contained task rows make it 1, and its plan says so."""
    small = _launch(bytes_read=3_000_000, bytes_written=1_000_000)
    two = M.predict(small, SPEC, USAGE)["time_s"]
    one = M.predict(dict(small, lookups=1), SPEC, USAGE)["time_s"]
    assert two - one == pytest.approx(2 * 1e-6)  # two rounds of programs, one latency each
    layout = _layout([(300, 70), (20000, 40)], rank=4)
    cfg = dict(BLOCK=16, SHORT_ROWS=64, GRAM_ROWS=32, SPLIT_ROWS=16, num_warps=4, num_stages=1)
    assert [launch["lookups"] for launch in orthogonalization.orthogonalize_plan(layout, "p", cfg)] == [1, 1]


def test_compute_and_l2_bound_launches():
    r = M.predict(_launch(flops=1e11), SPEC, USAGE)  # 5e10 flop per wave at 1e15 flop/s = 50 us
    assert r["bound"] == "compute" and r["time_s"] == pytest.approx(2 * 50e-6 + 1e-6)
    spill = dict(USAGE, spill_bytes=100)  # 2 x 100 B x 128 threads x 40 programs x 10 iterations of L2 traffic
    r = M.predict(_launch(l2_bytes=1e9), SPEC, spill)
    assert r["bound"] == "l2"
    assert r["time_s"] == pytest.approx((1e9 + 2 * 100 * 128 * 40 * 10) / 1e13 + 1e-6)


def test_issue_bound_launch_from_the_compiled_instructions():
    """With the compiled SASS in its usage, a launch's compute term is its issued warp instructions (main-loop
    instructions x loop trips of every program x warps) at SMs x issue_per_clock x clock_hz, not its multiply-adds:
    40 programs x 10 steps (2 per trip: 5 trips) x 100 instructions x 4 warps = 80,000 warp instructions at 10 x 4 x
    1 GHz = 2 us, above 1 MB at 1 TB/s (1 us) and the latency (2 waves x 12 ns): issue-bound, issue ratio 2.0."""
    spec = dataclasses.replace(SPEC, dram_latency_s=1e-9, clock_hz=1e9, issue_per_clock=4)
    usage = dict(USAGE, loop=dict(instructions=100, trip_latencies=1.0), kernel_instructions=300)
    launch = _launch(bytes_read=600_000, bytes_written=400_000, flops=1e14, program_iterations=[10] * 40,
                     steps_per_trip=2)
    assert M.issued_instructions(launch, usage) == 40 * 5 * 100 * 4
    r = M.predict(launch, spec, usage)
    assert r["bound"] == "issue" and r["time_s"] == pytest.approx(2e-6 + 1e-6)  # the flops are not charged
    assert r["issue_ratio"] == pytest.approx(2.0) and r["issued"] == 80_000
    # a kernel without a loop: its instructions once per program and warp
    assert M.issued_instructions(launch, dict(usage, loop=None)) == 300 * 40 * 4
    # no SASS (a hand-made usage): the multiply-adds stand in, as before
    assert M.issued_instructions(launch, USAGE) is None
    assert M.predict(launch, spec, USAGE)["bound"] == "compute"


def test_tensor_core_flops_at_their_own_rate():
    # 1e11 FMA-pipe flop at 1e15 flop/s (100 us) plus 1e12 tensor-core flop at 1e16 flop/s (100 us), one after the
    # other; a spec without a tensor-core rate refuses them
    spec = dataclasses.replace(SPEC, tensor_flops=1e16)
    r = M.predict(_launch(flops=1e11, tensor_flops=1e12), spec, USAGE)
    assert r["bound"] == "compute" and r["time_s"] == pytest.approx(200e-6 + 1e-6)
    assert M.predict(_launch(flops=1e11), spec, USAGE)["time_s"] == pytest.approx(100e-6 + 1e-6)
    with pytest.raises(ValueError, match="tensor_flops"):
        M.predict(_launch(tensor_flops=1e12), SPEC, USAGE)
    assert M.GPUS["h200"].tensor_flops == M.GPUS["h100"].tensor_flops == 989e12


@pytest.mark.parametrize("dtype, dots, m_ops", [(torch.bfloat16, 3, 0), (torch.float16, 5, 5)], ids=str)
def test_project_t_split_plan_counts_tensor_and_fma_flops(dtype, dots, m_ops):
    """The split tensor-core path: every bfloat16 dot on the padded rank as tensor-core flops; the FMA pipe splits
    P once per column tile (and float16 M once), 2 flops per instruction. float32 gradients, configs without
    SPLIT_BF16 and the padding error keep the FMA dot's 2 R n m."""
    layout = _layout([(512, 4608), (2048, 512), (300, 70)], rank=16)
    cfg = configs.PROJECT_T_SPLIT_CONFIG
    nm = 512 * 4608 + 2048 * 512 + 300 * 70
    tiles = 512 * 72 + 2048 * 8 + 300 * 2  # rows x 64-column tiles
    (main, *_), R = plans.plan("project_t", layout, dtype, cfg, num_sms=132), 16
    assert main["tensor_flops"] == dots * 2 * R * nm
    assert main["flops"] == 2 * configs.SPLIT_OPS_P * R * tiles + 2 * m_ops * nm
    fma_dot = [(torch.float32, cfg, {}), (dtype, configs.PROJECT_T_FP32_DOT_CONFIG, {}), (dtype, cfg, {"PAD_ERROR": True})]
    for d, c, v in fma_dot:
        other = plans.plan("project_t", layout, d, c, num_sms=132, variant=v)[0]
        assert other["tensor_flops"] == 0 and other["flops"] == 2 * R * nm
    padded = plans.plan("project_t", layout, dtype, cfg, num_sms=132, variant={"PAD_ERROR": True})[0]
    assert padded["config"] == configs.PROJECT_T_FP32_DOT_CONFIG  # padding_error_config


def test_overlapped_launch_is_charged_its_sm_time():
    """The next step's Q orthogonalization runs on a side stream during the step before: charged its programs' SM
    time over all SMs (each program holds 1 / blocks_per_sm of an SM), or its bytes at copy bandwidth, and no
    launch overhead; step_plan marks exactly the orthogonalize Q launches so, with warm start only."""
    small = _launch(programs=4, bytes_read=30_000, bytes_written=10_000)  # 4 programs of 2 + 10 us
    alone = M.predict(small, SPEC, USAGE)
    assert alone["bound"] == "latency" and alone["time_s"] == pytest.approx(12e-6 + 1e-6)
    r = M.predict(dict(small, overlapped=True), SPEC, USAGE)
    assert r["bound"] == "overlapped (latency)" and r["time_s"] == pytest.approx(4 * 12e-6 / 2 / 10)
    heavy = M.predict(dict(small, overlapped=True, bytes_read=30_000_000), SPEC, USAGE)
    assert heavy["bound"] == "overlapped (bandwidth)" and heavy["time_s"] == pytest.approx(30.01e-6)
    layout = _layout([(512, 4608), (512,), (20000, 512)], rank=4)
    for warm in (True, False):
        plan = M.step_plan(layout, torch.float32, num_sms=132, warm_start=warm)
        assert {p["step"] for p in plan if p.get("overlapped")} == ({"orthogonalize Q"} if warm else set())


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
    order = [st for i, st in enumerate(steps) if i == 0 or steps[i - 1] != st]  # a split factor: two launches
    # the uncompressed gradients lie in several ranges: packed by project's launch (PACK), no launch of their own
    assert order == ["orthogonalize Q", "project", "orthogonalize P", "project_t", "average", "reconstruct"]
    assert all(p["kernel"] in kernels.KERNEL_FUNCTIONS for p in plan)
    by = {p["kernel"]: p for p in plan}
    assert by["project"]["variant"]["PACK"] and by["project"]["variant"]["PACK_ALIGN"] == 0  # (7,): ragged
    unpacked = plans.plan("project", layout, torch.bfloat16, num_sms=132, variant=dict(HAS_ERROR=True, wire=True))[0]
    chunks = [-(-n // 1024) for _, n in layout.uncompressed]
    assert by["project"]["programs"] == unpacked["programs"] + -(-sum(chunks) // by["project"]["config"]["num_warps"])
    unc = 2 * layout.uncompressed_numel  # the pack programs' bytes: read from the bucket, written packed
    assert by["project"]["bytes_read"] == unpacked["bytes_read"] + unc
    assert by["project"]["bytes_written"] == unpacked["bytes_written"] + unc
    g = sum(s.numel for s in layout.matrices)
    # the streaming launches move at least the 7-pass floor: 5 passes of bf16 gradients, 2 of float32 error
    streaming = sum(by[k]["bytes_read"] + by[k]["bytes_written"] for k in configs.STREAMING_KERNELS)
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
    for bad, message in ((["--models", "foo"], "invalid choice: 'foo'"),
                         (["--matrix-approximation-ranks", "0"], "must be positive, got 0")):
        with pytest.raises(SystemExit) as exc:
            M.main(bad)
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_makespan_dispatches_programs_in_order_to_free_slots():
    # 2 slots: 4 and 1 start at 0; 2 starts at 1 (ends 3); 3 starts at 3 (ends 6); 1 starts at 4 (ends 5)
    assert M.makespan([4, 1, 2, 3, 1], 2) == 6
    assert M.makespan([4, 1, 2], 3) == 4 and M.makespan([], 5) == 0
    # the same work longest-first packs tighter: the dispatch order matters
    assert M.makespan([4, 3, 2, 1, 1], 2) == 6 and M.makespan([1, 1, 2, 3, 4], 2) == 7


def test_depth_from_pipelining_or_prefetch():
    launch = _launch(config=dict(PREFETCH=2))
    assert M.depth(launch, dict(USAGE, pipelined=False)) == 3  # no SASS replay in a hand-made usage: 1 + PREFETCH
    assert M.depth(launch, dict(USAGE, pipelined=True, num_stages=2)) == 2  # cp.async: the compiled stages
    # the SASS replay: loop steps per trip over the DRAM latencies one trip waits
    assert M.depth(launch, dict(USAGE, trip_latencies=1.0)) == 1  # a rotated prefetch waits for its own loads
    unrolled = _launch(config=dict(PREFETCH=1), steps_per_trip=2)
    assert M.depth(unrolled, dict(USAGE, trip_latencies=1.0)) == 2
    assert M.depth(unrolled, dict(USAGE, trip_latencies=4.0)) == 0.5  # loads interleaved with waits
    assert M.depth(unrolled, dict(USAGE, trip_latencies=4.0, pipelined=True, num_stages=3)) == 3
    assert M.depth(_launch(), dict(USAGE, pipelined=False)) == 1
    # programs of 10 and 2 loop trips: the per-program lengths, not programs x the longest, set the latency time
    r = M.predict(_launch(programs=2, program_iterations=[10, 2], bytes_read=1000, bytes_written=0,
                          config=dict(PREFETCH=1)), SPEC, USAGE)
    assert r["bound"] == "latency" and r["time_s"] == pytest.approx(2e-6 + 10 * 1e-6 / 2 + 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_plan_program_iterations_follow_the_tile_tables(dtype, monkeypatch):
    """The per-program loop trips the model reads are those of the tables the launchers build, in launch order."""
    monkeypatch.setattr(_env, "interpreter_enabled", lambda: False)  # the GPU heuristics
    shapes = [(512, 4608), (512,), (2048, 512), (30, 7000), (4096, 2048), (300, 3)]
    total = sum(torch.Size(s).numel() for s in shapes)
    buf = torch.zeros(total, dtype=dtype)
    grads, off = [], 0
    for sh in shapes:
        n = torch.Size(sh).numel()
        grads.append(buf[off : off + n].view(sh))
        off += n
    layout = BucketLayout.from_gradients(buf, grads, 4, 2.0)
    for kernel in configs.STREAMING_KERNELS:
        launches = plans.plan(kernel, layout, dtype, num_sms=132)
        cfg, main = launches[0]["config"], launches[0]
        bk = cfg["BLOCK_K"]
        if kernel == "project":  # whole trips of the unrolled loop over a row's columns
            tiles = tables.tiles(layout, "rows", cfg["BLOCK_N"]).tolist()
            trip = main["steps_per_trip"]
            assert trip == (1 if cfg["USE_DOT"] or cfg.get("CARRY") else 1 + cfg.get("PREFETCH", 0))
            want = [-(-layout.matrices[i].m // (bk * trip)) * trip for i, _ in tiles]
        elif kernel == "reconstruct":
            tiles = tables.reconstruct_tiles(layout, cfg["BLOCK_N"], main["split_cols"]).tolist()
            trip = main["steps_per_trip"]
            assert trip == (1 if cfg["USE_DOT"] else 1 + cfg.get("PREFETCH", 0))
            want = [-(-(c1 - c0) // (bk * trip)) * trip for _, _, c0, c1 in tiles]
        else:  # the loop runs whole trips of steps_per_trip steps (the last trip's extra steps are masked)
            R = padded_rank(layout.max_rank, cfg["USE_DOT"])
            tiles, reduce_tiles, _ = tables.project_t_tiles(layout, cfg["BLOCK_M"], main["split_rows"], projection_t.reduce_block_m(cfg, R))
            trip = main["steps_per_trip"]
            if main["variant"]["ALIGN"] and not cfg["USE_DOT"]:  # the aligned float32 path: a step is one row
                assert trip == bk
                bk = 1
            else:
                assert trip == (1 if cfg["USE_DOT"] else 1 + cfg.get("PREFETCH", 0))
            want = [-(-(r1 - r0) // (bk * trip)) * trip for _, _, r0, r1, _ in tiles.tolist()]
            sb = projection_t.reduce_split_block(projection_t.reduce_block_m(cfg, R), R)
            assert launches[1]["program_iterations"] == [-(-ns // sb) for *_, ns in reduce_tiles.tolist()]
        assert main["program_iterations"] == want and main["programs"] == len(want)
        assert main["programs"] >= 2 * 132  # >= 2 programs per SM of an H100/H200


@pytest.mark.parametrize("model", ["resnet50", "gpt2", "bert-base"])
def test_bench_buckets_get_two_programs_per_sm(model, monkeypatch):
    """Every streaming launch of every full 25 MB bucket at ranks 1/4/16, fp32 and bf16: >= 2 programs per SM."""
    monkeypatch.setattr(_env, "interpreter_enabled", lambda: False)
    for dname in ("fp32", "bf16"):
        for rank in (1, 4, 16):
            for layout in M.model_layouts(model, rank, M.DTYPES[dname]):
                for launch in M.step_plan(layout, M.DTYPES[dname], num_sms=132):
                    if launch["kernel"] in configs.STREAMING_KERNELS:
                        assert launch["programs"] >= 2 * 132, (model, dname, rank, launch["kernel"])


TARGETS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from powersgd_triton import perfmodel as M
    spec = M.GPUS["h200"]
    out = []
    for case in sys.argv[1].split(";"):
        model, dname, rank, buckets = case.split(",")
        dtype = M.DTYPES[dname]
        for bi, layout in enumerate(M.model_layouts(model, int(rank), dtype)[: int(buckets)]):
            for launch in M.step_plan(layout, dtype, num_sms=spec.sms):
                u = M.compiled_usage(launch, spec.arch)
                r = M.predict(launch, spec, u)
                out.append(dict(model=model, dtype=dname, rank=int(rank), bucket=bi, kernel=r["kernel"], step=r["step"],
                                programs=r["programs"], registers=r["registers"], spills=r["spill_bytes"],
                                fraction=r["copy_fraction"], time_s=r["time_s"], depth=r["stages"],
                                config=launch["config"], steps_per_trip=launch.get("steps_per_trip", 1),
                                loop=u["loop"]))
    json.dump(out, sys.stdout)
    """
)

# Where the model predicts a streaming kernel below 60 % of copy bandwidth on the H200 (bench/RESULTS.md says why),
# as (model, dtype, rank) or (dtype, rank):
SHORT = {
    "project_t": set(),  # bfloat16 at rank 16: 75-78 % on the split tensor-core path (was 45-46 % FMA-bound)
    "project": set(),  # 79-93 % with the unrolled register prefetch (PROJECT_TILES; was 50-56 % in five cells)
    "reconstruct": set(),
}


def _predicted(tmp_path, cases):
    script = tmp_path / "targets.py"
    script.write_text(TARGETS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(script), ";".join(cases)], capture_output=True, text=True, env=env,
                         timeout=scaled(900))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _check_targets(rows):
    steps, ortho = {}, {}
    for r in rows:  # orthogonalization (Q on its side stream, P, with their Gram launches) <= 10 % of the step
        key = (r["model"], r["dtype"], r["rank"])
        steps[key] = steps.get(key, 0.0) + r["time_s"]
        if r["step"].startswith("orthogonalize"):
            ortho[key] = ortho.get(key, 0.0) + r["time_s"]
    for key, total in steps.items():
        assert ortho[key] <= 0.10 * total, (key, ortho[key] / total)
    for r in rows:
        key = (r["model"], r["dtype"], r["rank"], r["kernel"])
        if r["kernel"] not in configs.STREAMING_KERNELS:
            continue
        assert r["spills"] == 0 and r["programs"] >= 2 * 132, key
        if r["rank"] <= 8:
            assert r["registers"] <= 128, key
        short = SHORT[r["kernel"]]
        if (r["dtype"], r["rank"]) not in short and (r["model"], r["dtype"], r["rank"]) not in short:
            assert r["fraction"] >= 0.6, (key, r["fraction"])
        if r["kernel"] in ("project", "project_t") and not r["config"]["USE_DOT"]:
            # the broadcast loop: project_t sums each step's rows in the thread that loaded them (no barrier, shuffle,
            # shared or local memory in the loop; project's 64-column tiles at R >= 2 convert M's tile through shared
            # memory once per step, its 128-column ones do not); every load of a trip issued before the trip waits
            # (one DRAM latency per trip, 1 + PREFETCH steps in flight)
            loop = r["loop"]
            assert loop["shuffles"] == loop["local"] == 0, (key, loop)
            if r["kernel"] == "project_t":
                assert loop["barriers"] == loop["shared"] == 0, (key, loop)
            assert loop["trip_latencies"] == 1.0 and r["depth"] == r["steps_per_trip"] >= 2, (key, loop)


@pytest.mark.timeout(900)
def test_sm90_streaming_kernels_reach_60_percent_of_copy_bandwidth(tmp_path):
    """The model on the compiled sm_90 kernels (one GPT-2 25 MB bucket: rank 1 in fp32 and bf16, rank 4 in bf16, the
    tightest for project_t's registers): project, project_t and reconstruct predicted at >= 60 % of copy bandwidth
    (but for :data:`SHORT`), >= 2 programs per SM, no spills, <= 128 registers; project's and project_t's loops
    work in-thread and have 1 + PREFETCH steps of loads in flight in their SASS; orthogonalization <= 10 % of the
    step."""
    rows = _predicted(tmp_path, ["gpt2,fp32,1,1", "gpt2,bf16,1,1", "gpt2,bf16,4,1"])
    assert {r["kernel"] for r in rows} >= set(configs.STREAMING_KERNELS)
    _check_targets(rows)


@pytest.mark.aot_matrix
@pytest.mark.timeout(1800)
def test_sm90_targets_whole_table(tmp_path):
    """bench/RESULTS.md's table: every full bucket of ResNet-50, GPT-2, BERT at ranks 1/4/16, fp32 and bf16 (the
    orthogonalization share over all of a model's full buckets)."""
    cases = [f"{m},{d},{r},99" for m in ("resnet50", "gpt2", "bert-base") for d in ("fp32", "bf16") for r in (1, 4, 16)]
    _check_targets(_predicted(tmp_path, cases))
