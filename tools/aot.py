"""Compile every autotuner candidate ahead of time for GPU targets, on a machine without a GPU.

``python -m tools.aot [--ranks 4 16] [--ranks-for orthogonalize=4] [--archs 80 90]
[--dtypes bf16] [--jobs 2] [--all-variants] [--json PATH]``

``python -m tools.aot --plan CASES.json --jsonl OUT.jsonl [--archs 90] [--jobs 2] [--usage]``
compiles what a list of bucket cases launches instead (:func:`plan_jobs`; used by ``bench/gpu_check.py``), one JSON
line per compilation as it finishes, with :func:`resource_usage` when ``--usage``.

Runs :func:`~tools.aot_compile.compile_aot` for each kernel, each config of
:func:`~powersgd_triton.ops.configs.config_space` at each rank (rank 4 covers the broadcast-multiply path,
rank 16 the ``tl.dot`` path; together they cover every config the space offers at any rank) plus the heuristic
config, and each target ``sm_<arch>``, in a pool of processes. A config fails when Triton/ptxas raises or when its
shared memory exceeds what one block may use on that target. By default each config is compiled with its kernel's
first feature variant (error feedback and the update flag on: the largest code); ``--all-variants`` compiles them all.
Needs ``TRITON_INTERPRET`` unset. Exit status 1 when anything fails; ``--json PATH`` writes every result.

:func:`resource_usage` reads what one compiled kernel needs per thread and per block (registers, spills, shared memory)
and how many of its blocks fit on one SM, without a GPU.
"""

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Dict, Iterable, List, Optional, Sequence

from powersgd_triton.ops.occupancy import SM_LIMITS, blocks_per_sm

# Largest shared memory one block may use (bytes), per target: A100 163 KiB, H100/H200 227 KiB, sm_86/89 99 KiB.
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


def _nvidia_tool(name: str, arch: int) -> Optional[str]:
    """Path of the CUDA tool ``name`` that Triton ships (and uses for ``sm_<arch>``), or None."""
    if name == "ptxas":
        try:  # the ptxas Triton itself compiles this arch with (triton >= 3.5 has one per arch family)
            from triton.backends.nvidia.compiler import get_ptxas

            try:
                return get_ptxas(arch).path
            except TypeError:
                return get_ptxas().path
        except Exception:  # noqa: BLE001 - older/newer triton: fall back to the shipped binary
            pass
    try:
        import triton.backends.nvidia as nv

        path = os.path.join(os.path.dirname(nv.__file__), "bin", name)
        return path if os.access(path, os.X_OK) else None
    except Exception:  # noqa: BLE001
        return None


_USAGE_CACHE: Dict[tuple, dict] = {}

# One SASS instruction of ``cuobjdump -sass``: "/*0a60*/  @P4 LDG.E R108, desc[UR6][R6.64] ;"
_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_SASS_REG = re.compile(r"(?<![\w.])R(\d+)(?:\.(64|128))?")
_SASS_BRANCH = re.compile(r"^BRA(?:\.\w+)*\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)")


def _sass_registers(operand: str) -> List[int]:
    out = []
    for m in _SASS_REG.finditer(operand):
        first, width = int(m.group(1)), {None: 1, "64": 2, "128": 4}[m.group(2)]
        out += range(first, first + width)
    return out


def _sass_instruction(text: str):
    """(opcode, registers written, registers read) of one SASS instruction (its guard predicate dropped). The
    first operand is the destination when it is a register (stores, branches, barriers and compares into
    predicates have none); a load or a wide multiply writes as many registers as its width."""
    text = re.sub(r"^@!?U?P[T\d]+\s+", "", text)
    op, _, rest = text.partition(" ")
    operands = [o.strip() for o in rest.split(",")] if rest.strip() else []
    if operands and re.match(r"^R\d+", operands[0]):
        first = _sass_registers(operands[0])[0]
        width = 4 if ".128" in op else 2 if (".64" in op and op.startswith("LD")) or op.startswith("IMAD.WIDE") else 1
        written = list(range(first, first + width))
        read = [r for o in operands[1:] for r in _sass_registers(o)]
    else:
        written, read = [], [r for o in operands for r in _sass_registers(o)]
    return op, written, read


