"""Autotuner tests on CPU: selection with injected timings, the JSON cache, shipped defaults, rank 0's choice.

Nothing here needs a GPU: ``timer(kernel, config, shape_class)`` replaces the device measurement. Every test gets its
own cache folder (``POWERSGD_TRITON_CACHE_DIR``), so the user's cache is never touched.
"""

import json
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py on main; must precede `import triton`

import pytest
import torch

from _deadline import scaled

import powersgd_triton

from powersgd_triton import autotune
from powersgd_triton.autotune import cache as cache_mod
from powersgd_triton.cli import autotune_run as at_cli
from powersgd_triton.autotune import tuner as tuner_mod
from powersgd_triton.autotune.cache import CacheWarning, ConfigCache, export_device_file
from powersgd_triton.autotune.keys import DeviceKey, ShapeClass, device_key, normalize_gpu_name, shape_class
from powersgd_triton.autotune.tuner import KERNELS, AutotuneWarning, Tuner, candidates
from powersgd_triton.layout import BucketLayout

from _dist import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


pytestmark = pytest.mark.usefixtures("isolated_autotune")  # tests/conftest.py: a cache folder per test


def make_layout(shapes=((64, 32), (32,), (128, 64), (16, 16, 3, 3)), rank=4, dtype=torch.float32):
    total = sum(int(torch.Size(s).numel()) for s in shapes)
    buf = torch.zeros(total, dtype=dtype)
    grads, off = [], 0
    for s in shapes:
        n = int(torch.Size(s).numel())
        grads.append(buf[off : off + n].view(s))
        off += n
    return BucketLayout.from_gradients(buf, grads, rank, 2.0)


def fake_device(gpu="fake_h200"):
    return DeviceKey(gpu, "sm90", "3.9.0")


class FakeTimer:
    """Deterministic timings: configs for which ``prefer(kernel, config)`` holds take 1 ms, others 2-3 ms."""

    def __init__(self, prefer, fail=lambda k, c: False):
        self.prefer, self.fail, self.calls = prefer, fail, []

    def __call__(self, kernel, config, sc):
        self.calls.append((kernel, dict(config), sc.key))
        if self.fail(kernel, config):
            raise RuntimeError("out of resources (fake)")
        if self.prefer(kernel, config):
            return 1.0
        return 2.0 + (len(json.dumps(config, sort_keys=True)) % 7) / 10


def tile(c):
    """The config's largest block size (the row block of project/reconstruct can be 4-64 wide, its K block wider)."""
    return max(v for k, v in c.items() if k.startswith("BLOCK"))


def _project_t_broadcast(kernel, c):
    """project_t's broadcast space (padded rank <= 8) has only 4 warps and 256-1024 column tiles
    (``configs._PROJECT_T_TILES``): the preferences below take one of its configs, present at every rank <= 8."""
    return kernel == "project_t" and not c.get("USE_DOT", False)


def prefer_64_w8(kernel, c):
    if _project_t_broadcast(kernel, c):
        return (c["BLOCK_M"], c["BLOCK_K"], c.get("PREFETCH", 0), c.get("maxnreg")) == (256, 4, 0, 96)
    if kernel == "orthogonalize":  # (its candidates at R 4: 32-1024 rows, 4-16 warps)
        return c["BLOCK"] == 256 and c["num_warps"] == 8
    return tile(c) == 64 and c["num_warps"] == 8


def prefer_128_w4(kernel, c):
    if _project_t_broadcast(kernel, c):
        return (c["BLOCK_M"], c["BLOCK_K"], c.get("PREFETCH", 0), c.get("maxnreg")) == (512, 2, 0, 96)
    if kernel == "orthogonalize":
        return c["BLOCK"] == 32 and c["num_warps"] == 4
    return tile(c) == 128 and c["num_warps"] == 4 and not c.get("USE_DOT", False)


