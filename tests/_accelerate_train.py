"""Accelerate, MULTI_CPU mode, 2 processes (``accelerate.debug_launcher``): our hook registered after ``prepare``.

``python tests/_accelerate_train.py OUT_DIR``: every rank trains a small model for TOTAL steps uninterrupted; then
trains another for STOP steps, ``accelerator.save_state``, builds everything afresh, ``accelerator.load_state`` and
continues to TOTAL. Each rank writes ``OUT_DIR/rank{r}.json`` (what the hook did, whether both runs ended with the same
parameters bitwise) and the checkpoint folder lists its files.
"""

import json
import os
import sys
import warnings

import torch

torch.set_num_threads(1)

from accelerate import Accelerator, debug_launcher  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from powersgd_triton import PowerSGDState, powerSGD_hook  # noqa: E402
from powersgd_triton.integrations.accelerate import register_comm_hook  # noqa: E402

TOTAL, STOP = 12, 6


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 4))


def _setup():
    accelerator = Accelerator(cpu=True)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=3, backend="torch")
    registered = register_comm_hook(accelerator, model, state, powerSGD_hook)
    return accelerator, model, optimizer, state, registered


def _steps(accelerator, model, optimizer, start, stop):
    rank = accelerator.process_index
    for i in range(start, stop):
        g = torch.Generator().manual_seed(100 * i + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
        optimizer.zero_grad()
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()


def worker(out):
    accelerator, model, optimizer, state, registered = _setup()
    _steps(accelerator, model, optimizer, 0, TOTAL)
    reference = [p.detach().clone() for p in model.parameters()]
    rate, before, after = state.compression_stats()
    report = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.name,
        "registered": registered,
        "comm_hook": model._get_ddp_logging_data().get("comm_hook"),
        "iter": state.iter,
        "stats": [rate, before, after],
    }

    accelerator, model, optimizer, state, _ = _setup()
    _steps(accelerator, model, optimizer, 0, STOP)
    ckpt = os.path.join(out, "ckpt")
    accelerator.save_state(ckpt)
    accelerator.wait_for_everyone()
    accelerator, model, optimizer, state, _ = _setup()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.load_state(ckpt)
        report["loaded_iter"] = state.iter
        _steps(accelerator, model, optimizer, STOP, TOTAL)
    report["resumed_iter"] = state.iter
    report["resumed_equal"] = all(torch.equal(a, b) for a, b in zip(reference, model.parameters()))
    report["warnings"] = [str(w.message) for w in caught if "PowerSGD" in str(w.message)]
    report["ckpt_files"] = sorted(os.listdir(ckpt))
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    debug_launcher(worker, args=(sys.argv[1],), num_processes=2)
