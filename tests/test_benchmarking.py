"""The benchmark infrastructure (powersgd_triton.benchmarking): fake buckets, counters, byte model. Fast, CPU only."""

import os

import pytest
import torch

from powersgd_triton import benchmarking as B
from powersgd_triton.shapes import model_shapes, numel


def test_fake_bucket_views_and_api(rng):
    shapes = [(4, 3, 3, 3), (4,), (10, 4)]
    buf = B.random_buffer(sum(numel(s) for s in shapes), torch.float32, "cpu", rng)
    b = B.FakeGradBucket(buf, shapes, index=2, num_buckets=3)
    grads = b.gradients()
    assert [tuple(g.shape) for g in grads] == shapes
    assert all(g.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for g in grads)
    grads[2][0, 0] = 123.0
    assert buf[4 * 27 + 4].item() == 123.0
    assert b.buffer() is buf and b.index() == 2 and b.is_last()
    assert [tuple(p.shape) for p in b.parameters()] == shapes
    assert all(p.device.type == "meta" for p in b.parameters())
    new = buf.clone().to(torch.bfloat16)
    b.set_buffer(new)
    assert b.buffer() is new and b.gradients()[0].dtype == torch.bfloat16
    assert b.gradients()[2].untyped_storage().data_ptr() == new.untyped_storage().data_ptr()
    with pytest.raises(ValueError):
        b.set_buffer(torch.zeros(3))
    with pytest.raises(ValueError):
        B.FakeGradBucket(buf, shapes, index=3, num_buckets=3)


def test_model_buckets_cover_the_model_in_reverse_order(rng):
    buckets = B.model_buckets("resnet50", "fp32", shrink=8, bucket_cap_mb=0.1, first_bucket_mb=0.01, generator=rng)
    shapes = B.shrink_shapes(model_shapes("resnet50"), 8)
    flat = [s for b in buckets for s in b.shapes]
    assert flat == list(reversed(shapes))
    assert [b.index() for b in buckets] == list(range(len(buckets)))
    assert [b.is_last() for b in buckets] == [False] * (len(buckets) - 1) + [True]
    assert all(bool((b.buffer() != 0).any()) for b in buckets)  # random, never zeros
    # DDP-like 25 MB buckets of the full model: 5 buckets for ResNet-50 (1 MB first bucket, then 25 MB)
    assert len(B.model_bucket_shapes("resnet50")) == 5
    bf16 = B.model_bucket_shapes("gpt2", torch.bfloat16)
    assert len(bf16) < len(B.model_bucket_shapes("gpt2"))  # 25 MB of 2-byte elements hold twice as many


def test_model_bucket_layouts_are_the_layouts_of_the_model_buckets(rng):
    """What the autotuner tunes (``cli.autotune_run.model_layouts`` builds them with this) is the layout of each bucket
    of :func:`model_buckets`: the same matrices and device table, layer-wise; one matrix of the whole bucket,
    batched."""
    from powersgd_triton.cli.autotune_run import model_layouts

    kw = dict(bucket_cap_mb=0.2, first_bucket_mb=0.05)
    buckets = B.model_buckets("gpt2", "bf16", shrink=8, generator=rng, **kw)
    layer = B.model_bucket_layouts("gpt2", 3, "bf16", shrink=8, min_compression_rate=20, **kw)
    batched = B.model_bucket_layouts("gpt2", 3, torch.bfloat16, batched=True, shrink=8, **kw)
    assert len(layer) == len(batched) == len(buckets) > 2
    for bucket, lay, bat in zip(buckets, layer, batched):
        want = B.bucket_layout(bucket, 3, min_compression_rate=20)
        assert lay.num_matrices > 0 and lay.matrices == want.matrices and lay.uncompressed == want.uncompressed
        assert torch.equal(lay.table, want.table) and lay.numel == bucket.buffer().numel() and not lay.batched
        assert bat.batched and bat.numel == bucket.buffer().numel() and bat.num_matrices == 1
    full = model_layouts("resnet50", 4, torch.float32, "layerwise", "cpu")
    assert [lay.numel for lay in full] == [sum(numel(s) for s in g) for g in B.model_bucket_shapes("resnet50")]
    assert [repr(a) for a in full] == [repr(b) for b in B.model_bucket_layouts("resnet50", 4)]


