# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Quickstart: our PowerSGD hook on a DDP model, and PyTorch's in its place
#
# `powersgd_triton` is a drop-in replacement for PyTorch's PowerSGD DDP communication hook: the same
# `PowerSGDState` arguments, the same `hook(state, bucket)` signature, registered with
# `ddp_model.register_comm_hook(state, hook)`. This notebook
#
# 1. registers our hook on a DDP model in a single-process gloo group and trains a few steps,
# 2. swaps it for PyTorch's hook (one changed import) and checks that both give the same training run,
# 3. reads the compression statistics,
# 4. runs two ranks through the library's launcher: a worker defined here, then the train command's loop.
#
# The model and data are the `digits` workload of `powersgd-triton train`: a small convnet on scikit-learn's
# 8×8 handwritten digits (bundled with scikit-learn, no download).

# %% tags=["parameters"]
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # the unit tests' interpreter setting is not for the notebooks (GPU or torch)
os.environ.setdefault("OMP_NUM_THREADS", "1")
FULL = os.environ.get("POWERSGD_NB_FULL") == "1"  # bigger runs; the default is sized for CI on 2 CPU cores

# %%
try:
    import powersgd_triton  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, os.path.abspath(".."))

import warnings

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from powersgd_triton.train.data import load_workload
from powersgd_triton.train.models import build_model

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm in a kernel without ipywidgets
plt.rcParams.update({"figure.dpi": 80, "font.size": 8})

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
STEPS = 200 if FULL else 40
BATCH = 64
data = load_workload("digits", seed=0)
print(f"device {DEVICE}; digits: {len(data.x_train)} training images, {len(data.x_test)} test images; {STEPS} steps")

# %% [markdown]
# ## 1. Our hook on a DDP model (one process)
#
# A process group of one rank is enough to run DDP and its communication hook (the all-reduces are then no-ops,
# the compression is not). `start_powerSGD_iter=10`: the first 10 steps are plain all-reduce (DDP rebuilds its
# buckets after the first step), then every gradient matrix that is worth it is replaced by a rank-2 product.

# %%
dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)

from powersgd_triton import PowerSGDState, powerSGD_hook  # noqa: E402


def train(state, hook, steps=STEPS, seed=0, record_step=10):
    """A fresh seeded model under DDP with ``hook`` registered; SGD on the digits.

    Returns the losses, the model and the gradients the hook produced at step ``record_step`` (the first compressed
    one), flattened."""
    torch.manual_seed(seed)
    model = DDP(build_model("digits").to(DEVICE))
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    losses, recorded = [], None
    for step in range(steps):
        idx = torch.randint(len(data.x_train), (BATCH,), generator=g)
        x, y = data.x_train[idx].to(DEVICE), data.y_train[idx].to(DEVICE)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # DDP calls the hook here, once per gradient bucket
        if step == record_step:
            recorded = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu()
        opt.step()
        losses.append(loss.item())
    return losses, model, recorded


ours_state = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10)
ours_losses, ours_model, ours_grad = train(ours_state, powerSGD_hook)
backend = {m.backend for m in ours_state.buckets.values()}
print(f"loss {ours_losses[0]:.3f} -> {ours_losses[-1]:.3f}; our hook ran its {'/'.join(sorted(backend))} kernels; "
      f"{ours_state.iter} steps seen by the state")

# %% [markdown]
# ## 2. The same with PyTorch's hook
#
# Only the import changes. (A DDP model accepts one hook registration, so `train` builds a new one, from the same
# seed.) With the same arguments and `random_seed`, both hooks draw the same initial $Q$ and compute the same
# products: the gradients of the first compressed step agree to float rounding. Our kernels order their sums
# differently from PyTorch's `bmm`/QR, and training amplifies such last-bit differences slowly, so the two loss
# curves overlay without being bitwise equal.

# %%
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd  # noqa: E402

torch_state = torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10)
torch_losses, torch_model, torch_grad = train(torch_state, torch_powersgd.powerSGD_hook)

grad_diff = ((ours_grad - torch_grad).abs().max() / torch_grad.abs().max()).item()
weight_diff = max((a - b).abs().max().item() for a, b in zip(ours_model.parameters(), torch_model.parameters()))
loss_diff = max(abs(a - b) for a, b in zip(ours_losses, torch_losses))
print(f"first compressed step: largest gradient difference {grad_diff:.1e} (relative to the largest gradient)")
print(f"over {STEPS} steps: largest loss difference {loss_diff:.1e}, largest weight difference {weight_diff:.1e}")

fig, ax = plt.subplots(figsize=(4, 3))
ax.plot(ours_losses, label="powersgd_triton.powerSGD_hook", lw=2)
ax.plot(torch_losses, "o", ms=2.5, label="torch powerSGD_hook")
ax.axvline(10, color="gray", ls=":", lw=1)
ax.text(10.5, max(ours_losses) * 0.95, "compression starts", fontsize=7, color="gray")
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Compression statistics
#
# `state.compression_stats()` returns `(rate, numel before, numel after)`, summed over the compressed steps: the
# number of gradient elements the buckets held against the number the hook all-reduced (P and Q for the
# compressed matrices, the rest as they are). Same call, same numbers for both states.

