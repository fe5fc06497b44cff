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
# # 05 · Autotuning: which block sizes our kernels use, and what tuning gains over the heuristic
#
# Each of our four bucket kernels (`project`, `orthogonalize`, `project_t`, `reconstruct`) has block sizes, warps
# and pipeline stages to choose. The autotuner (`powersgd_triton.autotune`) picks them per GPU model and per
# *shape class* (kernel, gradient dtype, rank, hook kind, and the log2 sizes of the bucket's matrices), in this
# order: this process's memory, the user cache, the configs shipped in `powersgd_triton/autotune/configs/<gpu>.json`,
# live timing (only with `autotune=True`, on CUDA), the nearest tuned size class, and last a heuristic.
#
# Timing only means something on a GPU: on a CPU machine nothing is timed, and this notebook shows what would be
# used (shipped configs if there are any, else the heuristic). On a GPU it times the candidates of one model's
# shape classes (into a temporary cache, so your own is untouched) and plots the speed-up over the heuristic.

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

import glob
import json
import tempfile

import matplotlib.pyplot as plt
import torch

from powersgd_triton.autotune import KERNELS, ConfigCache, Tuner, device_key
from powersgd_triton.autotune.cache import PACKAGE_CONFIG_DIR, find_device_file, load_device_file
from powersgd_triton.cli.autotune_run import format_config, model_layouts
from powersgd_triton.autotune.keys import DeviceKey, ShapeClass, parse_dtype
from powersgd_triton.autotune.tuner import candidates
from powersgd_triton.ops import configs
from powersgd_triton.layout import BucketLayout

torch.set_num_threads(1)
plt.rcParams.update({"figure.dpi": 80, "font.size": 8})

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")
here = device_key(DEVICE if CUDA else None)
can_time, why_not = Tuner(cache=False).timing_available(DEVICE)
print(f"this device: {here.gpu} ({here.capability}), triton {here.triton}, library {here.library}")
print("timing available" if can_time else f"no timing here: {why_not}")

# %% [markdown]
# ## Shipped configs
#
# Measured results only, produced on a GPU with `powersgd-triton autotune --model ... --export
# powersgd_triton/autotune/configs/` (see that folder's README). A GPU uses the file of its own model name.

# %%
shipped_files = sorted(glob.glob(os.path.join(PACKAGE_CONFIG_DIR, "*.json")))
shipped = {}
for path in shipped_files:
    with open(path) as f:
        info = json.load(f).get("device", {})
    entries = load_device_file(path)
    shipped[os.path.basename(path)] = (info, entries)
    print(f"{os.path.basename(path)}: {len(entries)} shape classes, {info.get('name', '?')} ({info.get('capability')}),"
          f" triton {info.get('triton')}, torch {info.get('torch')}")
if not shipped:
    print("No shipped configs yet: no GPU run has been exported to powersgd_triton/autotune/configs/.\n"
          "Every GPU therefore starts from the heuristic below until it is tuned (PowerSGDState(autotune=True) or "
          "`powersgd-triton autotune`).")
h200_file = find_device_file("h200")
print("H200:", f"shipped configs in {os.path.basename(h200_file)}" if h200_file else "no shipped configs")

# %% [markdown]
# ## What the autotuner picks for a model's shape classes
#
# The gradient shapes of ResNet-50 and GPT-2 (generated from the published architectures, `powersgd_triton.shapes`),
# split into DDP's buckets (25 MB, and the 1 MB first bucket), rank 4, bf16 gradients. Two tuners answer: one for
# this device, and one for an H200 (`DeviceKey("h200", "sm90", ...)`), which reads the shipped H200 file if there is
# one. Nothing is timed here (`autotune=False`); neither tuner reads or writes your cache.

# %%
MODELS = ("resnet50", "gpt2") + (("bert-base", "vit-b16") if FULL else ())
DTYPE = torch.bfloat16
RANK = 4
layout_device = DEVICE if CUDA else torch.device("cpu")
this_tuner = Tuner(cache=False)
h200_tuner = Tuner(cache=False, device=DeviceKey("h200", "sm90", here.triton))

choices = {}  # (model, shape class key) -> (this device's choice, H200's choice, layout)
for model in MODELS:
    layouts = [lay for lay in model_layouts(model, RANK, DTYPE, "layerwise", layout_device) if lay.num_matrices]
    for lay in layouts:
        for k in KERNELS:
            mine = this_tuner.choose(k, lay, DTYPE)
            choices.setdefault((model, mine.shape_class.key), (mine, h200_tuner.choose(k, lay, DTYPE), lay))
    print(f"{model}: {len(layouts)} buckets with compressed matrices, "
          f"{sum(1 for m, _ in choices if m == model)} shape classes")

print(f"\n{'model':9s} {'kernel':13s} {'log2 n,m,work':>13s}  {'this device':24s} {'source':10s} {'H200 source':12s}")
for (model, key), (mine, h200, _) in choices.items():
    sc = mine.shape_class
    print(f"{model:9s} {sc.kernel:13s} {f'{sc.n},{sc.m},{sc.work}':>13s}  {format_config(mine.config):24s} "
          f"{mine.source:10s} {h200.source:12s}")

