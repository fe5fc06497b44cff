"""Command line: ``powersgd-triton train | autotune | bench`` (also ``python -m powersgd_triton``).

Each sub-command lives in its own module, which exposes ``add_parser(subparsers)`` (registers its arguments and
sets ``func`` on the parsed namespace); this module only wires them together with argparse.
"""

import argparse
import importlib
import math
import sys
from typing import List, Optional

# sub-command name -> module providing add_parser(subparsers)
SUBCOMMANDS = {
    "train": "powersgd_triton.train.cli",
    "autotune": "powersgd_triton.autotune.cli",
    "bench": "powersgd_triton.bench_cli",
}


def positive(kind=float):
    """An argparse ``type`` that parses ``kind`` (int or float) and refuses values <= 0, NaN and infinity with
    argparse's message."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def text_table(headers: List[str], rows: List[List[str]]) -> str:
    """A markdown table with padded columns (what the sub-commands print)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="powersgd-triton",
        description="PowerSGD gradient compression for PyTorch DDP with grouped Triton kernels.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    sub.required = True
    for name, module in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module.startswith(exc.name):
                continue  # sub-command not shipped in this build
            raise
        mod.add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
