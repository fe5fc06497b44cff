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
import sys
from typing import Dict, List, Optional

# The argparse types and options every command shares, and the table they print, live in a module of their own
# (:mod:`powersgd_triton.cli_common`) that any command may import; re-exported here, where they were.
from powersgd_triton.cli_common import (  # noqa: F401
    RANK_HELP, DeprecatedAlias, add_rank_option, comma_list, did_you_mean, positive, text_table,
)

# sub-command name -> module providing add_parser(subparsers)
SUBCOMMANDS = {
    "train": "powersgd_triton.train.cli",
    "autotune": "powersgd_triton.cli.autotune",
    "bench": "powersgd_triton.cli.bench",
}


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
                    None, f"unknown command {value!r}{did_you_mean(value, choices)}; the commands: {listed}")
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r}{did_you_mean(value, choices)}; choose from {listed}")


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
