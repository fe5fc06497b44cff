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
# # 03 · Speed: ours vs PyTorch's hook, time per step and launches per step
#
# One *step* is the hook called on every DDP bucket of a model, as DDP does in a backward pass. The models are the
# shape sets of `bench/` (`powersgd_triton.shapes`: ResNet-50, BERT-base, GPT-2 small, ViT-B/16, generated from the
# published architectures), split into DDP's buckets (a 1 MB first bucket, then 25 MB), filled with random
# gradients; world size 1 (an in-process process group); PowerSGD rank 4, fp32, error feedback and warm start on.
# The hooks get identical buckets and are timed in turn (`powersgd_triton.benchmarking.compare_hooks`, the same
# code as `powersgd-triton bench`): PyTorch's `powerSGD_hook`, ours (`powersgd_triton.powerSGD_hook`, the drop-in)
# and our `alternating_powerSGD_hook` (one half power-iteration and one all-reduce per bucket per step).
#
# * **Time per step** is measured live on this machine. On a CPU our hook runs its torch backend (the Triton kernels
#   need a GPU): the same algorithm as PyTorch's hook in a different arrangement of ATen ops, so the CPU figures say
#   little about the GPU, where the kernels run.
# * **Launches per step** is what the grouped kernels change: PyTorch's hook issues ATen ops per matrix (and several
#   GPU kernels per QR); ours issues a fixed handful of Triton launches per bucket. On a CPU the Triton launches are
#   counted under Triton's interpreter without running the kernels (launch counts do not depend on the numbers);
#   on a GPU the profiler counts the device kernels of each hook.
# * **GPU figures** come from `bench/RESULTS.md` when it has GPU tables, with their date and machine.

# %% tags=["parameters"]
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
FULL = os.environ.get("POWERSGD_NB_FULL") == "1"  # full-size transformers and more ranks; default sized for CI

# %%
import torch

CUDA = torch.cuda.is_available()
if CUDA:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    # Only to count the Triton backend's launches without a GPU (set before triton is imported); every timing
    # below uses the torch backend, never the interpreter.
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import powersgd_triton  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, os.path.abspath(".."))

import math

import matplotlib.pyplot as plt

import powersgd_triton
from powersgd_triton import benchmarking as B
from powersgd_triton.analysis import gpu_results
from powersgd_triton.layout import should_compress
from powersgd_triton.shapes import ddp_buckets, model_shapes, numel

torch.set_num_threads(1)
plt.rcParams.update({"figure.dpi": 80, "font.size": 8})

DEVICE = torch.device("cuda" if CUDA else "cpu")
BACKEND = "auto" if CUDA else "torch"  # our hook's kernels: Triton on CUDA, the torch backend on CPU
MODELS = ("resnet50", "bert-base", "gpt2", "vit-b16")
# On a CPU in the default run the transformers' channel dims are divided by 4 (16x fewer elements, same tensors).
SHRINK = {m: 1 if (CUDA or FULL or m == "resnet50") else 4 for m in MODELS}
RANKS = (1, 4, 16) if FULL else (4,)
ROUNDS = 5 if (CUDA or FULL) else 3
pg = B.ensure_process_group()
env = B.environment(DEVICE)
print(f"{env['date']}: {env.get('gpu', env['cpu'])}, torch {env['torch']}, triton {env['triton']}, process group {pg}, "
      f"our backend {BACKEND}, {torch.get_num_threads()} thread(s)")

# %% [markdown]
# ## The shape sets
#
# Compressed matrices at rank 4: those for which $(n + m)\,r \cdot 2 < n m$ (PyTorch's rule); the rest (biases,
# norms, small tensors) are all-reduced as they are.

