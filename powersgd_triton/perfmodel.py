"""A performance model of one compressed step of the Triton kernels, computed without a GPU.

``python -m powersgd_triton.perfmodel --models resnet50 gpt2 bert-base --matrix-approximation-ranks 1 4 16 --dtypes fp32 bf16 --gpu h200``
(also ``powersgd-triton bench --model-only ...``) prints, for every bucket of a model (DDP's 25 MB buckets of
:mod:`powersgd_triton.shapes`), rank, gradient dtype and GPU, each launch of the standard hook's step: programs,
waves, blocks per SM, registers, spills, bytes moved, the predicted time and the fraction of copy bandwidth it
reaches, and the whole step against the 7-pass floor (``project`` reads g and e and writes g, ``project_t`` reads g,
``reconstruct`` reads g and writes g and e: five passes over the gradient dtype and two over the float32 error).

Inputs of the model, per launch: the tile plan (:func:`powersgd_triton.ops.plans.plan` and
``orthogonalize_plan``: a list of dicts with ``kernel``, ``programs``, ``iterations`` (loop trips of the longest
program), ``bytes_read``, ``bytes_written``, ``config``, ``variant``; optional ``flops``, ``l2_bytes``, ``serial``),
the compiled kernel's metadata for ``sm_<arch>`` (registers and spills from ``ptxas -v``, shared memory, warps,
stages, whether the loop's loads are software-pipelined: ``cp.async`` in the PTX; through
:func:`tools.aot.resource_usage`; the replay of its loop's SASS,
:func:`tools.aot.main_loop`), and a :class:`GPUSpec`.

The model (assumptions, to be corrected by the first GPU run of ``bench/gpu_check.py``):

1. Occupancy: ``blocks_per_sm`` from registers, shared memory, warps (``aot.blocks_per_sm``, CUDA's occupancy
   arithmetic); ``slots = blocks_per_sm * SMs`` programs are resident at once.
2. Latency hiding (Little's law per program): a loop step waits for its loads once, but ``depth`` steps of loads
   are in flight at a time, so a step costs ``dram_latency_s / depth``: ``depth = num_stages`` when the compiled
   loop is software-pipelined (``cp.async`` in the PTX: the ``tl.dot`` paths), else measured on the SASS of the
   compiled loop (:func:`tools.aot.sass_loops`: a replay in which each global load takes one
   latency and an instruction waits for the loads whose registers it reads or overwrites) as the loop steps of one
   trip (the plan's ``steps_per_trip``: the broadcast loops of project, project_t and reconstruct are unrolled
   ``1 + PREFETCH`` times) over the latencies one trip waits. (The model used to take ``1 + PREFETCH`` for every
   register-prefetching loop; the SASS shows that a prefetch carried to the next trip in the same registers waits
   for its loads within the trip -- the loop-carried copy reads them -- so the ``CARRY`` forms of project and
   reconstruct, and project's ``tl.dot`` path with ``PREFETCH``, have one step in flight.) Without
   a replay (a hand-made ``usage``) it is ``1 + PREFETCH``. A program's length is ``lookups * dram_latency_s``
   (the dependent table look-ups before the loop: the plan's ``lookups``, default 2, a tile row then the layout
   table's row; orthogonalize's task rows are self-contained: 1) plus its loop trips (the plan's
   ``program_iterations``, per program, in launch order, in loop steps) times that step cost. Bytes in flight per SM are then ``resident programs x depth
   x tile bytes`` per ``dram_latency_s``: the occupancy, the prefetch depth and the tile size all enter.
3. Programs are dispatched in program-id order, each to the first free slot (:func:`makespan`, the block
   scheduler's in-order dispatch): a launch's latency time is when its last program ends. The launch takes the
   longest of that, its bytes at copy bandwidth (``hbm_bandwidth * copy_fraction``), its L2 traffic (factor
   re-reads, spills) at ``l2_bandwidth`` and its instruction issue (``"issue"``, issue 39): the warp instructions
   of its compiled SASS (:func:`issued_instructions`: main-loop instructions x loop trips x warps, every instruction
   counted -- address arithmetic, masks, conversions, loads, stores, not only the multiply-adds) at
   ``sms * issue_per_clock * clock_hz`` (132 x 4 x 1.98 GHz), plus its tensor-core multiply-adds (the plan's
   ``tensor_flops``: project_t's split bfloat16 path) at ``tensor_flops``, the data sheet's dense bfloat16 peak
   (not measured). A launch whose issue term is the longest is "issue-bound": no tile makes it faster, only fewer
   instructions per element (vector-wide accesses, fewer masks). ``issue_ratio`` = issue time / time of its bytes
   at copy bandwidth (1.0: even perfect issue only just keeps up with copy bandwidth). Without compiled SASS (a
   hand-made usage) the multiply-adds at ``fp32_flops * fma_efficiency`` stand in (``"compute"``).
4. Each launch adds ``launch_overhead_s`` (start-up and tail of a kernel on a busy stream, no CUDA graph).
5. ``serial`` launches pay ``l2_latency_s`` per iteration instead.
6. ``overlapped`` launches (with warm start, the orthogonalization of the next step's Q, made at the end of the
   step before on a side CUDA stream: :func:`powersgd_triton.hooks.driver.orthogonalize_next_q`) are off the step's
   critical path; they are charged what they take from the work they overlap: their programs' SM time (a
   program holds ``1 / blocks_per_sm`` of an SM for its duration) over all SMs, or their bytes at copy bandwidth
   if that is longer, and no launch overhead.

7. Orthogonalize's serial r x r Gram-Schmidt (the plan's ``rank_steps``, R per program of the finishing launch)
   adds one block-wide reduction per column (``block_reduction_s``) to each of its programs (1 block per SM).
8. The host (:class:`~powersgd_triton.perfmodel_host.HostSpec`, measured by ``powersgd-triton bench --host-overhead`` on a CPU, recorded with the
   Triton version): the step is three segments between its collectives (project, with the pack | all-reduce P |
   orthogonalize P, project_t | all-reduce Q | average, reconstruct, the next Q's orthogonalization). A segment's
   host time is its share of the hook's own Python (``step_s / 3``), ``launch_s`` per launch and
   ``collective_s`` per all-reduce call (P and Q are written in their all-reduce's dtype by the kernels
   themselves; when that is not float32, P's copy back into float32 is the step's one torch op, charged
   ``launch_s``); its device time the sum of its
   launches; it takes the slower of the two (:func:`predict_host`). A bucket is host-bound when its host time is
   the larger in total.

Not modelled: DRAM page and channel effects, L2 hits of the bucket itself, the cost of warp shuffles and of the
reductions after the loops, the all-reduces' transfer time.

The percentages are "bytes moved / predicted time" over copy bandwidth. Nothing here is measured; bench/RESULTS.md
says which figures a GPU run replaced.
"""

