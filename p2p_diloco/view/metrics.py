"""Prometheus metrics of a swarm, from the same snapshot the terminal view and the web page show.

A collector, not a set of live `Counter` objects: the figures already exist (the peer's counters, refreshed on
its network loop, and the peers' records), so a scrape reads them as they are and nothing is counted twice.

This peer (present when the observer is a peer; names without a `peer` label):
    p2p_diloco_bytes_sent_total, p2p_diloco_bytes_received_total    counters: everything uploaded / downloaded
    p2p_diloco_updates_merged_total                                 counter: remote updates merged
    p2p_diloco_rejected_total{reason}                               counter: `rejected_by`, refusals by reason
    p2p_diloco_bans_total                                           counter: senders banned
    p2p_diloco_round, _loss, _eval_loss, _utilization, _tau,
    p2p_diloco_peers_known, p2p_diloco_version_vector_total         gauges
    p2p_diloco_alone                                                gauge: 1 while it merges nothing although
                                                                    others publish (peer/isolation.py)
Every peer of the run, from its signed record (label `peer`, the full PeerID):
    p2p_diloco_peer_round, _loss, _eval_loss, _samples_per_second, _utilization, _tau, _bytes_sent,
    _bytes_received, _version_vector_total, _record_age_seconds,
    _rejected                                                       gauges (a record's counters are a gauge here:
                                                                    a peer that restarts starts over)
    p2p_diloco_peer_reachability{peer, reachability}                1 for the peer's probe verdict
The swarm: p2p_diloco_swarm_peers, p2p_diloco_replica_groups (distinct live replicas: several while updates
are in flight), p2p_diloco_replica_agreement{state} (1 for agree, in_flight or diverged) and
p2p_diloco_replicas_behind (peers lacking an update others have held too long).
Each figure is the snapshot's, named as the other views name it (view/figures.py defines them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from p2p_diloco.view.figures import AGREEMENT_STATES

PREFIX = "p2p_diloco_"
MAX_LABELLED_PEERS = 256
"""Per-peer series are kept for this many peers: a scrape must stay bounded whatever the DHT holds."""

_SELF_COUNTERS = (("bytes_sent", "bytes_sent", "bytes uploaded: updates, pulls served and snapshots"),
                  ("bytes_received", "bytes_received", "bytes downloaded"),
                  ("updates_merged", "merged", "remote updates merged into the replica"),
                  ("bans", "banned", "senders banned (equivocation, invalid or non-finite updates)"))
_SELF_GAUGES = (("round", "round", "outer rounds done"), ("loss", "loss", "mean train loss of the last inner phase"),
                ("eval_loss", "eval_loss", "last eval loss of the replica"),
                ("utilization", "utilization", "share of wall time spent computing since training began"),
                ("tau", "tau", "staleness of the last update (remote updates merged during its phase)"),
                ("peers_known", "peers", "peers this one counts in the swarm"),
                ("version_vector_total", "vv_total", "updates merged into the replica (sum of the version vector)"))
_PEER_GAUGES = (("round", "round", "outer rounds done"), ("loss", "loss", "last train loss"),
                ("eval_loss", "eval_loss", "last eval loss"), ("samples_per_second", "samples_per_s", "throughput"),
                ("utilization", "utilization", "compute share of wall time"), ("tau", "tau", "staleness"),
                ("bytes_sent", "bytes_sent", "bytes uploaded (its record's claim)"),
                ("bytes_received", "bytes_received", "bytes downloaded (its record's claim)"),
                ("version_vector_total", "vv_total", "updates merged into its replica"),
                ("record_age_seconds", "age_s", "age of its newest record"),
                ("rejected", "rejected", "updates refused by it (its record's claim)"),
                ("refused", "refused", "requests its network turned away (its record's claim)"))


def _number(figures: Mapping[str, Any], key: str) -> float | None:
    value = figures.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def swarm_metrics(snapshot: Mapping[str, Any]) -> Iterator[Metric]:
    """The metric families of one snapshot (view/snapshot.py)."""
    own = snapshot.get("self")
    if own:
        for name, key, doc in _SELF_COUNTERS:
            value = _number(own, key)
            if value is not None:
                yield CounterMetricFamily(PREFIX + name, doc, value=value)
        rejected = CounterMetricFamily(PREFIX + "rejected", "updates and requests refused, by reason (honest "
                                       "duplicates left out)", labels=["reason"])
        for reason, n in sorted(dict(own.get("rejected_by") or {}).items()):
            rejected.add_metric([str(reason)], float(n))
        yield rejected
        for name, key, doc in _SELF_GAUGES:
            value = _number(own, key)
            if value is not None:
                yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        yield GaugeMetricFamily(PREFIX + "alone", "1 while this peer merges nothing although others publish "
                                "(peer/isolation.py)", value=1.0 if own.get("alone") else 0.0)
    rows = list(snapshot.get("peers") or [])[:MAX_LABELLED_PEERS]
    for name, key, doc in _PEER_GAUGES:
        family = GaugeMetricFamily(PREFIX + "peer_" + name, doc + " (per peer, from its signed record)",
                                   labels=["peer"])
        for row in rows:
            value = _number(row, key)
            if value is not None:
                family.add_metric([str(row.get("peer_id", ""))], value)
        yield family
    reach = GaugeMetricFamily(PREFIX + "peer_reachability", "1 for the peer's own probe verdict (per peer)",
                              labels=["peer", "reachability"])
    for row in rows:
        reach.add_metric([str(row.get("peer_id", "")), str(row.get("reachability", "unknown"))], 1.0)
    yield reach
    yield GaugeMetricFamily(PREFIX + "swarm_peers", "live peer records of the run", value=len(snapshot.get("peers")
                                                                                              or []))
    yield from _agreement_metrics(dict(snapshot.get("agreement") or {}))


def _agreement_metrics(agreement: Mapping[str, Any]) -> Iterator[Metric]:
    yield GaugeMetricFamily(PREFIX + "replica_groups", "distinct live replicas (several while updates are in "
                            "flight)", value=len(agreement.get("groups") or []))
    state = GaugeMetricFamily(PREFIX + "replica_agreement", "1 for the replicas' state: agree, in_flight or "
                              "diverged", labels=["state"])
    for name in AGREEMENT_STATES:
        state.add_metric([name], 1.0 if agreement.get("state") == name else 0.0)
    yield state
    yield GaugeMetricFamily(PREFIX + "replicas_behind", "live peers lacking an update another has held too long",
                            value=len(agreement.get("behind") or {}))


class _Collector:
    def __init__(self, source: Callable[[], Mapping[str, Any]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        yield from swarm_metrics(self.source())


def metrics_endpoint(source: Callable[[], Mapping[str, Any]]) -> Callable[[], tuple[bytes, str]]:
    """A `() -> (body, content type)` for the status server's /metrics: the exposition of `source()`'s snapshot.
    Its own registry, so the process's default one (and anything else registered there) is not exposed."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(source))
    return lambda: (generate_latest(registry), CONTENT_TYPE_LATEST)
