"""The announcing half of gossip (the protocol: net/gossip/service.py): our version vector, sent to a few peers
that may lack part of it, each announce in its own bounded task.

Announces are sent after we publish and after a pull that brought anything new (each hop re-announces, which
is what makes it gossip), to `fanout()` peers picked by `PeerPicker`, skipping peers whose last vector already
holds all of ours. Nothing waits for them: a failure is counted and logged, and at most MAX_ANNOUNCE_TASKS are in
flight (more are dropped and counted).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from p2p_diloco.net.gossip.known import KnownVectors
from p2p_diloco.net.gossip.messages import GossipConfig, encode_request
from p2p_diloco.net.gossip.pulls import FailureLog
from p2p_diloco.net.gossip.sends import Sends
from p2p_diloco.net.gossip.targets import PeerPicker
from p2p_diloco.net.transport.node import SwarmNode
from p2p_diloco.sync.intake import Intake

MAX_ANNOUNCE_TASKS = 64
"""Announces in flight, at most; more are dropped and counted."""


class Announcer:
    """Sends our vector to the peers that may lack part of it (see the module docstring)."""

    def __init__(self, node: SwarmNode, announce_name: str, intake: Intake, config: GossipConfig, *,
                 known: KnownVectors, picker: PeerPicker, fanout: Callable[[], int], stats: dict[str, int],
                 failures: FailureLog) -> None:
        """`fanout()` is the number of peers to announce to now (it follows the measured uplink)."""
        self.node, self.announce_name, self.intake, self.config = node, announce_name, intake, config
        self.known, self.picker, self.fanout = known, picker, fanout
        self.stats, self.failures = stats, failures
        self._sends = Sends(node, announce_name, limit=MAX_ANNOUNCE_TASKS, timeout_s=config.rpc_timeout_s,
                            stats=stats, keys=("announces_sent", "announce_failures", "announces_dropped"),
                            failed=lambda peer, e: failures.log(peer, "announce", e))

    def announce(self, exclude: Iterable[str] = ()) -> None:
        """Send our vector to `fanout()` random peers that may lack part of it, each in its own bounded task."""
        ours = self.intake.replica.version_vector  # immutable and swapped whole by the replica: no lock
        targets = self.picker.pick(self.fanout(), (*exclude, *self.known.satisfied(ours)))
        if not targets:
            return
        request = encode_request(ours)
        for peer in targets:
            self._sends.send(peer, request, "announce")

    def halt(self) -> list[asyncio.Task]:
        """Cancel the announces in flight; returns their tasks, for the caller to wait on."""
        return self._sends.halt()
