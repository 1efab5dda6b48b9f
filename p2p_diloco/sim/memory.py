"""The in-memory network: bytes between endpoints with simulated latency, uplink bandwidth and loss.

It carries the same encoded, signed envelopes as the real swarm, so the simulator exercises the real
decode-verify-merge path. Each sender has one uplink: copies to several peers queue behind each other,
which is what makes full dissemination cost O(N) per peer.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence

from p2p_diloco.sim.events import EventQueue
from p2p_diloco.sync.heralds import HERALD_WAIT_S
from p2p_diloco.train.exchange import SwarmView
from p2p_diloco.wire.envelope import OuterUpdate, encode_update
from p2p_diloco.wire.herald import encode_herald

Handler = Callable[[bytes, str], object]  # (data, sender); what it returns is ignored


class MemoryNetwork:
    def __init__(self, queue: EventQueue, *, latency_s: float, bandwidth_mbps: float, loss: float,
                 rng: random.Random, latency_jitter_s: float = 0.0, jitter_rng: random.Random | None = None):
        self.queue = queue
        self.latency_s = latency_s
        self.latency_jitter_s = latency_jitter_s
        self.jitter_rng = jitter_rng or rng
        self.bytes_per_s = bandwidth_mbps * 1e6 / 8
        self.loss = loss
        self.rng = rng
        self.handlers: dict[str, Handler] = {}
        self.herald_handlers: dict[str, Handler] = {}
        self.sum_handlers: dict[str, Handler] = {}  # group sums going up a tree and totals coming down (data, kind)
        self.bytes_sent: Counter[str] = Counter()
        self.messages_lost = 0
        self.in_flight = 0
        self._uplink_free_at: dict[str, float] = {}

    def attach(self, peer: str, handler: Handler, on_herald: Handler | None = None,
               on_sum: Handler | None = None) -> None:
        self.handlers[peer] = handler
        if on_herald is not None:
            self.herald_handlers[peer] = on_herald
        if on_sum is not None:
            self.sum_handlers[peer] = on_sum

    def detach(self, peer: str) -> None:
        for handlers in (self.handlers, self.herald_handlers, self.sum_handlers):
            handlers.pop(peer, None)

    def send(self, src: str, dst: str, data: bytes, *, herald: bool = False, kind: str = "") -> float | None:
        """Queue one message on src's uplink; it arrives after transmission time plus latency (or is lost).
        `herald`: an update's herald (wire/herald.py), delivered to the receiver's herald handler; `kind`: a group
        sum's ("sum" up the tree, "total" down: sim/aggregation.py), to its sum handler with the kind. Returns when
        it arrives (None: lost)."""
        self.bytes_sent[src] += len(data)
        start = max(self.queue.now, self._uplink_free_at.get(src, 0.0))
        done = start + len(data) / self.bytes_per_s
        self._uplink_free_at[src] = done
        if self.rng.random() < self.loss:
            self.messages_lost += 1
            return None
        self.in_flight += 1
        arrives = done + self.latency()
        self.queue.push(arrives, self._deliver, src, dst, data, herald, kind)
        return arrives

    def latency(self) -> float:
        """One message's latency, jitter included."""
        if self.latency_jitter_s:
            return self.latency_s + self.jitter_rng.uniform(0.0, self.latency_jitter_s)
        return self.latency_s

    def broadcast(self, src: str, data: bytes) -> None:
        """Full dissemination: one copy to every other attached peer (random order, like gossip targets)."""
        others = [p for p in self.handlers if p != src]
        self.rng.shuffle(others)
        for dst in others:
            self.send(src, dst, data)

    def _deliver(self, src: str, dst: str, data: bytes, herald: bool = False, kind: str = "") -> None:
        self.in_flight -= 1
        if kind:
            on_sum = self.sum_handlers.get(dst)
            if on_sum is not None:
                on_sum(data, kind)
            return
        handler = (self.herald_handlers if herald else self.handlers).get(dst)
        if handler is not None:  # a crashed peer receives nothing
            handler(data, src)


class MemoryExchange:
    """The `Exchange` of one peer on a `MemoryNetwork`: publish = full dissemination of the encoded update."""

    def __init__(self, network: MemoryNetwork, peer_id: str, view: Callable[[], SwarmView],
                 backlog: Callable[[], int] | None = None, heralds_to: Sequence[str] = (), herald_wait: bool = True,
                 disseminate: Callable[[str, bytes, OuterUpdate], None] | None = None):
        self.network, self.peer_id, self._view, self._backlog = network, peer_id, view, backlog
        self.disseminate = disseminate  # instead of a copy to everyone (an aggregation tree: sim/aggregation.py)
        # The sponsors, for a proposer (sync/heralds.py); a sponsor heralds nothing, as a real peer (net/gossip).
        self.heralds_to = [] if peer_id in heralds_to else list(heralds_to)
        self.herald_wait = herald_wait
        self.released_at = 0.0  # when the last published payload was let go (after the sponsors' acks)

    def publish(self, update: OuterUpdate) -> None:
        now = self.released_at = self.network.queue.now
        if self.heralds_to:  # the herald first: on the same uplink, so it leaves ahead of every copy of the payload
            herald = encode_herald(update)
            arrivals = [self.network.send(self.peer_id, sponsor, herald, herald=True) for sponsor in self.heralds_to]
            if self.herald_wait:  # the payload waits for every sponsor's ack, at most HERALD_WAIT_S (a lost one)
                acks = [a + self.network.latency() if a is not None else math.inf for a in arrivals]
                self.released_at = min(max(acks), now + HERALD_WAIT_S)
        data = encode_update(update)
        if self.disseminate is not None:
            self.disseminate(self.peer_id, data, update)
        elif self.released_at > now:
            self.network.queue.push(self.released_at, self.network.broadcast, self.peer_id, data)
        else:
            self.network.broadcast(self.peer_id, data)

    def swarm_view(self) -> SwarmView:
        return self._view()

    def backlog(self) -> int:
        """Our updates no other peer holds yet, as the simulator measures it (`backlog`); 0 without one."""
        return self._backlog() if self._backlog is not None else 0
