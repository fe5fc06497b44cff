"""``powersgd-triton train`` end to end: short 2-rank runs of every hook through the CLI, the JSON schema, the
failure paths (a rank raising, bad options, a taken port), torchrun, determinism across hooks, measured bytes."""

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _deadline import scaled

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["--steps", "4", "--start-iter", "2", "--no-progress"]


def run_cli(*args, timeout=120, module=("-m", "powersgd_triton")):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, *module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(timeout)
    )
    proc.seconds = time.monotonic() - t0
    return proc


def check_schema(payload, hooks, steps):
    assert set(payload) == {"runs", "config"}
    assert list(payload["runs"]) == list(hooks)
    cfg = payload["config"]
    assert "rank" not in cfg  # PowerSGD's r is matrix_approximation_rank: under torchrun "rank" is the process
    for key in ("workload", "world_size", "matrix_approximation_rank", "start_iter", "seed", "lr", "batch_size",
                "backend", "hooks"):
        assert key in cfg, key
    for name, run in payload["runs"].items():
        assert isinstance(run["final_test_accuracy"], float) and 0.0 <= run["final_test_accuracy"] <= 1.0
        for key in ("allreduce_bytes_per_step", "allreduce_calls_per_step", "seconds_per_step"):
            assert isinstance(run[key], float) and run[key] > 0 and math.isfinite(run[key]), (name, key)
        assert isinstance(run["steps"], int) and run["steps"] == steps
        assert len(run["loss"]) == steps and all(isinstance(v, float) and math.isfinite(v) for v in run["loss"])
        assert len(run["test_accuracy"]) == run["epochs"] >= 1
        assert all(0.0 <= a <= 1.0 for a in run["test_accuracy"])
        assert run["test_accuracy"][-1] == run["final_test_accuracy"]
        assert len(run["allreduce_bytes"]) == steps
        assert run["compression_rate"] >= 1.0


