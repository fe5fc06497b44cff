"""``PowerSGDState(communication_dtype=, grad_scaler=)``: validation, the dtype on the wire per bucket dtype, the loss
scale read from the scaler (no host sync), and persistence (state_dict / pickling)."""

import pickle

import pytest
import torch

from powersgd_triton import PowerSGDState
from powersgd_triton.hooks import driver as _step


def _state(**kw):
    return PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, backend="torch", **kw)


@pytest.mark.parametrize("bad", [torch.int8, torch.complex64, "half", 16, torch.float8_e4m3fn])
def test_bad_communication_dtype_is_refused(bad):
    with pytest.raises(ValueError, match="communication_dtype"):
        _state(communication_dtype=bad)


@pytest.mark.parametrize("bad", [object(), "scaler", torch.tensor([1024.0])])
def test_bad_grad_scaler_is_refused(bad):
    with pytest.raises(TypeError, match="grad_scaler"):
        _state(grad_scaler=bad)


@pytest.mark.parametrize("bucket", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("comm", [None, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_wire_dtype(bucket, comm):
    state = _state(communication_dtype=comm)
    memory = torch.float64 if bucket == torch.float64 else torch.float32
    want = comm if comm is not None else bucket
    got = _step.wire_dtype(state, torch.empty(4, dtype=bucket), memory)
    assert got == (None if want == memory else want)


def test_loss_scale_is_the_scalers_tensor():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    state = _state(grad_scaler=scaler)
    buf = torch.empty(4)
    assert _step.loss_scale(state, buf) is None  # no loss scaled yet: scale 1
    scaler.scale(torch.ones(()))
    s = _step.loss_scale(state, buf)
    assert s.dtype == torch.float32 and s.numel() == 1 and float(s) == 1024.0
    assert s.data_ptr() == scaler._scale.data_ptr()  # the live tensor: no copy, no sync
    scaler.update(new_scale=512.0)
    assert float(_step.loss_scale(state, buf)) == 512.0
    assert _step.loss_scale(_state(grad_scaler=torch.amp.GradScaler("cpu", enabled=False)), buf) is None


def test_state_dict_and_pickle_round_trip():
    scaler = torch.amp.GradScaler("cpu")
    state = _state(communication_dtype=torch.bfloat16, grad_scaler=scaler)
    sd = state.state_dict()
    assert sd["config"]["communication_dtype"] == "bfloat16" and sd["unscaled_error"] is True
    torch.save(sd, buf := __import__("io").BytesIO())
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    other = _state(communication_dtype=torch.bfloat16, grad_scaler=scaler)
    other.load_state_dict(loaded)
    assert other.communication_dtype == torch.bfloat16 and other.grad_scaler is scaler
    back = pickle.loads(pickle.dumps(state))
    assert back.communication_dtype == torch.bfloat16
    assert back.grad_scaler is None  # the scaler is the training loop's: set it again (the integrations do)
    # a different dtype: warned, this state's kept
    with pytest.warns(RuntimeWarning, match="communication_dtype"):
        _state().load_state_dict(sd)


def test_unscaled_error_flag_is_checked_on_load():
    state = _state()
    sd = state.state_dict()
    sd["unscaled_error"] = True
    sd["buckets"] = {}
    _state().load_state_dict(sd)  # no memory: nothing to warn about
    with pytest.raises(ValueError, match="unscaled_error"):
        bad = dict(sd, unscaled_error="yes")
        _state().load_state_dict(bad)
