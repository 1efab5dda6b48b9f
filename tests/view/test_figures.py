"""One meaning per figure: reachability, rejected and the replicas' agreement are defined once (view/figures.py)
and every view (snapshot, /metrics, the terminal, `status`, the peer's own page) shows the same value under the
same name; updates in flight are not divergence, an update that does not arrive is."""

from __future__ import annotations

import hashlib
import io
import json
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from p2p_diloco.peer.status import PeerStatus
from p2p_diloco.view.figures import ReplicaWatch, rejected
from p2p_diloco.view.metrics import metrics_endpoint
from p2p_diloco.view.snapshot import build_snapshot
from p2p_diloco.view.table import status_table
from p2p_diloco.view.terminal import render

T0 = 1_764_075_000.0
A, B, C = "12D3KooWaaaaAlpha111", "12D3KooWbbbbBravo222", "12D3KooWccccCharl333"
OBSERVER = {"kind": "bootstrap", "peer_id": None, "reachability": "public", "addrs": []}


def record(vv: dict[str, int], at: float, state: str = "training", **extra) -> dict:
    return {"state": state, "round": max(vv.values(), default=0), "updated_at": at, "vv": dict(vv),
            "version_vector_total": sum(vv.values()), "maddrs": ["/ip4/127.0.0.1/tcp/4001"],
            "vv_digest": hashlib.sha256(json.dumps(sorted(vv.items())).encode()).hexdigest()[:16], **extra}


def scrape(snapshot: dict) -> dict:
    body, _ = metrics_endpoint(lambda: snapshot)()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def text_of(renderable) -> str:
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_reachability_and_rejected_are_the_same_figure_in_every_view():
    """A peer on loopback whose probe said public, that refused 3 updates and saw 9 honest duplicates."""
    records = {A: record({A: 5}, T0, reach="public", rejected=3, refused=1,
                         rejected_by={"duplicate": 9, "norm_bound": 2, "bad_layout": 1, "busy": 1}),
               B: record({B: 5}, T0, reach="private", rejected=0, refused=0, rejected_by={"duplicate": 4}),
               C: record({C: 5}, T0)}  # an older peer: no probe verdict, no refusals carried
    snap = build_snapshot(run_id="r", spec_hash=None, now=T0 + 1, records=records, observer=OBSERVER,
                          replicas=ReplicaWatch())
    rows = {r["peer_id"]: r for r in snap["peers"]}
    assert [rows[p]["reachability"] for p in (A, B, C)] == ["public", "private", "unknown"]
    assert [rows[p]["rejected"] for p in (A, B, C)] == [3, 0, None]
    assert [rows[p]["refused"] for p in (A, B, C)] == [1, 0, None]
    assert rows[A]["rejected_by"] == {"norm_bound": 2, "bad_layout": 1, "busy": 1}
    metrics = scrape(snap)
    for pid, reach, refused in ((A, "public", 3), (B, "private", 0)):
        assert metrics[("p2p_diloco_peer_reachability", (("peer", pid), ("reachability", reach)))] == 1
        assert metrics[("p2p_diloco_peer_rejected", (("peer", pid),))] == refused
    terminal = {line.split()[0]: line.split() for line in text_of(render(snap)).splitlines()
                if line[:8] in ("Alpha111", "Bravo222", "Charl333")}
    table = {line.split()[0]: line.split() for line in status_table(records, now=T0 + 1).splitlines()[1:]}
    header = status_table(records, now=T0 + 1).splitlines()[0].split()
    for pid, short in ((A, "Alpha111"), (B, "Bravo222"), (C, "Charl333")):
        reach, refused = rows[pid]["reachability"], rows[pid]["rejected"]
        assert reach in terminal[short] and table[pid][header.index("reach")] == reach
        assert table[pid][header.index("rejected")] == (str(refused) if refused is not None else "-")
        assert (str(refused) if refused is not None else "-") in terminal[short]
    assert "norm_bound 2" in status_table(records, now=T0 + 1)


def test_the_peers_own_page_reads_its_probe_and_its_record():
    """The peer's page shows its probe's verdict (what its `reachability:` line printed), not its addresses, and
    its own `rejected` as the others read it from its record."""
    own = record({A: 3}, T0, reach="public", rejected=2, refused=1,
                 rejected_by={"duplicate": 6, "norm_bound": 2, "rate_limited": 1})
    node = SimpleNamespace(peer_id=A, reachability="public", visible_maddrs=lambda: ["/ip4/10.0.0.5/tcp/1"])
    learner = SimpleNamespace(replica=SimpleNamespace(version_vector=SimpleNamespace(total=lambda: 3), banned=()))
    network = SimpleNamespace(node=node, learner=learner, counters={"merged": 2}, peers={}, run_id="r",
                              spec_hash=None, presence=SimpleNamespace(last_record=own))
    snap = PeerStatus(network, report=None).snapshot()
    assert snap["observer"]["reachability"] == "public"
    assert snap["self"]["rejected_by"] == {"norm_bound": 2, "rate_limited": 1}
    assert snap["self"]["rejected"] == rejected(own) == snap["peers"][0]["rejected"] == 2
    assert snap["self"]["refused"] == snap["peers"][0]["refused"] == 1
    assert "rejected 2" in text_of(render(snap))
    assert scrape(snap)[("p2p_diloco_rejected_total", (("reason", "rate_limited"),))] == 1


