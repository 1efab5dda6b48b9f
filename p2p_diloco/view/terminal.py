"""The live terminal view of a swarm (`p2p-diloco status --watch`): a snapshot dict rendered with `rich`.

Snapshot values are untrusted: every one is shown through view/fmt.py (literal text, control characters
stripped, cut; "-" for what is not a finite number). The figures and their names (reachability, rejected,
agreement) are the snapshot's, as view/figures.py defines them: this view computes none of its own.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from p2p_diloco.view.fmt import (
    as_dict,
    as_list,
    clean,
    fmt_age,
    fmt_bytes,
    fmt_float,
    fmt_int,
    fmt_pct,
    fmt_time,
    num_or,
    safe_text,
    sparkline,
)

MAX_ALONE = 300  # an `alone` reason (peer/isolation.py) shown under the table
MAX_ALONE_LINES = 8
STATE_STYLES = {"training": "green", "syncing": "cyan", "done": "blue", "left": "dim"}
REACH_STYLES = {"public": "green", "private": "magenta", "unknown": "dim"}
AGREEMENT_STYLES = {"agree": "bold green", "in_flight": "cyan", "diverged": "bold red"}
COMPACT_WIDTH = 120  # below this the columns that matter least are left out so the rest stay readable
COMPACT_DROPS = {"eval", "tau", "reach", "rejected", "loss curve", "samples/s"}


def peers_of(snapshot: dict) -> list[dict]:
    """The peers, sorted by V total descending (the most caught-up first), then peer id for a stable order."""
    peers = [p for p in as_list(snapshot.get("peers")) if isinstance(p, dict)]
    return sorted(peers, key=lambda p: (-num_or(p.get("vv_total"), -1.0), clean(p.get("peer_id") or "")))


def groups_of(snapshot: dict) -> list[dict]:
    return [g for g in as_list(as_dict(snapshot.get("agreement")).get("groups")) if isinstance(g, dict)]


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
    line.append_text(agreement_text(as_dict(snapshot.get("agreement")), groups_of(snapshot)))
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


def agreement_text(agreement: dict, groups: list[dict]) -> Text:
    """The replicas' `agreement` figure: its state, the groups' V totals, and who is behind and for how long."""
    state = agreement.get("state")
    if state not in AGREEMENT_STYLES:
        return Text("agreement unknown", style="dim")
    style = AGREEMENT_STYLES[state]
    if state == "agree":
        return Text("replicas agree", style=style)
    totals = " / ".join(fmt_int(g.get("vv_total")) for g in groups[:8]) + (
        f" / +{len(groups) - 8}" if len(groups) > 8 else "")
    if state == "in_flight":
        return Text(f"replicas in flight: {len(groups)} versions (V {totals})", style=style)
    behind = as_dict(agreement.get("behind"))
    who = ", ".join(clean(pid)[-8:] for pid in list(behind)[:8])
    return Text(f"replicas diverged: {len(groups)} groups of replicas (V {totals}); behind for over "
                f"{fmt_age(agreement.get('stuck_s'))}: {who or '?'}", style=style)


def peers_table(snapshot: dict, width: int | None) -> RenderableType:
    peers = peers_of(snapshot)
    if not peers:
        return Text("no peers yet", style="dim italic")
    behind = as_dict(as_dict(snapshot.get("agreement")).get("behind"))
    curves = as_dict(snapshot.get("curves"))
    drop = COMPACT_DROPS if width is not None and width < COMPACT_WIDTH else set()
    columns = [("peer", "left"), ("state", "left"), ("round", "right"), ("loss", "right"), ("eval", "right"),
               ("samples/s", "right"), ("util", "right"), ("tau", "right"), ("update", "right"), ("out", "right"),
               ("in", "right"), ("reach", "left"), ("rejected", "right"), ("V", "right"), ("loss curve", "left")]
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    for name, justify in columns:
        if name not in drop:
            table.add_column(name, justify="right" if justify == "right" else "left", no_wrap=True)
    for p in peers:
        state = p.get("state")
        reach = p.get("reachability")
        diverged = isinstance(p.get("peer_id"), str) and p.get("peer_id") in behind  # lacks what others hold
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
            "rejected": Text(fmt_int(p.get("rejected")), style="red" if num_or(p.get("rejected"), 0) > 0 else ""),
            "V": v,
            "loss curve": Text(sparkline(curves.get(pid) if isinstance(pid, str) else None), style="cyan"),
        }
        table.add_row(*(cells[name] for name, _ in columns if name not in drop))
    alone = alone_lines(peers)
    return Group(table, *alone) if alone else table


def alone_lines(peers: list[dict]) -> list[Text]:
    """One line per peer that says it trains alone (its own record's reason and fix)."""
    lines: list[Text] = []
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
    with _CtrlC() as ctrl_c:
        fetch = ctrl_c.interruptible(fetch)
        try:
            if live_ok:
                live = Live(Text("connecting…", style="dim"), console=console, screen=False, auto_refresh=False,
                            transient=False)
                with live:  # its exit shows the cursor again and keeps the last frame, whatever ends the loop
                    try:
                        for view, err in frames(fetch, interval_s, lambda: console.width):
                            live.update(view if err is None else Group(view, err), refresh=True)
                            shown += 1
                            if (max_frames is not None and shown >= max_frames) or ctrl_c.wait(stop, interval_s):
                                break
                    except KeyboardInterrupt:
                        pass
            else:
                for view, err in frames(fetch, interval_s, lambda: console.width):
                    console.print(view if err is None else err)
                    shown += 1
                    if (max_frames is not None and shown >= max_frames) or ctrl_c.wait(stop, interval_s):
                        break
        except KeyboardInterrupt:  # Ctrl-C during a fetch, seen by ctrl_c.interruptible
            pass
    return 0


class _CtrlC:
    """Ctrl-C as a flag the watch loop polls, never as an exception raised wherever the main thread happens to be.

    Python raises KeyboardInterrupt at any bytecode; inside `Event.wait` it can land while the condition re-acquires
    its lock, and the `with` then fails with "RuntimeError: release unlocked lock" (CPython's known hazard; CI saw
    `status --watch` exit 1 that way). The handler only sets a flag and touches no lock; the loop's waits poll it, and
    a fetch runs on a helper thread so a DHT read that takes seconds does not hold up the exit. Off the main thread
    (a test, an embedding) no handler can be installed and Ctrl-C keeps Python's default.
    """

    POLL_S = 0.1

    def __init__(self) -> None:
        self.pressed = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, signum: int, frame: object) -> None:
        self.pressed = True

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        """Wait up to `seconds`; True when `stop` was set or Ctrl-C pressed."""
        deadline = time.monotonic() + seconds
        while not (stop.is_set() or self.pressed):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            stop.wait(min(left, self.POLL_S))
        return True

    def interruptible(self, fetch: Callable[[], dict]) -> Callable[[], dict]:
        """`fetch` on a daemon thread; KeyboardInterrupt (raised here, between our own statements) on Ctrl-C."""
        if not self._installed:
            return fetch

        def run() -> dict:
            box: dict[str, Any] = {}
            done = threading.Event()

            def work() -> None:
                try:
                    box["value"] = fetch()
                except BaseException as e:  # handed to the caller as is
                    box["error"] = e
                finally:
                    done.set()

            threading.Thread(target=work, name="watch-fetch", daemon=True).start()
            while not done.wait(self.POLL_S):
                if self.pressed:
                    raise KeyboardInterrupt
            if "error" in box:
                raise box["error"]
            return box["value"]
        return run
