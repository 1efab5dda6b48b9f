"""`SwarmExchange`: the `Exchange` (train/exchange.py) of one peer on the real swarm, used from the compute thread.

`publish` hands the update to the network loop (`Gossip.publish` runs there) and returns at once;
`swarm_view` reads the live peer list the loop keeps fresh. Neither waits on the network (invariant 4).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from p2p_diloco.net.discovery.status import MAX_WEIGHTED_PEERS, swarm_samples_per_round

logger = logging.getLogger(__name__)


class SwarmExchange:
    """The round loop's view of a `PeerNetwork` (peer/network.py) running on `loop`."""

    def __init__(self, network: Any, loop: Any, samples_per_update: float) -> None:
        self.network, self.loop, self.samples_per_update = network, loop, samples_per_update
        self.last_publish: Any = None  # concurrent.futures.Future of the last hand-over
        self.sent_at_publish = 0  # our bytes_sent counter when the last update was handed over
        self.last_nbytes = 0  # and that update's size
        self._seen: dict[str, int] = {}  # sender -> highest seq we have merged from it
        self._active_at: dict[str, float] = {}  # sender -> when its seq last advanced in our replica
        self._last_view_at: float | None = None

    def publish(self, update: Any) -> None:
        import asyncio

        self.last_publish = asyncio.run_coroutine_threadsafe(self.network.publish(update), self.loop)
        self.sent_at_publish, self.last_nbytes = self.network.counters.get("bytes_sent", 0), update.nbytes

    def swarm_view(self) -> Any:  # -> SwarmView
        from p2p_diloco.train.learner import SwarmView

        node = self.network.node
        me = node.peer_id if node else ""
        num_peers, _ = swarm_samples_per_round(self.network.peers, me, self.samples_per_update)
        # DHT records lag (a peer that started a few seconds later is not listed yet, and then every update
        # would be signed with too large a weight): also count the senders whose updates advanced our replica
        # within the last few of our rounds. Both are cheap local reads; neither waits on the network.
        num_peers = min(MAX_WEIGHTED_PEERS + 1, max(num_peers, self._recent_senders(me) + 1))
        return SwarmView(num_peers=num_peers, samples_per_round=self.samples_per_update * num_peers)

    def _recent_senders(self, me: str) -> int:
        now = time.monotonic()
        window_s = max(30.0, 3 * (now - self._last_view_at)) if self._last_view_at else 30.0
        self._last_view_at = now
        learner = getattr(self.network, "learner", None)
        if learner is not None:
            for sender, seq in learner.replica.version_vector.items():
                if sender != me and seq > self._seen.get(sender, 0):
                    self._seen[sender], self._active_at[sender] = seq, now
        for sender in [s for s, t in self._active_at.items() if now - t > window_s]:
            del self._active_at[sender]  # bounded: only senders active within the window stay
        return len(self._active_at)

    def see_last_update_out(self, within_s: float) -> None:
        """After a stop request: give peers a moment (`within_s`, finish_phase_within_s) to pull our last
        update, which is why we finished the phase at all. Others then have it; if they don't, nobody does,
        and replicas agree."""
        publish = self.last_publish
        if publish is None or self.last_nbytes == 0:
            return
        deadline = time.monotonic() + within_s
        try:
            publish.result(timeout=within_s)
        except Exception as e:
            logger.debug("last publish did not finish error=%r", e)
        while time.monotonic() < deadline and \
                self.network.counters.get("bytes_sent", 0) - self.sent_at_publish < self.last_nbytes:
            time.sleep(0.1)
