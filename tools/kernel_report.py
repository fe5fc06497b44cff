"""The kernel report (issue 39): every launch of a compressed bucket step, read from the code compiled for sm_90.

``powersgd-triton bench --kernel-report --models resnet50,gpt2 --dtypes fp32,bf16 --rank 4 --json FILE``
(:func:`run`; the command finds this checkout's ``tools/`` through
:func:`powersgd_triton.perfmodel.checkout_tools`, as ``--model-only`` does).

For each model's full 25 MB DDP buckets (:func:`powersgd_triton.perfmodel.model_layouts`) and each launch of the
standard hook's compressed step (:func:`powersgd_triton.perfmodel.step_plan`: the heuristic configs, the variants
the hook launches, P and Q in the bucket's dtype for a 16-bit bucket), the kernel is compiled for sm_90 under the
installed Triton as its JIT compiles the launch on a GPU (:func:`tools.aot_compile.compile_aot`: 16-byte aligned
pointers marked divisible by 16; ``tests/test_aot_jit_match.py``), and read:

* ``registers``, ``spill_bytes`` (``ptxas -v``);
* ``load_bytes``, ``store_bytes``: the widest global load and store of data in the PTX (16 = ``ld.global.v4.b32``;
  elements of at most 32 bits: gradients, error memory, factors, int32 tile rows; not the int64 layout-table rows
  nor float64 Gram slots: :func:`tools.aot.ptx_access_bytes`), with ``narrowest_load_bytes`` /
  ``narrowest_store_bytes`` beside them (a kernel streams 16 bytes wide only where its narrowest access is);
* ``sass_instructions_per_element``: the warp instructions the launch issues (:func:`powersgd_triton.perfmodel.
  issued_instructions`: SASS main-loop instructions x loop trips of every program x warps per program; a kernel
  without a loop, its instructions once per program and warp) over the elements it streams (the compressed
  gradients' n x m for project, project_t and reconstruct; the packed and averaged elements for copy_segments and
  average; float32 words read for the others). The layer-wise hook's project packs the uncompressed gradients in
  the same launch where they lie in several ranges (its ``PACK`` variant, one launch less per step): its row is the
  whole fused launch, the pack programs' bytes, elements and loop trips included (a pack trip counted at the issue
  cost of one of project's loop trips);
* ``issue_ratio`` = (issued / (132 SMs x 4 warp instructions per clock x 1.98 GHz)) / (the launch's bytes /
  4.32 TB/s, the H200's measured copy bandwidth): 1.0 means even perfect issue only just keeps up with copy
  bandwidth; above it the launch is issue-bound whatever its tiles.

Rows: one per distinct launch (model, dtype, step, kernel, config, variant), its figures summed over the model's full
buckets. ``launches_per_bucket_step``: the launches one compressed bucket step of ``powerSGD_hook`` makes, counted
on the hook itself run under a fake GPU driver (:func:`tools.jit_launches.hook_step_launches`), the mean over the
full buckets; each counted launch is matched to its planned row (``as_launched``) and its JIT-compiled PTX
compared with the row's (``jit_ptx_match``). ``steps``: the performance model's whole step per model and dtype
against the 7-pass floor, with the issue term and with the multiply-adds in its place (the model before issue 39).
Needs ``TRITON_INTERPRET`` unset.
"""

import json
import os
import sys
from typing import Dict, List, Optional, Sequence

import torch

KEYS = ("kernel", "model", "dtype", "triton", "registers", "spill_bytes", "load_bytes", "store_bytes",
        "sass_instructions_per_element", "issue_ratio")
STREAMING = ("project", "project_t", "reconstruct")