def test_kernel_bytes_model(rng):
    shapes = [(8, 6), (5,), (16, 12)]
    buf = B.random_buffer(sum(numel(s) for s in shapes), torch.float32, "cpu", rng)
    layout = B.bucket_layout(B.FakeGradBucket(buf, shapes), 2, min_compression_rate=1)
    mn, p, q = 48 + 192, (8 + 16) * 2 * 4, (6 + 12) * 2 * 4
    assert layout.e_numel == mn
    assert B.kernel_bytes("project", layout, torch.float32) == mn * 4 * 3 + p + q
    assert B.kernel_bytes("project", layout, torch.float32, error=False) == mn * 4 + p + q
    assert B.kernel_bytes("orthogonalize", layout, torch.float32) == 2 * p
    assert B.kernel_bytes("project_t", layout, torch.bfloat16) == mn * 2 + p + q
    assert B.kernel_bytes("reconstruct", layout, torch.bfloat16) == p + q + mn * (2 + 2 + 4)
    with pytest.raises(ValueError):
        B.kernel_bytes("nope", layout, torch.float32)


def test_pytorch_hook_step_counts(world1, rng):
    buckets = B.model_buckets("resnet50", "fp32", shrink=8, bucket_cap_mb=0.5, first_bucket_mb=0.02, generator=rng)
    step = B.HookStep("pytorch", buckets, 2).warmup(1)
    assert step.state.iter >= 2
    counts = B.count_step(step, hook_step=step)
    # PyTorch's layer-wise hook: uncompressed, P and Q all-reduces for every bucket
    assert counts.per_bucket().keys() == {b.index() for b in buckets}
    assert all(calls == 3 for calls, _ in counts.per_bucket().values())
    assert counts.aten_compute > 10 * len(buckets)
    assert counts.by_op.get("aten.bmm.out", 0) > 0
    held = B.held_bytes(step.state)
    for b in buckets:  # error memory (a whole bucket) + P + Q, all in the bucket's dtype
        assert held[b.index()] > b.nbytes
    with B.synchronous_collectives(step):
        peak = B.peak_extra_bytes(step, "cpu")
    assert peak is None or peak > 0


def test_kernel_bench_runs_both_sides(rng):
    shapes = [(32, 16, 3, 3), (32,), (64, 32)]
    buf = B.random_buffer(sum(numel(s) for s in shapes), torch.float32, "cpu", rng)
    kb = B.KernelBench(B.FakeGradBucket(buf, shapes), 4, generator=rng)
    for kernel in B.KERNELS:
        kb.ours(kernel, backend="torch")()
        kb.pytorch(kernel)()
        assert kb.bytes(kernel) > 0
    assert torch.isfinite(buf).all() and torch.isfinite(kb.p).all() and torch.isfinite(kb.pt_p).all()


def test_triton_launches_counted_without_running(rng):
    pytest.importorskip("triton")
    from powersgd_triton.compat import env as _env

    if not _env.interpreter_enabled():
        pytest.skip("needs the interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)")
    shapes = [(64, 48), (7,), (33, 20), (33, 20)]
    buf = B.random_buffer(sum(numel(s) for s in shapes), torch.float32, "cpu", rng)
    kb = B.KernelBench(B.FakeGradBucket(buf, shapes), 4, generator=rng)
    before = kb.p.clone()
    with B.count_triton_launches(execute=False) as n:
        for kernel in B.KERNELS:
            kb.ours(kernel, backend="triton")()
    assert n["n"] == 4 and set(n["by"]) == {"_project_kernel", "_orthogonalize_kernel", "_project_t_kernel",
                                             "_reconstruct_kernel"}
    assert torch.equal(kb.p, before)  # nothing ran
    with B.count_triton_launches() as n:
        kb.ours("project", backend="triton")()
    assert n["n"] == 1 and not torch.equal(kb.p, before)


def test_op_counter_kinds():
    x = torch.randn(8, 8)
    with B.OpCounter() as ops:
        y = x.t()
        z = torch.empty(3)
        (y @ x).add_(1)
    assert ops.by_kind["view"] >= 1 and ops.by_kind["alloc"] >= 1 and ops.compute == 2
    assert z.numel() == 3


def test_markdown_table_and_environment():
    text = B.markdown_table([{"a": 1.23456, "b": None}, {"a": 12345.0, "b": "x"}], [("a", "A"), ("b", "B")])
    assert text.splitlines()[0] == "| A | B |"
    assert "| 1.23 | - |" in text and "| 12345 | x |" in text
    env = B.environment()
    assert env["torch"] == torch.__version__ and env["cpu_count"] >= 1


