"""Accelerate: our hook registered on the prepared model, MULTI_CPU mode, 2 processes (``debug_launcher``, fork).

``tests/_accelerate_train.py`` trains on 2 gloo ranks, then resumes from ``accelerator.save_state`` /
``load_state`` with the per-rank hook state ``register_comm_hook`` adds to it; parameters must equal the uninterrupted
run's bitwise.
"""

import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch.nn as nn

from _deadline import scaled

pytest.importorskip("accelerate")

from powersgd_triton import PowerSGDState  # noqa: E402
from powersgd_triton.integrations.accelerate import register_comm_hook  # noqa: E402

pytestmark = pytest.mark.timeout(180)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "_accelerate_train.py")


def test_multi_cpu_registers_our_hook_and_resumes_exactly(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_") and k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, SCRIPT, str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=scaled(120))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"Accelerate run timed out:\n{log.decode()[-4000:]}")
    assert proc.returncode == 0, log.decode()[-4000:]
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            r = json.load(f)
        assert r["distributed_type"] == "MULTI_CPU" and r["world_size"] == 2 and r["rank"] == rank
        assert r["registered"] and r["comm_hook"] == "powerSGD_hook"
        assert r["iter"] == 12
        rate, before, after = r["stats"]
        assert rate > 1 and before > after > 0
        assert "hook_state.rank0.pt" in r["ckpt_files"] and "hook_state.rank1.pt" in r["ckpt_files"]
        assert r["loaded_iter"] == 6 and r["resumed_iter"] == 12
        assert r["resumed_equal"] and r["warnings"] == []


def _accelerator(mode, processes):
    return SimpleNamespace(distributed_type=SimpleNamespace(name=mode), num_processes=processes, process_index=0)


@pytest.mark.parametrize("mode", ["FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"])
def test_refuses_modes_without_ddp(mode):
    with pytest.raises(TypeError, match=mode):
        register_comm_hook(_accelerator(mode, 2), nn.Linear(2, 2), PowerSGDState(None))


def test_single_process_registers_nothing():
    assert register_comm_hook(_accelerator("NO", 1), nn.Linear(2, 2), PowerSGDState(None)) is False


def test_multi_process_model_must_be_ddp():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        register_comm_hook(_accelerator("MULTI_CPU", 2), nn.Linear(2, 2), PowerSGDState(None))
