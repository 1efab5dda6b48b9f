"""The terminal view (`status --watch`): recorded swarm states rendered to text, the watch loop piped (under a
pseudo-terminal: test_terminal_pty.py), and peers whose strings try to drive the terminal."""

from __future__ import annotations

import copy
import io
import threading
import time

import pytest
from rich.console import Console

from p2p_diloco.view.fmt import fmt_bytes, sparkline
from p2p_diloco.view.terminal import render, watch

A = "a1b2c3d4e5f60718"
B = "0f0e0d0c0b0a0908"
P1 = "12D3KooWHb7sLqJ2m4Y8xR1aZpWcQdVtNe5UfGkS9aAlpha111"
P2 = "12D3KooWJz3kTgM6vP9qLrX2bYcHdWs8Ff4NeGuR7bBravo222"
P3 = "12D3KooWQn5rCvB8xL2mK7aTeYpHgDs4Zj9WfNuE3cCharl333"
HOSTILE = "12D3KooW[bold red]pwn[/]\x1b]0;owned\x07\x1b[2J\u202eevil\r\nX"

# A recorded swarm state: three peers, all holding the same replica.
AGREED = {
    "run_id": "default",
    "spec_hash": "3f2a9c1b7d4e",
    "now": 1764075000.0,
    "observer": {"kind": "peer", "peer_id": P1, "reachability": "public", "addrs": ["/ip4/203.0.113.5/tcp/4001"]},
    "self": {"round": 12, "loss": 2.31, "eval_loss": 2.40, "bytes_sent": 123456, "bytes_received": 654321,
             "merged": 30, "rejected": 0, "utilization": 0.95, "tau": 2, "peers": 3, "vv_total": 36},
    "peers": [
        {"peer_id": P2, "short": "Bravo222", "state": "syncing", "round": 11, "step": 220, "loss": 2.45,
         "eval_loss": None, "samples_per_s": 98.0, "utilization": 0.81, "tau": 2, "age_s": 3.0, "update_age_s": None,
         "bytes_sent": 999, "bytes_received": 2_500_000_000, "reachability": "relayed", "vv_total": 36,
         "vv_digest": A, "seq": 11, "rejected": 0, "banned": 0},
        {"peer_id": P1, "short": "Alpha111", "state": "training", "round": 12, "step": 240, "loss": 2.31,
         "eval_loss": 2.4, "samples_per_s": 120.5, "utilization": 0.95, "tau": 2, "age_s": 1.5, "update_age_s": 0.8,
         "bytes_sent": 1_234_567, "bytes_received": 654_321, "reachability": "public", "vv_total": 36,
         "vv_digest": A, "seq": 12, "rejected": 0, "banned": 0},
        {"peer_id": P3, "short": "Charl333", "state": "done", "round": 13, "step": 260, "loss": 2.2,
         "eval_loss": 2.3, "samples_per_s": 0.0, "utilization": 0.5, "tau": 1, "age_s": 0.4, "update_age_s": 75.0,
         "bytes_sent": 0, "bytes_received": 10, "reachability": "loopback", "vv_total": 37,
         "vv_digest": A, "seq": 13, "rejected": 0, "banned": 0},
    ],
    "agreement": {"state": "agree", "agree": True, "groups": [{"digest": A, "vv_total": 36, "peers": [P1, P2, P3]}],
                  "behind": {}, "stuck_s": 60.0},
    "vv_matrix": {"holders": [P1, P2, P3], "senders": [P1, P2, P3],
                  "seq": [[12, 11, 13], [12, 11, None], [12, 11, 13]]},
    "curves": {P1: [[1.0, 1, 3.2, None], [2.0, 2, 3.0, None], [3.0, 3, 2.7, 2.9], [4.0, 4, 2.5, None],
                    [5.0, 5, 2.31, 2.4]]},
    "local": [{"time": 1.0, "round": 1, "loss": 3.1, "eval_loss": None, "bytes_sent": 1000, "bytes_received": 2000,
               "utilization": 0.9}],
}


