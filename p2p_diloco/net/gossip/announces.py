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
from p2p_diloco.net.gossip.targets import PeerPicker
from p2p_diloco.net.transport import rpc
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
        self._tasks: set[asyncio.Task] = set()

    def announce(self, exclude: Iterable[str] = ()) -> None:
        """Send our vector to `fanout()` random peers that may lack part of it, each in its own bounded task."""
        ours = self.intake.replica.version_vector  # immutable and swapped whole by the replica: no lock
        targets = self.picker.pick(self.fanout(), (*exclude, *self.known.satisfied(ours)))
        if not targets:
            return
        request = encode_request(ours)
        for peer in targets:
            if len(self._tasks) >= MAX_ANNOUNCE_TASKS:
                self.stats["announces_dropped"] += 1
                continue
            task = asyncio.create_task(self._announce_to(peer, request), name=f"announce:{peer[-8:]}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def halt(self) -> list[asyncio.Task]:
        """Cancel the announces in flight; returns their tasks, for the caller to wait on."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        return tasks

    async def _announce_to(self, peer: str, request: bytes) -> None:
        try:
            await rpc.call(self.node.p2p, peer, self.announce_name, request, max_response_bytes=16,
                           timeout_s=self.config.rpc_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.stats["announce_failures"] += 1
            self.failures.log(peer, "announce", e)
            return
        self.stats["announces_sent"] += 1
        self.stats["bytes_sent"] += len(request)
