"""A peer never trains alone while saying it is in a swarm (issue 12): the isolation detector, its diagnosis,
and how the peer shows it (round line, status views)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from p2p_diloco.peer.isolation import (
    DIAL,
    FIXES,
    REFUSED,
    SILENT,
    STUCK,
    THROTTLED,
    TIMEOUT,
    IsolationDetector,
    alone_lines,
    diagnose,
)
from p2p_diloco.peer.output import round_line
from p2p_diloco.peer.sinks import scalars
from p2p_diloco.view.snapshot import build_snapshot
from p2p_diloco.view.terminal import render
from tests.helpers.faults import peer_id_of
from tests.helpers.swarm import Launcher, Proc, wait_until

ME, A, B = "12D3KooWme000000", "12D3KooWaaaaaaaa", "12D3KooWbbbbbbbb"


def rec(seq: int, state: str = "training", **extra) -> dict:
    return {"seq": seq, "state": state, **extra}


def feed(det: IsolationDetector, rounds, *, dt: float = 10.0, peers=None, vector=None, counters=None,
         rejected=None, start: int = 1):
    """Observe `rounds` rounds; `peers`/`vector` are functions of the round (default: A publishes one update per
    round, we merge nothing of it)."""
    out = []
    for r in range(start, start + rounds):
        out.append(det.observe(r, r * dt, peers(r) if peers else {ME: rec(r), A: rec(r)},
                               vector(r) if vector else {ME: r}, counters(r) if counters else {},
                               rejected(r) if rejected else {}))
    return out


def test_alone_when_another_member_publishes_and_nothing_merges():
    det = IsolationDetector(ME, min_rounds=3, min_seconds=20)
    verdicts = feed(det, 6)
    assert [v.alone for v in verdicts] == [False, False, False, True, True, True]
    assert [v.event for v in verdicts] == [None, None, None, "alone", None, None]
    alone = verdicts[3]
    assert alone.rounds == 3 and alone.seconds == 30 and alone.publishing == 1
    assert alone.unreached == ({"peer": A, "seq": 4, "held": 0},)
    line = alone.line()
    assert line.startswith("ALONE: 1 peer publishes updates but none merged here for 3 rounds (30s)")
    assert "Fix:" in line and A[-8:] in line
    assert alone.status() and "Fix:" in alone.status()


def test_a_member_that_existed_before_we_looked_and_whose_updates_we_lack_counts():
    det = IsolationDetector(ME, min_rounds=2, min_seconds=0)
    verdicts = feed(det, 4, peers=lambda r: {A: rec(40)})  # its seq never moves while we watch; we hold none
    assert verdicts[-1].alone and verdicts[-1].unreached[0]["held"] == 0


def test_not_alone_when_nobody_else_publishes():
    alone_swarm = IsolationDetector(ME, min_rounds=1, min_seconds=0)
    assert not any(v.alone for v in feed(alone_swarm, 8, peers=lambda r: {ME: rec(r)}))
    # others lingering after their last round: their seq stands still and we hold all of it
    lingering = IsolationDetector(ME, min_rounds=1, min_seconds=0)
    verdicts = feed(lingering, 8, peers=lambda r: {ME: rec(r), A: rec(30, "done"), B: rec(12, "left")},
                    vector=lambda r: {ME: r, A: 30})
    assert not any(v.alone for v in verdicts)
    # a member still syncing, or one we banned, is never waited for
    syncing = IsolationDetector(ME, min_rounds=1, min_seconds=0)
    assert not any(v.alone for v in feed(syncing, 5, peers=lambda r: {A: rec(r, "syncing")}))
    banned = IsolationDetector(ME, min_rounds=1, min_seconds=0)
    assert not any(banned.observe(r, r * 10.0, {A: rec(r)}, {ME: r}, ignore={A}).alone for r in range(1, 6))


def test_merging_keeps_it_connected():
    det = IsolationDetector(ME, min_rounds=2, min_seconds=0)
    verdicts = feed(det, 10, vector=lambda r: {ME: r, A: r - 1})  # A's updates merge every round
    assert not any(v.alone for v in verdicts)


def test_reconnects_as_soon_as_something_merges_and_repeats_while_alone():
    det = IsolationDetector(ME, min_rounds=3, min_seconds=20, repeat_every=5)
    verdicts = feed(det, 14)
    assert [r + 1 for r, v in enumerate(verdicts) if v.event] == [4, 9, 14]
    assert [v.event for v in verdicts if v.event] == ["alone", "still_alone", "still_alone"]
    back = det.observe(15, 150.0, {A: rec(15), B: rec(3)}, {ME: 15, A: 2, B: 1})
    assert not back.alone and back.event == "connected" and back.merging_from == 2 and back.status() is None
    assert back.line() == "merging again from 2 peers (after 14 rounds alone)"
    # and the window starts again: not alone at once
    assert not det.observe(16, 160.0, {A: rec(16)}, {ME: 16, A: 2, B: 1}).alone


def test_the_minimum_window_holds_in_rounds_and_in_seconds():
    fast = IsolationDetector(ME, min_rounds=3, min_seconds=20)
    verdicts = feed(fast, 12, dt=0.5)  # 0.5 s rounds: 3 rounds pass long before 20 s
    assert not any(v.alone for v in verdicts)
    assert fast.observe(41, 20.5, {A: rec(41)}, {ME: 41}).alone  # 40 rounds and 20 s after the first
    slow = IsolationDetector(ME, min_rounds=3, min_seconds=20)
    verdicts = feed(slow, 3, dt=60.0)  # minutes per round: still three rounds
    assert not any(v.alone for v in verdicts)


def test_cleared_when_the_publishers_go_quiet():
    det = IsolationDetector(ME, min_rounds=2, min_seconds=0)
    feed(det, 5, vector=lambda r: {ME: r, A: 1} if r == 1 else {ME: r, A: 1})
    assert det.alone
    quiet = det.observe(6, 60.0, {A: rec(5, "left")}, {ME: 6, A: 1})
    assert not quiet.alone and quiet.event == "cleared" and "no longer alone" in quiet.line()


def test_diagnosis_picks_the_dial_failure_fix_from_the_counters():
    det = IsolationDetector(ME, min_rounds=3, min_seconds=20)
    verdicts = feed(det, 5, counters=lambda r: {"pulls": 2 * r, "pull_failures": 2 * r, "announce_failures": r},
                    rejected=lambda r: {"disconnect": 2 * r, "duplicate": 7})
    diagnosis = verdicts[3].diagnosis
    assert diagnosis.kind == DIAL and diagnosis.fix == FIXES[DIAL][1]
    assert diagnosis.evidence == {"disconnect": 6, "pull_failures": 6, "announce_failures": 3}  # this window only
    assert "--reachability private" in verdicts[3].line() and "doctor --bootstrap" in verdicts[3].line()


def test_diagnosis_by_counters():
    assert diagnose({}, {}).kind == SILENT
    assert diagnose({"announce_failures": 4, "announces_sent": 4}, {}).kind == DIAL
    assert diagnose({"pulls": 5, "pull_failures": 5}, {"refused": 5}).kind == REFUSED
    assert diagnose({"pulls": 5, "pull_failures": 5}, {"timeout": 4, "slow_stream": 1}).kind == TIMEOUT
    assert diagnose({"announces_received": 3}, {"not_allowed": 3}).kind == THROTTLED
    assert diagnose({"pulls": 3, "updates_received": 9}, {"rejected_buffer_full": 9}).kind == STUCK
    assert diagnose({"pulls": 3, "updates_received": 3}, {"wrong_spec": 3}).kind == "invalid"
    assert diagnose({"pulls": 3}, {}).kind == "unknown"
    assert diagnose({"pulls": float("nan"), "pull_failures": True}, {"disconnect": "x", 5: 1}).kind == SILENT
    assert all(reason and fix for reason, fix in FIXES.values())


def test_the_peer_shows_it_in_its_round_line_sinks_status_views_and_status_footer():
    stats = {"round": 7, "step": 14, "loss": 2.0, "eval_loss": None, "peers": 2, "tau": 0, "vv_total": 7,
             "bytes_sent": 10, "merged": 0, "rejected": 0, "utilization": 0.9}
    assert not round_line(stats).endswith("ALONE") and round_line({**stats, "alone": True}).endswith("  ALONE")
    assert scalars({**stats, "alone": True})["alone"] == 1.0 and "alone" not in scalars(stats)
    why = "1 publishing peer(s) unreached for 3 rounds: the other peers cannot be dialed. Fix: run doctor\x1b[2J"
    records = {A: {"seq": 3, "state": "training", "alone": why}, B: {"seq": 2, "state": "training", "alone": 5}}
    snap = build_snapshot(run_id="r", spec_hash=None, now=0.0, records=records, observer={"kind": "peer"},
                          self_figures={"round": 3, "alone": why})
    assert {r["peer_id"]: r["alone"] for r in snap["peers"]} == {A: why, B: None}
    from rich.console import Console

    console = Console(width=200, record=True, color_system=None)
    console.print(render(snap, width=200))
    shown = console.export_text()
    assert f"{A[-8:]} ALONE: 1 publishing peer(s)" in shown and "\nALONE: 1 publishing" in shown
    assert "\x1b" not in shown and f"{B[-8:]} ALONE" not in shown
    assert alone_lines(records) == [f"{A[-8:]} ALONE: {why[:-4]}?[2J"]


@pytest.mark.slow  # ~50 s: two peers start (~25 s on 2 cores), then the 20 s minimum window
def test_a_peer_whose_pulls_are_refused_says_it_is_alone_on_its_terminal_log_and_status(tmp_path: Path):
    """Real processes on 127.0.0.1: A serves one pull per remote, then refuses every other (its pull rate limit),
    while it pulls B's updates as usual. B sees A publish on the DHT and merges nothing more of it: B says ALONE,
    with the refusal's diagnosis, in its terminal, JSON log, status page and DHT record; A does not."""
    with Launcher(tmp_path) as launcher:
        _, bootstrap = launcher.bootstrap()
        a = launcher.peer("A", bootstrap, "--admission.rate.pulls-per-s", "0.0001", "--status-port", "0")
        b = launcher.peer("B", bootstrap, "--status-port", "0")
        line = b.wait_for_line(r"^ALONE: .*$", timeout_s=150).group(0)
        assert "refuse" in line and "Fix:" in line and peer_id_of(a)[-8:] in line, line
        event = wait_until(lambda: b.events("isolation"), 10, "B's isolation event", procs=[b])[0]
        assert event["alone"] and event["change"] == "alone" and event["diagnosis"] == "refused"
        assert event["rounds"] >= 3 and event["seconds"] >= 20 and event["unreached"][0]["peer"] == peer_id_of(a)
        assert b.rounds()[-1]["alone"] is True
        assert "refuse" in status_of(b)["self"]["alone"]

        def b_alone_on_a_page():  # B's DHT record, as A reads it (what `p2p-diloco status` shows too)
            rows = {r["peer_id"]: r for r in status_of(a)["peers"]}
            return rows.get(peer_id_of(b), {}).get("alone")

        assert "refuse" in wait_until(b_alone_on_a_page, 30, "A's page to show B alone", procs=[a, b])
        assert "ALONE" not in a.output() and status_of(a)["self"]["alone"] is None


def status_of(proc: Proc) -> dict:
    url = proc.wait_for_line(r"^status page: (http://127\.0\.0\.1:\d+/)", 10).group(1)
    with urllib.request.urlopen(url + "api/status", timeout=10) as response:
        return json.loads(response.read())


def test_metrics_say_alone():
    from p2p_diloco.view.metrics import swarm_metrics

    def alone_gauge(why):
        snap = build_snapshot(run_id="r", spec_hash=None, now=0.0, records={}, observer={"kind": "peer"},
                              self_figures={"round": 1, "alone": why})
        return next(m.samples[0].value for m in swarm_metrics(snap) if m.name == "p2p_diloco_alone")

    assert alone_gauge("cut off. Fix: x") == 1.0 and alone_gauge(None) == 0.0
