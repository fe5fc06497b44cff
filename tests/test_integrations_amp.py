"""The Lightning and Accelerate integrations give the state their GradScaler under AMP with fp16 (2 gloo ranks).

The registration code runs as the frameworks call it (Lightning's ``_register_ddp_hooks`` with a ``16-mixed``
precision plugin; Accelerate's ``register_comm_hook`` with an accelerator whose ``scaler`` is a GradScaler), on a
real DDP model; then one scaled compressed step shows the scaler is used (error memory in unscaled units).
"""

import types

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_ranks
from powersgd_triton import PowerSGDState, powerSGD_hook
from powersgd_triton.integrations import adopt_grad_scaler

pytestmark = pytest.mark.timeout(120)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 4))


def _state():
    return PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, backend="torch")


def _lightning(rank, world_size):
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.plugins.precision import MixedPrecision

    from powersgd_triton.integrations.lightning import strategy_class

    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    state = _state()
    strategy = strategy_class("pytorch_lightning")(ddp_comm_state=state, ddp_comm_hook=powerSGD_hook,
                                                   precision_plugin=MixedPrecision("16-mixed", "cpu", scaler=scaler))
    assert pl is not None
    ddp = DDP(_model())
    strategy.model = ddp
    strategy._register_ddp_hooks()
    return state.grad_scaler is scaler, _steps(ddp, state, scaler)


def _accelerate(rank, world_size):
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    state = _state()
    from powersgd_triton.integrations.accelerate import register_comm_hook

    accelerator = types.SimpleNamespace(distributed_type=types.SimpleNamespace(name="MULTI_CPU"), num_processes=2,
                                        process_index=rank, scaler=scaler)
    ddp = DDP(_model())
    register_comm_hook(accelerator, ddp, state, powerSGD_hook, checkpoint=False)
    return state.grad_scaler is scaler, _steps(ddp, state, scaler)


def _steps(ddp, state, scaler):
    """The largest error-memory entry after 3 scaled steps (compressed from step 2)."""
    gen = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    for _ in range(3):
        ddp.zero_grad()
        scaler.scale(nn.functional.mse_loss(ddp(x), y)).backward()
    return next(iter(state.buckets.values())).error.abs().max().item()


@pytest.mark.parametrize("framework", ["lightning", "accelerate"])
def test_integrations_pass_their_grad_scaler(tmp_path, framework):
    fn = _lightning if framework == "lightning" else _accelerate
    for adopted, err_max in run_ranks(fn, 2, tmp_path, timeout=110):
        assert adopted
        # unscaled units: the error of gradients of order 1 (not of order 256, the loss scale)
        assert 0 < err_max < 10


def test_adopt_grad_scaler_rules():
    state = _state()
    off = torch.amp.GradScaler("cpu", enabled=False)
    assert not adopt_grad_scaler(state, off) and state.grad_scaler is None
    assert not adopt_grad_scaler(state, object()) and state.grad_scaler is None
    mine = torch.amp.GradScaler("cpu")
    assert adopt_grad_scaler(state, mine) and state.grad_scaler is mine
    with pytest.warns(RuntimeWarning, match="grad_scaler"):
        assert not adopt_grad_scaler(state, torch.amp.GradScaler("cpu"))
    assert state.grad_scaler is mine
