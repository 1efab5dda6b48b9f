"""The live terminal view of a swarm (`p2p-diloco status --watch`): a snapshot dict rendered with `rich`.

Every string and number in a snapshot comes from peers we do not trust (their signed status records say only who
wrote them, not that what they wrote is sane). So nothing from a snapshot is ever parsed as rich markup: strings go
into `rich.text.Text` after every control and format character is stripped (rich itself strips only a few, not ESC,
so a peer id could otherwise move the cursor or recolour the terminal), strings are cut to a bounded length, and
numbers that are not finite reals show as "-" instead of raising.
"""

from __future__ import annotations

import math
import threading
import time
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

MAX_STR = 64  # a peer may send a megabyte-long "peer id"; the table should not grow with it
MAX_ALONE = 300  # an `alone` reason (peer/isolation.py) shown under the table
MAX_ALONE_LINES = 8
SPARK_BLOCKS = "▁▂▃▄▅▆▇█"
SPARK_POINTS = 16
STATE_STYLES = {"training": "green", "syncing": "cyan", "done": "blue", "left": "dim"}
REACH_STYLES = {"public": "green", "relayed": "yellow", "private": "magenta", "loopback": "dim"}
COMPACT_WIDTH = 120  # below this the columns that matter least are left out so the rest stay readable
COMPACT_DROPS = {"eval", "tau", "reach", "loss curve", "samples/s"}


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


def peers_of(snapshot: dict) -> list[dict]:
    """The peers, sorted by V total descending (the most caught-up first), then peer id for a stable order."""
    peers = [p for p in as_list(snapshot.get("peers")) if isinstance(p, dict)]
    return sorted(peers, key=lambda p: (-num_or(p.get("vv_total"), -1.0), clean(p.get("peer_id") or "")))


def groups_of(snapshot: dict) -> list[dict]:
    return [g for g in as_list(as_dict(snapshot.get("agreement")).get("groups")) if isinstance(g, dict)]


def majority_digest(snapshot: dict, peers: list[dict]) -> str | None:
    """The digest most replicas hold: from the agreement groups when given, else counted from the peers' records.

    None when every peer agrees (or nobody says): then no peer is flagged as diverged.
    """
    groups = groups_of(snapshot)
    if groups:
        if len(groups) < 2:
            return None
        best = max(groups, key=lambda g: (len(as_list(g.get("peers"))), num_or(g.get("vv_total"), -1.0)))
        digest = best.get("digest")
        return digest if isinstance(digest, str) else None
    counts = Counter(p.get("vv_digest") for p in peers if isinstance(p.get("vv_digest"), str))
    if len(counts) < 2:
        return None
    return counts.most_common(1)[0][0]


def short_id(peer: dict) -> str:
    short = peer.get("short")
    if isinstance(short, str) and short:
        return clean(short, 16)
    pid = peer.get("peer_id")
    return clean(pid)[-8:] if isinstance(pid, str) and pid else "?"


def header(snapshot: dict) -> Text:
    peers = peers_of(snapshot)
    line = Text()
    line.append("run ", style="bold").append(safe_text(snapshot.get("run_id") or "?", "bold"))
    line.append("  spec ").append(safe_text(snapshot.get("spec_hash") or "unknown", "", 16))
    line.append(f"  {len(peers)} peer{'s' if len(peers) != 1 else ''}  ")
    agreement = as_dict(snapshot.get("agreement"))
    groups = groups_of(snapshot)
    if len(groups) >= 2:  # the groups are the evidence; a bare `agree` flag that contradicts them is not trusted
        totals = " / ".join(fmt_int(g.get("vv_total")) for g in groups[:8])
        more = f" / +{len(groups) - 8}" if len(groups) > 8 else ""
        line.append(f"{len(groups)} groups of replicas (V {totals}{more})", style="bold yellow" if len(groups) == 2
                    else "bold red")
    elif agreement.get("agree") is True or len(groups) == 1:
        line.append("replicas agree", style="bold green")
    elif agreement.get("agree") is False:
        line.append("replicas disagree", style="bold red")
    else:
        line.append("agreement unknown", style="dim")
    line.append(f"  {fmt_time(snapshot.get('now'))}", style="dim")
    observer = as_dict(snapshot.get("observer"))
    if observer:
        line.append("\nseen from ", style="dim").append(safe_text(observer.get("kind") or "?", "dim"))
        if observer.get("peer_id"):
            line.append(" ", style="dim").append(safe_text(observer.get("peer_id"), "dim"))
        reach = observer.get("reachability")
        if reach:
            line.append(" (", style="dim").append(safe_text(reach, REACH_STYLES.get(str(reach), "dim")))
            line.append(")", style="dim")
    return line


