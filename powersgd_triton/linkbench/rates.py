"""Link rates for ``bench --link``, without torch: parsing ``tc``'s rate syntax and the ``tc tbf`` arguments.

A rate is written as ``tc`` writes it, a number and a unit: ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` (bits per
second, decimal prefixes) or ``bps``, ``kbps``, ``mbps``, ``gbps``, ``tbps`` (bytes per second), or ``unlimited`` (no
limit: the veth pair as it is, or the ranks' own link).
"""

import re
from dataclasses import dataclass
from typing import Dict, List, Optional

UNITS: Dict[str, float] = {  # tc's units, in bits per second (tc-tbf(8), "PARAMETERS")
    "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8.0, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
}
UNLIMITED = "unlimited"
_RATE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([a-z]+)$")
# tbf's queue: a packet that would wait longer than this for tokens is dropped (TCP then backs off, as on a real link)
TBF_LATENCY_MS = 50


@dataclass(frozen=True)
class Rate:
    """One ``--link`` entry: ``label`` as given (lower case, no spaces) and ``bits_per_second`` (``None``:
    unlimited)."""

    label: str
    bits_per_second: Optional[float]

    @property
    def limited(self) -> bool:
        return self.bits_per_second is not None


def parse_rate(text: str) -> Rate:
    """``"100mbit"`` -> ``Rate("100mbit", 1e8)``; ``"unlimited"`` -> ``Rate("unlimited", None)``.

    Raises ``ValueError`` for anything else: an unknown unit, no unit, zero, a negative number."""
    word = str(text).strip().lower().replace(" ", "")
    if word == UNLIMITED:
        return Rate(UNLIMITED, None)
    m = _RATE.match(word)
    if not m or m.group(2) not in UNITS:
        raise ValueError(f"bad link rate {text!r}: a number and one of {', '.join(UNITS)} (tc's units, e.g. 100mbit, "
                         "1gbit), or unlimited")
    value = float(m.group(1)) * UNITS[m.group(2)]
    if not value >= 1.0:
        raise ValueError(f"bad link rate {text!r}: must be at least 1 bit per second")
    return Rate(word, value)


def parse_rates(text: str) -> List[Rate]:
    """A comma list of rates, returned slowest first and ``unlimited`` last.

    Raises ``ValueError`` when the list is empty or a rate is listed twice (``1gbit,1000mbit`` too)."""
    rates = [parse_rate(t) for t in str(text).split(",") if t.strip()]
    if not rates:
        raise ValueError("--link needs at least one rate, e.g. --link 100mbit,1gbit,unlimited")
    keys = [r.bits_per_second for r in rates]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a rate is listed twice in {text!r}")
    return sorted(rates, key=lambda r: (r.bits_per_second is None, r.bits_per_second or 0.0))


def tbf_burst_bytes(bits_per_second: float) -> int:
    """The token bucket's depth (bytes) for ``tc tbf``: 4 ms at the rate, at least 64 KiB (a whole GSO packet, and
    above tbf's floor of rate / HZ)."""
    return max(64 * 1024, int(bits_per_second / 8 * 0.004))


def tbf_args(bits_per_second: float, latency_ms: int = TBF_LATENCY_MS) -> List[str]:
    """The words after ``tc qdisc replace dev VETH root`` for a token-bucket limit of ``bits_per_second`` leaving
    that end of the veth pair: ``["tbf", "rate", "100000000bit", "burst", "65536", "latency", "50ms"]`` (tc-tbf(8)).
    The bench puts one on each end, so each direction runs at the rate."""
    return ["tbf", "rate", f"{int(round(bits_per_second))}bit", "burst", str(tbf_burst_bytes(bits_per_second)),
            "latency", f"{int(latency_ms)}ms"]