# ---------------------------------------------------------------------------------------------------------- keys
def test_shape_class_keys():
    lay = make_layout()
    sc = shape_class("project", lay, torch.bfloat16)
    assert ShapeClass.parse(sc.key) == sc
    assert (sc.kernel, sc.dtype, sc.rank, sc.batched) == ("project", "bf16", 4, False)
    # typical n, m: the numel-weighted median matrix is the 128x64 one; work = all compressed elements
    assert (sc.n, sc.m, sc.work) == (7, 6, 14)
    orth = shape_class("orthogonalize", lay, torch.bfloat16)
    assert (orth.n, orth.m) == (7, 7)  # largest n = 128, largest m = 16*3*3 = 144 -> round(7.17)
    assert orth.work == 2  # three matrices -> round(log2 3)
    assert shape_class("project", make_layout(rank=3), torch.bfloat16).rank == 4  # padded rank
    assert shape_class("project", make_layout(rank=8), torch.bfloat16) != sc
    assert shape_class("project", lay, torch.float32) != sc
    batched = BucketLayout.batched(10000, 4, "cpu", torch.bfloat16)
    bsc = shape_class("reconstruct", batched, torch.bfloat16)
    assert bsc.batched and bsc.n == bsc.m == 7 and bsc.work == 13
    with pytest.raises(ValueError):
        ShapeClass.parse("project|bf16|garbage")