def training(watch: ReplicaWatch, seconds: int, lag_of: dict[str, int] | None = None, step_s: float = 1.0):
    """Three peers, one round a second each: every peer merges its own update at once and the others' a round
    later (in flight); a peer in `lag_of` stops receiving `lag_of[peer]`'s updates. Yields each snapshot."""
    lag_of = lag_of or {}
    frozen: dict[tuple[str, str], int] = {}
    for t in range(1, seconds + 1):
        at = T0 + t * step_s
        records = {}
        for holder in (A, B, C):
            vv = {s: t if s == holder else t - 1 for s in (A, B, C)}
            if holder in lag_of:
                vv[lag_of[holder]] = frozen.setdefault((holder, lag_of[holder]), vv[lag_of[holder]])
            records[holder] = record(vv, at - 0.5 * (holder == B))  # records of different ages
        yield build_snapshot(run_id="r", spec_hash=None, now=at, records=records, observer=OBSERVER, replicas=watch)


def test_updates_in_flight_are_not_divergence():
    snaps = list(training(ReplicaWatch(), 300))
    states, snap = [s["agreement"]["state"] for s in snaps], snaps[-1]
    assert set(states) == {"in_flight"}  # three versions at every moment, for five minutes: nothing is wrong
    shown = text_of(render(snap))
    assert "replicas in flight: 3 versions" in shown and "diverged" not in shown and "≠" not in shown
    assert scrape(snap)[("p2p_diloco_replica_agreement", (("state", "in_flight"),))] == 1
    snap = build_snapshot(run_id="r", spec_hash=None, now=T0, observer=OBSERVER,
                          records={p: record({A: 4, B: 4}, T0) for p in (A, B)}, replicas=ReplicaWatch())
    assert snap["agreement"]["state"] == "agree" and snap["agreement"]["agree"]
    assert scrape(snap)[("p2p_diloco_replica_agreement", (("state", "agree"),))] == 1


def test_a_replica_that_stops_receiving_a_sender_diverges_after_stuck_s():
    snaps = list(training(ReplicaWatch(stuck_s=60), 120, lag_of={C: A}))
    assert all(s["agreement"]["state"] == "in_flight" for s in snaps[:55])
    last = snaps[-1]["agreement"]
    assert last["state"] == "diverged" and list(last["behind"]) == [C] and last["behind"][C] > 60
    metrics = scrape(snaps[-1])
    assert metrics[("p2p_diloco_replica_agreement", (("state", "diverged"),))] == 1
    assert metrics[("p2p_diloco_replicas_behind", ())] == 1
    shown = text_of(render(snaps[-1]))
    assert "replicas diverged" in shown and "Charl333" in shown and "≠" in shown


def test_without_per_sender_vectors_the_totals_tell_a_stuck_replica():
    watch = ReplicaWatch(stuck_s=30)
    for t in range(0, 50, 2):
        records = {A: {**record({A: t}, T0 + t), "vv": None}, B: {**record({B: 3}, T0 + t), "vv": None}}
        snap = build_snapshot(run_id="r", spec_hash=None, now=T0 + t, records=records, observer=OBSERVER,
                              replicas=watch)
    assert snap["agreement"]["state"] == "diverged" and list(snap["agreement"]["behind"]) == [B]


def test_joiners_and_peers_that_left_are_not_compared():
    watch = ReplicaWatch(stuck_s=10)
    for t in range(0, 40, 2):
        records = {A: record({A: t + 1}, T0 + t), B: record({A: 0}, T0 + t, state="syncing"),
                   C: record({A: 1}, T0 + t, state="left")}
        snap = build_snapshot(run_id="r", spec_hash=None, now=T0 + t, records=records, observer=OBSERVER,
                              replicas=watch)
    assert snap["agreement"]["state"] == "agree" and snap["agreement"]["behind"] == {}


def test_records_seen_out_of_order_and_a_flood_of_senders_stay_sound_and_bounded():
    watch = ReplicaWatch(stuck_s=60, max_senders=8, max_marks=16)
    watch.observe({A: record({A: 5}, T0 + 100)}, T0 + 100)
    watch.observe({B: record({A: 5}, T0 + 80)}, T0 + 100)  # read later, written earlier: held since T0 + 80
    assert watch.behind({A: record({A: 5}, T0 + 150), C: record({A: 4}, T0 + 150)}, T0 + 150) == {C: 70.0}
    # A record's time is a claim: one dated long ago counts as read CLOCK_SLACK_S ago, not as an old holding.
    forged = ReplicaWatch(stuck_s=60)
    forged.observe({A: record({A: 9}, 0.0)}, T0)
    assert forged.behind({A: record({A: 9}, T0), C: record({A: 4}, T0)}, T0) == {}
    for i in range(100):
        watch.observe({f"p{i}": record({f"s{i}": j for j in range(1, 3)} | {A: 40 + i}, T0 + i)}, T0 + i)
    assert len(watch._seqs) <= 8 and all(len(held.levels) <= 16 for held in watch._seqs.values())


values = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=8),
                   st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.floats(), st.text())))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.dictionaries(st.text(max_size=6), st.dictionaries(st.sampled_from(
    ["state", "updated_at", "vv", "version_vector_total", "vv_digest", "reach", "rejected_by"]), values),
    max_size=4), max_size=4))
def test_hostile_records_never_break_the_agreement(reads):
    watch = ReplicaWatch()
    for records in reads:
        snap = build_snapshot(run_id="r", spec_hash=None, now=T0, records=records, observer=OBSERVER,
                              replicas=watch)
        json.dumps(snap, allow_nan=False)
        assert snap["agreement"]["state"] in ("agree", "in_flight", "diverged")
        assert all(row["reachability"] in ("public", "private", "unknown") for row in snap["peers"])
