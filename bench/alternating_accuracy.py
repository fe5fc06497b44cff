"""Accuracy of the alternating hook against the standard hook, at the same rank and at the same bytes.

Issue 8's acceptance compares ``alternating_powerSGD_hook`` with our ``powerSGD_hook`` at the same rank (the
alternating hook then sends half the compressed bytes). This script measures that, and the two equal-bytes pairs
(alternating at rank 2r against standard at rank r; standard at rank r/2 against alternating at rank r), over
several seeds, on 2 CPU ranks (gloo), through the same training loop as ``powersgd-triton train``::

    python bench/alternating_accuracy.py --workloads digits charlm --seeds 0 1 2
    python bench/alternating_accuracy.py --workloads charlm --seeds 0 1 2 --steps 1800

It prints one markdown table per workload (accuracy, loss or bits/char, bytes and all-reduce calls per compressed
step, all measured) and the per-seed accuracy differences. About 20 s per charlm run of 600 steps on 2 cores.

``--approximation`` prints instead why the hooks differ: the relative error ``||M - approx|| / ||M||`` of each
compressed layer's averaged gradient M along a plain-SGD trajectory (:func:`powersgd_triton.analysis.approximation_errors`,
error feedback off, so every hook approximates the same M), for the standard hook, the alternating hook on its P and
on its Q steps, and the best rank-r matrix (SVD)::

    python bench/alternating_accuracy.py --approximation --workloads charlm
"""

import argparse
import json
import statistics
import sys
from typing import Dict, List, Tuple

from powersgd_triton.cli import add_rank_option
from powersgd_triton.train.loop import TrainConfig, run_training

# (hook, matrix approximation rank as a multiple of --matrix-approximation-rank): the acceptance pair first, then
# the equal-bytes pairs.
VARIANTS: Tuple[Tuple[str, float], ...] = (("powersgd", 1), ("alternating", 1), ("alternating", 2), ("powersgd", 0.5))


def measure(workload: str, seed: int, hook: str, rank: int, steps, world_size: int) -> Dict:
    cfg = TrainConfig(workload=workload, hooks=(hook,), matrix_approximation_rank=rank, seed=seed, steps=steps,
                      world_size=world_size, progress=False)
    run = run_training(cfg)["runs"][hook]
    return {
        "workload": workload, "seed": seed, "hook": hook, "matrix_approximation_rank": rank, "steps": run["steps"],
        "accuracy": run["final_test_accuracy"], "loss": run["final_test_loss"],
        "bits_per_char": run.get("final_test_bits_per_char"),
        "bytes_per_step": run["allreduce_bytes_per_step"], "calls_per_step": run["allreduce_calls_per_step"],
    }


def table(rows: List[Dict], base_rank: int) -> str:
    charlm = rows[0]["workload"] == "charlm"
    head = "| hook | approx. rank | accuracy per seed | mean | " + ("bits/char mean" if charlm else "loss mean") + \
        " | all-reduced/step | calls/step | mean diff vs powerSGD_hook rank %d |" % base_rank
    lines = [head, "|" + "---|" * 8]
    base = {r["seed"]: r["accuracy"] for r in rows
            if r["hook"] == "powersgd" and r["matrix_approximation_rank"] == base_rank}
    for hook, mult in VARIANTS:
        rank = max(1, int(base_rank * mult))
        sel = [r for r in rows if r["hook"] == hook and r["matrix_approximation_rank"] == rank]
        if not sel:
            continue
        accs = [r["accuracy"] for r in sel]
        metric = [r["bits_per_char"] if charlm else r["loss"] for r in sel]
        diff = statistics.mean(r["accuracy"] - base[r["seed"]] for r in sel if r["seed"] in base)
        lines.append(
            f"| {hook} | {rank} | {' / '.join(f'{a:.4f}' for a in accs)} | {statistics.mean(accs):.4f} | "
            f"{statistics.mean(metric):.3f} | {statistics.mean(r['bytes_per_step'] for r in sel) / 1024:.1f} KiB | "
            f"{statistics.mean(r['calls_per_step'] for r in sel):g} | {100 * diff:+.2f} points |"
        )
    return "\n".join(lines)


def approximation_table(workload: str, rank: int, steps: int, world_size: int, skip: int = 10) -> str:
    """Mean relative error per layer over the recorded steps after the first ``skip`` (markdown)."""
    from powersgd_triton import analysis

    res = analysis.approximation_errors(workload=workload, mode="trajectory", ranks=(rank,), steps=steps,
                                        world_size=world_size, impls=("ours", "alternating"), kernels="torch")
    recs = [r for r in res["records"] if r["step"] > skip]

    def mean(impl, layer=None, parity=None):
        e = [r["error"] for r in recs if r["impl"] == impl and (layer is None or r["layer"] == layer)
             and (parity is None or r["step"] % 2 == parity)]
        return statistics.mean(e)

    lines = [f"| layer | matrix | powerSGD_hook | alternating, P steps | alternating, Q steps | best rank {rank} (SVD) |",
             "|---|---|---|---|---|---|"]
    for layer in res["compressed_layers"][rank] + [None]:
        shape = "x".join(map(str, res["matrix_shapes"][layer])) if layer else ""
        cells = (mean("ours", layer), mean("alternating", layer, 1), mean("alternating", layer, 0), mean("svd", layer))
        lines.append(f"| {layer or 'all layers'} | {shape} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", default=["digits", "charlm"], choices=["digits", "mnist5k", "charlm"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    add_rank_option(p, type=int, default=4, metavar="R", help="the acceptance rank r (PowerSGD's matrix approximation "
                    "rank, not a process rank)")
    p.add_argument("--steps", type=int, default=None, help="total steps (default: the workload's)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--json", default=None, help="also write every run's numbers here")
    p.add_argument("--approximation", action="store_true",
                   help="print the approximation errors along a trajectory instead of training")
    p.add_argument("--approximation-steps", type=int, default=60)
    args = p.parse_args(argv)
    if args.approximation:
        r = args.matrix_approximation_rank
        for workload in args.workloads:
            print(f"{workload}, matrix approximation rank {r}, {args.approximation_steps} steps "
                  "(first 10 not averaged):")
            print(approximation_table(workload, r, args.approximation_steps, args.world_size))
        return 0
    if args.matrix_approximation_rank < 2:
        p.error("--matrix-approximation-rank must be at least 2 (the equal-bytes pair runs the standard hook at "
                "rank r/2)")
    rows = []
    for workload in args.workloads:
        for seed in args.seeds:
            for hook, mult in VARIANTS:
                rank = max(1, int(args.matrix_approximation_rank * mult))
                row = measure(workload, seed, hook, rank, args.steps, args.world_size)
                print(f"{workload} seed {seed} {hook} rank {rank}: accuracy {row['accuracy']:.4f}", flush=True)
                rows.append(row)
        print()
        print(table([r for r in rows if r["workload"] == workload], args.matrix_approximation_rank))
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