def peers_table(snapshot: dict, width: int | None) -> RenderableType:
    peers = peers_of(snapshot)
    if not peers:
        return Text("no peers yet", style="dim italic")
    majority = majority_digest(snapshot, peers)
    curves = as_dict(snapshot.get("curves"))
    drop = COMPACT_DROPS if width is not None and width < COMPACT_WIDTH else set()
    columns = [("peer", "left"), ("state", "left"), ("round", "right"), ("loss", "right"), ("eval", "right"),
               ("samples/s", "right"), ("util", "right"), ("tau", "right"), ("update", "right"), ("out", "right"),
               ("in", "right"), ("reach", "left"), ("V", "right"), ("loss curve", "left")]
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    for name, justify in columns:
        if name not in drop:
            table.add_column(name, justify=justify, no_wrap=True)
    for p in peers:
        state = p.get("state")
        reach = p.get("reachability")
        digest = p.get("vv_digest")
        diverged = majority is not None and isinstance(digest, str) and digest != majority
        v = Text(fmt_int(p.get("vv_total")), style="bold red" if diverged else "")
        if diverged:
            v.append(" ≠", style="bold red")  # visible without colour too (piped output, screen readers)
        pid = p.get("peer_id")
        shown_state = safe_text(state, STATE_STYLES.get(state, "") if isinstance(state, str) else "", 16)
        if isinstance(p.get("alone"), str) and p.get("alone"):
            shown_state.append(" ALONE", style="bold red")  # merges nothing while others publish
        cells = {
            "peer": safe_text(short_id(p), "bold red" if diverged else ""),
            "state": shown_state,
            "round": Text(fmt_int(p.get("round"))),
            "loss": Text(fmt_float(p.get("loss"))),
            "eval": Text(fmt_float(p.get("eval_loss"))),
            "samples/s": Text(fmt_float(p.get("samples_per_s"), 1)),
            "util": Text(fmt_pct(p.get("utilization"))),
            "tau": Text(fmt_int(p.get("tau"))),
            "update": Text(fmt_age(p.get("update_age_s"))),
            "out": Text(fmt_bytes(p.get("bytes_sent"))),
            "in": Text(fmt_bytes(p.get("bytes_received"))),
            "reach": safe_text(reach, REACH_STYLES.get(reach, "") if isinstance(reach, str) else "", 16),
            "V": v,
            "loss curve": Text(sparkline(curves.get(pid) if isinstance(pid, str) else None), style="cyan"),
        }
        table.add_row(*(cells[name] for name, _ in columns if name not in drop))
    alone = alone_lines(peers)
    return Group(table, *alone) if alone else table


def alone_lines(peers: list[dict]) -> list[Text]:
    """One line per peer that says it trains alone (its own record's reason and fix)."""
    lines = []
    for p in peers:
        why = p.get("alone")
        if isinstance(why, str) and why and len(lines) < MAX_ALONE_LINES:
            lines.append(Text(f"{short_id(p)} ALONE: ", style="bold red").append(safe_text(why, "", MAX_ALONE)))
    return lines


