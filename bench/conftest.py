"""Benchmark setup: options, parametrization, and the side-by-side ratio tables printed at the end of the run.

Run (CPU, full table)::

    PYTHONPATH=. python -m pytest bench/ --benchmark-only

Smoke set for CI (tiny shapes, every benchmark body runs once, no timing)::

    PYTHONPATH=. python -m pytest bench/ --quick --benchmark-disable

Options: ``--bench-models resnet50,gpt2`` ``--bench-matrix-approximation-ranks 1,4,16`` ``--bench-dtypes fp32,bf16``
``--bench-kernels project,reconstruct`` ``--bench-rounds 3`` ``--bench-report FILE.md`` (writes the ratio tables) and
``--bench-skip-kernels`` / ``--bench-skip-hooks``. ``POWERSGD_BENCH_THREADS=N`` sets torch's CPU threads.

Speed is never asserted: the tables are printed (pytest-benchmark's, and ours with the PyTorch/ours ratio of the
medians measured in this same run, plus the counts).
"""

import os
import sys

import torch

# Before triton is imported anywhere: on a machine without CUDA the Triton kernels run in the interpreter, which the
# launch counts of our Triton backend use (launches counted, kernels not executed).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("POWERSGD_BENCH_THREADS"):
    torch.set_num_threads(int(os.environ["POWERSGD_BENCH_THREADS"]))

import pytest  # noqa: E402

from powersgd_triton import benchmarking as B  # noqa: E402

# The hang detectors scale with the machine's load, as the tests' do (tests/_deadline.py; tests/conftest.py registers
# the same timer when both folders run: the first answer wins).
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from _deadline import pytest_timeout_set_timer  # noqa: E402,F401 - pytest-timeout's timer, load-scaled

FULL = dict(models=("resnet50", "bert-base", "gpt2", "vit-b16"), ranks=(1, 4, 16), dtypes=("fp32", "bf16"))
QUICK = dict(models=("resnet50",), ranks=(4,), dtypes=("fp32", "bf16"))
QUICK_SHRINK = 8  # channel dims / 8: same tensor counts, ~1/64 of the elements
QUICK_BUCKET_MB = 0.5  # keeps several buckets at that size
QUICK_FIRST_BUCKET_MB = 0.02


def pytest_addoption(parser):
    g = parser.getgroup("powersgd_triton benchmarks")
    g.addoption("--quick", action="store_true", default=False,
                help="smoke set: ResNet-50 shapes shrunk 8x, rank 4, fp32 and bf16 (no timing claims)")
    g.addoption("--bench-models", default=None, help="comma list of models (resnet50,bert-base,gpt2,vit-b16)")
    g.addoption("--bench-matrix-approximation-ranks", "--bench-ranks", dest="bench_ranks", default=None,
                help="comma list of PowerSGD matrix approximation ranks r (default 1,4,16; --bench-ranks: old name)")
    g.addoption("--bench-dtypes", default=None, help="comma list of fp32,bf16,fp16 (default fp32,bf16)")
    g.addoption("--bench-kernels", default=None, help="comma list of bucket kernels")
    g.addoption("--bench-rounds", type=int, default=3, help="timed rounds per benchmark (default 3)")
    g.addoption("--bench-report", default=None, help="also write the ratio tables (markdown) to this file")
    g.addoption("--bench-skip-kernels", action="store_true", default=False)
    g.addoption("--bench-skip-hooks", action="store_true", default=False)


class BenchConfig:
    def __init__(self, config):
        opt = config.getoption
        self.quick = opt("--quick")
        base = QUICK if self.quick else FULL

        def pick(name, default, conv=str):
            raw = opt(name)
            return tuple(conv(x) for x in raw.split(",") if x) if raw else default

        self.models = pick("--bench-models", base["models"])
        self.ranks = pick("bench_ranks", base["ranks"], int)
        self.dtypes = pick("--bench-dtypes", base["dtypes"])
        self.kernels = pick("--bench-kernels", B.KERNELS)
        self.rounds = 1 if self.quick else max(1, opt("--bench-rounds"))
        self.report = opt("--bench-report")
        self.skip_kernels = opt("--bench-skip-kernels")
        self.skip_hooks = opt("--bench-skip-hooks")
        self.shrink = QUICK_SHRINK if self.quick else 1
        self.bucket_mb = QUICK_BUCKET_MB if self.quick else 25.0
        self.first_bucket_mb = QUICK_FIRST_BUCKET_MB if self.quick else B.DDP_FIRST_BUCKET_MB
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.backend = "triton" if self.device.type == "cuda" else "torch"
        self.results = []  # dicts appended by the tests, tabulated at the end


