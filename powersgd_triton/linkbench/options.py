"""The options ``bench --link`` adds to the ``bench`` parser, without torch (``powersgd-triton bench --help``)."""

import argparse
from typing import List

from powersgd_triton.cli_common import did_you_mean, positive
from powersgd_triton.linkbench.names import (
    DEFAULT_HOOKS, DEFAULT_START_ITER, DEFAULT_STEPS, LINK_HOOKS, WORKLOADS,
)
from powersgd_triton.linkbench.rates import Rate, parse_rates


def rates_type(text: str) -> List[Rate]:
    """argparse ``type`` of ``--link``: :func:`~powersgd_triton.linkbench.rates.parse_rates`."""
    try:
        return parse_rates(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _names_type(choices, what: str):
    def parse(text: str) -> List[str]:
        names = [t.strip() for t in str(text).split(",") if t.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices)}; got {text!r}")
        for name in names:
            if name not in choices:
                raise argparse.ArgumentTypeError(
                    f"unknown {what} {name!r}{did_you_mean(name, choices)}; choose from {', '.join(choices)}")
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"a {what} is listed twice in {text!r}")
        return names

    parse.__name__ = "comma list"
    return parse


hooks_type = _names_type(LINK_HOOKS, "hook")
workloads_type = _names_type(WORKLOADS, "workload")


def start_iter_type(text: str) -> int:
    value = positive(int)(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (DDP rebuilds its buckets after the first step), got "
                                         f"{value}")
    return value


def add_options(p: argparse.ArgumentParser) -> None:
    """``--link`` and the options that go with it (the bench's ``--matrix-approximation-ranks`` (one value),
    ``--device`` and ``--threads`` apply too)."""
    g = p.add_argument_group(
        "step time over a link (--link)",
        "Train a workload on 2 ranks with each hook in turn and report the median step time over the compressed "
        "steps, its p10-p90, the bytes all-reduced per step and the ratio to plain all-reduce measured in the same "
        "run, per link rate. With --netns (root, iproute2) the link is made here: two network namespaces joined by "
        "a veth pair, a tc token-bucket limit on each end, always removed again. Without it, under torchrun, each "
        "process is one rank and the link is the one the nodes have (--link names it). See docs/when-it-pays.md.")
    g.add_argument("--link", type=rates_type, default=None, metavar="RATES",
                   help="comma list of link rates in tc's units, e.g. 100mbit,1gbit,10gbit,unlimited")
    g.add_argument("--netns", action="store_true",
                   help="make each rate here between two network namespaces (root and iproute2 needed)")
    g.add_argument("--workload", type=workloads_type, default=["mnist5k"], metavar="W,...",
                   help=f"comma list of {', '.join(WORKLOADS)} (the train command's workloads; resnet18: a "
                        "CIFAR-shaped ResNet-18 on generated data) (default mnist5k)")
    g.add_argument("--hooks", type=hooks_type, default=list(DEFAULT_HOOKS), metavar="H,...",
                   help=f"comma list of {', '.join(LINK_HOOKS)}, named as the train command names them, <ours>_bf16: "
                        f"bfloat16 factors; allreduce always runs (default {','.join(DEFAULT_HOOKS)})")
    g.add_argument("--steps", type=positive(int), default=None,
                   help="timed (compressed) steps per hook and rate (default: "
                        + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items()) + ")")
    g.add_argument("--start-iter", type=start_iter_type, default=DEFAULT_START_ITER,
                   help=f"start_powerSGD_iter: untimed steps of plain all-reduce first (default {DEFAULT_START_ITER})")
    g.add_argument("--batch-size", type=positive(int), default=None, help="per rank (default: the workload's)")
    g.add_argument("--bucket-cap-mb", type=positive(float), default=None,
                   help="DDP bucket_cap_mb for our hooks and all-reduce (default: ours get the buckets PyTorch's hook "
                        "gets, one bucket on gloo; all-reduce DDP's default)")
    g.add_argument("--seed", type=int, default=0, help="seed of every hook's model, data and Q (default 0)")
    g.add_argument("--out", default=None, metavar="FILE.json", help="write the rows as JSON")
    g.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw step time against link rate per hook, the crossover marked (needs matplotlib)")
    g.add_argument("--link-timeout", type=positive(float), default=3600.0, metavar="S",
                   help="seconds one workload at one rate may take before its ranks are stopped (default 3600)")
