"""`SwarmExchange`: the `Exchange` (train/exchange.py) of one peer on the real swarm, used from the compute thread.

`publish` hands the update to the network loop (`Gossip.publish` runs there) and returns at once;
`swarm_view` reads the live peer list the loop keeps fresh; `backlog` reads the last vector each remote sent us.
None waits on the network (invariant 4).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

from p2p_diloco.net.discovery.status import MAX_WEIGHTED_PEERS, swarm_samples_per_round
from p2p_diloco.peer.network import PeerNetwork
from p2p_diloco.train.exchange import SwarmView
from p2p_diloco.wire.envelope import OuterUpdate

logger = logging.getLogger(__name__)

MIN_VIEW_WINDOW_S = 30.0
VIEW_WINDOW_ROUNDS = 6
"""An author counts in the swarm's size while its last update merged here within this many of our rounds (at
least MIN_VIEW_WINDOW_S): a peer a few times slower than us still counts between its updates."""


class SwarmExchange:
    """The round loop's view of a `PeerNetwork` (peer/network.py) running on `loop`."""

    def __init__(self, network: PeerNetwork, loop: asyncio.AbstractEventLoop, samples_per_update: float) -> None:
        self.network, self.loop, self.samples_per_update = network, loop, samples_per_update
        self.last_publish: concurrent.futures.Future[None] | None = None  # the last hand-over
        self.sent_at_publish = 0  # our bytes_sent counter when the last update was handed over
        self.last_nbytes = 0  # and that update's size
        self._last_view_at: float | None = None
        self._backlog = 0  # the last backlog read (kept if a read ever fails)

    def publish(self, update: OuterUpdate) -> None:
        self.last_publish = asyncio.run_coroutine_threadsafe(self.network.publish(update), self.loop)
        self.sent_at_publish, self.last_nbytes = self.network.counters.get("bytes_sent", 0), update.nbytes

    def swarm_view(self) -> SwarmView:
        """How many peers' worth of updates the swarm makes per round, as our replica saw them merge within the
        last few of our rounds (sync/standing.py `swarm_size`): a newcomer on probation counts a fraction, a
        refused identity nothing. Never the DHT records: a crowd of fresh identities writes as many as it likes,
        and each would shrink every honest update's weight. A local read; it never waits on the network."""
        now = time.monotonic()
        window_s = max(MIN_VIEW_WINDOW_S, VIEW_WINDOW_ROUNDS * (now - self._last_view_at)) \
            if self._last_view_at else MIN_VIEW_WINDOW_S
        self._last_view_at = now
        learner = getattr(self.network, "learner", None)
        standing = learner.replica.standing if learner is not None else None
        if learner is not None and standing is not None:  # a standing comes with a learner
            with learner.replica.lock:
                size = standing.swarm_size(learner.replica.clock(), window_s)
            size = min(float(MAX_WEIGHTED_PEERS + 1), size)
            return SwarmView(num_peers=max(1, round(size)), samples_per_round=self.samples_per_update * size)
        node = self.network.node  # no standing (a replica built without a spec): the live records
        num_peers, _ = swarm_samples_per_round(self.network.peers, node.peer_id if node else "",
                                               self.samples_per_update)
        return SwarmView(num_peers=num_peers, samples_per_round=self.samples_per_update * num_peers)

    def backlog(self) -> int:
        """Our own published updates that no live peer is known to hold yet: our last seq minus the MAX over
        live remotes of their vector's entry for us (`Gossip.known_vectors`, the last vector each sent us in an
        announce or a pull request). The max, not the median: once one peer holds an update, gossip relays it
        from there, so what no one holds is exactly what still has to leave through our own uplink, the queue
        a slow uplink grows. It is also the safe side against lies: a remote (or a crowd of fresh identities)
        that claims to hold little of ours cannot raise it while one honest live peer reports what it holds,
        and one that claims too much only turns stretching off, today's behaviour. A stale vector errs high by
        what merged since it was sent; the freshest remote's vector wins the max. No known vector: 0.

        A local read, never a wait (invariant 4): `known_vectors` copies the gossip's table in one C-level dict
        copy under the GIL (str keys, immutable `VersionVector`s), and `peers` is replaced whole. Should the
        copy ever see the table change under it, the last value stands."""
        network = self.network
        gossip, node, learner = network.gossip, network.node, getattr(network, "learner", None)
        if gossip is None or node is None or learner is None:
            return 0
        me = node.peer_id
        try:
            known = gossip.known_vectors()
        except RuntimeError:  # "changed size during iteration": keep the last answer
            return self._backlog
        live = network.peers
        held = [vector.get(me) for peer, vector in known.items() if peer != me and peer in live]
        tree = gossip.tree
        if tree is not None and tree.delivered:  # a total holding it came back: it is out
            held.append(tree.delivered)
        self._backlog = max(0, learner.last_seq - max(held)) if held else 0
        return self._backlog

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
