"""The snapshot every view renders: rows read defensively from untrusted records, agreement by digest, the
version-vector matrix, and histories that stay bounded whatever the DHT holds."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.view.figures import agreement
from p2p_diloco.view.snapshot import Curves, LocalRounds, build_snapshot, peer_row

NOW = 1_764_075_000.0


def record(round_=3, vv_total=9, digest="aaaa", loss=2.5, **extra):
    return {"state": "training", "round": round_, "step": round_ * 20, "loss": loss, "eval_loss": None,
            "samples_per_s": 100.0, "tau": 1, "updated_at": NOW - 2, "version_vector_total": vv_total,
            "vv_digest": digest, "seq": round_, "maddrs": ["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWx"],
            "bytes_sent": 1000, "bytes_received": 2000, "utilization": 0.9, "last_update_at": NOW - 1, **extra}


def test_reachability_is_the_peers_own_probe_not_its_addresses():
    on_loopback = {"maddrs": ["/ip4/127.0.0.1/tcp/1"]}
    assert peer_row("p", record(**on_loopback, reach="public"), NOW)["reachability"] == "public"
    assert peer_row("p", record(maddrs=["/ip4/8.8.8.8/tcp/1"], reach="private"), NOW)["reachability"] == "private"
    for junk in (None, "relayed", "<b>x</b>", 5):
        assert peer_row("p", record(reach=junk), NOW)["reachability"] == "unknown"
    assert peer_row("p", record(), NOW)["reachability"] == "unknown"  # a record without the probe's verdict


def test_a_row_reads_every_field_and_ages_from_now():
    row = peer_row("12D3KooWabcdefgh12345678", record(), NOW)
    assert row["short"] == "12345678" and row["round"] == 3 and row["vv_total"] == 9
    assert row["age_s"] == 2 and row["update_age_s"] == 1 and row["reachability"] == "unknown"
    assert row["loss"] == 2.5 and row["eval_loss"] is None and row["utilization"] == 0.9


def test_agreement_groups_by_digest_biggest_group_first():
    rows = [peer_row(p, record(digest=d, vv_total=v), NOW) for p, d, v in
            (("a", "d1", 9), ("b", "d1", 9), ("c", "d2", 7))]
    result = agreement(rows)
    assert not result["agree"] and [g["peers"] for g in result["groups"]] == [["a", "b"], ["c"]]
    assert result["state"] == "in_flight"  # several vectors with no history: updates on their way
    assert agreement(rows[:2])["agree"] and agreement(rows[:2])["state"] == "agree"


def test_snapshot_has_the_matrix_and_is_json():
    records = {"a": record(vv={"a": 3, "b": 2}), "b": record(vv={"a": 1, "b": 2}, digest="bbbb"), "c": record()}
    snap = build_snapshot(run_id="r", spec_hash="h", now=NOW, records=records,
                          observer={"kind": "status", "peer_id": None, "reachability": "unknown", "addrs": []})
    assert snap["vv_matrix"] == {"holders": ["a", "b"], "senders": ["a", "b"], "seq": [[3, 2], [1, 2]]}
    assert [r["peer_id"] for r in snap["peers"]] == ["a", "b", "c"]
    assert json.loads(json.dumps(snap)) == snap


def test_curves_add_a_point_per_new_round_and_fill_a_late_eval():
    curves = Curves()
    curves.observe({"a": record(round_=1)}, NOW)
    curves.observe({"a": record(round_=1, eval_loss=2.2)}, NOW)
    curves.observe({"a": record(round_=2, loss=2.0, eval_loss=2.2)}, NOW)  # the same eval, carried on: not redrawn
    curves.observe({"a": record(round_=3, loss=1.9, eval_loss=2.1)}, NOW)
    assert [(p[1], p[2], p[3]) for p in curves.to_dict()["a"]] == [(1, 2.5, 2.2), (2, 2.0, None), (3, 1.9, 2.1)]


def test_curves_stay_bounded_under_a_flood_of_identities_and_rounds():
    curves = Curves(max_peers=8, max_points=16)
    for i in range(100):
        curves.observe({f"p{i}": record(round_=1)}, NOW)
    for r in range(1, 200):
        curves.observe({"p99": record(round_=r)}, NOW)
    got = curves.to_dict()
    assert len(got) == 8 and "p99" in got and "p0" not in got
    assert len(got["p99"]) <= 16 and got["p99"][-1][1] == 199  # thinned, the newest kept
    rounds = LocalRounds(max_rounds=5)
    for r in range(10):
        rounds.append({"round": r, "loss": 1.0, "junk": object()})
    assert [x["round"] for x in rounds.to_list()] == [5, 6, 7, 8, 9] and "junk" not in rounds.to_list()[0]


values = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=20),
                   st.lists(st.text(max_size=10), max_size=3), st.dictionaries(st.text(max_size=5), st.integers()))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=12), st.dictionaries(st.sampled_from(
    ["state", "round", "loss", "eval_loss", "updated_at", "last_update_at", "maddrs", "vv", "vv_digest",
     "version_vector_total", "rejected_by", "utilization", "bytes_sent", "banned", "tau"]), values), max_size=5))
def test_hostile_records_never_break_the_snapshot(records):
    snap = build_snapshot(run_id="r", spec_hash=None, now=NOW, records=records, curves=Curves(),
                          observer={"kind": "status", "peer_id": None, "reachability": "unknown", "addrs": []})
    json.dumps(snap, allow_nan=False)  # every number finite: the page's JSON.parse would choke on NaN
    for row in snap["peers"]:
        assert isinstance(row["round"], int) and isinstance(row["state"], str) and row["age_s"] >= 0
