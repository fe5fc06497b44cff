"""Unsupported callers refused with the mode named, register(), our bf16 wrapper on CPU, and import hygiene."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_wrapper as torch_bf16_wrapper
from torch.nn.parallel import DistributedDataParallel as DDP

from _deadline import scaled
from _dist import params_agree, run_ranks
from powersgd_triton import PowerSGDState, alternating_powerSGD_hook, batched_powerSGD_hook, powerSGD_hook
from powersgd_triton.integrations import check_ddp_model, register
from powersgd_triton.wrappers import bf16_compress_wrapper, fp16_compress_wrapper

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("hook", [powerSGD_hook, batched_powerSGD_hook, alternating_powerSGD_hook])
def test_hook_refuses_python_reducer_and_fsdp_arguments(hook):
    state = PowerSGDState(None, start_powerSGD_iter=2)
    grad = torch.zeros(4, 4)
    with pytest.raises(TypeError, match="python_reducer") as caught:
        hook(state, (grad, nn.Parameter(grad)))
    # one message that says what works, without pointing back at the python reducer (torch's compiled-autograd
    # error with DDP's C++ reducer points there)
    assert "compiled autograd" in str(caught.value) and "optimize_ddp='ddp_optimizer'" in str(caught.value)
    with pytest.raises(TypeError, match="FSDP"):
        hook(state, grad)
    with pytest.raises(TypeError, match="GradBucket"):
        hook(state, object())


def test_register_refuses_compiled_autograd(world1, monkeypatch):
    import torch._dynamo as dynamo

    ddp = DDP(nn.Linear(4, 4))
    monkeypatch.setattr(dynamo.config, "compiled_autograd", True)
    with pytest.raises(TypeError, match="compiled_autograd is on.*compiled_autograd = False.*ddp_optimizer"):
        register(ddp, PowerSGDState(None))
    monkeypatch.setattr(dynamo.config, "compiled_autograd", False)
    register(ddp, PowerSGDState(None))


def test_register_refuses_what_is_not_ddp():
    state = PowerSGDState(None)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        register(nn.Linear(2, 2), state)

    class FullyShardedDataParallel(nn.Module):  # stands for FSDP1 (FSDP2's FSDPModule is matched the same way)
        pass

    with pytest.raises(TypeError, match="FSDP"):
        check_ddp_model(FullyShardedDataParallel())


def _real_modes_worker(rank, world_size):
    """Real FSDP (CPU, gloo) and real compiled-DDP python reducer: register() refuses both; the hook too."""
    import torch._dynamo as dynamo
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    out = {}

    def attempt(fn):
        try:
            fn()
        except TypeError as exc:
            return str(exc)
        return None

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # NO_SHARD is deprecated
        fsdp = FSDP(nn.Linear(16, 16), sharding_strategy=ShardingStrategy.NO_SHARD, device_id=torch.device("cpu"))
    out["fsdp_register"] = attempt(lambda: register(fsdp, PowerSGDState(None)))
    fsdp.register_comm_hook(PowerSGDState(None), powerSGD_hook)  # FSDP itself does not check the hook
    out["fsdp_backward"] = attempt(lambda: fsdp(torch.randn(4, 16)).sum().backward())

    before = dynamo.config.optimize_ddp
    dynamo.config.optimize_ddp = "python_reducer"
    try:
        ddp = DDP(nn.Linear(16, 16))
    finally:
        dynamo.config.optimize_ddp = before
    out["reducer_register"] = attempt(lambda: register(ddp, PowerSGDState(None)))
    ddp.register_comm_hook(PowerSGDState(None), powerSGD_hook)
    out["reducer_backward"] = attempt(lambda: ddp(torch.randn(4, 16)).sum().backward())
    return out


def test_real_fsdp_and_python_reducer_are_refused(tmp_path):
    for r in run_ranks(_real_modes_worker, 2, tmp_path, timeout=90):
        assert r["fsdp_register"] and "FSDP" in r["fsdp_register"]
        assert r["fsdp_backward"] and "FSDP" in r["fsdp_backward"]
        assert r["reducer_register"] and "python_reducer" in r["reducer_register"]
        assert r["reducer_backward"] and "python_reducer" in r["reducer_backward"]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def _wrapper_worker(rank, world_size):
    return {which: _wrapper_run(rank, world_size, which) for which in ("torch_bf16", "bf16", "none")}


def _wrapper_run(rank, world_size, which):
    torch.manual_seed(0)
    ddp = DDP(Net())
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, backend="torch")
    out = {}
    if which == "torch_bf16":  # PyTorch refuses its own bf16 wrapper by name on CPU builds
        try:
            ddp.register_comm_hook(state, torch_bf16_wrapper(powerSGD_hook))
            out["refused"] = None
        except TypeError as exc:
            out["refused"] = str(exc)
        return out
    wrapper = {"bf16": bf16_compress_wrapper, "fp16": fp16_compress_wrapper, "none": lambda h: h}[which]
    register(ddp, state, wrapper(powerSGD_hook))
    out["logged"] = ddp._get_ddp_logging_data().get("comm_hook")
    gen = torch.Generator().manual_seed(10 + rank)
    x, y = torch.randn(32, 32, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    mem = state.buckets[0]
    out.update(
        losses=losses,
        same_on_ranks=params_agree(ddp.module, world_size),
        memory_dtypes={str(t.dtype) for t in (mem.error, mem.p, mem.q)},
        bucket_dtype=str(mem.layout.signature[2]),
        iter=state.iter,
        stats=state.compression_stats(),
        params=flat,
    )
    return out


def test_bf16_wrapper_runs_on_cpu_gloo_with_fp32_memory(tmp_path):
    results = run_ranks(_wrapper_worker, 2, tmp_path)
    refused = results[0]["torch_bf16"]["refused"]
    if torch.version.cuda is None and torch.version.hip is None:  # DDP refuses it by name on CPU-only builds
        assert refused is not None  # why ours exists (if PyTorch lifts the gate, ours is still fine)
    bf16 = [r["bf16"] for r in results]
    fp32 = results[0]["none"]
    for r in bf16:
        assert r["logged"] == "bf16_compress_wrapper.<locals>.powersgd_bf16_wrapper_hook"
        assert r["same_on_ranks"] and r["iter"] == 12 and r["stats"][0] > 1
        assert r["memory_dtypes"] == {"torch.float32"}  # error memory, P and Q stay fp32
        assert r["bucket_dtype"] == "torch.bfloat16"  # what the hook compressed
        assert r["losses"][-1] < r["losses"][0]
    # bf16 messages change the numbers a little, not the training
    diff = (bf16[0]["params"] - fp32["params"]).abs().max()
    assert 0 < diff < 0.05, float(diff)
    assert abs(bf16[0]["losses"][-1] - fp32["losses"][-1]) < 0.02 * fp32["losses"][-1]


def test_fp16_wrapper_reexport_is_pytorchs():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    assert fp16_compress_wrapper is default_hooks.fp16_compress_wrapper
    hook = bf16_compress_wrapper(powerSGD_hook)
    assert hook.__name__ not in ("bf16_compress_hook", "bf16_compress_wrapper_hook")  # DDP's CPU refusal list


def test_register_refuses_pytorchs_state_with_our_hook():
    class FakeDDP(DDP):  # isinstance passes; never constructed as a real DDP
        def __init__(self):
            nn.Module.__init__(self)

    with pytest.raises(TypeError, match="powersgd_triton.PowerSGDState"):
        register(FakeDDP(), torch_psgd.PowerSGDState(None), powerSGD_hook)


def test_package_imports_no_framework():
    code = (
        "import sys, powersgd_triton, powersgd_triton.integrations, powersgd_triton.checkpoint, "
        "powersgd_triton.wrappers\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'accelerate', "
        "'lightning_fabric', 'transformers'))\n"
        "assert not bad, bad\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=scaled(60), cwd=ROOT)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (PyTorch's bf16 wrapper is CUDA-only)")
def test_pytorch_wrappers_compose_with_our_hook_on_cuda():
    """PyTorch's fp16_compress_wrapper and bf16_compress_wrapper, and ours, around our hook on NCCL (world size 1)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "_wrappers_world1.py"), "cuda"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    import json

    rows = {r["wrapper"]: r for r in map(json.loads, proc.stdout.strip().splitlines())}
    assert set(rows) == {"torch_fp16", "torch_bf16", "ours_bf16"}
    for name, r in rows.items():
        assert r["iter"] == 8 and r["finite"] and r["loss_went_down"], r
        assert r["memory_dtypes"] == ["torch.float32"], r
        assert r["bucket_dtype"] == ("torch.float16" if name == "torch_fp16" else "torch.bfloat16"), r
    assert rows["torch_bf16"]["logged"] == "bf16_compress_wrapper.<locals>.bf16_compress_wrapper_hook"