import argparse
import heapq
import math
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from powersgd_triton.benchmarking import DTYPES, FakeGradBucket, model_bucket_shapes
from powersgd_triton.cli_common import RANK_HELP, add_rank_option, positive
from powersgd_triton.layout import BucketLayout
from powersgd_triton.perfmodel_host import HOSTS, SEGMENTS, HostSpec, default_host, predict_host  # noqa: F401
from powersgd_triton.shapes import MODELS, numel

__all__ = ["GPUSpec", "GPUS", "step_plan", "depth", "makespan", "predict", "predict_step", "predict_measured",
           "spec_for_device", "model_table", "issued_instructions", "main"]


@dataclass(frozen=True)
class GPUSpec:
    """What the model knows about a GPU. Bandwidths in bytes/s, latencies and overheads in seconds."""

    name: str
    arch: int  # compute capability x 10 (the AOT target)
    sms: int
    hbm_bandwidth: float  # peak DRAM bandwidth
    copy_fraction: float  # device-to-device copy reaches this fraction of the peak
    l2_bandwidth: float
    fp32_flops: float  # peak fp32 FMA rate x 2
    tensor_flops: float = 0.0  # peak dense bfloat16 tensor-core rate (flop/s, float32 accumulate); 0: none known
    regs_per_sm: int = 65536
    smem_per_sm: int = 228 * 1024
    dram_latency_s: float = 800e-9
    l2_latency_s: float = 300e-9
    launch_overhead_s: float = 2.0e-6
    fma_efficiency: float = 0.5  # the FMA term of a launch without compiled SASS (a hand-made usage) only
    # instruction issue: each SM issues at most ``issue_per_clock`` warp instructions per clock (4 schedulers on
    # sm_80/sm_90) at ``clock_hz`` (the H100/H200 SXM boost clock, 1.98 GHz); the issue term of a launch
    # (:func:`issued_instructions`)
    clock_hz: float = 1.98e9
    issue_per_clock: int = 4
    # one block-wide reduction (warp shuffles, a shared-memory round trip and two barriers, float64) of the serial
    # Gram-Schmidt loop of orthogonalize, per column: ~600 cycles at ~1.9 GHz (an estimate, not measured)
    block_reduction_s: float = 0.3e-6

    @property
    def copy_bandwidth(self) -> float:
        return self.hbm_bandwidth * self.copy_fraction


