"""README and docs tables regenerated from the command written beside each, and checked against a fresh run.

Every measured table in ``README.md`` and in the documentation pages (``docs/**/*.md``) follows a marker line naming
the command that prints it::

    <!-- readme-table check: powersgd-triton train --workload digits --compare -->
    | hook | DDP buckets | final test acc | ... |
    |------|-------------|----------------|-----|
    ...

``check``: the table's deterministic columns (accuracy, loss, bytes, calls, compression: everything but timings)
must come back exactly as printed from a fresh run on the same machine type with the same seed.
``regenerate``: a table of timings (ms, speed-ups), which a fresh run cannot reproduce; ``--write`` rewrites it,
``--check`` skips it and says so. Timing columns of a ``check`` table (header with ``ms``, ``speed``, ``median``,
``p20``/``p80``, ``PyTorch/ours``) are never compared.

The command's first markdown table on stdout (consecutive lines starting with ``|``) is the table. Only this
project's commands run: ``powersgd-triton ...`` and ``python -m powersgd_triton ...`` (run with this Python, the
package this module belongs to first on ``PYTHONPATH``, in the README's folder, without ``TRITON_INTERPRET``: on CPU
our hooks run their torch backend, as in the tables).

Without ``--file`` the commands work on README.md and every page under ``docs/`` that has a marked table; a command
marked in several places (the digits table is in the README and in ``docs/benchmarks.md``) runs once and its table
goes to every place. Commands run from the checkout's root (the folder with ``pyproject.toml``).

Usage (from a checkout)::

    python -m tools.readme_tables --list               # the tables and their commands
    python -m tools.readme_tables --check              # every check table against a fresh run
    python -m tools.readme_tables --write              # regenerate every table in place
    python -m tools.readme_tables --check --only digits # tables whose marker contains "digits"
    python -m tools.readme_tables --check --file docs/benchmarks.md   # one file
    python -m tools.readme_tables --write --append='--timeout 3600'   # train's own 900 s limit raised

The digits depend on the CPU's math kernels: ``powersgd-triton train`` pins them on CPU
(:data:`powersgd_triton.train.launch.CPU_NUMERICS_ENV`), and ``--write`` records the machine it ran on in a
``<!-- readme-tables machine: ... -->`` line (CPU vendor, family and model, torch version). ``--check`` on that
machine type compares exactly; on another one it says so and compares accuracy within ``0.02`` and loss (or
bits/char) within 15 %, the other columns exactly: a broken hook still shows, the last digits of another CPU do not.

``--check`` exits 1 and prints each difference (table, row, column, README value, fresh value) when a checked cell
differs; 2 for a bad README (marker without a table to check, unknown command) or a command that fails.
"""

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

MARKER = re.compile(r"^<!--\s*readme-table\s+(check|regenerate)\s*:\s*(.+?)\s*-->\s*$")
MACHINE = re.compile(r"^<!--\s*readme-tables\s+machine\s*:\s*(.+?)\s*-->\s*$")
# On another machine type: accuracy columns within this much (absolute), loss / bits columns within this fraction
ACCURACY_TOLERANCE = 0.02
LOSS_TOLERANCE = 0.15
# headers of columns that hold timings: never compared
TIMING_HEADER = re.compile(r"(\bms\b|ms/|speed|median|\bp20\b|\bp80\b|PyTorch/ours|seconds|time)", re.IGNORECASE)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ReadmeTableError(ValueError):
    """A marker without a usable table or command, or a command that failed or printed no table."""