def sass_loops(sass: str, trips: int = 16) -> List[dict]:
    """Every loop of a kernel's SASS (``cuobjdump -sass`` text; a loop is a backward branch and the instructions
    from its target to it) replayed for its global loads in flight.

    The replay: every instruction takes no time, every global load (``LDG``) one unit (a DRAM latency), and an
    instruction that reads or overwrites a register a load has not yet written waits for that load (the
    scoreboard); the loop body runs ``trips`` times and ``trip_latencies`` is the steady-state time of one trip
    (the average over the second half), in latencies. A loop whose loads are all issued before it waits for any
    of them takes 1; one that waits for part of its loads before issuing the rest takes more; one that consumes a
    load only a trip later (register prefetch without a copy) can take less. Loads into shared memory
    (``cp.async``, ``LDGSTS``) are not replayed. Returns per loop: ``start``, ``end`` (addresses),
    ``instructions``, ``global_loads``, ``trip_latencies``, and counts of ``barriers`` (BAR), ``shuffles``
    (SHFL), ``shared`` (LDS/STS), ``local`` (LDL/STL: spills) inside the loop."""
    code = [(int(m.group(1), 16), m.group(2).strip()) for line in sass.splitlines()
            for m in [_SASS_LINE.match(line)] if m]
    out = []
    for addr, text in code:
        m = _SASS_BRANCH.match(re.sub(r"^@!?U?P[T\d]+\s+", "", text))
        if not m or int(m.group(1), 16) > addr:
            continue
        start = int(m.group(1), 16)
        body = [_sass_instruction(t) for a, t in code if start <= a <= addr]
        pending: Dict[int, float] = {}
        t, ends = 0.0, []
        for _ in range(trips):
            for op, written, read in body:
                for reg in set(read) | set(written):
                    if reg in pending:
                        t = max(t, pending.pop(reg) + 1.0)
                if op.startswith("LDG"):
                    for reg in written:
                        pending[reg] = t
            ends.append(t)
        half = trips // 2
        ops = [op for op, _, _ in body]
        out.append(dict(
            start=start, end=addr, instructions=len(body), global_loads=sum(o.startswith("LDG") for o in ops),
            trip_latencies=(ends[-1] - ends[half - 1]) / (trips - half),
            barriers=sum(o.startswith("BAR") for o in ops), shuffles=sum(o.startswith("SHFL") for o in ops),
            shared=sum(o.startswith(("LDS", "STS")) for o in ops), local=sum(o.startswith(("LDL", "STL")) for o in ops),
        ))
    return out


_SASS_CACHE: Dict[tuple, str] = {}


def sass_text(compiled, arch: int) -> str:
    """``cuobjdump -sass`` of a compiled kernel's cubin (the ``cuobjdump`` Triton ships for ``sm_<arch>``), cached per
    binary. Raises ``RuntimeError`` when cuobjdump is missing or fails."""
    import hashlib

    cubin = compiled.asm["cubin"]
    key = (hashlib.sha256(cubin).hexdigest(), arch)
    if key in _SASS_CACHE:
        return _SASS_CACHE[key]
    tool = _nvidia_tool("cuobjdump", arch)
    if tool is None:
        raise RuntimeError("cuobjdump not found (triton ships it under triton/backends/nvidia/bin)")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        proc = subprocess.run([tool, "-sass", path], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"cuobjdump -sass failed ({proc.returncode}): {proc.stderr[-2000:]}")
    _SASS_CACHE[key] = proc.stdout
    return proc.stdout