def in_flight() -> dict:
    """The same swarm, but Charl333 merged an update the others have not yet: two versions, nobody stuck."""
    snap = copy.deepcopy(AGREED)
    snap["peers"][2]["vv_digest"] = B
    snap["agreement"] = {"state": "in_flight", "agree": False, "behind": {}, "stuck_s": 60.0,
                         "groups": [{"digest": A, "vv_total": 36, "peers": [P1, P2]},
                                    {"digest": B, "vv_total": 37, "peers": [P3]}]}
    return snap


def diverged() -> dict:
    """Two groups of replicas, and Charl333 has lacked an update the others hold for 75 s."""
    snap = in_flight()
    snap["agreement"].update(state="diverged", behind={P3: 75.0})
    return snap


def text_of(renderable, width: int = 160) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def cells(row: str) -> list[str]:
    return [c.strip() for c in row.split("│")]


def row_of(text: str, short: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith(short)]
    assert len(rows) == 1, text
    return rows[0]


def test_every_peer_its_round_and_units_and_agreement():
    text = text_of(render(AGREED, width=160))
    assert "default" in text and "3f2a9c1b7d4e" in text and "3 peers" in text
    assert "replicas agree" in text and "groups of replicas" not in text
    assert "2025-11-25 12:50:00 UTC" in text
    for short, rnd in (("Alpha111", "12"), ("Bravo222", "11"), ("Charl333", "13")):
        assert rnd in row_of(text, short).split()
    alpha = row_of(text, "Alpha111")
    for cell in ("training", "2.310", "2.400", "120.5", "95%", "0.8s", "1.2 MB", "654.3 kB", "public"):
        assert cell in alpha, alpha
    bravo = row_of(text, "Bravo222")
    assert "2.5 GB" in bravo and "999 B" in bravo and "relayed" in bravo and "81%" in bravo
    assert " - " in bravo  # no eval loss and no update yet
    assert "1m" in row_of(text, "Charl333")  # a 75 s old update
    assert "≠" not in text  # nobody diverged
    # V descending, then peer id: Charl333 (37) first, then Alpha111 before Bravo222 (both 36).
    order = [line.split()[0] for line in text.splitlines() if line[:8] in ("Alpha111", "Bravo222", "Charl333")]
    assert order == ["Charl333", "Alpha111", "Bravo222"]
    mine = next(line for line in text.splitlines() if line.startswith("this peer"))
    assert "round 12" in mine and "merged 30" in mine and "V 36" in mine and "123.5 kB" in mine


def test_two_groups_and_the_diverged_peer_flagged():
    shown = text_of(render(in_flight(), width=160))
    assert "replicas in flight: 2 versions (V 36 / 37)" in shown and "≠" not in shown  # not divergence
    text = text_of(render(diverged(), width=160))
    assert "2 groups of replicas (V 36 / 37)" in text and "replicas agree" not in text
    assert "replicas diverged" in text and "behind for over 1m: Charl333" in text
    assert "≠" in row_of(text, "Charl333")
    assert "≠" not in row_of(text, "Alpha111") and "≠" not in row_of(text, "Bravo222")
    # The view judges nothing itself: without the snapshot's agreement nobody is flagged.
    snap = diverged()
    del snap["agreement"]
    text = text_of(render(snap, width=160))
    assert "agreement unknown" in text and "≠" not in text



def test_header_is_coloured_by_agreement():
    def styled(snap) -> str:
        console = Console(width=160, file=io.StringIO(), force_terminal=True, color_system="standard")
        console.print(render(snap))
        return console.file.getvalue()

    assert "\x1b[1;32mreplicas agree" in styled(AGREED)  # bold green
    assert "\x1b[1;31mreplicas diverged" in styled(diverged())  # bold red
    assert "\x1b[36mreplicas in flight" in styled(in_flight())  # cyan: nothing to act on