def pytest_configure(config):
    config._powersgd_bench = BenchConfig(config)


@pytest.fixture(scope="session")
def bench_cfg(request):
    return request.config._powersgd_bench


def pytest_generate_tests(metafunc):
    cfg = metafunc.config._powersgd_bench
    if "hook_case" in metafunc.fixturenames:
        cases, ids = [], []
        if not cfg.skip_hooks:
            for model in cfg.models:
                for dtype in cfg.dtypes:
                    for rank in cfg.ranks:
                        for impl in B.IMPLS:
                            cases.append((model, rank, dtype, impl))
                            ids.append(f"{model}-r{rank}-{dtype}-{impl}")
        metafunc.parametrize("hook_case", cases, ids=ids)
    if "kernel_case" in metafunc.fixturenames:
        cases, ids = [], []
        if not cfg.skip_kernels:
            for model in cfg.models:
                for dtype in cfg.dtypes:
                    for rank in cfg.ranks:
                        for kernel in cfg.kernels:
                            for impl in B.IMPLS:
                                cases.append((model, rank, dtype, kernel, impl))
                                ids.append(f"{model}-r{rank}-{dtype}-{kernel}-{impl}")
        metafunc.parametrize("kernel_case", cases, ids=ids)


# ----------------------------------------------------------------------------------------------- summary tables
def _median_ms(bench):
    stats = getattr(bench, "stats", None)
    if stats is None:
        return None
    inner = getattr(stats, "stats", stats)
    med = getattr(inner, "median", None)
    return None if med is None else med * 1e3


def _paired(results, kind, key_fields):
    groups = {}
    for r in results:
        if r["kind"] != kind:
            continue
        key = tuple(r[k] for k in key_fields)
        groups.setdefault(key, {})[r["impl"]] = r
    return groups