# Published peaks (NVIDIA H100 SXM5 / H200 SXM data sheets); copy fraction from the H200's measured ~4.3 TB/s copy
# (DESIGN.md), used for both; L2 bandwidth and latencies are typical microbenchmark figures for Hopper. Tensor-core
# rate: the data sheets' "BF16 Tensor Core 1,979 teraFLOPS" is with 2:4 sparsity, dense is half, 989 TFLOPS (the
# same for H100 SXM and H200, https://www.nvidia.com/en-us/data-center/h100/ and /h200/); a data-sheet figure, not
# measured, reached by wgmma (sm_90's mma.sync issues at a lower rate).
GPUS: Dict[str, GPUSpec] = {
    "h100": GPUSpec("H100 SXM", 90, 132, 3.35e12, 0.9, 10e12, 67e12, tensor_flops=989e12),
    "h200": GPUSpec("H200 SXM", 90, 132, 4.8e12, 0.9, 10e12, 67e12, tensor_flops=989e12),
}



Usage = Callable[[dict, int], dict]
_USAGE: Dict[tuple, dict] = {}


def checkout_tools():
    """``(tools.aot, tools.aot_compile)`` of the repository checkout this package runs from: the ahead-of-time
    compile is a developer tool of the repository (``tools/``), not installed with the package. Found beside the
    package (an editable install or a run from the checkout; the checkout's root goes on ``sys.path``), whatever the
    current directory. Raises ``RuntimeError`` naming what to do where there is none (an installed wheel), or where
    another package named ``tools`` is imported already."""
    root = Path(__file__).resolve().parents[1]
    here = root / "tools"
    if not (here / "aot_compile.py").is_file():
        raise RuntimeError("the performance model compiles the kernels ahead of time with the repository's tools/, "
                           "which is not installed with the package: run it from a clone of the repository "
                           "(pip install -e .)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from tools import aot, aot_compile

    if Path(aot.__file__).resolve().parent != here:
        raise RuntimeError(f"another package named tools is imported ({aot.__file__}), not the repository's {here}")
    return aot, aot_compile


def compiled_usage(launch: dict, arch: int) -> dict:
    """Registers, spills, shared memory, warps, stages, blocks per SM and ``pipelined`` of one planned launch,
    from an ahead-of-time compile for ``sm_<arch>`` as Triton's JIT compiles the launch on a GPU (every pointer
    16-byte aligned, the launch's integer arguments: the plan's ``ints``; cached per kernel, config, variant, dtype,
    rank and integers), with its SASS main loop (``loop``: :func:`tools.aot.main_loop`), its SASS instruction count
    (``kernel_instructions``) and the widths of its global accesses (:func:`tools.aot.ptx_access_bytes`). Needs
    ``TRITON_INTERPRET`` unset; raises what the compiler raises."""
    aot, aot_compile = checkout_tools()
    from powersgd_triton.layout import padded_rank

    ints = dict(launch.get("ints") or {})
    key = (launch["kernel"], repr(sorted(launch["config"].items())), repr(sorted(launch["variant"].items())),
           launch["dtype"], padded_rank(launch["max_rank"], launch["config"].get("USE_DOT", False)), arch,
           repr(sorted(ints.items())))
    if key not in _USAGE:
        compiled = aot_compile.compile_aot(launch["kernel"], launch["config"], getattr(torch, launch["dtype"]),
                                          launch["max_rank"], arch, launch["variant"], ints=ints)
        usage = aot.resource_usage(compiled, arch)
        ptx = compiled.asm["ptx"]
        usage["pipelined"] = bool(re.search(r"cp\.async|cp\.async\.bulk", ptx if isinstance(ptx, str) else ptx.decode()))
        usage["loop"] = aot.main_loop(compiled, arch)
        usage["trip_latencies"] = usage["loop"]["trip_latencies"] if usage["loop"] else None
        usage["kernel_instructions"] = aot.sass_instructions(aot.sass_text(compiled, arch))
        usage.update(aot.ptx_access_bytes(ptx))
        usage["ptx_sha256"] = aot.ptx_digest(ptx)
        _USAGE[key] = usage
    return dict(_USAGE[key])


def step_plan(layout: BucketLayout, dtype: torch.dtype, *, num_sms: int, error_feedback: bool = True,
              warm_start: bool = True, configs: Optional[Dict[str, dict]] = None,
              wire: Optional[bool] = None) -> List[dict]:
    """The launches of one compressed step of ``powerSGD_hook`` on ``layout`` (Triton backend, heuristic configs
    unless ``configs`` gives some): orthogonalize Q, project (with the pack of the uncompressed gradients when they
    lie in several ranges: its ``PACK`` variant), orthogonalize P, project_t (+ reduce), average, reconstruct. Each entry has a ``step`` name besides :func:`plans.plan`'s keys; with
    ``warm_start`` the orthogonalize Q launches are ``overlapped`` (made on a side stream during the step
    before). ``wire``: P, Q and the packed uncompressed gradients are written in the bucket's dtype, the buffers
    they are all-reduced in (the hooks' default on the Triton backend for a bucket that is not float32: the
    ``wire`` variants); default: whether ``dtype`` is not float32. reconstruct carries ``ints``: its ``n_flags``,
    the average launch's programs (the JIT specializes it)."""
    from powersgd_triton.layout import padded_rank
    from powersgd_triton.ops import orthogonalization, plans
    from powersgd_triton.ops.configs import _ortho_constexprs

    configs = configs or {}
    out: List[dict] = []

    def add(step, launches):
        for launch in launches:
            launch["step"] = step
            out.append(launch)

    wire = dict(wire=True) if (dtype != torch.float32 if wire is None else wire) else {}
    # the uncompressed gradients in several ranges: packed by project's launch (its pack programs, PACK)
    pack = dict(PACK=True) if len(layout.uncompressed) > 1 and layout.uncompressed_numel else {}
    # with warm start made at the end of the last step on a side stream (hooks._Step; _step.orthogonalize_next_q)
    add("orthogonalize Q", [dict(launch, overlapped=warm_start)
                            for launch in orthogonalization.orthogonalize_plan(layout, "q", configs.get("orthogonalize"))])
    add("project", plans.plan("project", layout, dtype, configs.get("project"), num_sms=num_sms,
                          variant=dict(HAS_ERROR=error_feedback, **wire, **pack)))
    # out of place (the hooks all-reduce P in mem.p_work and orthogonalize it into mem.p): APPLY_ROWS applies
    add("orthogonalize P", orthogonalization.orthogonalize_plan(layout, "p", configs.get("orthogonalize")))
    add("project_t", plans.plan("project_t", layout, dtype, configs.get("project_t"), num_sms=num_sms,
                            variant=dict(PAD_ERROR=False, **wire)))
    for launch in out:
        if launch["kernel"] == "reduce_splits":
            launch["variant"] = dict(HAS_Q2=False, **wire)
    add("average", plans.plan("average", layout, dtype, num_sms=num_sms, variant=dict(which="q")))
    flags = sum(launch["programs"] for launch in out if launch["kernel"] == "average")  # one per program
    variant = dict(HAS_ERROR=error_feedback, HAS_FLAG=error_feedback or warm_start, COMMIT=2 if warm_start else 0)
    add("reconstruct", plans.plan("reconstruct", layout, dtype, configs.get("reconstruct"), num_sms=num_sms,
                              variant=variant))
    for launch in out:
        if launch["kernel"] == "orthogonalize":  # its plan counts tiles; one trip of its chunk loop takes CHUNK_TILES
            R = padded_rank(launch["max_rank"])
            launch["issue_steps_per_trip"] = _ortho_constexprs(launch["config"], R)["CHUNK_TILES"]
        align = {k: v for k, v in launch["variant"].items() if k in ("ALIGN", "RECIP")}  # the aligned layout's
        if launch["kernel"] == "average":
            launch["variant"] = dict(wire, **align)
        if launch["kernel"] == "copy_segments":
            launch["variant"] = dict(to_packed=True, **wire, **align)
        if launch["kernel"] == "reconstruct":
            launch["ints"] = dict(n_flags=flags if variant["HAS_FLAG"] else 0)
    return out


def depth(launch: dict, usage: dict) -> float:
    """Loop steps whose loads are in flight at once in one program: ``num_stages`` when the compiled loop is
    software-pipelined (``cp.async`` in the PTX); else, from the SASS replay of the compiled loop
    (``usage["trip_latencies"]``, :func:`tools.aot.sass_loops`), the plan's
    ``steps_per_trip`` (loop steps one trip of the compiled loop does, default 1) over the DRAM latencies one trip
    waits; without a replay (a hand-made ``usage``), ``1 + PREFETCH`` (the kernel's register prefetch of the next
    ``PREFETCH`` tiles, ``config["PREFETCH"]``)."""
    if usage.get("pipelined"):
        return max(1, int(usage.get("num_stages", 1)))
    trip = usage.get("trip_latencies")
    if trip:
        return max(1, int(launch.get("steps_per_trip", 1))) / trip
    return 1 + max(0, int(launch.get("config", {}).get("PREFETCH", 0)))


def makespan(durations: Sequence[float], slots: int) -> float:
    """Time until the last program ends when programs (``durations``, seconds, in program-id order) are dispatched
    in order, each to the first free one of ``slots`` resident-block slots (the block scheduler's in-order
    dispatch). A list no longer than ``slots`` takes its longest duration."""
    if not durations:
        return 0.0
    if len(durations) <= slots:
        return max(durations)
    free = [0.0] * slots
    heapq.heapify(free)
    end = 0.0
    for d in durations:
        t = heapq.heappop(free) + d
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def predict(launch: dict, spec: GPUSpec, usage: Optional[dict] = None) -> dict:
    """The model's prediction for one planned launch (see the module docstring). ``usage``: the compiled metadata
    (:func:`compiled_usage`); computed when not given. Returns the launch's figures: ``programs``, ``waves``,
    ``blocks_per_sm``, ``occupancy`` (resident warps / 64), ``registers``, ``spill_bytes``, ``bytes``, ``time_s``,
    ``copy_fraction`` (bytes / time over copy bandwidth), ``bound`` (what sets the time). Raises ``ValueError``
    when the launch has ``tensor_flops`` and ``spec`` no tensor-core rate."""
    if usage is None:
        usage = compiled_usage(launch, spec.arch)
    programs = max(1, int(launch["programs"]))
    iterations = max(1, int(launch["iterations"]))
    bpsm = max(1, int(usage["blocks_per_sm"]))
    warps = int(usage.get("num_warps", 4))
    slots = bpsm * spec.sms
    waves = math.ceil(programs / slots)
    total = int(launch["bytes_read"]) + int(launch["bytes_written"])
    flops = float(launch.get("flops", 0))
    tensor_flops = float(launch.get("tensor_flops", 0))
    if tensor_flops and not spec.tensor_flops:
        raise ValueError(f"{spec.name}: the plan has tensor-core flops but the GPUSpec has no tensor_flops rate")
    per_program = launch.get("program_iterations") or [iterations] * programs
    spill_traffic = 2 * int(usage.get("spill_bytes", 0)) * 32 * warps * sum(per_program)
    l2 = float(launch.get("l2_bytes", 0)) + spill_traffic
    stages = depth(launch, usage)
    latency = spec.l2_latency_s if launch.get("serial") else spec.dram_latency_s
    lookups = int(launch.get("lookups", 2))
    serial = int(launch.get("rank_steps", 0)) * spec.block_reduction_s  # orthogonalize's r x r Gram-Schmidt
    durations = [lookups * spec.dram_latency_s + serial + max(1, int(it)) * latency / stages for it in per_program]
    parts = {
        "latency": makespan(durations, slots),
        "bandwidth": total / spec.copy_bandwidth,
        "l2": l2 / spec.l2_bandwidth,
    }
    tensor_s = tensor_flops / spec.tensor_flops if tensor_flops else 0.0
    issued = issued_instructions(launch, usage)
    if issued is not None:  # the compiled code's instructions at the SMs' issue rate, tensor cores after them
        issue_s = issued / (spec.sms * spec.issue_per_clock * spec.clock_hz)
        parts["issue"] = issue_s + tensor_s
    else:  # no SASS (a hand-made usage): FMA pipe and tensor cores one after the other
        issue_s = None
        parts["compute"] = flops / (spec.fp32_flops * spec.fma_efficiency) + tensor_s
    overlapped = bool(launch.get("overlapped"))
    if overlapped:
        # off the critical path, on a side stream: what it takes from the work it overlaps, its SM time (each
        # program holds 1 / blocks_per_sm of an SM) spread over all SMs, or its traffic; no launch gap on the stream
        parts["latency"] = sum(durations) / bpsm / spec.sms
    bound = max(parts, key=parts.get)
    time_s = parts[bound] + (0.0 if overlapped else spec.launch_overhead_s)
    if overlapped:
        bound = f"overlapped ({bound})"
    resident = min(bpsm, math.ceil(programs / spec.sms))
    return dict(
        step=launch.get("step", launch["kernel"]), kernel=launch["kernel"], programs=programs, waves=waves,
        iterations=iterations, blocks_per_sm=bpsm, occupancy=min(1.0, resident * warps / 64),
        registers=usage.get("registers"), spill_bytes=usage.get("spill_bytes", 0), stages=stages,
        bytes=total, time_s=time_s, copy_fraction=total / time_s / spec.copy_bandwidth, bound=bound,
        issued=issued, issue_s=issue_s,
        issue_ratio=None if issue_s is None or not total else issue_s / (total / spec.copy_bandwidth),
    )


def issued_instructions(launch: dict, usage: dict) -> Optional[float]:
    """Warp instructions one launch issues, from its compiled SASS: the main loop's instructions (``usage["loop"]``)
    x the loop trips of every program (the plan's ``program_iterations``, loop steps, over its ``steps_per_trip``,
    rounded up) x the warps of a program; a kernel without a loop, its instructions up to ``EXIT``
    (``usage["kernel_instructions"]``) once per program and warp. Counts every instruction (address arithmetic,
    masks, conversions, loads and stores, not only the multiply-adds); leaves out the code before and after the loop
    (a few percent of a streaming kernel's). Where the plan gives ``step_loads`` (average, copy_segments: the global
    loads of one loop step per thread), a trip of the compiled loop is its global loads over those steps (the
    compiler unrolls those short loops 4 times). For orthogonalize (nested loops; its plan counts tiles, a trip of its
    largest loop takes ``CHUNK_TILES`` of them: the plan's ``issue_steps_per_trip``) an estimate. None without SASS
    in ``usage`` (a hand-made one)."""
    loop = usage.get("loop")
    warps = int(usage.get("num_warps", 4))
    programs = max(1, int(launch["programs"]))
    if loop:
        per = launch.get("program_iterations") or [max(1, int(launch["iterations"]))] * programs
        steps = max(1, int(launch.get("issue_steps_per_trip", launch.get("steps_per_trip", 1))))
        if launch.get("step_loads") and loop.get("global_loads"):  # a loop the compiler unrolled (average, copy)
            steps = max(1, int(loop["global_loads"]) // int(launch["step_loads"]))
        return float(loop["instructions"]) * sum(-(-int(it) // steps) for it in per) * warps
    if usage.get("kernel_instructions"):
        return float(usage["kernel_instructions"]) * programs * warps
    return None


def floor_bytes(layout: BucketLayout, dtype: torch.dtype) -> int:
    """Bytes of the 7-pass floor of one step: 5 passes over the compressed gradients, 2 over their error memory."""
    es = torch.empty((), dtype=dtype).element_size()
    g = sum(s.numel for s in layout.matrices)
    return 5 * g * es + 2 * 4 * layout.e_numel


def predict_step(layout: BucketLayout, dtype: torch.dtype, spec: GPUSpec, *, usage: Optional[Usage] = None,
                 host: Optional[HostSpec] = None, **kwargs) -> dict:
    """Every launch of one compressed step (:func:`step_plan`) predicted; ``step_s`` their sum (device time),
    ``floor_s`` the 7-pass floor at copy bandwidth, ``of_floor`` = floor / step; with ``host``, ``host``:
    :func:`predict_host` (host and device per segment, the slower of the two, the bucket's bound)."""
    rows = []
    for launch in step_plan(layout, dtype, num_sms=spec.sms, **kwargs):
        u = usage(launch, spec.arch) if usage is not None else None
        rows.append(predict(launch, spec, u))
    step_s = sum(r["time_s"] for r in rows)
    floor_s = floor_bytes(layout, dtype) / spec.copy_bandwidth
    out = dict(launches=rows, step_s=step_s, floor_s=floor_s, of_floor=floor_s / step_s)
    if host is not None:
        out["host"] = predict_host(rows, layout, dtype, host)
    return out


def spec_for_device(device) -> Optional[GPUSpec]:
    """The built-in :class:`GPUSpec` of a CUDA ``device`` (its name contains "H100" or "H200"), with the device's own
    SM count; None for any other device (the model knows no other GPU's bandwidth)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    name = props.name.upper()
    key = "h200" if "H200" in name else "h100" if "H100" in name else None
    if key is None:
        return None
    return replace(GPUS[key], sms=int(props.multi_processor_count))


# The launches of the bucket steps as benchmarking.KernelBench.ours runs them (ops.* with the heuristic configs).
_KERNEL_STEPS = {
    "project": ("project", dict(HAS_ERROR=True)),
    "project_t": ("project_t", dict(PAD_ERROR=False)),
    "reconstruct": ("reconstruct", dict(HAS_ERROR=True, HAS_FLAG=True, COMMIT=0)),
}


def predict_measured(what: str, *, device, spec: Optional[GPUSpec] = None, usage: Optional[Usage] = None,
                     **kw) -> Optional[float]:
    """The model's milliseconds for an item ``bench/gpu_check.py`` measures, printed beside the measurement.

    ``what="kernel"``: ``kernel`` (project, orthogonalize, project_t, reconstruct: one call of
    :class:`powersgd_triton.benchmarking.KernelBench`'s ``ours``), ``layout``, ``dtype``. ``what="hook"``: one
    compressed step of ``powerSGD_hook`` over ``buckets`` (:class:`~powersgd_triton.benchmarking.FakeGradBucket`)
    at ``rank`` (``min_compression_rate`` 2), the sum of :func:`predict_step` over the buckets (every bucket
    compressed; the all-reduces are not modelled). ``spec``: default :func:`spec_for_device`; returns None when
    there is none. ``usage``: default :func:`compiled_usage` (TRITON_INTERPRET unset). Raises ``ValueError`` for
    an unknown ``what`` or kernel."""
    spec = spec or spec_for_device(device)
    if spec is None:
        return None
    usage = usage or compiled_usage
    from powersgd_triton.ops import orthogonalization, plans

    if what == "kernel":
        kernel, layout, dtype = kw["kernel"], kw["layout"], kw["dtype"]
        if kernel == "orthogonalize":
            launches = orthogonalization.orthogonalize_plan(layout, "p")
        elif kernel in _KERNEL_STEPS:
            name, variant = _KERNEL_STEPS[kernel]
            launches = plans.plan(name, layout, dtype, num_sms=spec.sms, variant=variant)
        else:
            raise ValueError(f"unknown kernel {kernel!r}")
        for launch in launches:
            if launch["kernel"] == "reduce_splits":
                launch["variant"] = dict(HAS_Q2=False)
        return 1e3 * sum(predict(launch, spec, usage(launch, spec.arch))["time_s"] for launch in launches)
    if what == "hook":
        dtype, rank = kw["dtype"], kw["rank"]
        total = 0.0
        for bucket in kw["buckets"]:
            layout = BucketLayout.from_gradients(bucket.buffer(), bucket.gradients(), rank, 2.0)
            if layout.num_matrices:
                total += predict_step(layout, dtype, spec, usage=usage)["step_s"]
        return 1e3 * total
    raise ValueError(f"unknown item {what!r}; expected 'kernel' or 'hook'")


def model_layouts(model: str, rank: int, dtype: torch.dtype, bucket_cap_mb: float = 25.0,
                  min_bucket_fraction: float = 0.5) -> List[BucketLayout]:
    """Layouts of ``model``'s DDP buckets holding at least ``min_bucket_fraction`` of the cap (the full 25 MB buckets;
    DDP's small first and last buckets are left out). No gradient memory is touched (meta tensors)."""
    out = []
    cap = bucket_cap_mb * 2**20
    esize = torch.empty((), dtype=dtype).element_size()
    for shapes in model_bucket_shapes(model, dtype, bucket_cap_mb, first_bucket_mb=0.0):
        n = sum(numel(s) for s in shapes)
        if n * esize < min_bucket_fraction * cap:
            continue
        bucket = FakeGradBucket(torch.empty(n, dtype=dtype, device="meta"), shapes)
        out.append(BucketLayout.from_gradients(bucket.buffer(), bucket.gradients(), rank, 2.0))
    return out


def model_table(models: Sequence[str], ranks: Sequence[int], dtypes: Sequence[str], gpu: str = "h200",
                usage: Optional[Usage] = None, host: Optional[HostSpec] = None) -> List[dict]:
    """One row per (model, rank, dtype, bucket, launch) with :func:`predict`'s figures, plus a ``step`` row per
    bucket (``kernel="step"``: the sum, and ``of_floor``; ``host_s``, ``device_s``, ``predicted_s`` and ``bound``
    from :func:`predict_host` with ``host``, default :func:`default_host`)."""
    spec = GPUS[gpu]
    host = host or default_host()
    rows = []
    for model in models:
        for dname in dtypes:
            dtype = DTYPES[dname]
            for rank in ranks:
                for bi, layout in enumerate(model_layouts(model, rank, dtype)):
                    pred = predict_step(layout, dtype, spec, usage=usage, host=host)
                    h = pred["host"]
                    base = dict(model=model, rank=rank, dtype=dname, bucket=bi,
                                bucket_mb=layout.numel * torch.empty((), dtype=dtype).element_size() / 2**20)
                    for r in pred["launches"]:
                        rows.append(dict(base, **r))
                    rows.append(dict(base, step="step", kernel="step", time_s=pred["step_s"],
                                     floor_s=pred["floor_s"], of_floor=pred["of_floor"],
                                     bytes=floor_bytes(layout, dtype), host_s=h["host_s"], device_s=h["device_s"],
                                     predicted_s=h["time_s"], bound=h["bound"],
                                     host_segments=sum(g["bound"] == "host" for g in h["segments"])))
    return rows


def format_table(rows: Sequence[dict]) -> str:
    """Markdown: one line per launch kind per (model, dtype, rank), worst bucket of each, and the step lines."""
    grouped: Dict[tuple, List[dict]] = {}
    for r in rows:
        name = r["step"] if r["kernel"] in ("step", "orthogonalize") or r["step"] == r["kernel"] else f"{r['step']} ({r['kernel']})"
        grouped.setdefault((r["model"], r["dtype"], r["rank"], name), []).append(r)
    lines = ["| model | dtype | rank | launch | programs | waves | blocks/SM | regs | spills | MB moved | "
             "predicted µs | % of copy BW | bound |", "|" + "---|" * 13]
    def bound(text):  # "issue" -> "issue-bound", "overlapped (latency)" -> "overlapped (latency-bound)"
        return re.sub(r"(\w+)(\)?)$", r"\1-bound\2", text) if text else text

    for (model, dname, rank, step), rs in grouped.items():
        if step == "step":
            t = sum(r["time_s"] for r in rs)
            f = sum(r["floor_s"] for r in rs)
            lines.append(f"| {model} | {dname} | {rank} | **whole step** ({len(rs)} buckets), device | | | | | | "
                         f"{sum(r['bytes'] for r in rs) / 1e6:.1f} (floor) | {t * 1e6:.1f} | "
                         f"floor {f * 1e6:.1f} µs = {100 * f / t:.0f} % | |")
            for r in rs:
                if "host_s" in r:
                    lines.append(f"| {model} | {dname} | {rank} | bucket {r['bucket']}: host {r['host_s'] * 1e6:.1f} "
                                 f"µs, device {r['device_s'] * 1e6:.1f} µs | | | | | | | {r['predicted_s'] * 1e6:.1f} "
                                 f"| | **{r['bound']}-bound** ({r['host_segments']}/3 segments host-bound) |")
            continue
        worst = min(rs, key=lambda r: r["copy_fraction"])
        lines.append(
            f"| {model} | {dname} | {rank} | {step} | {worst['programs']} | {worst['waves']} | "
            f"{worst['blocks_per_sm']} | {worst['registers']} | {worst['spill_bytes']} | "
            f"{sum(r['bytes'] for r in rs) / 1e6:.1f} | {sum(r['time_s'] for r in rs) * 1e6:.1f} | "
            f"{100 * worst['copy_fraction']:.0f} | {bound(worst['bound'])} |"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=["resnet50", "gpt2", "bert-base"], choices=sorted(MODELS),
                   metavar="MODEL", help=f"models whose 25 MB DDP buckets are modelled, of {', '.join(sorted(MODELS))} "
                                         "(default resnet50 gpt2 bert-base)")
    add_rank_option(p, plural=True, deprecated="--ranks", dest="ranks", nargs="+", type=positive(int),
                    default=[1, 4, 16], metavar="R", help=RANK_HELP + " (default 1 4 16)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES),
                   help="gradient (bucket) dtypes (default fp32 bf16)")
    p.add_argument("--gpu", default="h200", choices=sorted(GPUS),
                   help="GPU spec: SMs, HBM bandwidth, latencies, registers and shared memory (default h200)")


def run(args) -> int:
    import os

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the model reads the kernels compiled for the GPU", file=sys.stderr)
        return 2
    spec = GPUS[args.gpu]
    rows = model_table(args.models, args.ranks, args.dtypes, args.gpu, usage=compiled_usage)
    host = default_host()
    print(f"Performance model, {spec.name} (sm_{spec.arch}, {spec.sms} SMs, copy {spec.copy_bandwidth / 1e12:.2f} TB/s)"
          f"; worst bucket per launch; not a measurement. Host: {host.name}, triton {host.triton} (measured by "
          f"bench --host-overhead): {host.launch_s * 1e6:.1f} µs per launch, {host.step_s * 1e6:.1f} µs of hook "
          f"Python per bucket step, {host.collective_s * 1e6:.1f} µs per all-reduce call; per bucket: the slower of "
          "host and device per segment between collectives")
    print(format_table(rows))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m powersgd_triton.perfmodel", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
