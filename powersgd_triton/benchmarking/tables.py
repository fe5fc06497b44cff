"""Formatting results: :func:`fmt_bytes` and :func:`markdown_table`.
"""

from typing import Iterable, Optional, Sequence, Tuple


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def markdown_table(rows: Iterable[dict], columns: Sequence[Tuple[str, str]]) -> str:
    """A markdown table of ``rows``; ``columns`` are ``(key, header)``; missing values print as ``-``."""
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    for r in rows:
        cells = []
        for key, _ in columns:
            v = r.get(key)
            if v is None:
                cells.append("-")
            elif isinstance(v, float):
                cells.append(f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}")
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
