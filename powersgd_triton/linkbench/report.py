"""The rows of ``bench --link``, their statistics, the JSON (``--out``), the table and the chart (``--plot``).

No torch. A row is one hook on one workload at one link rate::

    {"rate": "100mbit", "workload": "mnist5k", "hook": "powersgd", "step_ms_median": 10.2, "step_ms_p10": 9.8,
     "step_ms_p90": 11.5, "bytes_per_step": 49608.0, "ratio_to_allreduce": 0.048}

``ratio_to_allreduce``: this hook's median step time over plain all-reduce's, same workload and rate, measured in
the same launch (below 1: faster than all-reduce). ``bytes_per_step``: bytes through ``dist.all_reduce`` per rank,
mean over the timed steps. The chart needs matplotlib (an optional dependency): :func:`plot_missing` says so.
"""

import importlib.util
import math
import textwrap
from typing import Any, Dict, List, Optional, Sequence, Tuple

from powersgd_triton.cli_common import text_table
from powersgd_triton.linkbench.names import ALLREDUCE, OURS, REFERENCE, BF16_SUFFIX, is_ours
from powersgd_triton.linkbench.rates import UNLIMITED, parse_rate
from powersgd_triton.variants import VARIANTS

ROW_FIELDS = ("rate", "workload", "hook", "step_ms_median", "step_ms_p10", "step_ms_p90", "bytes_per_step",
              "ratio_to_allreduce")
HOOK_LABELS = {ALLREDUCE: "plain all-reduce", REFERENCE: "PyTorch's powerSGD_hook",
               **{v.name: f"ours, {'batched' if v.batched else v.name if v.pytorch_twin is None else 'layer-wise'}"
                  for v in VARIANTS}}
_PALETTE = ("tab:green", "tab:blue", "tab:orange", "tab:olive", "tab:pink")
_PALETTE_BF16 = ("tab:red", "tab:cyan", "tab:brown", "black", "gold")
# each of our variants in the table's order takes a colour, its bf16-factor run the matching one of the second row
COLORS = {ALLREDUCE: "tab:gray", REFERENCE: "tab:purple",
          **{v.name: _PALETTE[i % len(_PALETTE)] for i, v in enumerate(VARIANTS)},
          **{v.name + BF16_SUFFIX: _PALETTE_BF16[i % len(_PALETTE_BF16)] for i, v in enumerate(VARIANTS)}}