# %%
for name, state in (("ours", ours_state), ("PyTorch's", torch_state)):
    rate, before, after = state.compression_stats()
    print(f"{name:10s} rate {rate:6.2f}x   {before:>10,d} elements before, {after:>8,d} after "
          f"({STEPS - 10} compressed steps)")

from powersgd_triton.analysis import compressed_layers  # noqa: E402

shapes = {n: tuple(p.shape) for n, p in ours_model.module.named_parameters()}
print("compressed at rank 2:", ", ".join(compressed_layers(shapes, 2)))
dist.destroy_process_group()

# %% [markdown]
# ## 4. Two ranks through the library's launcher
#
# `powersgd_triton.train.launch.launch(fn, world_size)` starts one process per rank on this machine (fork on CPU),
# hands each `fn(rank, world_size, init_method)`, returns rank 0's result and stops every rank if one fails. Fork
# lets `fn` be defined right here in the notebook (spawn would need an importable function); each rank calls
# `torch.set_num_threads(1)` first (forked thread pools can deadlock otherwise). The registration is exactly the
# single-process one: each rank builds its DDP model and registers the hook.

# %%
from powersgd_triton.train.launch import launch  # noqa: E402


def worker(rank, world_size, init_method, steps=STEPS):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = DDP(build_model("digits"))
        state = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10)
        model.register_comm_hook(state, powerSGD_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(rank)  # every rank its own batches
        losses = []
        for _ in range(steps):
            idx = torch.randint(len(data.x_train), (BATCH // world_size,), generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        # the averaged (compressed) gradients are identical on every rank, so are the weights
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(gathered, flat)
        with torch.no_grad():
            acc = (model.module(data.x_test).argmax(1) == data.y_test).float().mean().item()
        dist.barrier()
        return dict(losses=losses, stats=state.compression_stats(), accuracy=acc,
                    rank_weight_diff=max((t - flat).abs().max().item() for t in gathered))
    finally:
        dist.destroy_process_group()


two = launch(worker, 2)
print(f"2 ranks: loss {two['losses'][0]:.3f} -> {two['losses'][-1]:.3f}, test accuracy {two['accuracy']:.3f}, "
      f"compression {two['stats'][0]:.1f}x, largest weight difference between ranks {two['rank_weight_diff']:.1e}")

# %% [markdown]
# The train command does the same with its own loop (`powersgd-triton train --compare` from a shell, or
# `run_training` from Python): every hook from the same seed, bytes measured at `dist.all_reduce`. Here ours,
# PyTorch's and plain all-reduce on two ranks (`04_convergence` goes further).

# %%
from powersgd_triton.train import TrainConfig, run_training  # noqa: E402
from powersgd_triton.train.cli import format_table  # noqa: E402

cuda_ranks = DEVICE.type == "cuda" and torch.cuda.device_count() >= 2
result = run_training(TrainConfig(workload="digits", hooks=("powersgd", "reference", "allreduce"), world_size=2,
                                  matrix_approximation_rank=2, steps=STEPS * 2, device="cuda" if cuda_ranks else "cpu",
                                  progress=False))
print(format_table(result))

# %% [markdown]
# ## Checks
#
# * one compressed step: our gradients equal PyTorch's to float rounding (1e-5 of the largest), and the two training
#   runs end at the same loss (mean of the last 10 steps within 10 %);
# * the same compression statistics for both states, more than 10×;
# * two ranks: identical weights on both, the loss falls, the same bytes as PyTorch's hook and more than 10× fewer
#   than all-reduce, test accuracy within 3 points of PyTorch's hook.

# %%
assert grad_diff < 1e-5, grad_diff  # one compressed step: the same numbers to float rounding
tail_ours, tail_torch = sum(ours_losses[-10:]) / 10, sum(torch_losses[-10:]) / 10
assert abs(tail_ours - tail_torch) < 0.1 * tail_torch + 0.02, (tail_ours, tail_torch)  # the same training run
assert ours_state.compression_stats() == torch_state.compression_stats()
assert ours_state.compression_stats()[0] > 10
assert ours_losses[-1] < ours_losses[0]
assert two["rank_weight_diff"] == 0.0 and two["stats"][0] > 10 and two["losses"][-1] < two["losses"][0]
runs = result["runs"]
assert runs["powersgd"]["allreduce_bytes_per_step"] == runs["reference"]["allreduce_bytes_per_step"]
assert runs["allreduce"]["allreduce_bytes_per_step"] > 10 * runs["powersgd"]["allreduce_bytes_per_step"]
assert abs(runs["powersgd"]["final_test_accuracy"] - runs["reference"]["final_test_accuracy"]) < 0.03
print("all checks passed")