# %%
print(f"{'model':10s} {'tensors':>7s} {'parameters':>11s} {'buckets':>7s} {'compressed at r=4':>18s}  shrink")
for model in MODELS:
    shapes = model_shapes(model)
    buckets = ddp_buckets(shapes, 25.0, 4, first_bucket_mb=B.DDP_FIRST_BUCKET_MB)
    mats = [s for s in shapes if len(s) >= 2 and should_compress(s[0], numel(s) // s[0], min(s[0], numel(s) // s[0], 4), 2.0)[0]]
    print(f"{model:10s} {len(shapes):7d} {sum(numel(s) for s in shapes):11,d} {len(buckets):7d} {len(mats):18d}  "
          f"{'÷' + str(SHRINK[model]) if SHRINK[model] > 1 else '-'}")

# %% [markdown]
# ## Time per step, measured here

# %%
IMPLS = ("pytorch", "ours", "alternating")
NAMES = {"pytorch": "torch powerSGD_hook", "ours": "powersgd_triton powerSGD_hook",
         "alternating": "powersgd_triton alternating"}
rows = []
for model in MODELS:
    s = SHRINK[model]
    for rank in RANKS:
        rows += B.compare_hooks(model, rank, "fp32", DEVICE, backend=BACKEND, rounds=ROUNDS, shrink=s,
                                bucket_cap_mb=25.0 / s**2, first_bucket_mb=B.DDP_FIRST_BUCKET_MB / s**2,
                                impls=IMPLS[1:])

by = {(r["model"], r["matrix_approximation_rank"], r["impl"]): r for r in rows}
print(f"{'model':10s} {'r':>2s} {'buckets':>7s} {'hook':30s} {'ms (p20-p80)':>21s} {'PyTorch/this':>12s} "
      f"{'all-reduces':>11s} {'bytes':>9s}")
for model in MODELS:
    for rank in RANKS:
        for impl in IMPLS:
            o = by[model, rank, impl]
            speed = f"{o['speedup']:11.2f}x" if "speedup" in o else f"{'':12s}"
            print(f"{model:10s} {rank:2d} {o['buckets']:7d} {NAMES[impl]:30s} {o['median_ms']:8.1f} "
                  f"({o['p20_ms']:5.1f}-{o['p80_ms']:5.1f}) {speed} {o['allreduce_calls']:11d} "
                  f"{B.fmt_bytes(o['allreduce_bytes']):>9s}")

# %% [markdown]
# ## Launches per step
#
# PyTorch's hook: ATen compute ops per step (each one kernel launch or more on a GPU; a QR is several). Ours: Triton
# launches plus the few ATen ops around them (the uncompressed gradients' copy, the finiteness check, the warm-start
# commit). The alternating hook alternates a P step and a Q step: the mean of two consecutive steps. On a GPU every
# hook is also counted as device kernels by the profiler.

# %%
launches = {}
for model in MODELS:
    s = SHRINK[model]
    for rank in RANKS:
        kw = dict(bucket_cap_mb=25.0 / s**2, first_bucket_mb=B.DDP_FIRST_BUCKET_MB / s**2, shrink=s)
        entry = {"pytorch_aten": by[model, rank, "pytorch"]["aten_compute"], "buckets": by[model, rank, "ours"]["buckets"]}
        for impl in ("pytorch", "ours", "alternating") if CUDA else ("ours", "alternating"):
            if CUDA:
                step = B.HookStep(impl, B.model_buckets(model, "fp32", DEVICE, **kw), rank, backend=BACKEND).warmup(2)
                entry[f"{impl}_kernels"] = sum(B.count_cuda_kernels(step)["kernels"] for _ in range(2)) / 2
                counts = [B.count_step(step, hook_step=step) for _ in range(2)] if impl != "pytorch" else []
            else:
                buckets = B.model_buckets(model, "fp32", "cpu", generator=torch.Generator().manual_seed(1), **kw)
                with B.count_triton_launches(execute=False):
                    step = B.HookStep(impl, buckets, rank, backend="triton").warmup(2)
                counts = [B.count_step(step, hook_step=step, triton_execute=False) for _ in range(2)]
                del buckets
            if counts:
                entry[f"{impl}_triton"] = sum(c.triton_launches for c in counts) / 2
                entry[f"{impl}_aten"] = sum(c.aten_compute for c in counts) / 2
            del step
        launches[model, rank] = entry

print(f"{'model':10s} {'r':>2s} {'buckets':>7s} {'PyTorch ATen ops':>16s} {'ours: Triton + ATen':>20s} "
      f"{'alternating: Triton + ATen':>27s}" + (f" {'GPU kernels: PyTorch / ours / alternating':>42s}" if CUDA else ""))
for (model, rank), e in launches.items():
    print(f"{model:10s} {rank:2d} {e['buckets']:7d} {e['pytorch_aten']:16d} "
          f"{e['ours_triton']:9.0f} + {e['ours_aten']:<8.0f} {e['alternating_triton']:14.1f} + {e['alternating_aten']:<10.0f}"
          + (f" {e['pytorch_kernels']:21.0f} / {e['ours_kernels']:.0f} / {e['alternating_kernels']:.0f}" if CUDA else ""))

# %%
labels = [f"{m}\nr={r}" if len(RANKS) > 1 else m for m in MODELS for r in RANKS]
keys = [(m, r) for m in MODELS for r in RANKS]
x = range(len(keys))
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3))
W = 0.27
for j, impl in enumerate(IMPLS):
    label = NAMES[impl] + ("" if impl == "pytorch" else f" ({'Triton' if CUDA else 'torch backend'})")
    ax1.bar([i + (j - 1) * W for i in x], [by[m, r, impl]["median_ms"] for m, r in keys], W, label=label)
