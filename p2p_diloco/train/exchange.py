"""The exchange: what a learner unit needs from the network, and nothing more.

The learner hands finished updates to `publish` (which must not block: an inner phase never waits on the
network) and reads the swarm's size and throughput from `swarm_view` to weight its next update, and `backlog`
to stretch a phase while its own updates queue (train/loop.py: a slow uplink sends less). Remote
updates arrive on the exchange's own schedule and go through `Intake` into the replica. The round loop
(train/loop.py) takes one as its only view of the network. Implementations: `SwarmExchange` (peer/exchange.py:
the hivemind swarm), `MemoryExchange` (sim/memory.py: the simulator's network) and `CollectingExchange` (here:
a unit alone, for tests and benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from p2p_diloco.wire.envelope import OuterUpdate


@dataclass
class SwarmView:
    """What the sender needs to know of the swarm to weight its update."""

    num_peers: int
    samples_per_round: float  # sum over live peers of the samples in one of their updates


class Exchange(Protocol):
    def publish(self, update: OuterUpdate) -> None:
        """Send our update to the swarm; returns at once."""

    def swarm_view(self) -> SwarmView:
        """Live peers and the samples one round of their updates carries."""

    def backlog(self) -> int:
        """How many of our own published updates no live peer is known to hold yet (0: none, or unknown). A plain
        local read, never a wait: the loop stretches its phase while this is at or above a threshold."""


class CollectingExchange:
    """A unit alone: keeps what it publishes (`sent`) and sees a fixed swarm (tests, benchmarks)."""

    def __init__(self, view: SwarmView) -> None:
        self.view = view
        self.sent: list[OuterUpdate] = []
        self.pending = 0  # what `backlog` answers (tests set it)

    def publish(self, update: OuterUpdate) -> None:
        self.sent.append(update)

    def swarm_view(self) -> SwarmView:
        return self.view

    def backlog(self) -> int:
        return self.pending