# %% [markdown]
# The heuristic depends only on the kernel, the rank and the dtype (broadcast-multiply tiles of about 8K products
# per program up to rank 8, tensor cores from rank 16 on). Per rank, what it picks and how many candidates the
# tuner would time instead:

# %%
RANKS = (1, 4, 16)
print(f"{'kernel':13s} {'dtype':5s} " + " ".join(f"{'r = ' + str(r) + ' (candidates)':>28s}" for r in RANKS))
for k in KERNELS:
    for dname in ("fp32", "bf16"):
        dtype, cells = parse_dtype(dname), []
        for r in RANKS:
            probe = BucketLayout.batched(4096 * 4096, r, "cpu", dtype)  # the heuristic reads only the rank
            cells.append(f"{format_config(configs.heuristic_config(k, probe, dtype))} "
                         f"({len(candidates(k, probe, dtype)[0])})")
        print(f"{k:13s} {dname:5s} " + " ".join(f"{c:>28s}" for c in cells))

# %% [markdown]
# ## Tuned against heuristic
#
# On a GPU: every shape class of ResNet-50 (rank 4, bf16) is timed now, each candidate with
# `triton.testing.do_bench` on scratch buffers, and the fastest kept. The heuristic config is always one of the
# candidates, so a tuned config is never slower than it in the same measurement. Without a GPU, the speed-ups
# recorded in the shipped files (if any) are shown instead.

# %%
timed = []  # (label, tuned ms, heuristic ms)
if can_time:
    tune_models = ("resnet50", "gpt2") if FULL else ("resnet50",)
    with tempfile.TemporaryDirectory() as tmp:
        tuner = Tuner(cache=ConfigCache(tmp), config_dirs=[], warmup_ms=10, rep_ms=40)
        with tuner.session():
            for (model, key), (_, _, lay) in choices.items():
                if model not in tune_models:
                    continue
                sc = ShapeClass.parse(key)
                c = tuner.choose(sc.kernel, lay, DTYPE, autotune=True, force=True)
                if c.time_ms is not None and c.heuristic_ms is not None:
                    timed.append((f"{model} {sc.kernel} n{sc.n} m{sc.m} w{sc.work}", c.time_ms, c.heuristic_ms))
    source = f"timed now on {here.gpu}"
else:
    for name, (info, entries) in shipped.items():
        for key, e in entries.items():
            if e.get("time_ms") and e.get("heuristic_ms"):
                timed.append((f"{info.get('gpu', name)} {key}", e["time_ms"], e["heuristic_ms"]))
    source = "from the shipped files"

if timed:
    print(f"{len(timed)} shape classes, {source}")
    for label, t, h in timed:
        print(f"  {label:60s} tuned {t:.4f} ms  heuristic {h:.4f} ms  {h / t:.2f}x")
    total_t, total_h = sum(t for _, t, _ in timed), sum(h for _, _, h in timed)
    print(f"sum over shape classes: tuned {total_t:.3f} ms, heuristic {total_h:.3f} ms, {total_h / total_t:.2f}x")
    fig, ax = plt.subplots(figsize=(5, 0.25 * len(timed) + 1))
    ax.barh(range(len(timed)), [h / t for _, t, h in timed])
    ax.set_yticks(range(len(timed)))
    ax.set_yticklabels([label for label, _, _ in timed], fontsize=6)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("speed-up of tuned over heuristic")
    ax.set_title(source)
    fig.tight_layout()
    plt.show()
else:
    print("No timings: this machine has no GPU and no shipped file holds measured configs. The speed-up of tuned "
          "over heuristic configs is measured on a GPU:\n"
          "  powersgd-triton autotune --model resnet50 --matrix-approximation-rank 4 --dtype bf16\n"
          "prints it per shape class and per step; PowerSGDState(..., autotune=True) tunes during training instead.")

# %% [markdown]
# ## Using it
#
# ```python
# state = PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=10, autotune=True)
# ddp_model.register_comm_hook(state, powerSGD_hook)
# ```
#
# With `autotune=True` the first compressed step of each new shape class times its candidates (seconds, once per
# GPU model: the result goes to the user cache); rank 0 decides and broadcasts its choice, so every rank runs the
# same configs. Without it, cached or shipped configs are used where they exist, else the heuristic.

# %% [markdown]
# ## Checks

# %%
for (model, key), (mine, h200, lay) in choices.items():
    for c in (mine, h200):
        assert c.config in candidates(c.kernel, lay, DTYPE)[0], (model, key, c.config)
    if not can_time:
        assert mine.source in ("heuristic", "shipped", "shipped-nearest", "cache", "cache-nearest"), mine.source
    if not h200_file:
        assert h200.source == "heuristic", h200.source
for name, (info, entries) in shipped.items():
    assert entries, f"{name} is empty or invalid"
for label, t, h in timed:
    assert t <= h * 1.0001, (label, t, h)  # the heuristic is a candidate of the same measurement
if CUDA:
    assert can_time and timed, "on a GPU the notebook times the candidates"
print("all checks passed")