def self_line(me: dict) -> Text:
    line = Text("this peer: ", style="bold")
    parts = [
        ("round", fmt_int(me.get("round"))), ("loss", fmt_float(me.get("loss"))),
        ("eval", fmt_float(me.get("eval_loss"))), ("util", fmt_pct(me.get("utilization"))),
        ("tau", fmt_int(me.get("tau"))), ("peers", fmt_int(me.get("peers"))), ("V", fmt_int(me.get("vv_total"))),
        ("merged", fmt_int(me.get("merged"))), ("rejected", fmt_int(me.get("rejected"))),
        ("out", fmt_bytes(me.get("bytes_sent"))), ("in", fmt_bytes(me.get("bytes_received"))),
    ]
    line.append("  ".join(f"{k} {v}" for k, v in parts))
    why = me.get("alone")
    if isinstance(why, str) and why:
        line.append("\nALONE: ", style="bold red").append(safe_text(why, "", MAX_ALONE))
    return line


def render(snapshot: dict, *, width: int | None = None) -> Group:
    """The whole view of one snapshot: header, peers table, and this peer's line when the observer is a peer."""
    snapshot = as_dict(snapshot)
    parts: list[RenderableType] = [header(snapshot), peers_table(snapshot, width)]
    me = snapshot.get("self")
    if isinstance(me, dict):
        parts.append(self_line(me))
    return Group(*parts)


def error_line(message: str) -> Text:
    return Text(clean(message, 200), style="bold red")


def frames(fetch: Callable[[], dict], interval_s: float, width: Callable[[], int]) -> Iterable[tuple[Any, Text | None]]:
    """(view, error) per refresh, forever: the view is the last good one when this refresh failed.

    A failed fetch is expected (the DHT is eventually consistent and peers come and go), so it is shown, not raised.
    """
    last: RenderableType = Text("waiting for the first snapshot…", style="dim")
    while True:
        try:
            snapshot = fetch()
        except Exception as e:  # any failure of the fetch is shown and retried, never fatal
            yield last, error_line(f"DHT did not answer: {type(e).__name__}: {e}; retrying in {interval_s:g}s")
            continue
        try:
            last = render(snapshot, width=width())
        except Exception as e:  # a snapshot we cannot draw must not end the watch
            yield last, error_line(f"could not show this snapshot: {type(e).__name__}: {e}; retrying")
            continue
        yield last, None


def watch(
    fetch: Callable[[], dict],
    *,
    interval_s: float = 2.0,
    console: Console | None = None,
    stop: threading.Event | None = None,
    max_frames: int | None = None,
) -> int:
    """Fetch and redraw every `interval_s` until `stop` is set, `max_frames` frames were shown, or Ctrl-C; returns 0.

    On a terminal the view is one live region redrawn in place; piped (a file, `| less`, a test), each refresh is
    printed once, so logs read as a plain history (a failed refresh prints only its error line there: the last view
    is already above it).
    """
    console = console if console is not None else Console()
    stop = stop if stop is not None else threading.Event()
    live_ok = console.is_terminal and not console.is_dumb_terminal
    shown = 0
    if stop.is_set() or (max_frames is not None and max_frames <= 0):
        return 0
    try:
        if live_ok:
            live = Live(Text("connecting…", style="dim"), console=console, screen=False, auto_refresh=False,
                        transient=False)
            with live:  # its exit shows the cursor again and keeps the last frame, whatever ends the loop
                try:
                    for view, err in frames(fetch, interval_s, lambda: console.width):
                        live.update(view if err is None else Group(view, err), refresh=True)
                        shown += 1
                        if (max_frames is not None and shown >= max_frames) or stop.wait(interval_s):
                            break
                except KeyboardInterrupt:
                    pass
        else:
            for view, err in frames(fetch, interval_s, lambda: console.width):
                console.print(view if err is None else err)
                shown += 1
                if (max_frames is not None and shown >= max_frames) or stop.wait(interval_s):
                    break
    except KeyboardInterrupt:  # Ctrl-C between frames, or while Live was tidying up: the terminal is left as is
        pass
    return 0
