"""Prometheus metrics of a swarm, from the same snapshot the terminal view and the web page show.

A collector, not a set of live `Counter` objects: the figures already exist (the peer's counters, refreshed on
its network loop, and the peers' records), so a scrape reads them as they are and nothing is counted twice.

This peer (present when the observer is a peer; names without a `peer` label):
    p2p_diloco_bytes_sent_total, p2p_diloco_bytes_received_total    counters: everything uploaded / downloaded
    p2p_diloco_updates_merged_total                                 counter: remote updates merged
    p2p_diloco_updates_rejected_total{reason}                       counter: refused updates and requests, by reason
    p2p_diloco_bans_total                                           counter: senders banned
    p2p_diloco_round, _loss, _eval_loss, _utilization, _tau,
    p2p_diloco_peers_known, p2p_diloco_version_vector_total         gauges
    p2p_diloco_alone                                                gauge: 1 while it merges nothing although
                                                                    others publish (peer/isolation.py)
Every peer of the run, from its signed record (label `peer`, the full PeerID):
    p2p_diloco_peer_round, _loss, _eval_loss, _samples_per_second, _utilization, _tau, _bytes_sent,
    _bytes_received, _version_vector_total, _record_age_seconds    gauges (a record's counters are a gauge here:
                                                                    a peer that restarts starts over)
The swarm: p2p_diloco_swarm_peers, p2p_diloco_replica_groups (1: every replica equal).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

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
                ("record_age_seconds", "age_s", "age of its newest record"))


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
        rejected = CounterMetricFamily(PREFIX + "updates_rejected", "updates and requests refused, by reason",
                                       labels=["reason"])
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
    yield GaugeMetricFamily(PREFIX + "swarm_peers", "live peer records of the run", value=len(snapshot.get("peers")
                                                                                              or []))
    groups = (snapshot.get("agreement") or {}).get("groups") or []
    yield GaugeMetricFamily(PREFIX + "replica_groups", "distinct replicas among the peers (1: all equal)",
                            value=len(groups))


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
