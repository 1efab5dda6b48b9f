"""Untrusted snapshot values as short, safe terminal text (view/terminal.py draws with these).

Every string and number in a snapshot comes from peers we do not trust (their signed status records say only who
wrote them, not that what they wrote is sane). So nothing from a snapshot is ever parsed as rich markup: strings go
into `rich.text.Text` after every control and format character is stripped (rich itself strips only a few, not ESC,
so a peer id could otherwise move the cursor or recolour the terminal), strings are cut to a bounded length, and
numbers that are not finite reals show as "-" instead of raising.
"""

from __future__ import annotations

import math
import time
import unicodedata
from typing import Any

from rich.text import Text

MAX_STR = 64  # a peer may send a megabyte-long "peer id"; the table should not grow with it
SPARK_BLOCKS = "▁▂▃▄▅▆▇█"
SPARK_POINTS = 16


def clean(value: Any, limit: int = MAX_STR) -> str:
    """A string safe to print: control (Cc) and format (Cf: bidi overrides, zero-width) characters removed, cut."""
    s = value if isinstance(value, str) else str(value)
    s = "".join(ch for ch in s[: limit * 4] if unicodedata.category(ch) not in ("Cc", "Cf"))
    return s if len(s) <= limit else s[: limit - 1] + "…"


def safe_text(value: Any, style: str = "", limit: int = MAX_STR) -> Text:
    """Untrusted value as literal Text: `Text(...)` never interprets markup, `clean` removes escape sequences."""
    return Text("-" if value is None else clean(value, limit), style=style)


def num(value: Any) -> float | None:
    """A finite real number, or None: peers can send strings, bools, NaN or 10**400 where a float belongs."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def num_or(value: Any, default: float) -> float:
    f = num(value)
    return default if f is None else f


def fmt_int(value: Any) -> str:
    f = num(value)
    return "-" if f is None else str(int(f))


def fmt_float(value: Any, digits: int = 3) -> str:
    f = num(value)
    return "-" if f is None else f"{f:.{digits}f}"


def fmt_pct(value: Any) -> str:
    f = num(value)
    return "-" if f is None else f"{f * 100:.0f}%"


def fmt_age(value: Any) -> str:
    f = num(value)
    if f is None:
        return "-"
    f = max(f, 0.0)
    if f < 60:
        return f"{f:.1f}s"
    return f"{f / 60:.0f}m" if f < 3600 else f"{f / 3600:.0f}h"


def fmt_bytes(value: Any) -> str:
    """Decimal units (1.2 MB), the way network traffic is usually counted."""
    f = num(value)
    if f is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(f) < 1000 or unit == "TB":
            return f"{int(f)} B" if unit == "B" else f"{f:.1f} {unit}"
        f /= 1000
    return "-"  # unreachable


def fmt_time(value: Any) -> str:
    """UTC, so that two people comparing screenshots across time zones see the same clock."""
    f = num(value)
    if f is None:
        return "time unknown"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(f))
    except (OverflowError, OSError, ValueError):
        return "time unknown"


def sparkline(points: Any, n: int = SPARK_POINTS) -> str:
    """The last `n` finite losses of a curve ([t, round, loss, eval] rows) as unicode blocks, scaled min..max."""
    losses: list[float] = []
    if isinstance(points, list):
        for row in points[-4 * n :]:  # a bounded look-back: malformed rows are skipped, not searched past forever
            if isinstance(row, (list, tuple)) and len(row) >= 3 and (v := num(row[2])) is not None:
                losses.append(v)
    losses = losses[-n:]
    if not losses:
        return ""
    lo, hi = min(losses), max(losses)
    if hi - lo <= 1e-12 * max(1.0, abs(hi)):
        return SPARK_BLOCKS[len(SPARK_BLOCKS) // 2 - 1] * len(losses)
    top = len(SPARK_BLOCKS) - 1
    return "".join(SPARK_BLOCKS[round((v - lo) / (hi - lo) * top)] for v in losses)


def as_dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list:
    return value if isinstance(value, list) else []
