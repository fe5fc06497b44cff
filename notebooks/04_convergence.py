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
# # 04 · Convergence: ours, PyTorch's hook and plain all-reduce, at PowerSGD ranks 1, 2 and 4
#
# Training runs of the train command (`powersgd-triton train --compare`, here through its Python entry point
# `run_training`): two gloo ranks, every hook from the same seed (same initial weights, same batches), on the
# `digits` workload (a small convnet on scikit-learn's 8×8 digits; SGD with momentum, cosine learning rate). For
# each PowerSGD rank $r$ ∈ {1, 2, 4} three hooks run side by side:
#
# * **ours**: `powersgd_triton.powerSGD_hook`, the drop-in for PyTorch's (three all-reduces per bucket per step:
#   uncompressed gradients, P, Q),
# * **alternating**: `powersgd_triton.alternating_powerSGD_hook`, one half power-iteration and *one* all-reduce per
#   bucket per step (P on one step, Q on the next, with the uncompressed gradients in the same buffer), so about
#   half the bytes,
# * **PyTorch**: `torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook`,
#
# and plain all-reduce is the baseline. Bytes are measured, not computed: the train loop counts every tensor that
# goes through `dist.all_reduce`.
#
# The same runs from a shell:
#
# ```
# powersgd-triton train --workload digits --world-size 2 --matrix-approximation-rank 2 --compare powersgd,alternating,reference,allreduce
# ```
#
# With `POWERSGD_NB_FULL=1` the notebook also runs the character-level LSTM (`--workload charlm`), the proxy of the
# paper's language-model experiment (a few minutes on a CPU).

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

from powersgd_triton.train import TrainConfig, run_training

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm in a kernel without ipywidgets
plt.rcParams.update({"figure.dpi": 80, "font.size": 8})

# figures for the README: written only when POWERSGD_NB_FIGURES names a folder (notebooks/execute.py sets it)
FIGURES = os.environ.get("POWERSGD_NB_FIGURES")


def save_figure(fig, name):
    if FIGURES:
        os.makedirs(FIGURES, exist_ok=True)
        fig.savefig(os.path.join(FIGURES, name + ".png"), dpi=80, bbox_inches="tight")

WORLD = 2
# one GPU per rank on CUDA (nccl); gloo ranks on CPU
DEVICE = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= WORLD else "cpu"
RANKS = (1, 2, 4)
WORKLOADS = {"digits": dict(epochs=10 if FULL else 6)}
if FULL:
    WORKLOADS["charlm"] = dict(steps=300)
print(f"device {DEVICE}, {WORLD} ranks, PowerSGD ranks {RANKS}, workloads {list(WORKLOADS)}")

# %% [markdown]
# ## Run
#
# One `run_training` call per PowerSGD rank (our two hooks and PyTorch's in the same call, from the same seed),
# all-reduce once. PyTorch's hook runs with one DDP bucket: on gloo it issues collectives from callback threads and aborts
# with several buckets; ours uses DDP's default buckets.

# %%
runs = {}  # (workload, label) -> metrics
for workload, length in WORKLOADS.items():
    for r in RANKS:
        hooks = ("powersgd", "alternating", "reference") + (("allreduce",) if r == RANKS[0] else ())
        cfg = TrainConfig(workload=workload, hooks=hooks, world_size=WORLD, matrix_approximation_rank=r, device=DEVICE,
                          progress=False, **length)
        result = run_training(cfg)
        for hook, metrics in result["runs"].items():
            name = {"powersgd": "ours", "alternating": "alternating", "reference": "PyTorch"}.get(hook)
            label = "all-reduce" if hook == "allreduce" else f"{name} r={r}"
            runs[workload, label] = metrics

# %% [markdown]
# ## Summary table
#
# Bytes per step are per rank, averaged over the compressed steps (compression starts at step 10).

# %%
for workload in WORKLOADS:
    base = runs[workload, "all-reduce"]
    metric = "final_test_bits_per_char" if workload == "charlm" else "final_test_loss"
    print(f"\n{workload}: {base['steps']} steps of batch {result['config']['batch_size']} per rank")
    print(f"{'run':15s} {'test acc':>8s} {metric.replace('final_', ''):>18s} {'bytes/step':>11s} "
          f"{'vs all-reduce':>13s} {'MiB total':>9s} {'ms/step':>8s}")
    for (w, label), m in runs.items():
        if w != workload:
            continue
        print(f"{label:15s} {m['final_test_accuracy']:8.4f} {m[metric]:18.4f} {m['allreduce_bytes_per_step']:11,.0f} "
              f"{base['allreduce_bytes_per_step'] / m['allreduce_bytes_per_step']:12.1f}x "
              f"{sum(m['allreduce_bytes']) / 2**20:9.2f} {1000 * m['seconds_per_step']:8.1f}")

# %% [markdown]
# The alternating hook sends about half the bytes of ours at the same $r$, but each step advances the power
# iteration by half a step only. Whether that pays off is a matter of accuracy at equal bytes: the alternating hook
# at rank $2r$ sends about what ours sends at rank $r$.

