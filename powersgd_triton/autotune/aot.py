"""Compile every autotuner candidate ahead of time for GPU targets, on a machine without a GPU.

``python -m powersgd_triton.autotune.aot [--ranks 4 16] [--ranks-for orthogonalize=4] [--archs 80 90]
[--dtypes bf16] [--jobs 2] [--all-variants] [--json PATH]``

Runs :func:`~powersgd_triton.kernels.triton_ops.compile_aot` for each kernel, each config of
:func:`~powersgd_triton.kernels.triton_ops.config_space` at each rank (rank 4 covers the broadcast-multiply path,
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

# Largest shared memory one block may use (bytes), per target: A100 163 KiB, H100/H200 227 KiB, sm_86/89 99 KiB.
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


# Per-SM limits of the occupancy calculation (CUDA C++ Programming Guide, "Technical Specifications per Compute
# Capability"; the arithmetic of cuda_occupancy.h): 64K 32-bit registers in 4 sub-partitions, allocated per warp in
# units of 256, at most 255 per thread; 2048 threads (64 warps) and 32 blocks per SM; shared memory per SM 164 KiB
# (A100) / 228 KiB (H100, H200), allocated in 128-byte units, plus 1 KiB the system reserves per block.
SM_LIMITS = {
    80: dict(regs=65536, sub_partitions=4, reg_unit=256, max_regs_per_thread=255, warps=64, blocks=32,
             shared=164 * 1024, shared_unit=128, shared_reserved=1024),
    90: dict(regs=65536, sub_partitions=4, reg_unit=256, max_regs_per_thread=255, warps=64, blocks=32,
             shared=228 * 1024, shared_unit=128, shared_reserved=1024),
}


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def blocks_per_sm(registers: int, num_warps: int, shared_bytes: int, arch: int) -> Dict[str, int]:
    """How many blocks of a kernel fit on one SM of ``sm_<arch>`` (80 or 90): the minimum of four limits.

    ``registers`` per thread, ``num_warps`` per block, ``shared_bytes`` of shared memory per block (Triton's
    dynamic shared memory plus any static). Returns ``blocks_per_sm`` and the limits ``by_registers``
    (each of the 4 sub-partitions holds ``16384 // round_up(32 * registers, 256)`` warps), ``by_shared``,
    ``by_warps`` (64 per SM) and ``by_blocks`` (32 per SM). Raises ``ValueError`` for another arch.
    """
    if arch not in SM_LIMITS:
        raise ValueError(f"no occupancy limits for sm_{arch}; known: {sorted(SM_LIMITS)}")
    lim = SM_LIMITS[arch]
    if registers > lim["max_regs_per_thread"]:
        by_regs = 0
    else:
        regs_per_warp = _round_up(max(registers, 1) * 32, lim["reg_unit"])
        warps_per_part = (lim["regs"] // lim["sub_partitions"]) // regs_per_warp
        by_regs = warps_per_part * lim["sub_partitions"] // num_warps
    smem = _round_up(shared_bytes + lim["shared_reserved"], lim["shared_unit"])
    by_shared = lim["shared"] // smem
    by_warps = lim["warps"] // num_warps
    limits = dict(by_registers=by_regs, by_shared=by_shared, by_warps=by_warps, by_blocks=lim["blocks"])
    return dict(blocks_per_sm=min(limits.values()), **limits)


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


def resource_usage(compiled, arch: int) -> dict:
    """Registers, spills, shared memory and occupancy of a kernel compiled by ``triton_ops.compile_aot`` (no GPU).

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
    from ..kernels import triton_ops as ops
    from .keys import parse_dtype
    from .tuner import KERNELS, candidates

    out, seen = [], set()
    for kernel in kernels or KERNELS:
        variants = list(ops.variants(kernel))
        variants = variants if all_variants else variants[:1]
        for dname in dtypes:
            dtype = parse_dtype(dname)
            for rank in (ranks_for or {}).get(kernel, ranks):
                configs, _ = candidates(kernel, _FakeLayout(rank), dtype)  # exactly what the tuner times
                for cfg in configs:
                    R = ops.padded_rank(rank, cfg.get("USE_DOT", False))
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


def compile_one(job: dict) -> dict:
    """Compile one job; returns it with ``ok``, ``error``, ``shared`` (bytes) and ``seconds``."""
    from ..kernels import triton_ops as ops
    from .keys import parse_dtype

    res = dict(job)
    t0 = time.perf_counter()
    try:
        k = ops.compile_aot(job["kernel"], job["config"], parse_dtype(job["dtype"]), job["rank"], job["arch"],
                            job["variant"])
        shared = int(getattr(k.metadata, "shared", 0) or 0)
        res["shared"] = shared
        limit = SMEM_LIMIT.get(job["arch"])
        if limit is not None and shared > limit:
            res.update(ok=False, error=f"shared memory {shared} B > {limit} B allowed on sm_{job['arch']}")
        else:
            res.update(ok=True, error=None)
    except Exception as exc:  # noqa: BLE001 - reported per job
        res.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:2000]}")
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


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
        prog="python -m powersgd_triton.autotune.aot",
        description="Compile every autotuner candidate for GPU targets without a GPU.",
    )
    p.add_argument("--kernels", nargs="+", default=None)
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 16])
    p.add_argument("--archs", type=int, nargs="+", default=[80, 90])
    p.add_argument("--dtypes", nargs="+", default=["bf16"])
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--ranks-for", nargs="+", default=[], metavar="KERNEL=R[,R]",
                   help="ranks for one kernel instead of --ranks, e.g. orthogonalize=4")
    p.add_argument("--all-variants", action="store_true")
    p.add_argument("--json", metavar="PATH", help="write every result here")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: ahead-of-time compilation needs the real @triton.jit kernels", file=sys.stderr)
        return 2
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