def sass_instructions(sass: str) -> int:
    """SASS instructions of a kernel up to its last ``EXIT`` (the padding after it, ``BRA`` to itself and ``NOP``s,
    not counted): what one program of a kernel without a loop issues per warp, at most."""
    code = [m.group(2).strip() for line in sass.splitlines() for m in [_SASS_LINE.match(line)] if m]
    last = max((i for i, t in enumerate(code) if re.sub(r"^@!?U?P[T\d]+\s+", "", t).startswith("EXIT")),
               default=len(code) - 1)
    return last + 1


def main_loop(compiled, arch: int) -> Optional[dict]:
    """:func:`sass_loops` of a kernel compiled by ``aot_compile.compile_aot`` for ``sm_<arch>`` (its cubin through
    the ``cuobjdump`` Triton ships), the loop with the most instructions (the streaming loop of the bucket
    kernels); None when the kernel has no loop. Raises ``RuntimeError`` when cuobjdump is missing or fails."""
    # not the one-instruction branch to itself after EXIT (padding, never executed)
    found = [lp for lp in sass_loops(sass_text(compiled, arch)) if lp["instructions"] > 1]
    return max(found, key=lambda lp: lp["instructions"]) if found else None


def ptx_code(ptx) -> str:
    """A kernel's PTX without what names where it was compiled from: comment lines, ``.file`` and ``.loc``
    directives and the DWARF sections after the code (Triton's disk cache may hand back a binary compiled from
    another checkout of the same source). Equal for the same code."""
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    out = []
    for ln in ptx.splitlines():
        if re.match(r"^\s*\.section\s+\.debug", ln):
            break
        if not re.match(r"^\s*(//|\.file\b|\.loc\b)", ln):
            out.append(ln)
    return "\n".join(out)


def ptx_digest(ptx) -> str:
    """SHA-256 of :func:`ptx_code`: equal for the same code, however and wherever it was compiled."""
    import hashlib

    return hashlib.sha256(ptx_code(ptx).encode()).hexdigest()


# A global load or store of PTX: "ld.global.nc.v4.b32 {...}, [%rd1];", "@%p1 st.global.b16 [%rd2], %rs1;"
_PTX_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)*)\s")
# An asynchronous copy global -> shared (the software-pipelined loads of tl.dot operands):
# "cp.async.cg.shared.global [ %r72 + 0 ], [ %rd20 + 0 ], 0x10, %r73;" (its third operand: bytes)
_PTX_CP_ASYNC = re.compile(
    r"\bcp\.async\.(?:ca|cg)\.shared\.global(?:\.[\w:]+)*\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-fA-F]+|\d+)")