ax1.set_xticks(list(x))
ax1.set_xticklabels([f"{lab}{'÷' + str(SHRINK[m]) if SHRINK[m] > 1 else ''}" for lab, (m, r) in zip(labels, keys)])
ax1.set_ylabel(f"ms per step ({'GPU' if CUDA else 'CPU, 1 thread'})")
ax1.set_yscale("log")
ax1.set_ylim(top=8 * max(r["median_ms"] for r in rows))
ax1.legend(fontsize=6, loc="upper center")
if CUDA:
    for j, impl in enumerate(IMPLS):
        ax2.bar([i + (j - 1) * W for i in x], [launches[k][f"{impl}_kernels"] for k in keys], W, label=NAMES[impl])
    what = "GPU kernels per step"
else:
    ax2.bar([i - W for i in x], [launches[k]["pytorch_aten"] for k in keys], W, label="torch powerSGD_hook: ATen ops")
    for j, impl in ((0, "ours"), (1, "alternating")):
        triton_n = [launches[k][f"{impl}_triton"] for k in keys]
        ax2.bar([i + j * W for i in x], triton_n, W, color=f"C{j + 1}", label=f"{impl}: Triton launches")
        ax2.bar([i + j * W for i in x], [launches[k][f"{impl}_aten"] for k in keys], W, bottom=triton_n,
                color=f"C{j + 1}", alpha=0.45, label=f"{impl}: other ATen ops")
    what = "launches per step"
ax2.set_xticks(list(x))
ax2.set_xticklabels(labels)
ax2.set_ylabel(what)
ax2.set_yscale("log")
ax2.set_ylim(10, 20 * max(launches[k].get("pytorch_kernels" if CUDA else "pytorch_aten", 10) for k in keys))
ax2.legend(fontsize=6, ncol=2, loc="upper center")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## GPU measurements from `bench/RESULTS.md`

# %%
results_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(powersgd_triton.__file__))), "bench",
                            "RESULTS.md")
gpu_sections = gpu_results(results_path)
if not os.path.exists(results_path):
    print("bench/RESULTS.md is not in this checkout: no GPU figures to show.")
elif not gpu_sections:
    print("No GPU measurements in bench/RESULTS.md yet (no GPU section with tables): the GPU speed of our hook "
          "has not been measured. bench/gpu_check.py is the command that measures it on a GPU machine.")
speedups = []
for sec in gpu_sections:
    print(f"\n## {sec['heading']}  (date: {sec['date'] or '?'}; machine: {sec['machine'] or '?'})")
    for t in sec["tables"]:
        print(f"\n{t['title']}")
        print(" | ".join(t["columns"]))
        for row in t["rows"]:
            print(" | ".join(row.get(c, "") for c in t["columns"]))
        col = next((c for c in t["columns"] if c.replace(" ", "").lower() in ("pytorch/ours", "speed-up", "speedup")),
                   None)
        for row in t["rows"] if col else []:
            try:
                value = float(row[col].rstrip("x× "))
            except ValueError:
                continue
            name = " ".join(row.get(c, "") for c in t["columns"][:3] if c != col)
            speedups.append((f"{name} ({sec['date'] or '?'})", value))
if speedups:
    fig, ax = plt.subplots(figsize=(5, 0.25 * len(speedups) + 1))
    ax.barh(range(len(speedups)), [v for _, v in speedups])
    ax.set_yticks(range(len(speedups)))
    ax.set_yticklabels([n for n, _ in speedups], fontsize=6)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("PyTorch / ours (GPU, from bench/RESULTS.md)")
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ## Checks
#
# * ours and PyTorch's hook all-reduce the same number of tensors and bytes (fp32); the alternating hook one
#   all-reduce per bucket, and fewer bytes;
# * our Triton backend launches a handful of kernels per bucket (at most 8: project, two orthogonalizations,
#   project_t, reconstruct, the warm-start commit; a few more or less for the alternating hook), whatever the number
#   of matrices, and in total fewer launches than PyTorch's hook issues ATen ops (on a GPU: fewer device kernels);
# * every timing is a positive number (speed itself is not asserted: CPU timings on a shared machine swing by 2×).

# %%
for (model, rank), e in launches.items():
    p, o, a = (by[model, rank, impl] for impl in IMPLS)
    assert (p["allreduce_calls"], p["allreduce_bytes"]) == (o["allreduce_calls"], o["allreduce_bytes"]), model
    assert a["allreduce_calls"] == a["buckets"] and a["allreduce_bytes"] < o["allreduce_bytes"], model
    assert 0 < e["ours_triton"] <= 8 * e["buckets"] and 0 < e["alternating_triton"] <= 8 * e["buckets"], (model, e)
    for impl in ("ours", "alternating"):
        assert e[f"{impl}_triton"] + e[f"{impl}_aten"] < e["pytorch_aten"], (model, impl, e)
        if CUDA:
            assert e[f"{impl}_kernels"] < e["pytorch_kernels"], (model, impl, e)
    for row in (p, o, a):
        assert row["median_ms"] > 0 and math.isfinite(row["median_ms"])
print("all checks passed")