@dataclass
class Table:
    """One marked table of a README: ``lines[start:end]`` are its rows (``start == end``: no table yet)."""

    mode: str  # "check" or "regenerate"
    command: str
    marker_line: int  # 0-based index of the marker line
    start: int
    end: int
    lines: List[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"line {self.marker_line + 1}: {self.command}"


def machine() -> str:
    """This machine type as the tables depend on it: architecture, CPU vendor, family and model (Linux'
    ``/proc/cpuinfo``; ``platform.processor()`` elsewhere), and the torch version."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    cpu = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("vendor_id", "cpu family", "model") and key not in cpu:
                    cpu[key] = value.strip()
                if not line.strip() and cpu:
                    break
    except OSError:
        pass
    if len(cpu) == 3:
        desc = f"{cpu['vendor_id']} family {cpu['cpu family']} model {cpu['model']}"
    else:
        desc = platform.processor() or "unknown CPU"
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "none"
    return f"{platform.machine()} {desc}, torch {torch_version}"


def recorded_machine(text: str) -> Optional[str]:
    """The machine of the ``<!-- readme-tables machine: ... -->`` line of ``text``; None without one."""
    for line in text.split("\n"):
        m = MACHINE.match(line.strip())
        if m:
            return m.group(1)
    return None


def find_tables(text: str) -> List[Table]:
    """Every marked table of ``text`` (a README), in order. Blank lines between marker and table are allowed."""
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines):
        m = MARKER.match(line.strip())
        if not m:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        k = j
        while k < len(lines) and lines[k].lstrip().startswith("|"):
            k += 1
        if k == j:  # no table after the marker: --write inserts one right after it
            j = k = i + 1
        out.append(Table(m.group(1), m.group(2), i, j, k, lines[j:k]))
    return out


def extract_table(output: str) -> List[str]:
    """The first markdown table (consecutive lines starting with ``|``) of a command's output."""
    block: List[str] = []
    for line in output.splitlines():
        if line.lstrip().startswith("|"):
            block.append(line.rstrip())
        elif block:
            break
    return block


def parse_table(lines: Sequence[str]) -> Tuple[List[str], List[List[str]]]:
    """``(header, rows)`` of a markdown table; cells stripped; the separator line dropped."""

    def cells(line: str) -> List[str]:
        s = line.strip()
        if s.startswith("|"):
            s = s[1:]
        if s.endswith("|"):
            s = s[:-1]
        return [c.strip() for c in s.split("|")]

    if len(lines) < 2:
        raise ReadmeTableError("not a markdown table (needs a header and a separator line)")
    head = cells(lines[0])
    rows = [cells(line) for line in lines[1:] if not re.fullmatch(r"[\s|:\-]+", line)]
    return head, rows


def timing_columns(header: Sequence[str]) -> List[int]:
    """Indices of the columns whose header names a timing."""
    return [i for i, h in enumerate(header) if TIMING_HEADER.search(h)]


def _within(header: str, a: str, b: str) -> bool:
    """Whether cells ``a`` (README) and ``b`` (fresh) of column ``header`` agree within the other-machine
    tolerance: accuracy columns within :data:`ACCURACY_TOLERANCE`, loss / bits columns within
    :data:`LOSS_TOLERANCE` relative; other columns and cells that are not numbers only when equal."""
    h = header.lower()
    try:
        x, y = float(a), float(b)
    except ValueError:
        return a == b
    if "acc" in h:
        return abs(x - y) <= ACCURACY_TOLERANCE
    if "loss" in h or "bits" in h:
        return abs(x - y) <= LOSS_TOLERANCE * abs(x)
    return a == b


def compare_tables(readme: Sequence[str], fresh: Sequence[str], tolerant: bool = False) -> List[str]:
    """The differences of a README table and a fresh one, ignoring the timing columns; ``[]`` when they agree.

    Headers must be equal (a renamed or added column is a difference); then the number of rows; then every cell
    of every non-timing column, compared as printed (strings, so ``0.9944`` and ``0.99440`` differ), or with
    ``tolerant`` (a fresh run on another machine type) accuracy and loss within the tolerances of :func:`_within`.
    """
    head_r, rows_r = parse_table(readme)
    head_f, rows_f = parse_table(fresh)
    if head_r != head_f:
        return [f"columns differ: README {head_r} vs fresh {head_f}"]
    diffs = []
    if len(rows_r) != len(rows_f):
        diffs.append(f"README has {len(rows_r)} rows, the fresh run {len(rows_f)}")
    skip = set(timing_columns(head_r))
    for r, (row_r, row_f) in enumerate(zip(rows_r, rows_f)):
        name = row_r[0] if row_r else f"row {r + 1}"
        for c, h in enumerate(head_r):
            if c in skip:
                continue
            a = row_r[c] if c < len(row_r) else "<missing>"
            b = row_f[c] if c < len(row_f) else "<missing>"
            if a != b and not (tolerant and _within(h, a, b)):
                diffs.append(f"row {r + 1} ({name}), column {h!r}: README {a} vs fresh {b}")
    return diffs


def command_argv(command: str) -> List[str]:
    """The argv that runs a marker's command with this Python; ``ReadmeTableError`` for other programs."""
    try:
        words = shlex.split(command)
    except ValueError as exc:
        raise ReadmeTableError(f"cannot parse the command {command!r}: {exc}") from None
    if words[:1] == ["powersgd-triton"]:
        return [sys.executable, "-m", "powersgd_triton"] + words[1:]
    if len(words) >= 3 and words[0] in ("python", "python3") and words[1] == "-m" and (
            words[2] == "powersgd_triton" or words[2].startswith("powersgd_triton.")):
        return [sys.executable] + words[1:]
    raise ReadmeTableError(f"only powersgd-triton / python -m powersgd_triton commands run here, not {command!r}")


def command_env() -> Dict[str, str]:
    """This environment, with this package first on ``PYTHONPATH`` and without ``TRITON_INTERPRET``."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_command(command: str, cwd: str, timeout: Optional[float] = None, extra: Sequence[str] = ()) -> Tuple[
        List[str], float]:
    """``(table lines, seconds)`` of one run of ``command`` (``extra`` arguments appended); ``ReadmeTableError`` when
    it fails or prints no table."""
    argv = command_argv(command) + list(extra)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=cwd, env=command_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ReadmeTableError(f"{command}: still running after {timeout:g} s") from None
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise ReadmeTableError(f"{command}: exit status {proc.returncode}\n{tail}")
    table = extract_table(proc.stdout)
    if not table:
        raise ReadmeTableError(f"{command}: printed no markdown table")
    return table, seconds


def _run_dir(path: str) -> str:
    """Where a file's commands run: the nearest folder above it with a ``pyproject.toml`` (the checkout's root),
    else the file's own folder."""
    here = folder = os.path.dirname(os.path.abspath(path))
    while True:
        if os.path.exists(os.path.join(folder, "pyproject.toml")):
            return folder
        up = os.path.dirname(folder)
        if up == folder:
            return here
        folder = up