def ptx_access_bytes(ptx, max_element_bits: int = 32) -> dict:
    """Widths in bytes of the global loads and stores of a kernel's PTX (``ld.global`` / ``st.global``: vector count
    x element bits / 8; ``ld.global.v4.b32`` is 16 bytes, ``ld.global.b16`` 2; ``cp.async`` global -> shared, the
    software-pipelined operand loads of ``tl.dot``, its byte count) whose elements have at most
    ``max_element_bits`` bits: by default the data (float32, bfloat16, float16 gradients, error memory and factors;
    int32 tile rows), not the int64 rows of the layout tables nor float64 Gram slots. Returns ``load_bytes`` and
    ``store_bytes`` (the widest), ``narrowest_load_bytes`` and ``narrowest_store_bytes`` (0 when there is none)."""
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    widths: Dict[str, List[int]] = {"ld": [], "st": []}
    for m in _PTX_ACCESS.finditer(ptx):
        mods = m.group(2).split(".")
        vec = next((int(x[1:]) for x in mods if re.fullmatch(r"v\d", x)), 1)
        bits = next((int(t[1:]) for t in reversed(mods) if re.fullmatch(r"[bfsu](8|16|32|64|128)", t)), None)
        if bits and bits <= max_element_bits:
            widths[m.group(1)].append(vec * bits // 8)
    for m in _PTX_CP_ASYNC.finditer(ptx):  # loads too (into shared memory): their width is the copy's bytes
        widths["ld"].append(int(m.group(1), 0))
    return dict(load_bytes=max(widths["ld"], default=0), store_bytes=max(widths["st"], default=0),
                narrowest_load_bytes=min(widths["ld"], default=0), narrowest_store_bytes=min(widths["st"], default=0))


def resource_usage(compiled, arch: int) -> dict:
    """Registers, spills, shared memory and occupancy of a kernel compiled by ``aot_compile.compile_aot`` (no GPU).

    ``compiled`` is Triton's ``CompiledKernel`` for ``sm_<arch>`` (``arch`` 80 or 90). Runs ``ptxas -v`` (the one
    Triton ships for that arch) on the kernel's PTX for the register count and the spill bytes, reads the shared
    memory, warps and stages from Triton's metadata, and applies :func:`blocks_per_sm`. Returns a dict:
    ``registers`` (per thread), ``spill_bytes`` (spill stores + spill loads, bytes per thread), ``stack_bytes``,
    ``shared_bytes`` (per block: Triton's dynamic + ptxas's static), ``num_warps``, ``num_stages``,
    ``blocks_per_sm`` and its four limits (``by_registers``, ``by_shared``, ``by_warps``, ``by_blocks``).
    Raises ``ValueError`` for an arch without limits and ``RuntimeError`` when ptxas is missing or fails.
    On a GPU the loaded kernel's ``n_regs`` (and ``n_spills``, local memory in 4-byte words) are the driver's view
    of the same binary.
    """
    if arch not in SM_LIMITS:
        raise ValueError(f"no occupancy limits for sm_{arch}; known: {sorted(SM_LIMITS)}")
    md = compiled.metadata
    key = (getattr(md, "hash", None) or id(compiled), arch)
    if key in _USAGE_CACHE:
        return dict(_USAGE_CACHE[key])
    ptx = compiled.asm["ptx"]
    if isinstance(ptx, bytes):
        ptx = ptx.decode()
    ptxas = _nvidia_tool("ptxas", arch)
    if ptxas is None:
        raise RuntimeError("ptxas not found (triton ships it under triton/backends/nvidia/bin)")
    target = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.MULTILINE)
    cmd = [ptxas, "-v", f"--gpu-name={target.group(1) if target else f'sm_{arch}'}"]
    if not getattr(md, "enable_fp_fusion", True):
        cmd.append("--fmad=false")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run(cmd + [src, "-o", os.path.join(d, "kernel.cubin")], capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", log)
    if proc.returncode != 0 or regs is None:
        raise RuntimeError(f"ptxas -v failed ({proc.returncode}): {log[-2000:]}")
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    smem = re.search(r"(\d+) bytes smem", log)
    shared = int(getattr(md, "shared", 0) or 0) + (int(smem.group(1)) if smem else 0)
    num_warps = int(getattr(md, "num_warps", 4))
    out = dict(
        registers=int(regs.group(1)),
        spill_bytes=int(spill.group(2)) + int(spill.group(3)) if spill else 0,
        stack_bytes=int(spill.group(1)) if spill else 0,
        shared_bytes=shared,
        num_warps=num_warps,
        num_stages=int(getattr(md, "num_stages", 1)),
    )
    out.update(blocks_per_sm(out["registers"], num_warps, shared, arch))
    _USAGE_CACHE[key] = dict(out)
    return out


def jobs(
    kernels: Optional[Sequence[str]] = None,
    ranks: Sequence[int] = (4, 16),
    dtypes: Sequence[str] = ("bf16",),
    archs: Sequence[int] = (80, 90),
    all_variants: bool = False,
    ranks_for: Optional[Dict[str, Sequence[int]]] = None,
) -> List[dict]:
    """The distinct compilations: one per (kernel, config, padded rank, dtype, variant, arch).

    ``ranks_for`` overrides ``ranks`` per kernel (e.g. ``{"orthogonalize": [4]}``).
    """
    from powersgd_triton.layout import padded_rank
    from tools import aot_compile
    from powersgd_triton.autotune.keys import parse_dtype
    from powersgd_triton.autotune.tuner import KERNELS, candidates

    out, seen = [], set()
    for kernel in kernels or KERNELS:
        variants = list(aot_compile.variants(kernel))
        variants = variants if all_variants else variants[:1]
        for dname in dtypes:
            dtype = parse_dtype(dname)
            for rank in (ranks_for or {}).get(kernel, ranks):
                configs, _ = candidates(kernel, _FakeLayout(rank), dtype)  # exactly what the tuner times
                for cfg in configs:
                    R = padded_rank(rank, cfg.get("USE_DOT", False))
                    for variant in variants:
                        for arch in archs:
                            key = (kernel, json.dumps(cfg, sort_keys=True), R, dname, json.dumps(variant), arch)
                            if key not in seen:
                                seen.add(key)
                                out.append(dict(kernel=kernel, config=cfg, rank=rank, R=R, dtype=dname,
                                                variant=variant, arch=arch))
    # Longest first (orthogonalize unrolls R columns: its compile time grows ~R^2) for a balanced pool.
    out.sort(key=lambda j: -(j["R"] ** 2 if j["kernel"] == "orthogonalize" else j["R"]))
    return out


class _FakeLayout:
    """What the tuner's candidates (and heuristic_config) read from a layout."""

    def __init__(self, max_rank: int):
        self.max_rank = max_rank


def _case_layout(case: dict):
    """The CPU :class:`~powersgd_triton.layout.BucketLayout` of a plan case (see :func:`plan_jobs`)."""
    import torch

    from powersgd_triton.layout import BucketLayout
    from powersgd_triton.autotune.keys import parse_dtype

    dtype = parse_dtype(case["dtype"])
    if case.get("batched"):
        return BucketLayout.batched(int(case["numel"]), int(case["rank"]), torch.device("cpu"), dtype)
    shapes = [tuple(int(d) for d in s) for s in case["shapes"]]
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    buf = torch.empty(sum(sizes), dtype=dtype)
    grads = [g.view(s) for g, s in zip(buf.split(sizes), shapes)]
    return BucketLayout.from_gradients(buf, grads, int(case["rank"]), float(case.get("min_compression_rate", 2.0)))


def plan_jobs(cases: Sequence[dict], archs: Sequence[int] = (90,)) -> List[dict]:
    """The distinct compilations that launching every kernel on every case needs, most important first.

    A case is ``{"label", "dtype" (e.g. "bf16"), "rank", "shapes": [[...], ...], "min_compression_rate"}`` or
    ``{"label", "dtype", "rank", "batched": true, "numel"}``. Per case and kernel of ``ops.kernels.KERNEL_FUNCTIONS``:
    the config the launcher uses by default (``heuristic_config`` on the case's real layout) and the one the tuner
    would pick (shipped files / heuristic; no user cache), every feature variant of ``aot_compile.variants`` the
    layout launches (the batched view's ``PADDED``/``PAD_ERROR`` variants on batched cases only). Helper
    kernels outside the tuner's list get ``{}``, or, if they need block sizes, those of the first tuned kernel whose
    config compiles them (``reduce_splits`` takes ``project_t``'s). Order: every kernel's first variant on the first
    case, then the other variants, then the other cases; duplicates (same kernel, config, padded rank, dtype, variant,
    arch) once. Must run with ``TRITON_INTERPRET`` unset (else the interpreter's configs are returned).
    """
    from powersgd_triton.ops import configs as _configs, kernels as _kernels
    from powersgd_triton.layout import padded_rank
    from tools import aot_compile
    from powersgd_triton.autotune.keys import parse_dtype
    from powersgd_triton.autotune.tuner import KERNELS as TUNED, Tuner

    tuner = Tuner(cache=False)
    out, seen = [], set()
    for ci, case in enumerate(cases):
        layout = _case_layout(case)
        dtype = parse_dtype(case["dtype"])
        configs: Dict[str, List[dict]] = {}
        for kernel in _kernels.KERNEL_FUNCTIONS:
            if kernel in TUNED:
                cands = [dict(_configs.heuristic_config(kernel, layout, dtype))]
                try:
                    chosen = dict(tuner.choose(kernel, layout, dtype).config)
                except Exception:  # noqa: BLE001 - no tuner view of this layout: the heuristic alone
                    chosen = cands[0]
                if chosen not in cands:
                    cands.append(chosen)
                configs[kernel] = cands
        for kernel in _kernels.KERNEL_FUNCTIONS:
            if kernel in TUNED:
                cfgs = configs[kernel]
            elif kernel == "orthogonalize_gram" and "orthogonalize" in configs:  # orthogonalize's first launch
                cfgs = configs["orthogonalize"]
            else:  # a helper: no block sizes, or those of a tuned kernel (tried in order when compiling)
                cfgs = [{}]
            batched = bool(getattr(layout, "batched", False))
            # the batched view's variants (PADDED, PAD_ERROR: its padding) are never launched on another layout
            launched = [v for v in aot_compile.variants(kernel) if batched or not (v.get("PADDED") or v.get("PAD_ERROR"))]
            for vi, variant in enumerate(launched):
                for cfg in cfgs:
                    try:
                        R = padded_rank(layout.max_rank, bool(cfg.get("USE_DOT", False)))
                    except Exception:  # noqa: BLE001
                        R = layout.max_rank
                    for arch in archs:
                        key = (kernel, json.dumps(cfg, sort_keys=True), R, case["dtype"], json.dumps(variant,
                               sort_keys=True), arch)
                        if key in seen:
                            continue
                        seen.add(key)
                        out.append(dict(kernel=kernel, config=cfg, rank=layout.max_rank, R=R, dtype=case["dtype"],
                                        variant=variant, arch=arch, case=case.get("label", str(ci)),
                                        fallback_configs=[] if kernel in TUNED else
                                        [c for k in TUNED for c in configs.get(k, [])],
                                        order=(0 if ci == 0 else 2, 0 if vi == 0 else 1, ci, len(out))))
    out.sort(key=lambda j: j.pop("order"))
    return out


def compile_one(job: dict, usage: bool = False) -> dict:
    """Compile one job; returns it with ``ok``, ``error``, ``shared`` (bytes), ``seconds`` and, with ``usage``,
    ``usage`` (:func:`resource_usage`, or ``usage_error``). A job with ``fallback_configs`` (a helper kernel) is
    retried with each of them when its own config lacks a block size the kernel needs (``KeyError``)."""
    from tools import aot_compile
    from powersgd_triton.autotune.keys import parse_dtype

    res = dict(job)
    res.pop("fallback_configs", None)
    t0 = time.perf_counter()
    try:
        configs = [job["config"]] + list(job.get("fallback_configs", []))
        for i, cfg in enumerate(configs):
            try:
                k = aot_compile.compile_aot(job["kernel"], cfg, parse_dtype(job["dtype"]), job["rank"], job["arch"],
                                    job["variant"])
                res["config_used"] = cfg  # a helper kernel: the block sizes it was compiled with
                break
            except KeyError:
                if i == len(configs) - 1:
                    raise
        shared = int(getattr(k.metadata, "shared", 0) or 0)
        res["shared"] = shared
        limit = SMEM_LIMIT.get(job["arch"])
        if limit is not None and shared > limit:
            res.update(ok=False, error=f"shared memory {shared} B > {limit} B allowed on sm_{job['arch']}")
        else:
            res.update(ok=True, error=None)
        res["seconds"] = round(time.perf_counter() - t0, 3)  # the compile alone, without ptxas -v below
        if usage:
            try:
                res["usage"] = resource_usage(k, job["arch"])
            except Exception as exc:  # noqa: BLE001
                res["usage_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    except Exception as exc:  # noqa: BLE001 - reported per job
        res.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:2000]}")
        res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