def hook_label(hook: str) -> str:
    """``"powersgd_bf16"`` -> ``"powersgd_bf16 (ours, layer-wise, bf16 factors)"``."""
    if hook.endswith(BF16_SUFFIX):
        return f"{hook} ({HOOK_LABELS.get(hook[: -len(BF16_SUFFIX)], 'ours')}, bf16 factors)"
    return f"{hook} ({HOOK_LABELS.get(hook, hook)})"


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear between the closest ranks (numpy's default method).
    ``ValueError`` when ``values`` is empty."""
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def make_rows(results: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The rows of ranks' results (:func:`powersgd_triton.linkbench.ranks.measure`), in their order, each hook as
    measured; ``ratio_to_allreduce`` is ``None`` where a result has no all-reduce run."""
    rows = []
    for res in results:
        hooks = res["hooks"]
        base = percentile(hooks[ALLREDUCE]["step_ms"], 50) if ALLREDUCE in hooks else None
        for hook, run in hooks.items():
            median = percentile(run["step_ms"], 50)
            rows.append({
                "rate": res["rate"], "workload": res["workload"], "hook": hook,
                "step_ms_median": median, "step_ms_p10": percentile(run["step_ms"], 10),
                "step_ms_p90": percentile(run["step_ms"], 90), "bytes_per_step": float(run["bytes_per_step"]),
                "ratio_to_allreduce": (median / base) if base else None,
            })
    return rows


def check_rows(rows: Sequence[Dict[str, Any]]) -> None:
    """``ValueError`` unless every row has exactly :data:`ROW_FIELDS`."""
    for row in rows:
        if tuple(sorted(row)) != tuple(sorted(ROW_FIELDS)):
            raise ValueError(f"a row needs exactly the fields {', '.join(ROW_FIELDS)}; got {', '.join(row)}")


def write_json(path: str, rows: Sequence[Dict[str, Any]], environment: Optional[Dict[str, Any]] = None) -> None:
    """``{"rows": [...], "environment": {...}}`` to ``path``, atomically (rows in :data:`ROW_FIELDS` order)."""
    from powersgd_triton.cache_files import atomic_write_json

    check_rows(rows)
    doc: Dict[str, Any] = {"rows": [{k: row[k] for k in ROW_FIELDS} for row in rows]}
    if environment:
        doc["environment"] = environment
    atomic_write_json(path, doc, sort_keys=False)


def fmt_bytes(n: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    """The markdown table the command prints."""
    head = ["link", "workload", "hook", "median ms/step", "p10-p90 ms", "all-reduced/step/rank", "time vs all-reduce"]
    body = []
    for r in rows:
        ratio = r["ratio_to_allreduce"]
        body.append([r["rate"], r["workload"], hook_label(r["hook"]), f"{r['step_ms_median']:.1f}",
                     f"{r['step_ms_p10']:.1f}-{r['step_ms_p90']:.1f}", fmt_bytes(r["bytes_per_step"]),
                     "-" if ratio is None else f"{ratio:.3f}" + (f" ({1 / ratio:.1f}x faster)" if ratio < 1 else "")])
    return text_table(head, body)


# ------------------------------------------------------------------------------------------------- the chart
def rate_positions(labels: Sequence[str]) -> Dict[str, float]:
    """Where each rate sits on the chart's log axis (bits per second); ``unlimited`` one decade beyond the fastest
    limited rate (1e10 when there is none)."""
    rates = [parse_rate(label) for label in labels]
    top = max((r.bits_per_second for r in rates if r.limited), default=1e9)
    return {r.label: (r.bits_per_second if r.limited else top * 10.0) for r in rates}


def fmt_rate(bits_per_second: float) -> str:
    """``1.7e8`` -> ``"170 Mbit/s"``."""
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.3g} {unit}"
    return f"{bits_per_second:.3g} bit/s"


def crossover(rows: Sequence[Dict[str, Any]], workload: str, hook: str = OURS) -> Dict[str, Any]:
    """Where ``hook`` starts to pay on ``workload``: walking from the slowest rate to the fastest, the first place
    where its time ratio to all-reduce crosses 1, interpolated on log rate and log ratio.

    Returns ``{"kind": "below", "bits_per_second": x, "between": (slower label, faster label)}`` (it pays on links
    slower than x), ``{"kind": "above", ...}`` (it pays on faster ones), ``{"kind": "always"}``, ``{"kind":
    "never"}``, or ``{"kind": "unknown"}`` when there are no ratios. ``bits_per_second`` is ``None`` when the
    crossing is between the fastest limited rate and ``unlimited`` (no rate to interpolate to)."""
    pts = [r for r in rows if r["workload"] == workload and r["hook"] == hook and r["ratio_to_allreduce"]]
    pos = rate_positions([r["rate"] for r in pts])
    pts.sort(key=lambda r: pos[r["rate"]])
    if not pts:
        return {"kind": "unknown"}
    pays = [r["ratio_to_allreduce"] < 1.0 for r in pts]
    if all(pays):
        return {"kind": "always"}
    if not any(pays):
        return {"kind": "never"}
    for a, b in zip(pts, pts[1:]):
        if (a["ratio_to_allreduce"] < 1.0) != (b["ratio_to_allreduce"] < 1.0):
            kind = "below" if a["ratio_to_allreduce"] < 1.0 else "above"
            if b["rate"] == UNLIMITED:  # no rate to interpolate to: the crossover is somewhere above a's
                return {"kind": kind, "bits_per_second": None, "between": (a["rate"], b["rate"])}
            la, lb = math.log(a["ratio_to_allreduce"]), math.log(b["ratio_to_allreduce"])
            xa, xb = math.log(pos[a["rate"]]), math.log(pos[b["rate"]])
            t = (0.0 - la) / (lb - la) if lb != la else 0.5
            return {"kind": kind, "bits_per_second": math.exp(xa + t * (xb - xa)), "between": (a["rate"], b["rate"])}
    return {"kind": "unknown"}  # pragma: no cover - a change of sign is found above


def crossover_text(c: Dict[str, Any], hook: str = OURS) -> str:
    """One line for a :func:`crossover`."""
    if c["kind"] in ("below", "above") and c["bits_per_second"] is None:
        yes, no = c["between"] if c["kind"] == "below" else c["between"][::-1]
        return f"{hook} pays at {yes}, not at {no}: the crossover lies between them"
    if c["kind"] in ("below", "above"):
        return (f"{hook} pays on links {'slower' if c['kind'] == 'below' else 'faster'} than ~"
                f"{fmt_rate(c['bits_per_second'])} (between {c['between'][0]} and {c['between'][1]})")
    return {"always": f"{hook} is faster than all-reduce at every measured rate",
            "never": f"{hook} is not faster than all-reduce at any measured rate",
            "unknown": f"{hook}: no ratio to all-reduce"}[c["kind"]]


def plot_missing() -> Optional[str]:
    """Why ``--plot`` cannot run here (matplotlib not installed), in one line, or ``None``."""
    if importlib.util.find_spec("matplotlib") is None:
        return ("--plot needs matplotlib, which is not installed: pip install matplotlib (or pip install "
                "'powersgd_triton[plot]'), or leave out --plot")
    return None


def plot(path: str, rows: Sequence[Dict[str, Any]], title: str = "", hook: str = OURS) -> List[str]:
    """Write the chart to ``path`` (PNG, or any format matplotlib infers from the name): median step time (log)
    against link rate (log) per hook, p10-p90 as error bars, one panel per workload, the crossover of ``hook``
    marked. Returns the crossover lines. Raises ``RuntimeError`` (:func:`plot_missing`'s message) without
    matplotlib."""
    missing = plot_missing()
    if missing:
        raise RuntimeError(missing)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.4 * len(workloads), 4.8), squeeze=False)
    notes = []
    for ax, workload in zip(axes[0], workloads):
        mine = [r for r in rows if r["workload"] == workload]
        pos = rate_positions([r["rate"] for r in mine])
        for h in dict.fromkeys(r["hook"] for r in mine):
            pts = sorted((r for r in mine if r["hook"] == h), key=lambda r: pos[r["rate"]])
            xs = [pos[r["rate"]] for r in pts]
            med = [r["step_ms_median"] for r in pts]
            err = [[m - r["step_ms_p10"] for m, r in zip(med, pts)], [r["step_ms_p90"] - m for m, r in zip(med, pts)]]
            style = "-" if is_ours(h) else "--"
            ax.errorbar(xs, med, yerr=err, marker="o", ls=style, capsize=3, lw=2.4 if h == hook else 1.3,
                        label=hook_label(h), color=COLORS.get(h), zorder=3 if h == hook else 2)
        ax.set_xscale("log")
        ax.set_yscale("log")
        # plain numbers at 1-2-3-5 steps: a panel of 1.6 to 6 s has no power of ten on it
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10.0, subs=(1.0, 2.0, 3.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ticks = sorted(set(pos.values()))
        ax.set_xticks(ticks, [next(k for k, v in pos.items() if v == t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlim(min(ticks) / 2, max(ticks) * 2)
        c = crossover(rows, workload, hook)
        line = crossover_text(c, hook)
        notes.append(f"{workload}: {line}")
        if c["kind"] in ("below", "above") and c["bits_per_second"] is None:
            ax.axvspan(pos[c["between"][0]], pos[c["between"][1]], color="black", alpha=0.08, lw=0)
            ax.text(0.98, 0.03, f"{hook}: crossover in the shaded span", transform=ax.transAxes, ha="right",
                    fontsize=8)
        elif c["kind"] in ("below", "above"):
            x = c["bits_per_second"]
            ax.axvline(x, color="black", ls=":", lw=1.2)
            ax.annotate(f"{hook} pays {'below' if c['kind'] == 'below' else 'above'}\n~{fmt_rate(x)}",
                        xy=(x, 0.03), xycoords=("data", "axes fraction"), va="bottom",
                        ha="right" if c["kind"] == "below" else "left", fontsize=8,
                        xytext=(-3 if c["kind"] == "below" else 3, 0), textcoords="offset points")
        else:
            ax.text(0.02, 0.02, line, transform=ax.transAxes, fontsize=8)
        ax.set_title(workload)
        ax.set_xlabel("link rate, each direction (log scale)")
        ax.set_ylabel("step time, ms (median; bars p10-p90; log scale)")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    if title:
        fig.suptitle("\n".join(textwrap.wrap(title, 110 * len(workloads))), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return notes


def summary(rows: Sequence[Dict[str, Any]]) -> List[Tuple[str, str]]:
    """``(workload, crossover line)`` for every workload of ``rows`` (our layer-wise hook's crossover)."""
    return [(w, crossover_text(crossover(rows, w))) for w in dict.fromkeys(r["workload"] for r in rows)]