def _elements(launch: dict, layout) -> int:
    """The elements a launch streams (see the module docstring)."""
    kernel = launch["kernel"]
    if kernel in STREAMING:  # project with PACK: and the uncompressed gradients its pack programs copy
        packed = layout.uncompressed_numel if kernel == "project" and launch["variant"].get("PACK") else 0
        return sum(s.numel for s in layout.matrices) + packed
    if kernel == "copy_segments":
        return layout.uncompressed_numel
    if kernel == "average":
        return layout.q_numel + layout.uncompressed_numel
    return max(1, int(launch["bytes_read"]) // 4)


def _constexprs(launch: dict, dtype: torch.dtype):
    """(constexprs, launch options) a planned launch compiles with, comparable with a recorded launch's."""
    from tools import aot_compile

    variant = dict(launch["variant"])
    if launch["kernel"] == "orthogonalize":
        variant["WITH_GRAM"] = False
    _, const, opts = aot_compile._compile_args(launch["kernel"], launch["config"], dtype, launch["max_rank"], variant)
    return const, opts


def count_launches(model: str, rank: int, dtype: torch.dtype, layouts) -> dict:
    """One compressed step of ``powerSGD_hook`` on the model's buckets under a fake GPU (the C launch and the
    collectives stubbed): per full bucket (those of ``layouts``, matched by element count), its recorded launches.
    Returns ``{numel: [launch dicts]}``."""
    from powersgd_triton.benchmarking.buckets import model_bucket_shapes
    from powersgd_triton.benchmarking.hooks import ensure_process_group
    from tools import jit_launches

    ensure_process_group("gloo")
    wanted = {layout.numel for layout in layouts}
    shapes = model_bucket_shapes(model, dtype, 25.0, first_bucket_mb=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        buckets = jit_launches.hook_step_launches(model, rank, dtype, shapes=shapes)
    finally:
        torch.set_num_threads(threads)
    return {b["numel"]: b["launches"] for b in buckets if b["numel"] in wanted}


def _whole_step(layouts, dtype: torch.dtype, spec) -> dict:
    """The performance model's whole step over the full buckets (:func:`powersgd_triton.perfmodel.predict_step`,
    the host from :func:`powersgd_triton.perfmodel.default_host`): ``floor_us`` (the 7-pass floor at copy
    bandwidth), ``device_us`` with the issue term, ``device_fma_us`` with the multiply-adds in its place (the model
    before issue 39: the same compiled usage without its SASS), ``issue_bound`` (launches whose issue term is the
    longest), ``host_us`` and ``predicted_us`` (the slower of host and device per segment)."""
    from powersgd_triton import perfmodel

    def fma(launch, arch):
        usage = dict(perfmodel.compiled_usage(launch, arch))
        usage.pop("loop", None)
        usage.pop("kernel_instructions", None)
        return usage

    host = perfmodel.default_host()
    out = dict(floor_us=0.0, device_us=0.0, device_fma_us=0.0, host_us=0.0, predicted_us=0.0, issue_bound=[])
    for layout in layouts:
        pred = perfmodel.predict_step(layout, dtype, spec, usage=perfmodel.compiled_usage, host=host)
        out["floor_us"] += 1e6 * pred["floor_s"]
        out["device_us"] += 1e6 * pred["step_s"]
        out["device_fma_us"] += 1e6 * perfmodel.predict_step(layout, dtype, spec, usage=fma)["step_s"]
        out["host_us"] += 1e6 * pred["host"]["host_s"]
        out["predicted_us"] += 1e6 * pred["host"]["time_s"]
        for r in pred["launches"]:
            if r["bound"] == "issue" and r["step"] not in out["issue_bound"]:
                out["issue_bound"].append(r["step"])
    out["buckets"] = len(layouts)
    out["host"] = f"{host.name}, triton {host.triton}"
    return out


def report(models: Sequence[str], dtypes: Sequence[str], rank: int, *, gpu: str = "h200",
           count: bool = True) -> dict:
    """The report as a dict: ``rows`` (one per distinct launch, :data:`KEYS` and more), ``launches_per_bucket_step``
    (``{"model/dtype": mean launches}``, counted on the hook; with ``count=False``, planned), ``launches_planned``
    (the step plan's), ``spec`` (the GPU figures of the formula), ``triton``. See the module docstring."""
    import triton

    from powersgd_triton import perfmodel
    from powersgd_triton.benchmarking import DTYPES
    from tools import aot

    spec = perfmodel.GPUS[gpu]
    rows: Dict[tuple, dict] = {}
    per_step: Dict[str, float] = {}
    planned: Dict[str, float] = {}
    steps: Dict[str, dict] = {}
    for model in models:
        for dname in dtypes:
            dtype = DTYPES[dname]
            layouts = perfmodel.model_layouts(model, rank, dtype)
            recorded = count_launches(model, rank, dtype, layouts) if count else {}
            counts, plan_counts = [], []
            for bi, layout in enumerate(layouts):
                plan = perfmodel.step_plan(layout, dtype, num_sms=spec.sms)
                plan_counts.append(len(plan))
                keys = []
                for launch in plan:
                    usage = perfmodel.compiled_usage(launch, spec.arch)
                    pred = perfmodel.predict(launch, spec, usage)
                    # the integer arguments as the JIT specializes them (n_flags: divisible by 16, 1, or neither),
                    # each a binary of its own
                    ints = {k: ("D" if v % 16 == 0 else "1" if v == 1 else "")
                            for k, v in (launch.get("ints") or {}).items()}
                    key = (model, dname, launch["step"], launch["kernel"],
                           json.dumps(launch["config"], sort_keys=True), json.dumps(launch["variant"], sort_keys=True),
                           json.dumps(ints, sort_keys=True))
                    keys.append((key, usage["ptx_sha256"], _constexprs(launch, dtype)))  # this bucket's binary
                    row = rows.get(key)
                    if row is None:
                        loop = usage.get("loop") or {}
                        row = rows[key] = dict(
                            kernel=launch["kernel"], model=model, dtype=dname, triton=triton.__version__,
                            step=launch["step"], registers=usage["registers"], spill_bytes=usage["spill_bytes"],
                            load_bytes=usage["load_bytes"], store_bytes=usage["store_bytes"],
                            narrowest_load_bytes=usage["narrowest_load_bytes"],
                            narrowest_store_bytes=usage["narrowest_store_bytes"],
                            num_warps=usage["num_warps"], loop_instructions=loop.get("instructions"),
                            kernel_instructions=usage.get("kernel_instructions"), config=launch["config"],
                            variant=launch["variant"], overlapped=bool(launch.get("overlapped")), buckets=0,
                            programs=[], issued=0.0, bytes=0, elements=0, predicted_s=0.0, bound=[],
                            as_launched=None if not count else False, jit_ptx_match=None)
                    row["buckets"] += 1
                    row["programs"].append(pred["programs"])
                    row["issued"] += pred["issued"] or 0.0
                    row["bytes"] += pred["bytes"]
                    row["elements"] += _elements(launch, layout)
                    row["predicted_s"] += pred["time_s"]
                    if pred["bound"] not in row["bound"]:
                        row["bound"].append(pred["bound"])
                launched = recorded.get(layout.numel)
                if launched is None:
                    continue
                counts.append(len(launched))
                free = list(keys)  # each planned launch stands for one recorded launch of its bucket
                for rec in launched:  # each recorded launch: its planned row, and the same binary?
                    want = (rec["constexprs"], rec["options"])
                    for entry in free:
                        key, sha, const = entry
                        row = rows[key]
                        if row["kernel"] == rec["kernel"] and const == want:
                            free.remove(entry)
                            row["as_launched"] = True
                            same = aot.ptx_digest(rec["compiled"].asm["ptx"]) == sha
                            row["jit_ptx_match"] = same if row["jit_ptx_match"] is None else (row["jit_ptx_match"]
                                                                                               and same)
                            break
            steps[f"{model}/{dname}"] = _whole_step(layouts, dtype, spec)
            name = f"{model}/{dname}"
            planned[name] = sum(plan_counts) / max(1, len(plan_counts))
            per_step[name] = sum(counts) / len(counts) if counts else planned[name]
    out_rows = []
    rate = spec.sms * spec.issue_per_clock * spec.clock_hz
    for row in rows.values():
        issue_s = row["issued"] / rate
        bytes_s = row["bytes"] / spec.copy_bandwidth
        row["sass_instructions_per_element"] = row["issued"] / max(1, row["elements"])
        row["issue_ratio"] = issue_s / bytes_s if bytes_s else None
        row["issue_us"], row["bytes_us"], row["predicted_us"] = 1e6 * issue_s, 1e6 * bytes_s, 1e6 * row.pop(
            "predicted_s")
        out_rows.append(row)
    return dict(rows=out_rows, launches_per_bucket_step=per_step, launches_planned=planned, steps=steps,
                spec=dict(gpu=spec.name, arch=spec.arch, sms=spec.sms, issue_per_clock=spec.issue_per_clock,
                          clock_hz=spec.clock_hz, copy_bandwidth=spec.copy_bandwidth),
                triton=triton.__version__, rank=rank)


def format_report(rep: dict) -> str:
    """Markdown: one line per row, then the launches per bucket step."""
    lines = [f"Kernel report, triton {rep['triton']}, sm_{rep['spec']['arch']}, rank {rep['rank']}: compiled as the JIT "
             f"compiles a GPU launch; issue ratio = (warp instructions / ({rep['spec']['sms']} SMs x "
             f"{rep['spec']['issue_per_clock']} x {rep['spec']['clock_hz'] / 1e9:.2f} GHz)) / (bytes / "
             f"{rep['spec']['copy_bandwidth'] / 1e12:.2f} TB/s); summed over each model's full 25 MB buckets", "",
             "| model | dtype | step | kernel | regs | spills | load B (narrowest) | store B (narrowest) | "
             "warp instr./element | issue ratio | bound (model) | as launched |", "|" + "---|" * 12]
    for r in rep["rows"]:
        ratio = "" if r["issue_ratio"] is None else f"{r['issue_ratio']:.2f}"
        launched = {True: "yes" + ("" if r["jit_ptx_match"] else " (PTX differs)"), False: "NOT LAUNCHED",
                    None: ""}[r["as_launched"]]
        lines.append(f"| {r['model']} | {r['dtype']} | {r['step']} | {r['kernel']} | {r['registers']} | "
                     f"{r['spill_bytes']} | {r['load_bytes']} ({r['narrowest_load_bytes']}) | {r['store_bytes']} "
                     f"({r['narrowest_store_bytes']}) | {r['sass_instructions_per_element']:.3f} | {ratio} | "
                     f"{', '.join(r['bound'])} | {launched} |")
    lines += ["", f"Whole step, performance model ({rep['spec']['gpu']}), the full buckets summed:", "",
              "| model | dtype | buckets | 7-pass floor µs | device µs, issue term | of floor | device µs, FMA term "
              "(before) | of floor | issue-bound | host µs | predicted µs (slower of host and device per segment) |",
              "|" + "---|" * 11]
    for name, st in rep.get("steps", {}).items():
        model, dtype = name.split("/")
        lines.append(f"| {model} | {dtype} | {st['buckets']} | {st['floor_us']:.1f} | {st['device_us']:.1f} | "
                     f"{100 * st['floor_us'] / st['device_us']:.0f} % | {st['device_fma_us']:.1f} | "
                     f"{100 * st['floor_us'] / st['device_fma_us']:.0f} % | {', '.join(st['issue_bound']) or '-'} | "
                     f"{st['host_us']:.1f} | {st['predicted_us']:.1f} |")
    lines.append("")
    lines.append("Launches per bucket step (counted on powerSGD_hook under a fake GPU; planned): " + ", ".join(
        f"{k} {v:g} ({rep['launches_planned'][k]:g})" for k, v in rep["launches_per_bucket_step"].items()))
    return "\n".join(lines)


def run(models: Sequence[str], dtypes: Sequence[str], rank: int, json_path: Optional[str] = None,
        gpu: str = "h200") -> int:
    """What ``powersgd-triton bench --kernel-report`` runs: prints :func:`format_report`, writes the report's JSON
    (``{"rows", "launches_per_bucket_step", ...}``) to ``json_path``. 2 under ``TRITON_INTERPRET``."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the kernel report reads the kernels compiled for the GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, without its warning
    rep = report(models, dtypes, rank, gpu=gpu)
    print(format_report(rep))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rep, f, indent=1, default=str)
    return 0


def main(argv: Optional[List[str]] = None) -> int:  # pragma: no cover - the CLI is bench --kernel-report
    import argparse

    p = argparse.ArgumentParser(prog="python -m tools.kernel_report", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="resnet50,gpt2")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    return run(a.models.split(","), a.dtypes.split(","), a.rank, a.json)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