def _fresh(command: str, path: str, timeout, extra, cache: Optional[dict]) -> Tuple[List[str], float]:
    """:func:`run_command` of ``command`` for the file ``path``, once per command when ``cache`` is a dict."""
    if cache is not None and command in cache:
        return cache[command]
    out = run_command(command, _run_dir(path), timeout, extra)
    if cache is not None:
        cache[command] = out
    return out


def marked_files(root: str) -> List[str]:
    """``root/README.md`` and every markdown file under ``root/docs`` that has a marked table, in that order."""
    files = [os.path.join(root, "README.md")]
    docs = []
    for folder, _, names in os.walk(os.path.join(root, "docs")):
        docs += [os.path.join(folder, n) for n in names if n.endswith(".md")]
    for path in sorted(docs):
        with open(path, encoding="utf-8") as f:
            if find_tables(f.read()):
                files.append(path)
    return [f for f in files if os.path.exists(f)]


def select(tables: Sequence[Table], only: Optional[str]) -> List[Table]:
    return [t for t in tables if only is None or only in t.command]


def check(path: str, only: Optional[str] = None, timeout: Optional[float] = None, log=print,
          extra: Sequence[str] = (), cache: Optional[dict] = None) -> List[str]:
    """Run every ``check`` table's command (those containing ``only``) and return the differences (``[]``: agree).

    ``regenerate`` tables are skipped (logged). Raises ``ReadmeTableError`` for a marker without a table, a failing
    command, and when nothing matched ``only``. ``cache`` (a dict, shared between files): each command runs once.
    """
    with open(path) as f:
        text = f.read()
    tables = select(find_tables(text), only)
    if not tables:
        raise ReadmeTableError(f"no marked table in {path}" + (f" whose command contains {only!r}" if only else ""))
    recorded, here = recorded_machine(text), machine()
    tolerant = recorded != here
    if tolerant:
        log(f"the tables were made on {recorded or 'an unrecorded machine'}, this is {here}: accuracy compared "
            f"within {ACCURACY_TOLERANCE}, loss within {LOSS_TOLERANCE:.0%}, the other columns exactly")
    diffs = []
    for t in tables:
        if t.mode != "check":
            log(f"not checked (timings; regenerate with --write): {t.label}")
            continue
        if not t.lines:
            raise ReadmeTableError(f"{path} {t.label}: no table after the marker (run --write)")
        fresh, seconds = _fresh(t.command, path, timeout, extra, cache)
        found = compare_tables(t.lines, fresh, tolerant=tolerant)
        exact = not tolerant or not compare_tables(t.lines, fresh)
        verdict = "DIFFERS" if found else "agrees" if exact else "agrees within the other-machine tolerance"
        log(f"{verdict} ({seconds:.0f} s): {t.label}")
        diffs += [f"{t.label}: {d}" for d in found]
    return diffs


