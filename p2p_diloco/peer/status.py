"""What this peer shows people of the swarm: the snapshot (view/snapshot.py) of the records it holds and of its
own figures, its round history, and, with `--status-port`, the read-only status page and /metrics serving it.

The snapshot is built on the HTTP server's thread from values the other threads replace whole (the network's
`peers`, `counters`, the report's `last`), so reading them needs no lock; the histories (curves, rounds, the
replicas' agreement) are guarded by one.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from p2p_diloco.view.figures import ReplicaWatch, reachability, refused, rejected, rejected_by
from p2p_diloco.view.snapshot import Curves, LocalRounds, build_snapshot
from p2p_diloco.view.web import StatusServer

if TYPE_CHECKING:
    from p2p_diloco.peer.network import PeerNetwork
    from p2p_diloco.peer.report import PeerReport

Figures = dict[str, object]
"""A snapshot's figures (view/snapshot.py): JSON values, untrusted where they come from records."""


class PeerStatus:
    """This peer's view of the swarm, and the status server when one is asked for."""

    def __init__(self, network: PeerNetwork, report: PeerReport | None) -> None:
        self.network, self.report = network, report
        self.curves = Curves()
        self.rounds = LocalRounds()
        self.replicas = ReplicaWatch()
        self.server: StatusServer | None = None
        self._lock = threading.Lock()

    def round_done(self, figures: Figures) -> None:
        """After each round (compute thread): our round into the history, the others' records into the curves,
        so the page shows the whole run even when nobody watched it."""
        self.rounds.append({**figures, "time": time.time()})
        with self._lock:
            records = self._records()
            self.curves.observe(records, time.time())
            self.replicas.observe(records, time.time())

    def _records(self) -> dict[str, dict]:
        """The members' records and ours as last announced (what the others see of us; built on the network
        loop, which also owns the counters a fresh record would have to read)."""
        network = self.network
        records = dict(network.peers)
        own = network.presence.last_record
        if own and network.node is not None:
            records[network.node.peer_id] = own
        return records

    def self_figures(self) -> Figures | None:
        """Our own figures; `rejected` as the others read it from our last record (view/figures.py)."""
        network = self.network
        if network.learner is None:
            return None
        counters = network.counters
        last = self.report.last if self.report is not None else {}
        own = network.presence.last_record
        by_reason = rejected_by(own) or {}
        return {**{k: last.get(k) for k in ("round", "loss", "eval_loss", "utilization", "tau", "peers")},
                "vv_total": network.learner.replica.version_vector.total(),
                "bytes_sent": counters.get("bytes_sent", 0), "bytes_received": counters.get("bytes_received", 0),
                "merged": counters.get("merged", 0), "rejected": rejected(own), "refused": refused(own),
                "rejected_by": by_reason,
                "banned": len(network.learner.replica.banned), "alone": self._alone()}

    def _alone(self) -> str | None:
        """Why this peer trains alone while others publish (peer/isolation.py), or None."""
        detector = getattr(self.report, "isolation", None)
        verdict = detector.verdict if detector is not None else None
        return verdict.status() if verdict is not None else None

    def snapshot(self) -> Figures:
        network = self.network
        node = network.node
        addrs = node.visible_maddrs() if node is not None else []
        observer = {"kind": "peer", "peer_id": node.peer_id if node is not None else None,
                    "reachability": reachability(node.reachability if node is not None else None),
                    "addrs": addrs[:8]}  # the probe's verdict: what our `reachability:` line and record say
        with self._lock:
            return build_snapshot(run_id=network.run_id, spec_hash=network.spec_hash, now=time.time(),
                                  records=self._records(), observer=observer, self_figures=self.self_figures(),
                                  curves=self.curves, local=self.rounds, replicas=self.replicas)

    # ---- the server ---------------------------------------------------------------------------------------

    def serve(self, host: str, port: int) -> str:
        """Start the status page and /metrics on host:port (port 0: a free one); returns its URL."""
        from p2p_diloco.view.metrics import metrics_endpoint

        self.server = StatusServer(self.snapshot, host=host, port=port, metrics=metrics_endpoint(self.snapshot))
        self.server.start()
        return self.server.url

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