def test_bench_cli_prints_the_side_by_side_table(world1, tmp_path, capfd):
    """The table, labelled, and nothing else: torch.profiler's USDT profiler_start/stop lines and c10's
    CPUAllocator warning (the CPU peak-memory measurement profiles the step) stay out of stdout and stderr."""
    from powersgd_triton import cli

    md, js, hist = tmp_path / "t.md", tmp_path / "t.json", tmp_path / "history.jsonl"
    from powersgd_triton import history as H

    commit = H.git_commit()[0]
    code = cli.main(["bench", "--models", "resnet50", "--matrix-approximation-ranks", "2", "--shrink", "16",
                     "--rounds", "1", "--markdown", str(md), "--json", str(js), "--history", str(hist)]
                    + (["--compare-to", "HEAD"] if commit else []))
    assert code == 0
    out, err = capfd.readouterr()
    # correctness gate of the history: ours agrees with PyTorch's hook on the same buckets, so the rows are recorded
    assert "resnet50 r=2 fp32: max relative difference" in out and "agrees" in out
    if commit:  # keyed by commit and device; compared with HEAD's rows (these very rows: ratio 1)
        recs = H.load(str(hist))
        assert len(recs) == 2 and {r["commit"] for r in recs} == {commit}
        assert {r["key"]["impl"] for r in recs} == {"pytorch", "ours"} and recs[0]["key"]["shrink"] == 16
        assert f"recorded 2 rows in {hist}" in out and "| median_ms |" in out and "| 1.000 |" in out
    assert "PyTorch/ours" in out and "| resnet50 | 2 | float32 | pytorch |" in out
    assert "| approx. rank r |" in out and "| ran as | ATen compute ops/step | Triton launches/step |" in out
    assert "PyTorch's hook (ATen ops)" in out and "our torch backend" in out  # which backend the ops are of
    for noise in ("USDT", "profiler_start", "profiler_stop", "CPUAllocator", "Memory block of unknown size"):
        assert noise not in out + err, (noise, err[-2000:])
    import json

    payload = json.loads(js.read_text())
    rows = payload["rows"]
    assert payload["checks"][0]["ok"] and payload["checks"][0]["max_rel_diff"] < 1e-4
    assert [r["impl"] for r in rows] == ["pytorch", "ours"] and rows[1]["speedup"] > 0
    assert [r["matrix_approximation_rank"] for r in rows] == [2, 2] and "rank" not in rows[0]
    assert [r["ops_backend"] for r in rows] == ["pytorch", "torch"] and rows[1]["triton_launches"] == 0
    assert rows[0]["allreduce_calls"] == 3 * rows[0]["buckets"]
    assert rows[1]["peak_extra_bytes"] > 0  # the profiler still measured, quietly
    assert md.read_text().count("| resnet50 |") == 2


def test_quiet_profiler_passes_other_stderr_through(capfd):
    import sys

    with B.quiet_profiler():
        sys.stderr.write("a line of the step\n")
        os.write(2, b"[W1130 CPUAllocator.cpp:245] Memory block of unknown size was allocated before the profiling "
                    b"started, profiler results will not include the deallocation event\n")
        os.write(2, b"USDT:2026-11-30 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"another line\n")
    err = capfd.readouterr().err
    assert err == "a line of the step\nanother line\n"


def test_time_interleaved_alternates():
    calls = []
    stats = B.time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=2, warmup=0)
    assert calls == ["a", "b", "b", "a"] and stats["a"]["reps"] == 2


@pytest.mark.parametrize(
    "bad", [["--models", "nope"], ["--rounds", "0"], ["--matrix-approximation-ranks", "0"], ["--approx-ranks", "x"],
            ["--dtypes", "fp8"], ["--rnds", "2"]]
)
def test_bench_cli_rejects_bad_options_cleanly(bad, capsys):
    from powersgd_triton import cli

    try:
        code = cli.main(["bench", *bad])
    except SystemExit as exc:  # argparse's own errors (argument types)
        code = exc.code
    assert code == 2
    assert "powersgd-triton bench: error:" in capsys.readouterr().err


def test_held_bytes_counts_state_tensors_not_code(rng):
    """A state that refers to modules and functions (a hook, ``torch.distributed``): their namespaces are not walked
    (touching ``dist.reduce_op`` there raised torch's FutureWarning), and each tensor storage counts once."""
    import warnings

    import torch.distributed as dist

    class _State:
        pass

    s = _State()
    a = torch.randn(7, 5, generator=rng)
    s.memory = {3: [a, a[1:]], 4: torch.randn(11, generator=rng, dtype=torch.float64)}
    s.lib, s.hook, s.cls = dist, B.held_bytes, _State
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        held = B.held_bytes(s)
    assert held == {3: 7 * 5 * 4, 4: 11 * 8}
