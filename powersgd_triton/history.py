"""Benchmark history: one JSON line per measured row, keyed by git commit and device, so a run can be compared with an
earlier ref (not only with PyTorch's hook in the same run).

Writers: ``powersgd-triton bench`` (``--history PATH``; by default ``bench/history.jsonl`` when run from a git
checkout of this project, ``--no-history`` to skip) and ``bench/gpu_check.py`` (its kernel and hook timings, into
``--history`` and ``$OUT/history.jsonl``). Only correct runs are recorded: the writer passes ``correct`` (``bench``:
ours against PyTorch's hook on the same buckets; ``gpu_check``: its correctness and non-finite sections without a
failure) and :func:`append` refuses the rows otherwise.

A line (``FORMAT`` = 1)::

    {"format": 1, "time": "2026-11-30T14:20:00Z", "commit": "0e5c608...", "dirty": false, "device": "cpu: AMD EPYC x2",
     "source": "bench", "key": {"model": "resnet50", "matrix_approximation_rank": 4, "dtype": "float32",
     "impl": "ours"}, "metrics": {"median_ms": 135.2, ...}, "env": {"torch": ..., "triton": ..., "load_avg": ...}}

Compare (``python -m powersgd_triton.history --ref HEAD~3``, or ``powersgd-triton bench --compare-to REF``): per
(source, key) on the same device, the newest row at ``--ref`` against the newest at ``--new`` (default: the newest
commit in the file), their ratio per metric. Times from a loaded CPU are noise: compare GPU runs, or counts.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

FORMAT = 1
DEFAULT_PATH = os.path.join("bench", "history.jsonl")
KEY_FIELDS = ("model", "matrix_approximation_rank", "dtype", "impl", "ops_backend", "shrink", "kernel", "bucket",
              "variant", "layout")
METRICS = ("median_ms", "p20_ms", "p80_ms", "aten_compute", "triton_launches", "allreduce_calls", "allreduce_bytes",
           "held_bytes", "peak_extra_bytes", "gb_s", "kernels_per_step",
           "host_us", "python_calls", "launch_call_us", "collective_call_us")  # the last four: bench --host-overhead
LOWER_IS_BETTER = {"median_ms", "p20_ms", "p80_ms", "aten_compute", "triton_launches", "allreduce_calls",
                   "allreduce_bytes", "held_bytes", "peak_extra_bytes", "kernels_per_step",
                   "host_us", "python_calls", "launch_call_us", "collective_call_us"}


class HistoryError(ValueError):
    """A history file or a ref that cannot be used (damaged line, unknown commit): the message names it."""


def git_commit(root: Optional[str] = None) -> Tuple[Optional[str], bool]:
    """``(full commit hash of HEAD, whether the work tree has changes)`` of the git checkout at ``root`` (default:
    the current folder); ``(None, False)`` outside a checkout or without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None, False
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=10)
        return head.stdout.strip(), bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, False