def _compile_with_usage(job: dict) -> dict:
    return compile_one(job, usage=True)


def compile_stream(job_list: Sequence[dict], processes: int, out_path: str, usage: bool = False) -> int:
    """Compile ``job_list`` in a pool of ``processes``, appending one JSON line per finished job to ``out_path``
    (flushed at once: a run killed midway keeps what finished). Returns the number of failed jobs."""
    from concurrent.futures import as_completed

    fn = _compile_with_usage if usage else compile_one
    failed = 0
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with open(out_path, "a") as f, ProcessPoolExecutor(
        max_workers=max(1, processes), mp_context=multiprocessing.get_context(method)
    ) as pool:
        futures = [pool.submit(fn, j) for j in job_list]
        for fut in as_completed(futures):
            r = fut.result()
            failed += not r["ok"]
            f.write(json.dumps(r) + "\n")
            f.flush()
    return failed


def compile_all(job_list: Iterable[dict], processes: int = 2) -> List[dict]:
    """Compile every job in a pool of ``processes`` (in this process when 1)."""
    job_list = list(job_list)
    if processes <= 1:
        return [compile_one(j) for j in job_list]
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(max_workers=processes, mp_context=multiprocessing.get_context(method)) as pool:
        return list(pool.map(compile_one, job_list))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.aot",
        description="Compile every autotuner candidate for GPU targets without a GPU.",
    )
    p.add_argument("--kernels", nargs="+", default=None)
    from powersgd_triton.cli import RANK_HELP, add_rank_option

    add_rank_option(p, plural=True, deprecated="--ranks", dest="ranks", type=int, nargs="+", default=[4, 16],
                    metavar="R", help=RANK_HELP + " (default 4 16)")
    p.add_argument("--archs", type=int, nargs="+", default=[80, 90])
    p.add_argument("--dtypes", nargs="+", default=["bf16"])
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--ranks-for", nargs="+", default=[], metavar="KERNEL=R[,R]",
                   help="matrix approximation ranks for one kernel instead of --matrix-approximation-ranks, "
                         "e.g. orthogonalize=4")
    p.add_argument("--all-variants", action="store_true")
    p.add_argument("--json", metavar="PATH", help="write every result here")
    p.add_argument("--plan", metavar="CASES.json", help="compile what these bucket cases launch (plan_jobs)")
    p.add_argument("--jsonl", metavar="PATH", help="with --plan: append one JSON line per finished compilation")
    p.add_argument("--usage", action="store_true", help="with --plan: add resource_usage to each result")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: ahead-of-time compilation needs the real @triton.jit kernels", file=sys.stderr)
        return 2
    if args.plan:
        if not args.jsonl:
            p.error("--plan needs --jsonl")
        with open(args.plan) as f:
            cases = json.load(f)
        todo = plan_jobs(cases, args.archs)
        with open(args.jsonl + ".planned", "w") as f:  # what will be compiled, in order (for skip reports)
            json.dump(todo, f)
        return 1 if compile_stream(todo, args.jobs, args.jsonl, args.usage) else 0
    ranks_for = {}
    for item in args.ranks_for:
        kname, _, values = item.partition("=")
        ranks_for[kname] = [int(v) for v in values.split(",") if v]
    todo = jobs(args.kernels, args.ranks, args.dtypes, args.archs, args.all_variants, ranks_for)
    t0 = time.perf_counter()
    results = compile_all(todo, args.jobs)
    wall = time.perf_counter() - t0
    failed = [r for r in results if not r["ok"]]
    by_kernel: Dict[str, List[float]] = {}
    for r in results:
        by_kernel.setdefault(r["kernel"], []).append(r["seconds"])
    for kname, secs in by_kernel.items():
        print(f"{kname:14s} {len(secs):4d} compiled, {sum(secs):7.1f} s total, max {max(secs):6.1f} s")
    for r in failed:
        print(f"FAILED {r['kernel']} R={r['R']} sm_{r['arch']} {r['config']} {r['variant']}: {r['error']}")
    print(f"{len(results)} compilations, {len(failed)} failed, {wall:.1f} s wall on {args.jobs} processes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