def test_device_names_and_override(monkeypatch):
    assert normalize_gpu_name("NVIDIA H200") == "h200"
    assert normalize_gpu_name("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    assert normalize_gpu_name("NVIDIA A100-SXM4-80GB") == "a100_sxm4_80gb"
    assert normalize_gpu_name("NVIDIA GeForce RTX 4090") == "rtx_4090"
    monkeypatch.setenv("POWERSGD_TRITON_GPU_NAME", "NVIDIA H200 NVL")
    dk = device_key()
    assert dk.gpu == "h200_nvl"
    assert dk.library.startswith(powersgd_triton.__version__ + "+")  # version + kernel source hash
    assert f"triton-{dk.triton}" in dk.key and "powersgd_triton-" in dk.key


# ----------------------------------------------------------------------------------------------------- selection
def test_selection_picks_fastest_and_remembers(tmp_path):
    timer = FakeTimer(prefer_64_w8)
    tuner = Tuner(cache=ConfigCache(str(tmp_path / "c")), timer=timer, device=fake_device())
    lay = make_layout()
    choices = tuner.select(lay, torch.bfloat16, autotune=True)
    for k, c in choices.items():
        cands, heuristic = candidates(k, lay, torch.bfloat16)
        assert c.source == "tuned" and prefer_64_w8(k, c.config), (k, c.config)
        assert c.config == next(x for x in cands if prefer_64_w8(k, x))  # first of the equally fast ones
        assert len([call for call in timer.calls if call[0] == k]) == len(cands)
        assert heuristic in cands
        assert c.time_ms == 1.0 and c.heuristic_ms >= 2.0 and c.speedup == c.heuristic_ms
    n_calls = len(timer.calls)
    again = tuner.configs_for_layout(lay, torch.bfloat16, autotune=True)
    assert len(timer.calls) == n_calls  # memory, no new timing
    assert again == {k: c.config for k, c in choices.items()}
    data = json.load(open(tmp_path / "c" / "autotune-cache.json"))
    entries = data["devices"][fake_device().key]["entries"]
    assert set(entries) == {shape_class(k, lay, torch.bfloat16).key for k in KERNELS}


def test_failing_candidates_and_no_tuning_unless_asked(tmp_path):
    lay = make_layout()
    timer = FakeTimer(prefer_64_w8, fail=lambda k, c: tile(c) == 64)  # the preferred ones fail to compile
    tuner = Tuner(cache=False, timer=timer, device=fake_device())
    c = tuner.choose("project", lay, torch.float32, autotune=True)
    assert c.source == "tuned" and tile(c.config) != 64 and c.time_ms < float("inf")

    timer = FakeTimer(prefer_64_w8, fail=lambda k, c: True)
    tuner = Tuner(cache=False, timer=timer, device=fake_device())
    with pytest.warns(AutotuneWarning, match="every candidate"):
        c = tuner.choose("reconstruct", lay, torch.float32, autotune=True)
    assert c.source == "heuristic" and c.config == candidates("reconstruct", lay, torch.float32)[1]

    timer = FakeTimer(prefer_64_w8)
    tuner = Tuner(cache=ConfigCache(str(tmp_path / "c")), timer=timer, device=fake_device())
    c = tuner.choose("project", lay, torch.float32)  # autotune=False: first step never pays for tuning
    assert c.source == "heuristic" and not timer.calls
    assert not (tmp_path / "c" / "autotune-cache.json").exists()


def test_no_scratch_memory_falls_back_to_heuristic(monkeypatch):
    from powersgd_triton.autotune import tuner as tuner_mod

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("fake: no memory for scratch buffers")

    monkeypatch.setattr(tuner_mod, "_Workload", oom)
    tuner = Tuner(cache=False, bench=lambda fn: 1.0, device=fake_device())
    lay = make_layout()
    with pytest.warns(AutotuneWarning, match="no scratch buffers"):
        c = tuner.choose("project", lay, torch.float32, autotune=True)
    assert c.source == "heuristic" and c.config == candidates("project", lay, torch.float32)[1]


def test_stale_cached_config_is_ignored(tmp_path):
    lay = make_layout()
    dk = fake_device()
    cache = ConfigCache(str(tmp_path / "c"))
    sc = shape_class("project", lay, torch.float32)
    cache.put(dk, sc.key, {"config": {"BLOCK_N": 48, "BLOCK_K": 7, "USE_DOT": False, "num_warps": 4,
                                      "num_stages": 1}})
    c = Tuner(cache=ConfigCache(str(tmp_path / "c")), timer=FakeTimer(prefer_64_w8), device=dk).choose(
        "project", lay, torch.float32)
    assert c.source == "heuristic"


# ---------------------------------------------------------------------------------------------------------- cache
def test_cache_is_keyed_per_gpu_model(tmp_path):
    lay = make_layout()
    folder = str(tmp_path / "c")
    a, b = fake_device("fake_a100"), fake_device("fake_h200")
    ta = Tuner(cache=ConfigCache(folder), timer=FakeTimer(prefer_64_w8), device=a)
    tb = Tuner(cache=ConfigCache(folder), timer=FakeTimer(prefer_128_w4), device=b)
    ca = ta.choose("project", lay, torch.bfloat16, autotune=True).config
    cb = tb.choose("project", lay, torch.bfloat16, autotune=True).config
    assert ca != cb
    data = json.load(open(os.path.join(folder, "autotune-cache.json")))
    assert set(data["devices"]) == {a.key, b.key}
    assert data["devices"][a.key]["device"]["gpu"] == "fake_a100"
    # fresh tuners read their own model's entry, without timing
    for dk, expected in ((a, ca), (b, cb)):
        t = FakeTimer(prefer_64_w8)
        c = Tuner(cache=ConfigCache(folder), timer=t, device=dk).choose("project", lay, torch.bfloat16, autotune=True)
        assert (c.source, c.config, t.calls) == ("cache", expected, [])
    # another library or triton version does not reuse them
    other = DeviceKey("fake_a100", "sm90", "3.9.0", library="9.9.9")
    t = FakeTimer(prefer_128_w4)
    c = Tuner(cache=ConfigCache(folder), timer=t, device=other).choose("project", lay, torch.bfloat16, autotune=True)
    assert c.source == "tuned" and t.calls


READER = r"""
import json, sys, torch
from powersgd_triton.autotune.cache import ConfigCache
from powersgd_triton.autotune.keys import DeviceKey
from powersgd_triton.autotune.tuner import Tuner
from powersgd_triton.layout import BucketLayout
shapes = ((64, 32), (32,), (128, 64), (16, 16, 3, 3))
total = sum(torch.Size(s).numel() for s in shapes)
buf = torch.zeros(total)
grads, off = [], 0
for s in shapes:
    n = torch.Size(s).numel(); grads.append(buf[off:off + n].view(s)); off += n
lay = BucketLayout.from_gradients(buf, grads, 4, 2.0)
def timer(*a):
    raise AssertionError("timed although cached")
t = Tuner(cache=ConfigCache(sys.argv[1]), timer=timer, device=DeviceKey("fake_h200", "sm90", "3.9.0"))
print(json.dumps({k: [c.source, c.config] for k, c in t.select(lay, torch.bfloat16, autotune=True).items()}))
"""


def test_reload_across_processes(tmp_path):
    folder = str(tmp_path / "c")
    lay = make_layout()
    tuner = Tuner(cache=ConfigCache(folder), timer=FakeTimer(prefer_128_w4), device=fake_device())
    mine = {k: c.config for k, c in tuner.select(lay, torch.bfloat16, autotune=True).items()}
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", READER, folder], env=env, capture_output=True, text=True,
                         timeout=scaled(120), cwd=REPO)
    assert out.returncode == 0, out.stderr
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    assert {k: v[1] for k, v in theirs.items()} == mine
    assert {v[0] for v in theirs.values()} == {"cache"}


