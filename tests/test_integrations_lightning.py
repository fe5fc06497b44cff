"""PyTorch Lightning: PowerSGDDDPStrategy on 2 CPU processes (Lightning's DDPStrategy registers hooks on CUDA only).

``tests/_lightning_fit.py`` runs ``Trainer.fit`` for 2 epochs (Lightning's default launcher: the script is started
again for rank 1); each rank reports what the hook did. Then a second fit resumes from the epoch-0 checkpoint, whose
per-rank hook state files the strategy wrote, and must end with the same parameters, bitwise.
"""

import json
import os
import pickle
import signal
import subprocess
import sys

import pytest
import torch

from _deadline import scaled

pl = pytest.importorskip("pytorch_lightning")

from powersgd_triton import PowerSGDState, powerSGD_hook  # noqa: E402
from powersgd_triton.integrations.lightning import PowerSGDDDPStrategy, strategy_class  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "_lightning_fit.py")
STEPS = 16  # 2 epochs of 8 steps per rank


def _fit(out, *extra, timeout=150):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "RANK",
                                                            "LOCAL_RANK", "NODE_RANK", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::DeprecationWarning")
    proc = subprocess.Popen([sys.executable, SCRIPT, str(out), *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=scaled(timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # rank 1 was started by rank 0, in the same session
        log, _ = proc.communicate()
        pytest.fail(f"Lightning fit timed out after {timeout}s:\n{log.decode()[-4000:]}")
    assert proc.returncode == 0, log.decode()[-4000:]
    reports = []
    for rank in range(2):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            reports.append(json.load(f))
    params = [torch.load(os.path.join(out, f"params{rank}.pt")) for rank in range(2)]
    return reports, params


@pytest.mark.slow  # slow tier (docs/development.md): a real 2-rank Lightning fit and resume
def test_fit_on_cpu_runs_our_hook_and_resumes_exactly(tmp_path):
    reports, params = _fit(tmp_path / "full")
    for rank, r in enumerate(reports):
        assert r["rank"] == rank and r["world_size"] == 2
        assert r["comm_hook"] == "powerSGD_hook"  # DDPStrategy would leave None on CPU
        assert r["iter"] == r["global_step"] == STEPS  # the hook saw every synchronizing backward pass
        rate, before, after = r["stats"]
        assert rate > 1 and before > after > 0  # it compressed
        assert r["errors_nonzero"] > 0
        assert r["warnings"] == []
    assert all(torch.equal(a, b) for a, b in zip(*params))  # DDP: same weights on both ranks
    ckpt = tmp_path / "full" / "ckpt"
    for epoch in (0, 1):
        for rank in (0, 1):
            assert (ckpt / f"epoch={epoch}.ckpt.hook_state.rank{rank}.pt").exists()

    resumed, resumed_params = _fit(tmp_path / "resumed", "--resume", str(ckpt / "epoch=0.ckpt"))
    for r in resumed:
        assert r["iter"] == STEPS  # continued from the loaded 8, not restarted at 0
        assert r["warnings"] == []  # the memory followed its parameters into the fresh DDP's buckets
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(params[rank], resumed_params[rank])), rank


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lightning_ddpstrategy_registers_our_hook_on_gpu(tmp_path):
    """On CUDA, Lightning's own DDPStrategy registers our hook exactly as it registers PyTorch's."""
    devices = min(2, torch.cuda.device_count())
    out = tmp_path / "gpu"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, str(out), "--gpu"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=scaled(240))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for rank in range(devices):
        r = json.loads((out / f"rank{rank}.json").read_text())
        assert r["comm_hook"] == "powerSGD_hook" and r["iter"] == r["global_step"]
        assert r["stats"][0] > 1 and r["warnings"] == []


def test_strategy_pickles_before_init_process_group():
    """Lightning's spawn launcher pickles the strategy, hook state included, before any process group exists."""
    state = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=7)
    strategy = PowerSGDDDPStrategy(ddp_comm_state=state, ddp_comm_hook=powerSGD_hook, start_method="spawn")
    clone = pickle.loads(pickle.dumps(strategy))
    assert type(clone) is type(strategy)
    assert clone._ddp_comm_hook is powerSGD_hook
    assert clone._ddp_comm_state.start_powerSGD_iter == 7 and clone._ddp_comm_state.process_group is None


def test_strategy_class_per_package():
    assert strategy_class("pytorch_lightning") is strategy_class("pytorch_lightning")
    assert issubclass(strategy_class("pytorch_lightning"), pl.strategies.DDPStrategy)
    with pytest.raises(ValueError, match="package"):
        strategy_class("torch")
