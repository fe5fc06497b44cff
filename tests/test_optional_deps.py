"""The package runs with only torch, triton and numpy: every other module it imports is blocked here.

The GPU image has no platformdirs and no package index; the first compressed CUDA step used to crash in
``Tuner.configs_for_layout -> ConfigCache() -> import platformdirs``. In a subprocess (nothing leaks into this one),
``sys.modules[name] = None`` for every non-core module the package's source imports (found by parsing it, plus
platformdirs, filelock, tqdm by name), then: the tuner tunes (injected timings) and writes the JSON cache into the
documented fallback folder ``$XDG_CACHE_HOME/powersgd_triton`` under the fallback lock, a fresh tuner reads it back;
``powerSGD_hook`` (against PyTorch's hook) and ``batched_powerSGD_hook`` (against the exact answer for a bucket whose
s x s view has rank 2) run compressed steps on the Triton backend (interpreter) with configs from that tuner and
cache; ``autotune --show`` / ``--model`` and the training log run without tqdm.
"""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _deadline import scaled

REPO = Path(__file__).resolve().parents[1]
CORE = {"torch", "triton", "numpy", "powersgd_triton"}
ALWAYS_BLOCKED = {"platformdirs", "filelock", "tqdm"}


def non_core_imports() -> set:
    """Top-level modules imported anywhere in the package that are neither the standard library nor core."""
    found = set()
    for path in (REPO / "powersgd_triton").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found |= {n.split(".")[0] for n in names}
    return {m for m in found if m not in sys.stdlib_module_names and m not in CORE}


def test_the_scan_sees_the_optional_helpers():
    assert {"platformdirs", "filelock", "tqdm"} <= non_core_imports() | ALWAYS_BLOCKED
    assert not (non_core_imports() & CORE)


