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

MIN_VIEW_WINDOW_S = 30.0
VIEW_WINDOW_ROUNDS = 6
"""An author counts in the swarm's size while its last update merged here within this many of our rounds (at
least MIN_VIEW_WINDOW_S): a peer a few times slower than us still counts between its updates."""


class SwarmExchange:
    """The round loop's view of a `PeerNetwork` (peer/network.py) running on `loop`."""

    def __init__(self, network: Any, loop: Any, samples_per_update: float) -> None:
        self.network, self.loop, self.samples_per_update = network, loop, samples_per_update
        self.last_publish: Any = None  # concurrent.futures.Future of the last hand-over
        self.sent_at_publish = 0  # our bytes_sent counter when the last update was handed over
        self.last_nbytes = 0  # and that update's size
        self._last_view_at: float | None = None

    def publish(self, update: Any) -> None:
        import asyncio

        self.last_publish = asyncio.run_coroutine_threadsafe(self.network.publish(update), self.loop)
        self.sent_at_publish, self.last_nbytes = self.network.counters.get("bytes_sent", 0), update.nbytes

    def swarm_view(self) -> Any:  # -> SwarmView
        """How many peers' worth of updates the swarm makes per round, as our replica saw them merge within the
        last few of our rounds (sync/standing.py `swarm_size`): a newcomer on probation counts a fraction, a
        refused identity nothing. Never the DHT records: a crowd of fresh identities writes as many as it likes,
        and each would shrink every honest update's weight. A local read; it never waits on the network."""
        from p2p_diloco.train.learner import SwarmView

        now = time.monotonic()
        window_s = max(MIN_VIEW_WINDOW_S, VIEW_WINDOW_ROUNDS * (now - self._last_view_at)) \
            if self._last_view_at else MIN_VIEW_WINDOW_S
        self._last_view_at = now
        learner = getattr(self.network, "learner", None)
        standing = learner.replica.standing if learner is not None else None
        if standing is not None:
            with learner.replica.lock:
                size = standing.swarm_size(learner.replica.clock(), window_s)
            size = min(float(MAX_WEIGHTED_PEERS + 1), size)
            return SwarmView(num_peers=max(1, round(size)), samples_per_round=self.samples_per_update * size)
        node = self.network.node  # no standing (a replica built without a spec): the live records
        num_peers, _ = swarm_samples_per_round(self.network.peers, node.peer_id if node else "",
                                               self.samples_per_update)
        return SwarmView(num_peers=num_peers, samples_per_round=self.samples_per_update * num_peers)

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