# %%
for workload in WORKLOADS:
    for r in RANKS:
        alt, ours = runs[workload, f"alternating r={r}"], runs[workload, f"ours r={r}"]
        line = (f"{workload} r={r}: alternating {alt['final_test_accuracy']:.4f} vs ours {ours['final_test_accuracy']:.4f} "
                f"at {alt['allreduce_bytes_per_step'] / ours['allreduce_bytes_per_step']:.2f}x the bytes")
        if r // 2 in RANKS:
            half = runs[workload, f"ours r={r // 2}"]
            line += (f"; ours at r={r // 2} ({half['allreduce_bytes_per_step'] / alt['allreduce_bytes_per_step']:.2f}x "
                     f"the alternating bytes): {half['final_test_accuracy']:.4f}")
        print(line)

# %% [markdown]
# ## Curves
#
# Left: training loss (averaged over the ranks, moving average of 10 steps). Right: test accuracy after each
# epoch. Ours (solid), alternating (dotted) and PyTorch's (dashed) at the same $r$ share a colour.

# %%
COLORS = {1: "C0", 2: "C1", 4: "C2"}


def style(label):
    if label == "all-reduce":
        return dict(color="k", lw=1.5)
    r = int(label.split("=")[1])
    ls = {"ours": "-", "alternating": ":", "PyTorch": "--"}[label.split()[0]]
    return dict(color=COLORS[r], lw=1.5 if ls == "-" else 1.2, ls=ls)


def smooth(values, k=10):
    return [sum(values[max(0, i - k + 1) : i + 1]) / len(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]


for workload in WORKLOADS:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3))
    for (w, label), m in runs.items():
        if w != workload:
            continue
        ax1.plot(smooth(m["loss"]), label=label, **style(label))
        epochs = [m["steps_per_epoch"] * (i + 1) for i in range(len(m["test_accuracy"]))]
        ax2.plot(epochs, m["test_accuracy"], marker=".", label=label, **style(label))
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    ax1.set_yscale("log")
    ax2.set_xlabel("step")
    ax2.set_ylabel("test accuracy")
    ax2.legend(fontsize=6, ncol=2)
    fig.suptitle(workload)
    fig.tight_layout()
    save_figure(fig, f"04_curves_{workload}")
    plt.show()

# %% [markdown]
# ## Accuracy against bytes communicated
#
# Test accuracy after each epoch against the bytes each rank had all-reduced by then (log scale). PowerSGD reaches
# the same accuracy as all-reduce with one to two orders of magnitude fewer bytes; ours and PyTorch's send exactly
# the same bytes, the alternating hook about half. In a run this short most of PowerSGD's total is its first 10 steps, which are plain all-reduce
# (`start_powerSGD_iter=10`); the compressed steps add little after that.

# %%
for workload in WORKLOADS:
    fig, ax = plt.subplots(figsize=(4.5, 3))
    for (w, label), m in runs.items():
        if w != workload:
            continue
        per_epoch = m["steps_per_epoch"]
        sent = [sum(m["allreduce_bytes"][: per_epoch * (i + 1)]) / 2**20 for i in range(len(m["test_accuracy"]))]
        ax.plot(sent, m["test_accuracy"], marker=".", label=label, **style(label))
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlabel("MiB all-reduced per rank (cumulative)")
    ax.set_ylabel("test accuracy")
    ax.set_title(workload)
    ax.legend(fontsize=6)
    fig.tight_layout()
    save_figure(fig, f"04_accuracy_vs_bytes_{workload}")
    plt.show()

# %% [markdown]
# ## Checks
#
# * at every $r$, ours and PyTorch's hook send the same bytes and end within 2 points of test accuracy of each other;
# * the alternating hook makes one all-reduce per bucket per step (ours three) and sends fewer bytes than ours;
# * PowerSGD's bytes grow with $r$ and stay more than 10× below all-reduce's;
# * at $r \ge 2$ our drop-in hook ends within 3 points of all-reduce's test accuracy; the alternating hook, which
#   converges more slowly in runs this short, within 5 points at $r = 4$, above 80 % at $r \ge 2$ and above 70 % at
#   $r = 1$ (one half power-iteration per step at rank 1 is still climbing after the default 6 epochs: 0.79 with
#   seed 0 on a 2-core CPU).

# %%
for workload in WORKLOADS:
    base = runs[workload, "all-reduce"]
    for r in RANKS:
        ours, ref = runs[workload, f"ours r={r}"], runs[workload, f"PyTorch r={r}"]
        alt = runs[workload, f"alternating r={r}"]
        assert ours["allreduce_bytes_per_step"] == ref["allreduce_bytes_per_step"], r
        assert abs(ours["final_test_accuracy"] - ref["final_test_accuracy"]) <= 0.02, (workload, r)
        assert alt["allreduce_bytes_per_step"] < ours["allreduce_bytes_per_step"], (workload, r)
        assert alt["allreduce_calls_per_step"] * 3 == ours["allreduce_calls_per_step"], (workload, r)
        assert base["allreduce_bytes_per_step"] > 10 * ours["allreduce_bytes_per_step"], (workload, r)
        if r >= 2:
            assert ours["final_test_accuracy"] >= base["final_test_accuracy"] - 0.03, (workload, r)
        assert alt["final_test_accuracy"] > (0.8 if r >= 2 else 0.7), (workload, r)
        if r >= 4:
            assert alt["final_test_accuracy"] >= base["final_test_accuracy"] - 0.05, (workload, r)
    sent = [runs[workload, f"ours r={r}"]["allreduce_bytes_per_step"] for r in RANKS]
    assert sent == sorted(sent), sent
print("all checks passed")
