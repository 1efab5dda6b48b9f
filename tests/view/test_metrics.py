"""The Prometheus exposition says exactly what the snapshot says: scraped text parsed back equals the figures."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from p2p_diloco.view.metrics import MAX_LABELLED_PEERS, metrics_endpoint

SNAPSHOT = {
    "run_id": "r", "spec_hash": "h", "now": 1.0,
    "self": {"round": 7, "loss": 2.5, "eval_loss": None, "utilization": 0.97, "tau": 2, "peers": 3, "vv_total": 21,
             "bytes_sent": 123456, "bytes_received": 654321, "merged": 14, "rejected": 3, "banned": 1,
             "rejected_by": {"duplicate_seq": 2, "rate_limited": 1}},
    "peers": [{"peer_id": "12D3KooWa", "round": 7, "loss": 2.5, "eval_loss": 2.6, "samples_per_s": 99.5,
               "utilization": 0.97, "tau": 2, "bytes_sent": 10, "bytes_received": 20, "vv_total": 21, "age_s": 1.5},
              {"peer_id": "12D3KooWb", "round": 6, "loss": None, "eval_loss": None, "samples_per_s": 0.0,
               "utilization": None, "tau": 0, "bytes_sent": 0, "bytes_received": 0, "vv_total": 20, "age_s": 3.0}],
    "agreement": {"agree": False, "groups": [{"peers": ["12D3KooWa"]}, {"peers": ["12D3KooWb"]}]},
}


def scrape(snapshot):
    body, content_type = metrics_endpoint(lambda: snapshot)()
    assert content_type.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_this_peers_counters_and_gauges_match_its_figures():
    got = scrape(SNAPSHOT)
    own = SNAPSHOT["self"]
    assert got[("p2p_diloco_bytes_sent_total", ())] == own["bytes_sent"]
    assert got[("p2p_diloco_bytes_received_total", ())] == own["bytes_received"]
    assert got[("p2p_diloco_updates_merged_total", ())] == own["merged"]
    assert got[("p2p_diloco_bans_total", ())] == own["banned"]
    assert got[("p2p_diloco_rejected_total", (("reason", "duplicate_seq"),))] == 2
    assert got[("p2p_diloco_rejected_total", (("reason", "rate_limited"),))] == 1
    for name, key in (("round", "round"), ("loss", "loss"), ("utilization", "utilization"), ("tau", "tau"),
                      ("peers_known", "peers"), ("version_vector_total", "vv_total")):
        assert got[(f"p2p_diloco_{name}", ())] == own[key]
    assert ("p2p_diloco_eval_loss", ()) not in got  # None: no sample rather than a made-up 0


def test_every_peer_gets_its_labelled_gauges_and_the_swarm_its_counts():
    got = scrape(SNAPSHOT)
    assert got[("p2p_diloco_peer_round", (("peer", "12D3KooWb"),))] == 6
    assert got[("p2p_diloco_peer_samples_per_second", (("peer", "12D3KooWa"),))] == 99.5
    assert ("p2p_diloco_peer_loss", (("peer", "12D3KooWb"),)) not in got
    assert got[("p2p_diloco_swarm_peers", ())] == 2 and got[("p2p_diloco_replica_groups", ())] == 2


def test_a_bootstrap_has_no_self_series_and_a_flood_of_peers_is_bounded():
    rows = [{"peer_id": f"p{i}", "round": i} for i in range(MAX_LABELLED_PEERS + 50)]
    got = scrape({"self": None, "peers": rows, "agreement": {"groups": []}})
    assert not any(name == "p2p_diloco_bytes_sent_total" for name, _ in got)
    assert sum(1 for name, _ in got if name == "p2p_diloco_peer_round") == MAX_LABELLED_PEERS
    hostile = scrape({"self": None, "peers": [{"peer_id": 'x"}\n# EVIL 1', "round": 1}], "agreement": {}})
    assert hostile[("p2p_diloco_peer_round", (("peer", 'x"}\n# EVIL 1'),))] == 1  # escaped, not injected