def summary_tables(cfg) -> str:
    out = []
    hooks = _paired(cfg.results, "hook", ("model", "rank", "dtype"))
    if hooks:
        rows = []
        for (model, rank, dtype), pair in hooks.items():
            pt, ours = pair.get("pytorch"), pair.get("ours")
            row = dict(model=model, rank=rank, dtype=dtype)
            for name, r in (("pt", pt), ("ours", ours)):
                if r is None:
                    continue
                row[f"{name}_ms"] = _median_ms(r["bench"])
                row[f"{name}_ops"] = r.get("aten_compute")
                row[f"{name}_ar"] = f'{r.get("allreduce_calls")} / {B.fmt_bytes(r.get("allreduce_bytes"))}'
                row[f"{name}_held"] = B.fmt_bytes(r.get("held_bytes"))
                row[f"{name}_peak"] = B.fmt_bytes(r.get("peak_extra_bytes"))
            if ours is not None:
                row["ours_launches"] = ours.get("launches")
            if row.get("pt_ms") and row.get("ours_ms"):
                row["speedup"] = f'{row["pt_ms"] / row["ours_ms"]:.2f}x'
            rows.append(row)
        out.append("### Whole hook step (all buckets of the model), PyTorch's powerSGD_hook vs ours\n")
        out.append(B.markdown_table(rows, [
            ("model", "model"), ("rank", "r"), ("dtype", "dtype"),
            ("pt_ms", "PyTorch ms"), ("ours_ms", "ours ms"), ("speedup", "PyTorch/ours"),
            ("pt_ops", "PyTorch ATen compute ops"), ("ours_ops", "ours ATen compute ops"),
            ("ours_launches", "ours launches (Triton backend)"),
            ("pt_ar", "PyTorch all-reduces / bytes"), ("ours_ar", "ours all-reduces / bytes"),
            ("pt_held", "PyTorch held"), ("ours_held", "ours held"),
            ("pt_peak", "PyTorch peak extra"), ("ours_peak", "ours peak extra"),
        ]))
    if hooks:
        rows = []
        for (model, rank, dtype), pair in hooks.items():
            pt, ours = pair.get("pytorch", {}), pair.get("ours", {})
            indices = sorted({k for r in (pt, ours) for k in r.get("held_per_bucket", {}) if k is not None} |
                             {k for r in (pt, ours) for k in r.get("allreduce_per_bucket", {}) if k is not None})
            for i in indices:
                row = dict(model=model, rank=rank, dtype=dtype, bucket=i)
                for name, r in (("pt", pt), ("ours", ours)):
                    calls, nbytes = r.get("allreduce_per_bucket", {}).get(i, (0, 0))
                    if r:
                        row[f"{name}_ar"] = f"{calls} / {B.fmt_bytes(nbytes)}"
                        row[f"{name}_held"] = B.fmt_bytes(r.get("held_per_bucket", {}).get(i, 0))
                rows.append(row)
        out.append("\n### Per bucket: all-reduce calls / bytes and memory held by the hook state\n")
        out.append(B.markdown_table(rows, [
            ("model", "model"), ("rank", "r"), ("dtype", "dtype"), ("bucket", "bucket"),
            ("pt_ar", "PyTorch all-reduces / bytes"), ("ours_ar", "ours all-reduces / bytes"),
            ("pt_held", "PyTorch held"), ("ours_held", "ours held")]))
    kernels = _paired(cfg.results, "kernel", ("model", "rank", "dtype", "kernel"))
    if kernels:
        rows = []
        for (model, rank, dtype, kernel), pair in kernels.items():
            row = dict(model=model, rank=rank, dtype=dtype, kernel=kernel)
            for name in ("pytorch", "ours"):
                r = pair.get(name)
                if r is None:
                    continue
                ms = _median_ms(r["bench"])
                row[f"{name}_ms"] = ms
                row[f"{name}_ops"] = r.get("aten_compute")
                row["bytes"] = B.fmt_bytes(r.get("bytes"))
                row["matrices"] = r.get("matrices")
                if ms:
                    row[f"{name}_gbs"] = r["bytes"] / ms / 1e6
            if pair.get("ours") is not None:
                row["launches"] = pair["ours"].get("launches")
            if row.get("pytorch_ms") and row.get("ours_ms"):
                row["speedup"] = f'{row["pytorch_ms"] / row["ours_ms"]:.2f}x'
            rows.append(row)
        out.append("\n### Bucket kernels alone (one 25 MB bucket), PyTorch's hook code vs ours\n")
        out.append(B.markdown_table(rows, [
            ("model", "model"), ("rank", "r"), ("dtype", "dtype"), ("kernel", "kernel"), ("matrices", "matrices"),
            ("bytes", "bytes (model)"), ("pytorch_ms", "PyTorch ms"), ("ours_ms", "ours ms"),
            ("speedup", "PyTorch/ours"), ("pytorch_gbs", "PyTorch GB/s"), ("ours_gbs", "ours GB/s"),
            ("pytorch_ops", "PyTorch ATen compute ops"), ("ours_ops", "ours ATen compute ops"),
            ("launches", "ours launches (Triton backend)"),
        ]))
    return "\n".join(out)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    cfg = getattr(config, "_powersgd_bench", None)
    if cfg is None or not cfg.results:
        return
    env = B.environment(cfg.device)
    head = (f"{env['date']}; {env['cpu']} ({env['cpus_usable']} CPUs usable, torch threads {env['torch_threads']}); "
            f"python {env['python']}, torch {env['torch']}, triton {env.get('triton')}; device {cfg.device}; "
            f"ours backend {cfg.backend}; quick={cfg.quick}")
    if cfg.device.type == "cuda":
        head += f"; GPU {env.get('gpu')}"
    text = summary_tables(cfg)
    if all(_median_ms(r["bench"]) is None for r in cfg.results):
        text = "(timing disabled: counts only)\n" + text
    terminalreporter.write_sep("=", "powersgd_triton: PyTorch's hook vs ours, measured side by side in this run")
    terminalreporter.write_line(head)
    for line in text.splitlines():
        terminalreporter.write_line(line)
    if cfg.report:
        with open(cfg.report, "w") as f:
            f.write(head + "\n\n" + text + "\n")