def resolve_ref(ref: str, root: Optional[str] = None) -> str:
    """The full commit hash of a git ref (``HEAD~3``, a branch, a short hash); ``HistoryError`` when git cannot name
    it. A 40-hex hash is returned as it is (it may be from another clone)."""
    if len(ref) == 40 and all(c in "0123456789abcdef" for c in ref.lower()):
        return ref.lower()
    try:
        out = subprocess.run(["git", "rev-parse", "--verify", ref + "^{commit}"], cwd=root, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        raise HistoryError(f"cannot resolve {ref!r}: git failed ({exc})") from None
    if out.returncode != 0:
        raise HistoryError(f"{ref!r} is not a commit of this checkout: {out.stderr.strip()}")
    return out.stdout.strip()


def device_name(env: Dict[str, Any]) -> str:
    """The device part of the key, from :func:`powersgd_triton.benchmarking.environment`: the GPU's name on CUDA, else
    ``cpu: <model> x<usable cores>``."""
    if env.get("gpu"):
        return f"cuda: {env['gpu']}"
    return f"cpu: {env.get('cpu', '?')} x{env.get('cpus_usable', '?')}"


def default_path() -> Optional[str]:
    """``bench/history.jsonl`` when the current folder is a git checkout of this project (it has ``bench/`` and
    ``powersgd_triton/``), else None."""
    if os.path.isdir("bench") and os.path.isdir("powersgd_triton") and git_commit()[0]:
        return DEFAULT_PATH
    return None


def make_records(rows: Iterable[Dict[str, Any]], *, source: str, env: Dict[str, Any], commit: Optional[str],
                 dirty: bool) -> List[Dict[str, Any]]:
    """One history line per row: its key fields (:data:`KEY_FIELDS` present in the row) and metrics
    (:data:`METRICS` that are numbers)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    keep_env = {k: env.get(k) for k in ("torch", "triton", "python", "load_avg", "torch_threads", "capability",
                                         "cuda", "triton_interpret") if k in env}
    out = []
    for row in rows:
        key = {k: row[k] for k in KEY_FIELDS if k in row and row[k] is not None}
        metrics = {k: row[k] for k in METRICS if isinstance(row.get(k), (int, float)) and not isinstance(row[k], bool)}
        if not metrics:
            continue
        out.append({"format": FORMAT, "time": now, "commit": commit, "dirty": dirty, "device": device_name(env),
                    "source": source, "key": key, "metrics": metrics, "env": keep_env})
    return out


def append(path: str, records: Sequence[Dict[str, Any]], *, correct: bool, why: str = "") -> int:
    """Append ``records`` to ``path`` (one JSON line each, one write; the folder is created) when ``correct``;
    returns how many were written. Raises ``ValueError`` when not ``correct`` (``why`` says what failed) or when a
    record has no commit (history is keyed by commit)."""
    if not correct:
        raise ValueError(f"not recorded in {path}: the run's correctness check failed" + (f" ({why})" if why else ""))
    if any(not r.get("commit") for r in records):
        raise ValueError(f"not recorded in {path}: no git commit (run from a checkout)")
    if not records:
        return 0
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    with open(path, "a") as f:
        f.write(text)
    return len(records)


def load(path: str) -> List[Dict[str, Any]]:
    """Every record of ``path``; ``HistoryError`` naming the file and line for a line that is not a record, or
    saying how the file gets written when there is none."""
    out = []
    if not os.path.exists(path):
        raise HistoryError(f"no benchmark history at {path} yet: `powersgd-triton bench` run from this checkout (or "
                           "with --history PATH) writes it, after checking ours against PyTorch's hook")
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise HistoryError(f"{path}:{i}: not JSON ({exc.msg})") from None
            if not isinstance(rec, dict) or rec.get("format") != FORMAT or not isinstance(rec.get("key"), dict) \
                    or not isinstance(rec.get("metrics"), dict) or not rec.get("commit"):
                raise HistoryError(f"{path}:{i}: not a history record of format {FORMAT}")
            out.append(rec)
    return out


def _key(rec: Dict[str, Any]) -> Tuple:
    return (rec["source"], tuple(sorted((k, str(v)) for k, v in rec["key"].items())))


def compare(records: Sequence[Dict[str, Any]], ref: str, new: Optional[str] = None,
            device: Optional[str] = None) -> List[Dict[str, Any]]:
    """Rows ``{source, key, metric, ref, new, ratio}`` for every (source, key, metric) measured at both commits on the
    same device: the newest record at commit ``ref`` (full hash, or a prefix) against the newest at ``new`` (default:
    the commit of the newest record). ``ratio`` = new / ref. ``device`` defaults to the newest record's.
    ``HistoryError`` when a commit has no record on that device."""
    if not records:
        raise HistoryError("the history is empty")
    device = device or records[-1]["device"]
    on_device = [r for r in records if r["device"] == device]
    new = new or records[-1]["commit"]

    def newest(commit: str) -> Dict[Tuple, Dict[str, Any]]:
        got = {}
        for r in on_device:
            if r["commit"].startswith(commit):
                got[_key(r)] = r  # later lines win
        if not got:
            raise HistoryError(f"no record at commit {commit[:12]} on device {device!r}")
        return got

    old_rows, new_rows = newest(ref), newest(new)
    out = []
    for k in sorted(set(old_rows) & set(new_rows)):
        a, b = old_rows[k], new_rows[k]
        for metric in METRICS:
            if metric in a["metrics"] and metric in b["metrics"]:
                x, y = a["metrics"][metric], b["metrics"][metric]
                out.append({"source": k[0], "key": b["key"], "metric": metric, "ref": x, "new": y,
                            "ratio": (y / x) if x else None})
    return out


def format_comparison(rows: Sequence[Dict[str, Any]], ref: str, new: str, device: str) -> str:
    """A markdown table of :func:`compare`'s rows."""
    lines = [f"history: {new[:10]} against {ref[:10]} on {device} (ratio = new / ref; lower is better for times and "
             "counts)", "", "| source | key | metric | ref | new | new/ref |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        key = ", ".join(f"{k}={r['key'][k]}" for k in KEY_FIELDS if k in r["key"])
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"| {r['source']} | {key} | {r['metric']} | {r['ref']:.6g} | {r['new']:.6g} | {ratio} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m powersgd_triton.history",
                                description="Compare benchmark history rows of two commits on one device.")
    p.add_argument("--path", default=DEFAULT_PATH, help=f"history file (default {DEFAULT_PATH})")
    p.add_argument("--ref", required=True, help="the earlier commit: a git ref of this checkout or a hash")
    p.add_argument("--new", default=None, help="the later commit (default: the newest in the file)")
    p.add_argument("--device", default=None, help="device key (default: the newest record's)")
    args = p.parse_args(argv)
    try:
        records = load(args.path)
        ref = resolve_ref(args.ref)
        new = resolve_ref(args.new) if args.new else None
        rows = compare(records, ref, new, args.device)
    except (OSError, HistoryError) as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    device = args.device or records[-1]["device"]
    print(format_comparison(rows, ref, new or records[-1]["commit"], device))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