@pytest.mark.parametrize(
    "content",
    ["{not json", '{"format": 1, "devices": {"x": {"entries": {"k": {"config"', "[1, 2, 3]",
     '{"format": 99, "devices": {}}', '{"format": 1, "devices": {"x": {"entries": {"k": 5}}}}', b"\xff\xfe\x00"],
    ids=["garbage", "truncated", "list", "format", "entry", "binary"],
)
def test_corrupt_cache_is_set_aside(tmp_path, content):
    folder = tmp_path / "c"
    folder.mkdir()
    path = folder / "autotune-cache.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    lay = make_layout()
    tuner = Tuner(cache=ConfigCache(str(folder)), timer=FakeTimer(prefer_64_w8), device=fake_device())
    with pytest.warns(CacheWarning, match="unreadable"):
        c = tuner.choose("project", lay, torch.float32, autotune=True)
    assert c.source == "tuned"
    aside = [p for p in os.listdir(folder) if ".corrupt-" in p]
    assert len(aside) == 1
    assert (folder / aside[0]).read_bytes() == (content if isinstance(content, bytes) else content.encode())
    data = json.loads(path.read_text())
    assert list(data["devices"][fake_device().key]["entries"]) == [c.shape_class.key]


def test_unusable_cache_folder_does_not_crash(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    tuner = Tuner(cache=ConfigCache(str(blocker / "sub")), timer=FakeTimer(prefer_64_w8), device=fake_device())
    with pytest.warns(CacheWarning, match="in memory only"):
        c = tuner.choose("project", make_layout(), torch.float32, autotune=True)
    assert c.source == "tuned"
    assert tuner.choose("project", make_layout(), torch.float32).config == c.config


# -------------------------------------------------------------------------------------------------- distributed
def _rank_tuner(rank, world_size, out_dir):
    """Rank 0's fake timings prefer BLOCK 64 / 8 warps, rank 1's BLOCK 128 / 4 warps."""
    import torch.distributed as dist

    timer = FakeTimer(prefer_64_w8 if rank == 0 else prefer_128_w4)
    tuner = Tuner(cache=ConfigCache(os.path.join(out_dir, f"cache{rank}")), timer=timer, device=fake_device())
    lay = make_layout()
    first = tuner.configs_for_layout(lay, torch.bfloat16, autotune=True)
    again = tuner.configs_for_layout(make_layout(), torch.bfloat16, autotune=True)  # same classes
    other = tuner.configs_for_layout(make_layout(rank=16), torch.bfloat16, autotune=True)
    # the public entry point, through the process-wide tuner, on the default group
    autotune.set_tuner(tuner)
    public = autotune.configs_for_layout(lay, torch.bfloat16, torch.device("cpu"), process_group=dist.group.WORLD)
    return dict(first=first, again=again, other=other, public=public, timer_calls=len(timer.calls),
                broadcasts=tuner.stats["broadcasts"])


def test_gloo_ranks_use_rank0_choice(tmp_path):
    r0, r1 = run_ranks(_rank_tuner, 2, tmp_path, str(tmp_path))
    for k in KERNELS:
        assert prefer_64_w8(k, r0["first"][k])  # rank 0 tuned with its own timings
    for key in ("first", "again", "other", "public"):
        assert r0[key] == r1[key]  # ... and rank 1 uses exactly that, its own (different) timings unused
    assert r1["timer_calls"] == 0 and r0["timer_calls"] > 0
    assert r0["broadcasts"] == r1["broadcasts"] == 2  # once per new set of shape classes
    assert not (tmp_path / "cache1" / "autotune-cache.json").exists()
    assert (tmp_path / "cache0" / "autotune-cache.json").exists()


# ------------------------------------------------------------------------------------------------------ shipped
def test_shipped_defaults_found_by_gpu_name(tmp_path, monkeypatch):
    lay = make_layout()
    h200 = DeviceKey(normalize_gpu_name("NVIDIA H200"), "sm90", "3.6.0")
    tuned = Tuner(cache=False, timer=FakeTimer(prefer_128_w4), device=h200).select(lay, torch.bfloat16, True)
    configs = tmp_path / "configs"
    configs.mkdir()
    path = export_device_file(str(configs) + os.sep, h200, {c.shape_class.key: c.entry() for c in tuned.values()})
    assert os.path.basename(path) == "h200.json"
    (configs / "a100.json").write_text("{}")  # another model's (and broken) file is not read for an H200
    # The user's own GPU, an H200 NVL (another name, another Triton version): the h200 file serves it.
    nvl = DeviceKey(normalize_gpu_name("NVIDIA H200 NVL"), "sm90", "3.9.0")
    timer = FakeTimer(prefer_64_w8)
    tuner = Tuner(cache=ConfigCache(str(tmp_path / "c")), config_dirs=[str(configs)], timer=timer, device=nvl)
    got = tuner.select(lay, torch.bfloat16, autotune=True)
    assert {k: (c.source, c.config) for k, c in got.items()} == {k: ("shipped", c.config) for k, c in tuned.items()}
    assert not timer.calls  # exact shipped entries: no tuning even when asked
    # a nearby size class (bigger matrices) takes the nearest shipped entry when not tuning
    bigger = make_layout(shapes=((64, 32), (256, 64), (16, 16, 3, 3)))
    c = tuner.choose("project", bigger, torch.bfloat16)
    assert c.source == "shipped-nearest" and c.config == tuned["project"].config
    # another rank has no shipped entry in its family: heuristic
    assert tuner.choose("project", make_layout(rank=32), torch.bfloat16).source == "heuristic"
    # $POWERSGD_TRITON_CONFIG_DIR is searched (before the package folder)
    monkeypatch.setenv("POWERSGD_TRITON_CONFIG_DIR", str(configs))
    assert cache_mod.find_device_file("h200_nvl") == path
    assert cache_mod.find_device_file("rtx_4090") is None
    assert cache_mod.default_config_dirs()[-1] == cache_mod.PACKAGE_CONFIG_DIR


# ------------------------------------------------------------------------------------------- interpreter, no CUDA
def test_interpreter_uses_heuristic_and_says_so(monkeypatch, tmp_path):
    from powersgd_triton.ops import configs as _configs

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    lay = make_layout()
    tuner = Tuner()
    with pytest.warns(AutotuneWarning, match="TRITON_INTERPRET=1"):
        got = tuner.configs_for_layout(lay, torch.float32, autotune=True)
    assert got == _configs.INTERPRETER_CONFIGS
    assert autotune.configs_for_layout(lay, torch.float32, torch.device("cpu")) == _configs.INTERPRETER_CONFIGS
    assert not (tmp_path / "user-cache").exists()  # nothing read or written
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert autotune.configs_for_layout(lay, torch.float32, torch.device("cpu")) == {}  # torch backend


def test_no_cuda_means_no_timing(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lay = make_layout()
    tuner = Tuner(cache=False)
    ok, reason = tuner.timing_available(lay.device)
    assert not ok and "no CUDA" in reason
    with pytest.warns(AutotuneWarning, match="no CUDA"):
        c = tuner.choose("project_t", lay, torch.float16, autotune=True)
    assert c.source == "heuristic" and c.time_ms is None


def _kernels_interpreted():
    from powersgd_triton.ops import kernels

    return type(kernels.KERNEL_FUNCTIONS["project"]).__name__ == "InterpretedFunction"


@pytest.mark.skipif(not _kernels_interpreted(), reason="needs TRITON_INTERPRET=1 set before triton is imported")
@pytest.mark.parametrize("every_candidate", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["first-candidates", "every-candidate"])
def test_measurement_runs_kernels_on_rotating_scratch(monkeypatch, every_candidate):
    """The real measurement path minus do_bench: candidates run (interpreted) on scratch copies, never the bucket.
    The slow tier runs every candidate (92 of reconstruct, each checked against the torch backend: ~50 s); the quick
    tier the first three of each kernel and the heuristic."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not every_candidate:
        every = tuner_mod.candidates

        def first_candidates(kernel, layout, dtype):
            space, heuristic = every(kernel, layout, dtype)
            return space[:3] + ([heuristic] if heuristic not in space[:3] else []), heuristic

        monkeypatch.setattr(tuner_mod, "candidates", first_candidates)
    shapes = ((8, 16), (16, 8))
    total = 8 * 16 * 2
    buf = torch.randn(total)
    grads = [buf[:128].view(8, 16), buf[128:].view(16, 8)]
    lay = BucketLayout.from_gradients(buf, grads, 2, 1.0)
    before = buf.clone()
    seen = []

    def bench(fn):
        fn()  # one run per candidate: the interpreter is slow, the rotation shows over the candidates
        seen.append(fn)
        return float(len(seen))  # first candidate is "fastest"

    per_set = total * 4 + 4 * (lay.p_numel + lay.q_numel + lay.e_numel)
    tuner = Tuner(cache=False, bench=bench, device=fake_device(), rotate_bytes=3 * per_set)
    with tuner.session():
        choice = tuner.choose("reconstruct", lay, torch.float32, autotune=True)
        workload = tuner._scratch[1]
        tuner.choose("project", lay, torch.float32, autotune=True, force=True)
        assert tuner._scratch[1] is workload  # one set of scratch buffers per layout
    cands = tuner_mod.candidates("reconstruct", lay, torch.float32)[0]
    assert choice.source == "tuned" and choice.config == cands[0]
    print(f"{len(cands)} reconstruct candidates, {workload.calls} scratch runs")
    assert len(workload.sets) == 3 and workload.calls >= 2 * len(cands)
    assert torch.equal(buf, before)  # the bucket itself is never touched
    for s in workload.sets:
        assert torch.isfinite(s["buffer"]).all() and torch.isfinite(s["error"]).all()
    assert not torch.equal(workload.sets[0]["buffer"], workload.sets[1]["buffer"])  # distinct copies
    del shapes


# ---------------------------------------------------------------------------------------------------------- CLI
def test_cli_tunes_exports_shows_clears(tmp_path, monkeypatch, capsys):
    from powersgd_triton import cli

    h200 = DeviceKey("h200", "sm90", "3.9.0")
    monkeypatch.setattr(at_cli, "make_tuner", lambda args: Tuner(timer=FakeTimer(prefer_64_w8), device=h200))
    export = tmp_path / "configs"
    export.mkdir()
    assert cli.main(["autotune", "--model", "resnet50", "--matrix-approximation-rank", "4", "--dtype", "bf16",
                     "--hook", "both", "--export", str(export)]) == 0
    out = capsys.readouterr().out
    assert "| tuned" in out and "speed-up" in out and "per step" in out
    assert "no timing" not in out
    shipped = json.load(open(export / "h200.json"))
    assert shipped["format"] == 1 and shipped["device"]["gpu"] == "h200"
    keys = set(shipped["entries"])
    assert any("|batched|" in k for k in keys) and any("|layerwise|" in k for k in keys)
    assert all(prefer_64_w8(k.split("|")[0], e["config"]) for k, e in shipped["entries"].items())
    # second run: everything from the cache, nothing timed
    timer = FakeTimer(prefer_128_w4)
    monkeypatch.setattr(at_cli, "make_tuner", lambda args: Tuner(timer=timer, device=h200))
    assert cli.main(["autotune", "--model", "resnet50", "--hook", "both"]) == 0
    assert "| cache" in capsys.readouterr().out and not timer.calls
    assert cli.main(["autotune", "--show"]) == 0
    shown = capsys.readouterr().out
    assert h200.key in shown and f"{len(keys)} entries" in shown
    assert cli.main(["autotune", "--clear"]) == 0
    assert f"cleared {len(keys)} entries" in capsys.readouterr().out
    assert cli.main(["autotune", "--show"]) == 0
    assert "(empty)" in capsys.readouterr().out


@pytest.mark.parametrize("flag,what", [("--clear-verdicts", "verdicts"), ("--clear", "entries")])
def test_cli_clear_on_unusable_folder_says_not_cleared_only(flag, what, tmp_path, monkeypatch, capsys, caplog):
    """An unusable cache folder (here a file where the folder should be): "not cleared" and exit status 1, never a
    "cleared 0" after it; a usable one reports what it removed."""
    from powersgd_triton import cli
    from powersgd_triton.ops import verify

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("POWERSGD_TRITON_CACHE_DIR", str(blocker))
    with pytest.warns(CacheWarning, match="not usable") if what == "entries" else caplog.at_level("WARNING"):
        assert cli.main(["autotune", flag]) == 1
    captured = capsys.readouterr()
    assert "cleared" not in captured.out
    assert f"{what} not cleared: {blocker}" in captured.err

    folder = tmp_path / "usable"
    monkeypatch.setenv("POWERSGD_TRITON_CACHE_DIR", str(folder))
    n = 1 + int.from_bytes(os.urandom(1), "little") % 5
    if what == "verdicts":
        assert verify.store().put_many(fake_device(), {f"k{i}": {"ok": True, "kernel": "project", "config": {}}
                                                       for i in range(n)})
    else:
        ConfigCache(str(folder)).put_many(fake_device(), {f"k{i}": {"config": {"BLOCK": 64}} for i in range(n)})
    assert cli.main(["autotune", flag]) == 0
    assert f"cleared {n} {what} from {folder}" in capsys.readouterr().out


def test_cli_without_cuda_says_no_timing(monkeypatch, capsys, tmp_path):
    from powersgd_triton import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    target = tmp_path / "x.json"
    assert cli.main(["autotune", "--model", "gpt2", "--approx-rank", "4", "--dtype", "fp32",
                     "--export", str(target)]) == 1
    out = capsys.readouterr().out
    assert "no timing" in out and ("| heuristic" in out or "| interpreter" in out) and "not exporting" in out
    assert not target.exists()
    assert cli.main(["autotune"]) == 2
    for bad in (["--matrix-approximation-rank", "0"], ["--matrix-approximation-rank", "x"], ["--bucket-cap-mb", "-1"],
                ["--rep-ms", "0"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["autotune", "--model", "gpt2", *bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {bad[0]}:" in err or f"argument {bad[0]}/" in err, err  # argparse names the aliases too


# ------------------------------------------------------------------------------------------ correctness gate
@pytest.mark.skipif(not _kernels_interpreted(), reason="needs TRITON_INTERPRET=1 set before triton is imported")
def test_candidate_that_computes_wrong_numbers_is_dropped(monkeypatch, capsys):
    """The fake timer prefers one candidate, which a patched launcher makes wrong for that config only: it is
    dropped before its time counts, the next best wins, the cache entry and ``autotune --show`` say why."""
    from powersgd_triton import cli
    from powersgd_triton.autotune import tuner as tuner_mod
    from powersgd_triton.ops import projection
    from powersgd_triton.ops import verify

    lay = make_layout(shapes=((16, 8), (8,), (12, 16)), rank=2)
    cands, heuristic = candidates("project", lay, torch.float32)
    few = [c for c in cands if c != heuristic][:2] + [heuristic]
    monkeypatch.setattr(tuner_mod, "candidates", lambda k, layout, dtype: (few, heuristic))
    bad, good = few[0], few[1]
    real = projection.project

    def project(buffer, layout, q, p, error=None, *, config=None, **kw):
        real(buffer, layout, q, p, error, config=config, **kw)
        if config == bad:
            p[3] += 0.5  # one element of P off: what a race or a wrong mask would do

    monkeypatch.setattr(projection, "project", project)
    order = {json.dumps(bad, sort_keys=True): 1.0, json.dumps(good, sort_keys=True): 2.0}
    calls = []

    def fake_timer(kernel, config, sc):
        calls.append(config)
        return order.get(json.dumps(config, sort_keys=True), 3.0)

    h200 = DeviceKey("h200", "sm90", "3.9.0")
    tuner = Tuner(timer=fake_timer, device=h200, check=True, gate=verify.candidate_gate)
    choice = tuner.choose("project", lay, torch.float32, autotune=True)
    assert choice.source == "tuned" and choice.config == good  # the fastest is wrong: the second fastest wins
    assert bad not in calls and len(calls) == len(few) - 1  # the wrong one was never timed
    ((cfg, why),) = choice.rejected
    assert cfg == bad and "p: worst relative error" in why
    entry = ConfigCache().entries(h200)[choice.shape_class.key]
    assert entry["rejected"] == [{"config": bad, "why": why}]
    # without the gate (a timer and check=False: nothing runs) the wrong one would have won
    assert Tuner(cache=False, timer=fake_timer, device=h200, check=False).choose(
        "project", lay, torch.float32, autotune=True).config == bad
    assert cli.main(["autotune", "--show"]) == 0
    assert f"rejected for {choice.shape_class.key}" in capsys.readouterr().out
