"""The command line's help and its mistakes: ``--help`` without torch, one-line errors with "did you mean", and
every option name a help text mentions is one the command has."""

import argparse
import os
import re
import subprocess
import sys
import time

import pytest

from _deadline import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ("train", "autotune", "bench")


def _python(code: str, *args: str):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="400")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=scaled(120))
    proc.seconds = time.monotonic() - t0
    return proc


# parses argv with the CLI's main(), then prints whether torch (or any powersgd_triton module that needs it) loaded
_HELP_PROBE = """
import sys
from powersgd_triton import cli
try:
    cli.main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.") or m == "triton")
print("EXIT", code, "HEAVY", ",".join(heavy) or "-", file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--help"]] + [[c, "--help"] for c in COMMANDS])
def test_help_does_not_import_torch(argv):
    proc = _python(_HELP_PROBE, *argv)
    assert "EXIT 0 HEAVY -" in proc.stderr, proc.stderr
    assert proc.stdout.startswith("usage: powersgd-triton"), proc.stdout
    assert proc.seconds < 20  # the interpreter's start included; the parse itself is ~0.1 s (no torch import)


MISSPELT = [
    (["train", "--hook", "powersgdd"],
     "powersgd-triton train: error: argument --hook: invalid choice: 'powersgdd' (did you mean 'powersgd'?); "
     "choose from powersgd, batched, alternating, reference, allreduce (see powersgd-triton train --help)"),
    (["train", "--workload", "digit"],
     "powersgd-triton train: error: argument --workload: invalid choice: 'digit' (did you mean 'digits'?); "
     "choose from digits, mnist5k, charlm (see powersgd-triton train --help)"),
    (["train", "--kernels", "trition"],
     "powersgd-triton train: error: argument --kernels: invalid choice: 'trition' (did you mean 'triton'?); "
     "choose from auto, triton, torch (see powersgd-triton train --help)"),
    (["autotune", "--model", "resnet"],
     "powersgd-triton autotune: error: argument --model: invalid choice: 'resnet' (did you mean 'resnet50'?); "
     "choose from bert-base, gpt2, resnet50, vit-b16 (see powersgd-triton autotune --help)"),
    (["trian"],
     "powersgd-triton: error: unknown command 'trian' (did you mean 'train'?); the commands: train, autotune, "
     "bench (see powersgd-triton --help)"),
    (["train", "--amp", "xyz"],  # nothing close: no guess
     "powersgd-triton train: error: argument --amp: invalid choice: 'xyz'; choose from fp16, bf16 "
     "(see powersgd-triton train --help)"),
]


@pytest.mark.parametrize("argv, line", MISSPELT, ids=[" ".join(argv) for argv, _ in MISSPELT])
def test_misspelt_choice_gets_one_line_and_the_closest_choice(argv, line):
    proc = _python(_HELP_PROBE, *argv)
    err = proc.stderr.splitlines()
    assert err[-1] == "EXIT 2 HEAVY -", proc.stderr  # refused before anything heavy is imported
    assert err[:-1] == [line], proc.stderr
    assert proc.stdout == ""


def _visible_options(sub):
    return {o for a in sub._actions if a.help is not argparse.SUPPRESS for o in a.option_strings if o.startswith("--")}


def _named_options(sub):
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", sub.format_help()))


def test_every_option_a_help_text_names_exists(monkeypatch):
    """An option name written in a help text (``--models/--matrix-approximation-ranks``) is one of that command's
    listed options: a renamed option cannot linger in another's help (``bench --help`` named the old ``--ranks``,
    which is now a hidden deprecated alias)."""
    monkeypatch.setenv("COLUMNS", "1000")  # no line breaks inside option names
    from powersgd_triton.cli import build_parser

    parser = build_parser()
    assert set(parser.subcommand_parsers) == set(COMMANDS)
    for name, sub in parser.subcommand_parsers.items():
        named, visible = _named_options(sub), _visible_options(sub)
        assert named == visible, (name, "named, not listed:", sorted(named - visible),
                                  "listed, not named:", sorted(visible - named))


def test_the_help_check_catches_a_stale_option_name(monkeypatch):
    """The check above fails on a help that names the hidden old ``--ranks``."""
    monkeypatch.setenv("COLUMNS", "1000")
    from powersgd_triton.cli import build_parser

    sub = build_parser().subcommand_parsers["bench"]
    assert "--ranks" in {o for a in sub._actions for o in a.option_strings}  # still parsed, with a warning
    sub.description += " Compare --models/--ranks/--dtypes."
    assert _named_options(sub) - _visible_options(sub) == {"--ranks"}


def test_bench_comma_lists_name_the_closest_choice():
    proc = _python(_HELP_PROBE, "bench", "--models", "resnet50,gtp2")
    assert proc.stderr.splitlines() == [
        "powersgd-triton bench: error: argument --models: unknown model 'gtp2' (did you mean 'gpt2'?); choose from "
        "resnet50, bert-base, gpt2, vit-b16 (see powersgd-triton bench --help)", "EXIT 2 HEAVY -"], proc.stderr
    from powersgd_triton.benchmarking import DTYPES
    from powersgd_triton.cli.bench import DTYPE_NAMES

    assert set(DTYPE_NAMES) == set(DTYPES)
