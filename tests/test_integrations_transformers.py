"""Transformers Trainer: ``PowerSGDCallback`` registers our hook on the Trainer's DDP, 2 gloo ranks on CPU.

A tiny GPT-2 built from a config (randomly initialised, nothing downloaded) is trained by ``transformers.Trainer`` on
a generated token dataset, once with our ``powerSGD_hook`` and once with PyTorch's ``powerSGD_hook`` on PyTorch's
``PowerSGDState``, both registered by the same callback, from the same seed. Oracle: PyTorch's run. The losses the
rank computes (a forward hook reads each step's loss) and the final parameters must agree within 1e-5 (relative;
parameters: max |a - b| / max |b| per tensor); measured 2026-12-05 (torch 2.13, transformers 5.25, SGD at lr 0.1, 8
steps): losses within 1.2e-7, parameters within 2.4e-7. A third run keeps the Trainer's default
``find_unused_parameters=True`` (where PyTorch's hook fails on gloo) with our hook.
"""

import os

import pytest
import torch

try:
    import transformers  # noqa: F401
except ImportError as exc:  # not only ModuleNotFoundError: a transformers that fails to import skips too
    pytest.skip(f"transformers does not import here ({exc})", allow_module_level=True)

from _dist import run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(240)

STEPS = 8
TOL = 1e-5


def _gpt2(seed):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _dataset(seed, n=64, length=16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (n, length), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def _train(out_dir, seed, state, hook, find_unused):
    from transformers import Trainer, TrainingArguments

    from powersgd_triton.integrations.transformers import PowerSGDCallback

    args = TrainingArguments(
        output_dir=out_dir, use_cpu=True, per_device_train_batch_size=4, max_steps=STEPS, learning_rate=0.1,
        logging_steps=1, save_strategy="no", report_to=[], seed=seed, disable_tqdm=True, dataloader_num_workers=0,
        ddp_find_unused_parameters=find_unused, optim="sgd",
    )
    model = _gpt2(seed)
    losses = []  # this rank's loss at every step, as computed (the Trainer's log rounds to 4 digits)
    model.register_forward_hook(lambda module, inputs, output: losses.append(output.loss.item()))
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(seed),
                      callbacks=[PowerSGDCallback(state, hook)])
    trainer.train()
    ddp = trainer.model_wrapped
    return {
        "ddp": type(ddp).__name__,
        "comm_hook": ddp._get_ddp_logging_data().get("comm_hook"),
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "iter": state.iter,
    }


