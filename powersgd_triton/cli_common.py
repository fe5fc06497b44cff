"""What the command-line modules share: argparse types and options, and the markdown table the commands print.

:mod:`powersgd_triton.cli` (the ``powersgd-triton`` parser), the sub-commands' parsers and the modules that have a
command of their own (:mod:`powersgd_triton.perfmodel`, :mod:`powersgd_triton.train.cli`) import these from here;
this module imports nothing of the package (and not torch), so none of them depends on another through it.
"""

import argparse
import difflib
import math
import sys
from typing import List, Optional


def did_you_mean(word: str, options) -> str:
    """`` (did you mean 'x'?)`` for the option closest to ``word`` (difflib), ``""`` when none is close."""
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


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


def comma_list(choices, what: str = "value"):
    """An argparse ``type`` for a comma list of ``choices`` (``resnet50,gpt2``): returns the text as given, refuses an
    empty list or an unknown item with the closest choice (``unknown model 'resnet5' (did you mean 'resnet50'?)``)."""
    choices = list(choices)

    def parse(text: str) -> str:
        items = [t for t in text.split(",") if t]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices)}; got {text!r}")
        for item in items:
            if item not in choices:
                raise argparse.ArgumentTypeError(
                    f"unknown {what} {item!r}{did_you_mean(item, choices)}; choose from {', '.join(choices)}")
        return text

    parse.__name__ = "comma list"
    return parse


RANK_HELP = ("PowerSGD's matrix approximation rank r (PyTorch's matrix_approximation_rank): the columns of the "
             "factors P and Q; not the process rank")


class DeprecatedAlias(argparse.Action):
    """An old option name that still works and says, on stderr, which name replaces it.

    ``p.add_argument("--rank", action=DeprecatedAlias, replacement="--matrix-approximation-rank",
    dest="matrix_approximation_rank", type=int, help=argparse.SUPPRESS)``: parses like the new option (same
    ``dest``, ``type``, ``nargs``) and prints ``<prog>: warning: --rank is deprecated ...`` once per use.
    """

    def __init__(self, option_strings, dest, replacement: str, reason: str = "", **kwargs):
        self.replacement = replacement
        self.reason = reason
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        why = f" ({self.reason})" if self.reason else ""
        print(f"{parser.prog}: warning: {option_string} is deprecated{why}; use {self.replacement}",
              file=sys.stderr, flush=True)
        setattr(namespace, self.dest, values)


def add_rank_option(parser: argparse.ArgumentParser, *, plural: bool = False, deprecated: str = "--rank",
                    dest: Optional[str] = None, **kwargs) -> None:
    """``--matrix-approximation-rank`` (alias ``--approx-rank``; ``...-ranks`` with ``plural``) on ``parser``, with
    ``deprecated`` kept as a warning alias. ``kwargs`` (type, nargs, default, help, ...) go to both; the value lands
    in ``dest`` (default ``matrix_approximation_rank(s)``)."""
    suffix = "s" if plural else ""
    dest = dest or "matrix_approximation_rank" + suffix
    kwargs.setdefault("help", RANK_HELP)
    parser.add_argument(f"--matrix-approximation-rank{suffix}", f"--approx-rank{suffix}", dest=dest, **kwargs)
    old = {k: v for k, v in kwargs.items() if k not in ("help", "default", "metavar")}
    parser.add_argument(deprecated, dest=dest, action=DeprecatedAlias, help=argparse.SUPPRESS,
                        replacement=f"--matrix-approximation-rank{suffix}",
                        reason="under torchrun a rank is a process; this is the matrix approximation rank", **old)


def text_table(headers: List[str], rows: List[List[str]]) -> str:
    """A markdown table with padded columns (what the sub-commands print)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])
