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
"""

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Dict, Iterable, List, Optional, Sequence

# Largest shared memory one block may use (bytes), per target: A100 163 KiB, H100/H200 227 KiB, sm_86/89 99 KiB.
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


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