SCRIPT = textwrap.dedent(
    r"""
    import json, os, sys
    blocked = json.loads(sys.argv[1])
    seed = int(sys.argv[2])
    for name in blocked:
        sys.modules[name] = None  # `import name` now raises ImportError
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from powersgd_triton import PowerSGDState, autotune, batched_powerSGD_hook, powerSGD_hook
    from powersgd_triton import benchmarking as B
    from powersgd_triton import cli
    from powersgd_triton.autotune.cache import default_cache_dir
    from powersgd_triton.autotune.keys import DeviceKey
    from powersgd_triton.autotune.tuner import Tuner, candidates
    from powersgd_triton.ops import configs
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    for name in blocked:
        try:
            __import__(name)
        except ImportError:
            pass
        else:
            raise AssertionError(f"{name} was not blocked")
    report = {"cache_dir": default_cache_dir()}
    gen = torch.Generator().manual_seed(seed)
    device = DeviceKey("blocked_modules_gpu", "sm90", "x")
    heuristic = {}

    def timer(kernel, config, sc):  # the interpreter's own config wins: the hook then runs it
        return 1.0 if config == configs.heuristic_config(kernel, None, torch.float32) else 2.0

    autotune.set_tuner(Tuner(timer=timer, device=device))  # default cache: the fallback folder and lock
    B.ensure_process_group("gloo")

    def run(hook, state, shapes, data, steps):
        params = B.FakeGradBucket(data.clone(), shapes).parameters()  # the same parameters at every step, as DDP
        outs = []
        for _ in range(steps):
            bucket = B.FakeGradBucket(data.clone(), shapes, parameters=params)
            outs.append(hook(state, bucket).wait().clone())
        return outs

    # powerSGD_hook vs PyTorch's, 2 plain steps then 2 compressed ones (world size 1)
    shapes = [(24, 32), (8,), (16, 4, 3, 3), (32, 24)]
    n = sum(int(torch.Size(s).numel()) for s in shapes)
    data = torch.randn(n, generator=gen)
    kw = dict(matrix_approximation_rank=2, start_powerSGD_iter=2)
    ours = run(powerSGD_hook, PowerSGDState(None, backend="triton", autotune=True, **kw), shapes, data, 4)
    theirs = run(torch_psgd.powerSGD_hook, torch_psgd.PowerSGDState(None, **kw), shapes, data, 4)
    report["layerwise_rel_err"] = [float((a.double() - b.double()).norm() / b.double().norm())
                                   for a, b in zip(ours, theirs)]
    report["layerwise_finite"] = all(bool(torch.isfinite(o).all()) for o in ours)

    # batched_powerSGD_hook: 552 = 24 * 23 elements, viewed as 24 x 24 with one zero padding row; the data is a
    # rank-2 matrix, so the rank-2 approximation P P^T M is M itself (exact answer, float64)
    s = 24
    u = torch.randn(s - 1, 2, generator=gen, dtype=torch.float64)
    v = torch.randn(s, 2, generator=gen, dtype=torch.float64)
    m64 = (u @ v.t()).reshape(-1)
    bstate = PowerSGDState(None, backend="triton", autotune=True, **kw)
    bout = run(batched_powerSGD_hook, bstate, [(m64.numel(),)], m64.float(), 3)
    report["batched_rel_err"] = float((bout[-1].double() - m64).norm() / m64.norm())
    report["tuned"] = autotune.get_tuner().stats["tuned"]

    # what was tuned is in the cache file, and a fresh tuner (fresh process state) reads it from there
    path = os.path.join(default_cache_dir(), "autotune-cache.json")
    with open(path) as f:
        report["cache_entries"] = len(json.load(f)["devices"][device.key]["entries"])
    from powersgd_triton.layout import BucketLayout

    grads = [torch.zeros(s_) for s_ in shapes]
    flat = torch.zeros(n)
    off = 0
    views = []
    for s_ in shapes:
        k = int(torch.Size(s_).numel())
        views.append(flat[off:off + k].view(s_))
        off += k
    layout = BucketLayout.from_gradients(flat, views, 2, 2.0)
    fresh = Tuner(timer=lambda *a: 5.0, device=device)
    report["fresh_sources"] = sorted({fresh.choose(k, layout, torch.float32).source for k in autotune.KERNELS})

    # the CLI's progress bars without tqdm
    report["cli_show"] = cli.main(["autotune", "--show"])
    report["cli_model"] = cli.main(["autotune", "--model", "resnet50", "--matrix-approximation-rank", "4",
                                   "--dtype", "fp32"])
    from powersgd_triton.train import loop

    log = loop._Log(True, True)
    bar = log.bar(total=3, desc="x")
    bar.update(1)
    bar.set_postfix(loss="1.0")
    bar.close()
    log.line("epoch line without tqdm")
    report["still_blocked"] = sorted(n_ for n_ in blocked if sys.modules.get(n_, 0) is None)
    print("REPORT " + json.dumps(report))
    """
)


@pytest.mark.timeout(300)
def test_compressed_steps_tuner_and_cache_without_optional_modules(tmp_path, rng):
    blocked = sorted(non_core_imports() | ALWAYS_BLOCKED)
    seed = int(torch_seed(rng))
    script = tmp_path / "blocked.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("POWERSGD_TRITON_")}
    env.update(PYTHONPATH=str(REPO), XDG_CACHE_HOME=str(tmp_path / "xdg"), HOME=str(tmp_path / "home"),
               TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), json.dumps(blocked), str(seed)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=scaled(280))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")][-1]
    r = json.loads(line[len("REPORT "):])
    assert r["cache_dir"] == str(tmp_path / "xdg" / "powersgd_triton")
    assert r["layerwise_finite"]
    assert max(r["layerwise_rel_err"][:2]) == 0.0  # the plain all-reduce steps
    assert max(r["layerwise_rel_err"][2:]) < 1e-5, r["layerwise_rel_err"]  # compressed: PyTorch's numbers
    assert r["batched_rel_err"] < 1e-5, r
    assert r["tuned"] > 0 and r["cache_entries"] > 0
    assert r["fresh_sources"] == ["cache"]
    assert r["cli_show"] == 0 and r["cli_model"] == 0
    assert "epoch line without tqdm" in proc.stdout
    assert r["still_blocked"] == blocked


def torch_seed(gen) -> int:
    import torch

    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