@pytest.mark.parametrize("hooks", [("allreduce", "reference", "powersgd"), ("batched",)], ids=["compare", "batched"])
def test_short_run_of_each_hook(hooks, tmp_path):
    """Each hook, a short run: ``powersgd`` on ``--kernels auto`` (the Triton kernels here, in the interpreter), next to
    ``allreduce`` and ``reference`` in one ``--compare`` (one launch: the process start-up is most of a short run);
    ``batched`` through ``--hook`` on ``--kernels torch`` (what a CPU user gets from auto; the interpreter is slow)."""
    out = tmp_path / "m.json"
    kernels = ["--kernels", "torch"] if hooks == ("batched",) else []
    which = ["--hook", hooks[0]] if len(hooks) == 1 else ["--compare", ",".join(hooks)]
    proc = run_cli("train", *which, *SHORT, *kernels, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "final test acc" in proc.stdout
    payload = json.loads(out.read_text())
    check_schema(payload, list(hooks), steps=4)
    for hook in hooks:
        run = payload["runs"][hook]
        assert run["compressed_steps"] == 2
        if hook == "powersgd":
            # tests run under TRITON_INTERPRET=1 (conftest), so "auto" picks the Triton kernels on CPU tensors
            expected = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "torch"
            assert run["kernel_backend"] == expected
        elif hook == "batched":
            assert run["kernel_backend"] == "torch"
        else:
            assert run["kernel_backend"] is None
        if hook == "allreduce":
            assert run["allreduce_bytes_per_step"] == run["gradient_bytes"]
        else:
            assert run["allreduce_bytes_per_step"] < run["gradient_bytes"] / 10
            assert run["allreduce_bytes_per_warmup_step"] == run["gradient_bytes"]
            assert run["compression_rate"] > 10


def test_in_process_entry_point(tmp_path, capfd):
    from powersgd_triton.cli import main

    out = tmp_path / "m.json"
    assert main(["train", "--hook", "allreduce", "--world-size", "1", *SHORT, "--out", str(out)]) == 0
    check_schema(json.loads(out.read_text()), ["allreduce"], steps=4)
    assert "all-reduce" in capfd.readouterr().out


def test_compare_is_deterministic_across_hooks_and_counts_bytes(tmp_path):
    """Same seed -> same weights and data order: before compression starts PyTorch's hook is a plain all-reduce,
    so its losses equal the all-reduce run's; once it compresses it sends far fewer bytes."""
    out = tmp_path / "m.json"
    proc = run_cli("train", "--compare", "reference,allreduce", "--steps", "12", "--start-iter", "6", "--no-progress",
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(out.read_text())["runs"]
    ref, base = runs["reference"], runs["allreduce"]
    assert ref["loss"][:7] == pytest.approx(base["loss"][:7], rel=1e-5)
    assert base["allreduce_bytes_per_step"] >= 10 * ref["allreduce_bytes_per_step"]
    assert ref["allreduce_calls_per_step"] == 3  # uncompressed part, P, Q
    assert "| torch powerSGD_hook" in proc.stdout and "| all-reduce" in proc.stdout
    assert "one DDP bucket" in proc.stdout
    assert ref["bucket_cap_mb"] == base["bucket_cap_mb"] == 1024  # every row on PyTorch's hook's buckets


def test_rows_beside_pytorchs_hook_take_its_buckets():
    """The DDP bucket cap of each row: PyTorch's hook its own (one bucket on gloo); beside it every other row the same
    unless --bucket-cap-mb sets ours; alone, --bucket-cap-mb or DDP's default (None)."""
    from powersgd_triton.train.loop import TrainConfig, ddp_bucket_cap_mb

    side = TrainConfig(hooks=("powersgd", "reference", "allreduce"))
    assert [ddp_bucket_cap_mb(h, side) for h in side.hooks] == [1024.0, 1024.0, 1024.0]
    own = TrainConfig(hooks=("powersgd", "reference"), bucket_cap_mb=25.0, reference_bucket_cap_mb=512.0)
    assert [ddp_bucket_cap_mb(h, own) for h in own.hooks] == [25.0, 512.0]
    assert ddp_bucket_cap_mb("powersgd", TrainConfig(hooks=("powersgd", "allreduce"))) is None
    assert ddp_bucket_cap_mb("allreduce", TrainConfig(hooks=("allreduce",), bucket_cap_mb=2.0)) == 2.0


@pytest.mark.slow
def test_ours_tracks_pytorchs_hook(tmp_path):
    """Beside PyTorch's hook ours runs on its bucket (one: digits fits it anyway): same seed,
    same losses step by step (up to float rounding), same bytes and calls. Ours on the torch backend, as on a CPU
    without the interpreter (the Triton kernels' steps against PyTorch's hook: test_hooks_equivalence)."""
    out = tmp_path / "m.json"
    proc = run_cli("train", "--compare", "powersgd,reference", "--steps", "12", "--start-iter", "4", "--no-progress",
                   "--kernels", "torch", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(out.read_text())["runs"]
    ours, ref = runs["powersgd"], runs["reference"]
    assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-4)
    assert ours["allreduce_bytes_per_step"] == ref["allreduce_bytes_per_step"]
    assert ours["allreduce_calls_per_step"] == ref["allreduce_calls_per_step"]
    assert ours["compression_rate"] == pytest.approx(ref["compression_rate"])


def test_failing_rank_fails_the_run_promptly():
    proc = run_cli("train", "--hook", "allreduce", "--no-progress", "--debug-fail-rank", "1",
                   "--debug-fail-step", "2", "--timeout", "100", timeout=90)
    assert proc.returncode == 1
    assert "rank 1 failed" in proc.stderr
    assert "RuntimeError: injected failure on rank 1 at step 2" in proc.stderr
    assert proc.seconds < 60


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world-size", "0"], "--world-size must be at least 1, got 0"),
        (["--start-iter", "1"], "--start-iter must be at least 2"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--matrix-approximation-rank", "0"], "--matrix-approximation-rank must be at least 1"),
        (["--approx-rank", "0"], "--matrix-approximation-rank must be at least 1"),
        (["--lr", "-1"], "must be positive"),
        (["--lr", "inf"], "must be a finite number"),
        (["--timeout", "nan"], "must be positive"),
        (["--hook", "nope"], "invalid choice: 'nope'"),
        (["--compare", "powersgd,foo"], "expected a comma-separated list"),
        (["--workload", "cifar"], "invalid choice: 'cifar'"),
        (["--batch-size", "100000"], "is larger than the 1438 training items of digits"),
        (["--backend", "nccl"], "--backend nccl needs --device cuda"),
        (["--out", "."], "is a directory; give a file name"),
        (["--out", os.path.join(__file__, "metrics.json")], "is not a directory"),
        (["--out", "no-such-dir/metrics.json"], "does not exist"),
        (["--seed", "-1"], "--seed must be between 0 and 2**32 - 1, got -1"),
        (["--seed", str(2**32)], "--seed must be between 0 and 2**32 - 1, got 4294967296"),
        (["--hook", "reference", "--reference-bucket-cap-mb", "0.01"],
         "--reference-bucket-cap-mb 0.01 splits the model's 0.58 MB of gradients into several DDP buckets"),
    ],
)
def test_bad_options_give_a_clear_message(args, message, capsys):
    from powersgd_triton.cli import main

    try:
        code = main(["train", "--hook", "allreduce", *args, "--no-progress"])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "powersgd-triton train: error: " in err and message in err, err


def test_misspelt_option_prints_one_line_with_the_closest_option(capsys):
    """``train --workoad digits``: one line from train's parser (not the top-level one), with the closest option and
    where the options are listed; no usage block."""
    from powersgd_triton.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["train", "--workoad", "digits"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == ("powersgd-triton train: error: unrecognized arguments: --workoad digits; --workoad: did you mean "
                   "--workload? (see powersgd-triton train --help)\n"), err
    with pytest.raises(SystemExit):  # the same for the other sub-commands
        main(["autotune", "--modle", "resnet50"])
    err = capsys.readouterr().err
    assert err.startswith("powersgd-triton autotune: error: ") and "did you mean --model?" in err
    assert err.count("\n") == 1 and "usage:" not in err
    with pytest.raises(SystemExit):  # an unknown word before the sub-command stays the top-level parser's
        main(["--verbose", "train"])
    err = capsys.readouterr().err
    assert err.startswith("powersgd-triton: error: ") and "unrecognized arguments: --verbose" in err
    assert err.count("\n") == 1


def test_rank_is_a_deprecated_alias_of_matrix_approximation_rank(capsys):
    """``--rank`` still sets PowerSGD's r, and says on stderr that it is deprecated and what replaces it."""
    from powersgd_triton.cli import build_parser
    from powersgd_triton.train.cli import config_from_args

    parser = build_parser()
    for argv, expected, warned in ((["train"], 4, False), (["train", "--matrix-approximation-rank", "3"], 3, False),
                                   (["train", "--approx-rank", "5"], 5, False), (["train", "--rank", "2"], 2, True)):
        cfg = config_from_args(parser.parse_args(argv))
        assert cfg.matrix_approximation_rank == expected, argv
        err = capsys.readouterr().err
        assert ("--rank is deprecated" in err and "use --matrix-approximation-rank" in err) == warned, (argv, err)
    assert "--rank " not in parser.subcommand_parsers["train"].format_help()  # hidden from --help
    args = parser.parse_args(["bench", "--ranks", "1,4"])
    assert args.matrix_approximation_ranks == "1,4" and "use --matrix-approximation-ranks" in capsys.readouterr().err
    args = parser.parse_args(["autotune", "--model", "gpt2", "--rank", "4", "8"])
    assert args.matrix_approximation_rank == [4, 8] and "--rank is deprecated" in capsys.readouterr().err


def test_only_rank_0_checks_out_under_torchrun(monkeypatch, capsys):
    """Under torchrun only rank 0 writes --out, so only rank 0 refuses a path it could not write (on a multi-node
    job the directory may exist on rank 0's node only)."""
    from powersgd_triton.cli import main
    from powersgd_triton.train import launch, loop

    monkeypatch.setattr(loop, "run_training", lambda cfg: None)  # what a non-zero torchrun rank gets back
    for rank, code in ((1, 0), (0, 2)):
        monkeypatch.setattr(launch, "torchrun_env", lambda: launch.TorchrunEnv(rank=rank, world_size=2, local_rank=rank))
        assert main(["train", "--out", "no-such-dir/metrics.json", "--no-progress"]) == code, rank
    assert "does not exist" in capsys.readouterr().err


def test_help_shows_defaults_once(capsys):
    from powersgd_triton.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: True)" not in text and "(default: False)" not in text
    assert "per workload) (default" not in text
    assert "PowerSGD's matrix approximation rank r" in text and "not the process rank (default: 4)" in text


def test_taken_port_gives_a_clear_message():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_cli("train", "--hook", "allreduce", "--port", str(port), *SHORT, timeout=60)
    assert proc.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in proc.stderr


@pytest.mark.slow
def test_under_torchrun(tmp_path):
    out = tmp_path / "m.json"
    proc = run_cli(
        "--standalone", "--nproc-per-node", "2", "-m", "powersgd_triton", "train", "--hook", "reference", *SHORT,
        "--out", str(out), module=("-m", "torch.distributed.run"), timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    check_schema(payload, ["reference"], steps=4)
    assert payload["config"]["world_size"] == 2
    assert proc.stdout.count("final test acc") == 1  # only rank 0 prints the table


def test_triton_kernels_without_interpreter_on_cpu_is_a_clear_error(monkeypatch, capsys):
    from powersgd_triton.compat import env as _env
    from powersgd_triton import cli

    monkeypatch.setattr(_env, "interpreter_enabled", lambda: False)
    assert cli.main(["train", "--kernels", "triton", "--steps", "3"]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["m" * 250 + ".json", "m" * 260 + ".json"], ids=["writer_temp_too_long", "too_long"])
def test_out_that_cannot_be_created_is_refused_before_training(tmp_path, monkeypatch, capsys, name):
    """The directory exists and is writable, but the file system refuses the name: the writer's temporary file
    (``<name>.<random>.tmp``) or the file itself. Main passed the up-front check, trained, then lost the run to a
    traceback from the atomic writer; now the probe (create, then remove) refuses it before training."""
    from powersgd_triton.cli import main
    from powersgd_triton.train import loop

    def trained(cfg):
        raise AssertionError("training started")

    monkeypatch.setattr(loop, "run_training", trained)
    code = main(["train", "--hook", "allreduce", "--world-size", "1", *SHORT, "--out", str(tmp_path / name)])
    assert code == 2
    err = capsys.readouterr().err
    assert "powersgd-triton train: error: --out" in err and "cannot create" in err, err
    assert os.listdir(tmp_path) == []  # the probe left nothing behind


def test_out_probe_keeps_an_existing_file_and_leaves_nothing(tmp_path, monkeypatch):
    from powersgd_triton.cli import main
    from powersgd_triton.train import loop

    monkeypatch.setattr(loop, "run_training", lambda cfg: None)  # no metrics come back: nothing is written
    existing = tmp_path / "old.json"
    existing.write_text('{"kept": true}\n')
    assert main(["train", "--hook", "allreduce", "--world-size", "1", *SHORT, "--out", str(existing)]) == 0
    assert main(["train", "--hook", "allreduce", "--world-size", "1", *SHORT, "--out", str(tmp_path / "new.json")]) == 0
    assert existing.read_text() == '{"kept": true}\n' and os.listdir(tmp_path) == ["old.json"]


def test_amp_fp16_and_bfloat16_factors_in_compare(tmp_path):
    """``--amp fp16`` (autocast + GradScaler given to our state) and ``--communication-dtype bfloat16``: our row sends
    the factors in bfloat16 (fewer bytes than PyTorch's hook, whose factors stay float32 on fp32 buckets), says so in
    its label, and trains to a finite loss; the options are recorded in the metrics."""
    out = tmp_path / "m.json"
    proc = run_cli("train", "--compare", "powersgd,reference", "--steps", "6", "--start-iter", "3", "--amp", "fp16",
                   "--communication-dtype", "bfloat16", "--kernels", "torch", "--no-progress", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(out.read_text())
    assert payload["config"]["amp"] == "fp16" and payload["config"]["communication_dtype"] == "bfloat16"
    ours, ref = payload["runs"]["powersgd"], payload["runs"]["reference"]
    assert ours["allreduce_bytes_per_step"] < ref["allreduce_bytes_per_step"]
    assert ours["allreduce_bytes_per_warmup_step"] == ref["allreduce_bytes_per_warmup_step"]
    assert "bfloat16 factors" in proc.stdout and "AMP fp16 + GradScaler" in proc.stdout


@pytest.mark.parametrize("argv", [["--amp", "fp8"], ["--communication-dtype", "int8"]])
def test_bad_amp_or_communication_dtype_is_refused(argv, capsys):
    from powersgd_triton.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", *argv])
    assert "invalid choice" in capsys.readouterr().err


def test_configuration_is_checked_once(monkeypatch, capsys):
    """``train`` checks its configuration in one place (``loop.validate``), once: the CLI before it prints anything,
    and ``run_training`` takes what ``validate`` returned as it is; a configuration changed after ``validate``, or
    one from Python that never went through it, is checked again (with the same messages)."""
    from powersgd_triton.cli import main
    from powersgd_triton.train import launch, loop

    calls = {"resolved": 0, "check_available": 0}
    resolved, check_available = loop.TrainConfig.resolved, loop.check_available

    def counting_resolved(self):
        calls["resolved"] += 1
        return resolved(self)

    def counting_check_available(cfg):
        calls["check_available"] += 1
        return check_available(cfg)

    launched = []

    def fake_launch(fn, world_size, args=(), **kwargs):
        launched.append((world_size, args[0]))
        raise launch.LaunchError("no ranks in this test")

    monkeypatch.setattr(loop.TrainConfig, "resolved", counting_resolved)
    monkeypatch.setattr(loop, "check_available", counting_check_available)
    monkeypatch.setattr(launch, "launch", fake_launch)
    assert main(["train", "--hook", "allreduce", "--world-size", "3", "--batch-size", "7", *SHORT]) == 1
    assert "no ranks in this test" in capsys.readouterr().err
    assert calls == {"resolved": 1, "check_available": 1}
    (world, cfg), = launched
    assert world == 3 and cfg.batch_size == 7 and cfg.backend == "gloo"
    assert cfg.lr == loop.WORKLOAD_DEFAULTS["digits"]["lr"]  # resolved: the workload's default filled in

    for config, expected in ((loop.TrainConfig(hooks=("allreduce",), world_size=3), 1), (cfg, 0)):
        calls.update(resolved=0, check_available=0)
        with pytest.raises(launch.LaunchError):
            loop.run_training(config)
        assert calls == {"resolved": expected, "check_available": expected}
    cfg.batch_size = 0  # changed after validate: checked again
    with pytest.raises(ValueError, match="--batch-size must be at least 1, got 0"):
        loop.run_training(cfg)
    assert len(launched) == 3


def test_progress_bars_only_on_a_terminal(monkeypatch, capsys):
    """Rank 0's tqdm bars go to a terminal only; with stderr in a file or pipe the epoch lines stay, bars do not."""
    from powersgd_triton.compat import env as _env
    from powersgd_triton.train import loop

    if not _env.has_progress_bar():
        pytest.skip("tqdm is not installed")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    log = loop._Log(True, True)
    assert not log.progress
    bar = log.bar(total=3, desc="epoch 1")
    bar.update(3)
    bar.close()
    log.line("epoch 1 loss 0.5")
    out = capsys.readouterr()
    assert out.out == "epoch 1 loss 0.5\n" and "epoch 1" not in out.err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert loop._Log(True, True).progress and not loop._Log(False, True).progress and not loop._Log(True, False).progress
