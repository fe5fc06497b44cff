"""Command line: ``powersgd-triton train | autotune | bench`` (also ``python -m powersgd_triton``).

Each sub-command's parser lives in a module that exposes ``add_parser(subparsers)`` (registers its arguments and
sets ``func`` on the parsed namespace); this module only wires them together with argparse. None of those modules
imports torch at import time, so ``powersgd-triton --help`` and ``powersgd-triton <command> --help`` answer in a
fraction of a second; the command's own module (and torch) is imported when it runs.

A mistake on the command line gets one line on stderr, ``<prog>: error: <what> (see <prog> --help)``, exit status
2; a misspelt choice or option name also gets the closest valid one (``did you mean 'powersgd'?``).
"""

import argparse
import difflib
import importlib
import math
import sys
from typing import Dict, List, Optional

# sub-command name -> module providing add_parser(subparsers)
SUBCOMMANDS = {
    "train": "powersgd_triton.train.cli",
    "autotune": "powersgd_triton.cli.autotune",
    "bench": "powersgd_triton.cli.bench",
}


def _did_you_mean(word: str, options) -> str:
    """`` (did you mean 'x'?)`` for the option closest to ``word`` (difflib), ``""`` when none is close."""
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``<prog>: error: <message> (see <prog> --help)`` on stderr, exit status 2
    (argparse prints the whole usage first); an invalid choice names the closest valid one and the choices."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _check_value(self, action, value):
        choices = action.choices
        if choices is not None and value not in choices:
            listed = ", ".join(map(str, choices))
            if isinstance(action, argparse._SubParsersAction):
                raise argparse.ArgumentError(
                    None, f"unknown command {value!r}{_did_you_mean(value, choices)}; the commands: {listed}")
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r}{_did_you_mean(value, choices)}; choose from {listed}")


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
                    f"unknown {what} {item!r}{_did_you_mean(item, choices)}; choose from {', '.join(choices)}")
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


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; ``parser.subcommand_parsers`` maps each sub-command name to its own parser."""
    parser = Parser(
        prog="powersgd-triton",
        description="PowerSGD gradient compression for PyTorch DDP with grouped Triton kernels.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}", parser_class=Parser)
    sub.required = True
    parser.subcommand_parsers = {}  # type: Dict[str, argparse.ArgumentParser]
    for name, module in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module.startswith(exc.name):
                continue  # sub-command not shipped in this build
            raise
        parser.subcommand_parsers[name] = mod.add_parser(sub)
    return parser


def _unknown_options(parser: argparse.ArgumentParser, sub: argparse.ArgumentParser, extra: List[str]) -> None:
    """The error for ``extra`` from the sub-command's parser (its name, not the top-level one), with the closest
    option names (``--workoad``: did you mean ``--workload``?). Exits with status 2."""
    known = [o for a in sub._actions for o in a.option_strings if a.help is not argparse.SUPPRESS]
    hints = []
    for word in extra:
        if word.startswith("--"):
            close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1)
            if close:
                hints.append(f"{word}: did you mean {close[0]}?")
    sub.error("unrecognized arguments: " + " ".join(extra) + "".join("; " + h for h in hints))


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = parser.subcommand_parsers.get(getattr(args, "command", None))
        # words given after the sub-command's name are its options: its parser reports them with its usage
        if sub is not None and args.command in argv and all(
                argv.index(args.command) < i for i, w in enumerate(argv) if w in extra):
            _unknown_options(parser, sub, extra)
        parser.error("unrecognized arguments: " + " ".join(extra))
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