def write(path: str, only: Optional[str] = None, timeout: Optional[float] = None, log=print,
          extra: Sequence[str] = (), cache: Optional[dict] = None) -> Dict[str, float]:
    """Regenerate every marked table (those containing ``only``) in place; ``{command: seconds}``.

    The file is rewritten after each table, so an interrupted run keeps the tables done so far. ``cache`` (a dict,
    shared between files): each command runs once.
    """
    with open(path) as f:
        text = f.read()
    all_tables = find_tables(text)
    wanted = [i for i, t in enumerate(all_tables) if t in select(all_tables, only)]
    if not wanted:
        raise ReadmeTableError(f"no marked table in {path}" + (f" whose command contains {only!r}" if only else ""))
    times = {}
    for index in wanted:
        command = all_tables[index].command
        fresh, seconds = _fresh(command, path, timeout, extra, cache)
        times[command] = seconds
        with open(path) as f:  # re-read: line numbers of later tables move when a table grows or shrinks
            lines = f.read().split("\n")
        now = find_tables("\n".join(lines))
        if len(now) != len(all_tables) or now[index].command != command:
            raise ReadmeTableError(f"{path} changed while the tables were regenerated; run again")
        t = now[index]
        new = lines[: t.start] + fresh + lines[t.end:]
        if t.start == t.end and t.end < len(new) - len(fresh) and lines[t.end].strip():
            new.insert(t.start + len(fresh), "")  # a table inserted before text needs a blank line after it
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(new))
        os.replace(tmp, path)
        log(f"written ({seconds:.0f} s): {t.label}")
    if any(all_tables[i].mode == "check" for i in wanted):
        _record_machine(path)
    return times


def _record_machine(path: str) -> None:
    """Set the file's ``<!-- readme-tables machine: ... -->`` line to this machine (inserted before the first
    marked table when there is none)."""
    with open(path) as f:
        lines = f.read().split("\n")
    line = f"<!-- readme-tables machine: {machine()} -->"
    at = [i for i, text in enumerate(lines) if MACHINE.match(text.strip())]
    if at:
        lines[at[0]] = line
    else:
        first = next(i for i, text in enumerate(lines) if MARKER.match(text.strip()))
        lines.insert(first, line)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines))
    os.replace(tmp, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.readme_tables", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="compare the check tables with a fresh run (default)")
    mode.add_argument("--write", action="store_true", help="regenerate the tables in place")
    mode.add_argument("--list", action="store_true", help="list the marked tables")
    p.add_argument("--only", default=None, help="only tables whose command contains this text")
    p.add_argument("--file", action="append", default=None,
                   help="a markdown file (repeatable; default: README.md and the docs/ pages with marked tables)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per command")
    p.add_argument("--append", default="", metavar="ARGS",
                   help="arguments appended to every command that do not change its numbers, e.g. "
                        "--append='--timeout 3600' for train on a loaded machine")
    args = p.parse_args(argv)
    files = args.file or marked_files(os.getcwd())
    cache: dict = {}
    try:
        texts = {}
        for path in files:
            with open(path, encoding="utf-8") as f:
                texts[path] = f.read()
        wanted = [path for path in files if select(find_tables(texts[path]), args.only)]
        if not wanted:
            raise ReadmeTableError(f"no marked table in {', '.join(files)}"
                                   + (f" whose command contains {args.only!r}" if args.only else ""))
        if args.list:
            for path in wanted:
                for t in select(find_tables(texts[path]), args.only):
                    print(f"{t.mode:10s} {os.path.relpath(path)} {t.label} ({len(t.lines)} lines)")
            return 0
        diffs = []
        for path in wanted:
            log = (lambda line, _p=path: print(f"{os.path.relpath(_p)}: {line}", flush=True))
            if args.write:
                write(path, args.only, args.timeout, log=log, extra=shlex.split(args.append), cache=cache)
            else:
                diffs += [f"{os.path.relpath(path)} {d}" for d in check(path, args.only, args.timeout, log=log,
                                                                           extra=shlex.split(args.append), cache=cache)]
    except (OSError, ReadmeTableError) as exc:
        print(f"readme_tables: error: {exc}", file=sys.stderr)
        return 2
    for d in diffs:
        print(d)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