def test_sparkline_of_the_loss_curve():
    falling = [[t, t + 1, 7.0 - t, None] for t in range(8)] + [[9, 10, None, None]]
    assert sparkline(falling) == "█▇▆▅▄▃▂▁"  # min..max over all eight blocks; the row with no loss is skipped
    assert sparkline([[0, 1, 2.0, None]] * 3) == "▄▄▄"
    assert sparkline(None) == "" and sparkline([["x"], "junk", [0, 1, "2.0"]]) == ""
    line = row_of(text_of(render(AGREED, width=160)), "Alpha111")
    assert sparkline(AGREED["curves"][P1]) in line and line.rstrip().endswith("▁")


def test_byte_units():
    assert [fmt_bytes(v) for v in (0, 999, 1000, 1_234_567, 2_500_000_000, None, "1e9", float("nan"))] == [
        "0 B", "999 B", "1.0 kB", "1.2 MB", "2.5 GB", "-", "-", "-"]


def test_hostile_strings_are_shown_literally_and_stripped():
    snap = copy.deepcopy(AGREED)
    snap["run_id"] = "[blink]run[/blink]\x1b[5m"
    snap["peers"].append({"peer_id": HOSTILE, "short": "[red]x[/]\x1b[31m\x00", "state": "[green]training",
                          "round": 4, "reachability": "\x1b[2Jpublic", "vv_total": 1})
    snap["curves"][HOSTILE] = [[0, 1, 1.0, None], [1, 2, 0.5, None]]
    console = Console(record=True, width=160, file=io.StringIO(), force_terminal=True, color_system="standard")
    console.print(render(snap, width=160))
    raw, text = console.file.getvalue(), console.export_text()
    assert "[red]x[/][31m" in text  # the markup is text, the ESC before "[31m" is gone
    assert "[green]training" in text and "[blink]run[/blink][5m" in text and "[2Jpublic" in text
    for evil in ("\x1b]0;", "\x1b[2J", "\x1b[5m", "\x1b[31m\x00", "\x07", "\x00", "\u202e"):
        assert evil not in raw and evil not in text
    assert "\x1b[31mx" not in raw  # the markup did not take effect either
    # No short id given: the last 8 characters of the (cleaned) peer id stand for it.
    snap["peers"][-1]["short"] = None
    assert "[2JevilX" in text_of(render(snap, width=160))


@pytest.mark.parametrize(
    "snap",
    [
        {},
        {"peers": []},
        {"peers": None, "agreement": None, "self": None, "curves": None, "observer": None},
        {"peers": [{}], "agreement": {}, "self": {}},
        {"peers": [{"peer_id": 7, "short": None, "round": "x", "loss": float("nan"), "vv_total": 10**400,
                    "utilization": True, "bytes_sent": -5, "update_age_s": -1, "state": 3, "reachability": []}],
         "agreement": {"agree": False, "groups": [{"digest": None}, "junk", {"vv_total": "big"}]},
         "curves": {"7": "not a list"}, "now": "yesterday", "spec_hash": 12},
        {"peers": ["junk", None, 5], "agreement": {"agree": False}},
    ],
)
def test_missing_and_malformed_fields_do_not_crash(snap):
    text = text_of(render(snap))
    assert "run" in text
    if not [p for p in snap.get("peers") or [] if isinstance(p, dict)]:
        assert "no peers yet" in text


def test_narrow_width_drops_the_least_useful_columns():
    text = text_of(render(AGREED, width=90), width=90)
    assert all(len(line) <= 90 for line in text.splitlines())
    assert "Alpha111" in text and "1.2 MB" in text and "loss curve" not in text and "reach" not in text


class Recorded:
    """A fetch that replays a list of snapshots (or exceptions to raise), then repeats the last."""

    def __init__(self, items):
        self.items, self.calls = list(items), 0

    def __call__(self):
        item = self.items[min(self.calls, len(self.items) - 1)]
        self.calls += 1
        if isinstance(item, BaseException):
            raise item
        return item


def rounds(n: int) -> list[dict]:
    out = []
    for i in range(n):
        snap = copy.deepcopy(AGREED)
        snap["peers"][1]["round"] = 100 + i
        out.append(snap)
    return out