def _worker(rank, world_size, tmp, seed):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    from powersgd_triton import PowerSGDState, powerSGD_hook

    # what accelerate reads to see a 2-process CPU run (the harness has already joined the gloo group)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    ours = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2, backend="torch")
    theirs = torch_psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    result = {
        "ours": _train(os.path.join(tmp, "ours"), seed, ours, powerSGD_hook, False),
        "pytorch": _train(os.path.join(tmp, "pytorch"), seed, theirs, torch_psgd.powerSGD_hook, False),
    }
    result["stats"] = list(ours.compression_stats())
    # the Trainer's default, find_unused_parameters=True (PyTorch's hook fails there on gloo; DDP then keeps its
    # first bucket order, so the first compressed step draws other Qs than above: no equality past it)
    default = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2, backend="torch")
    result["default"] = _train(os.path.join(tmp, "default"), seed, default, powerSGD_hook, None)
    result["default_stats"] = list(default.compression_stats())
    return result


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.no_poison  # Trainer and transformers' own torch.empty calls are not ours to check here
def test_trainer_with_our_hook_matches_pytorchs_hook(tmp_path):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    results = run_ranks(_worker, 2, tmp_path, str(tmp_path), seed, timeout=180)
    for rank, r in enumerate(results):
        ours, theirs = r["ours"], r["pytorch"]
        assert ours["ddp"] == "DistributedDataParallel" and ours["comm_hook"] == "powerSGD_hook"
        assert ours["iter"] == STEPS and theirs["iter"] == STEPS
        rate, before, after = r["stats"]
        assert rate > 1 and before > after > 0  # compressed steps ran
        assert len(ours["losses"]) == STEPS == len(theirs["losses"])
        for a, b in zip(ours["losses"], theirs["losses"]):
            assert abs(a - b) <= TOL * abs(b), (seed, ours["losses"], theirs["losses"])
        assert ours["params"].keys() == theirs["params"].keys()
        worst = max(_rel(ours["params"][n], theirs["params"][n]) for n in ours["params"])
        assert worst <= TOL, (seed, rank, worst)
        # the parameters moved (not a test of two untrained models) and both ranks agree
        start = _gpt2(seed).state_dict()
        assert any(not torch.equal(ours["params"][n], start[n]) for n in ours["params"])
        default = r["default"]
        assert default["comm_hook"] == "powerSGD_hook" and default["iter"] == STEPS
        assert r["default_stats"][0] > 1  # compressed there too
        # the warm-up steps and the first compressed one's loss (before its update) as with find_unused=False
        assert default["losses"][:3] == ours["losses"][:3]
        assert all(abs(x) < 10 for x in default["losses"])  # finite, a language model's loss at vocabulary 64: ~4.2
    for run in ("ours", "default"):
        for n in results[0][run]["params"]:
            assert torch.equal(results[0][run]["params"][n], results[1][run]["params"][n])


# ------------------------------------------------------------------ the callback alone, without a distributed run


def _shell(callback, mode, processes, model):
    """A Trainer shell (no __init__: the attributes the callback reads) with a method that fires its event. Made here:
    ``transformers.Trainer`` takes seconds to import, which collecting this file on every xdist worker would pay."""
    from types import SimpleNamespace

    class _Trainer(transformers.Trainer):
        def fire(self, callback):
            return callback.on_train_begin(None, None, None, model=self.model_wrapped)

    trainer = _Trainer.__new__(_Trainer)
    trainer.callback_handler = SimpleNamespace(callbacks=[callback])
    trainer.accelerator = SimpleNamespace(distributed_type=SimpleNamespace(name=mode), num_processes=processes,
                                          process_index=0)
    trainer.model_wrapped = model
    return trainer


def test_single_process_registers_nothing():
    from powersgd_triton import PowerSGDState
    from powersgd_triton.integrations.transformers import PowerSGDCallback

    model = torch.nn.Linear(3, 2)
    callback = PowerSGDCallback(PowerSGDState(None))
    assert _shell(callback, "NO", 1, model).fire(callback) is None
    assert callback._registered_on is None


@pytest.mark.parametrize("mode, match", [("DEEPSPEED", "DeepSpeed"), ("FSDP", "FSDP"),
                                         ("MULTI_CPU", "DistributedDataParallel")])
def test_refuses_a_trainer_without_ddp(mode, match):
    from powersgd_triton import PowerSGDState
    from powersgd_triton.integrations.transformers import PowerSGDCallback

    callback = PowerSGDCallback(PowerSGDState(None))
    with pytest.raises(TypeError, match=match):
        _shell(callback, mode, 2, torch.nn.Linear(3, 2)).fire(callback)


def test_called_by_no_trainer_raises():
    from powersgd_triton import PowerSGDState
    from powersgd_triton.integrations.transformers import PowerSGDCallback

    callback = PowerSGDCallback(PowerSGDState(None))
    with pytest.raises(RuntimeError, match="no transformers.Trainer"):
        callback.on_train_begin(None, None, None)
    other = PowerSGDCallback(PowerSGDState(None))  # a Trainer that holds another callback does not count
    with pytest.raises(RuntimeError, match="no transformers.Trainer"):
        _shell(other, "MULTI_CPU", 2, torch.nn.Linear(3, 2)).fire(callback)