def piped() -> Console:
    return Console(record=True, width=160, file=io.StringIO())


def test_watch_piped_prints_one_plain_rendering_per_frame():
    console, fetch = piped(), Recorded(rounds(5))
    assert watch(fetch, interval_s=0, console=console, max_frames=3) == 0
    out = console.file.getvalue()
    assert fetch.calls == 3 and out.count("run default") == 3
    assert [cells(row_of(part, "Alpha111"))[2] for part in out.split("run default")[1:]] == ["100", "101", "102"]
    assert "\x1b" not in out  # plain: no cursor movement, no colour


def test_watch_shows_the_error_and_recovers():
    console = piped()
    fetch = Recorded([rounds(1)[0], TimeoutError("no reply from 3 of 3 DHT peers"), rounds(3)[2]])
    assert watch(fetch, interval_s=0, console=console, max_frames=3) == 0
    before, err, after = console.file.getvalue().partition("DHT did not answer")
    assert err and "no reply from 3 of 3 DHT peers" in after.splitlines()[0] and "retrying" in after.splitlines()[0]
    assert "100" in row_of(before, "Alpha111") and "102" in row_of(after, "Alpha111")


def test_watch_stops_on_the_event_and_on_ctrl_c():
    stop, fetched, snaps = threading.Event(), threading.Event(), rounds(5)

    def fetch():
        fetched.set()
        return snaps[0]

    def stopper():  # another thread (the CLI's signal handler, say) ends the watch while it waits 60 s
        if fetched.wait(10):
            stop.set()

    thread = threading.Thread(target=stopper, daemon=True)
    thread.start()
    console, started = piped(), time.monotonic()
    try:
        assert watch(fetch, interval_s=60, console=console, stop=stop) == 0
    finally:
        stop.set()
        thread.join(10)
    assert time.monotonic() - started < 10 and console.file.getvalue().count("run default") == 1

    console = piped()
    assert watch(Recorded([snaps[0], KeyboardInterrupt()]), interval_s=0, console=console) == 0
    assert console.file.getvalue().count("run default") == 1


def test_watch_live_on_a_forced_terminal_keeps_the_last_frame():
    console = Console(width=160, file=io.StringIO(), force_terminal=True)
    assert watch(Recorded(rounds(3) + [KeyboardInterrupt()]), interval_s=0, console=console) == 0
    out = console.file.getvalue()
    assert "\x1b[?25l" in out and out.endswith("\x1b[?25h") and "102" in out


def _ctrl_c_in(seconds: float) -> threading.Timer:
    import os
    import signal

    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def test_ctrl_c_is_a_flag_the_waits_see_and_a_slow_fetch_is_left_at_once():
    """The watch's Ctrl-C handler raises nothing where it lands (a KeyboardInterrupt inside Event.wait can break the
    lock's `with`: CI's "release unlocked lock"); the loop's wait returns True, a blocked fetch raises between our
    own statements, and the previous handler is back afterwards."""
    import signal

    from p2p_diloco.view.terminal import _CtrlC

    before = signal.getsignal(signal.SIGINT)
    stop = threading.Event()
    with _CtrlC() as ctrl_c:
        _ctrl_c_in(0.2)
        t0 = time.monotonic()
        assert ctrl_c.wait(stop, 30.0) and time.monotonic() - t0 < 10
        ctrl_c.pressed = False
        release = threading.Event()
        slow = ctrl_c.interruptible(lambda: (release.wait(30), {"late": True})[1])
        _ctrl_c_in(0.2)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            slow()
        assert time.monotonic() - t0 < 10
        release.set()
        ctrl_c.pressed = False
        assert ctrl_c.interruptible(lambda: {"ok": 1})() == {"ok": 1}
        with pytest.raises(ValueError):
            ctrl_c.interruptible(lambda: (_ for _ in ()).throw(ValueError("shown by frames")))()
    assert signal.getsignal(signal.SIGINT) is before
