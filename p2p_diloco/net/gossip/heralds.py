"""Heralds on the real network (sync/heralds.py says why): a proposer sends its update's signed header to each of
the run's sponsors before it announces the update, so a sponsor hears of the original before any copy of it can
exist; a sponsor dates each herald it verifies and judges near copies in that order.

One small unary RPC per sponsor per published update (a few hundred bytes), in bounded tasks. The proposer keeps
the payload back until every sponsor acked its herald (at most HERALD_WAIT_S): no peer can pull it sooner, so no
copier can hold it, and no copy's herald can reach a sponsor ahead of the original's. Without the wait a copier
next to the proposer had the payload's transfer time as its margin, and beat the herald to a sponsor whenever its
path was that much faster (BENCHMARKS "Heralds": 4 copiers graduated over 3 noisy runs at 100 Mbit/s). A herald
that fails or comes late only costs the proposer its place in a copy race (its update is then dated when it
merges, the rule without heralds), and a dead sponsor HERALD_WAIT_S of its update's start. Sponsors do not herald
(their updates are never proposals), and nobody heralds in a run without sponsors.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.gossip.sends import Sends
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import SwarmNode
from p2p_diloco.sync.heralds import HERALD_WAIT_S
from p2p_diloco.sync.intake import Intake
from p2p_diloco.wire.envelope import OuterUpdate
from p2p_diloco.wire.herald import MAX_HERALD_BYTES, encode_herald

logger = logging.getLogger(__name__)

MAX_HERALD_TASKS = 32
"""Heralds in flight, at most (more are dropped and counted: a proposer has a few sponsors)."""
MAX_HERALDS_SERVED = 16
"""Incoming heralds handled at once."""


class Heralds:
    """Send our heralds to the sponsors; at a sponsor, receive others' (see the module docstring)."""

    def __init__(self, node: SwarmNode, run_id: str, intake: Intake, *, sponsors: Callable[[], Sequence[str]],
                 timeout_s: float, stats: dict[str, int], guard: PeerGuard | None = None) -> None:
        """`sponsors()`: the run's sponsors (empty: nobody heralds)."""
        self.node, self.intake, self.sponsors, self.timeout_s, self.guard = node, intake, sponsors, timeout_s, guard
        self.name = f"p2p-diloco/{run_id}/herald"
        self.stats = stats
        for key in ("heralds_heard", "heralds_refused"):
            stats.setdefault(key, 0)
        self._sends = Sends(node, self.name, limit=MAX_HERALD_TASKS, timeout_s=timeout_s, stats=stats,
                            keys=("heralds_sent", "herald_failures", "heralds_dropped"),
                            failed=lambda peer, e: logger.debug("herald failed sponsor=%s error=%r", peer[-8:], e))
        self.rpc_stats: rpc.RpcStats | None = None

    @property
    def judging(self) -> bool:
        """We are a sponsor: we serve heralds."""
        standing = self.intake.replica.standing
        return standing is not None and standing.sponsorship.judging

    async def serve(self) -> None:
        self.rpc_stats = await rpc.serve(self.node.p2p, self.name, self.rpc_herald, max_request_bytes=MAX_HERALD_BYTES,
                                         timeout_s=self.timeout_s, max_concurrent=MAX_HERALDS_SERVED, guard=self.guard)

    async def unserve(self) -> None:
        await rpc.unserve(self.node.p2p, self.name, timeout_s=self.timeout_s / 2)

    async def rpc_herald(self, request: bytes, caller: str) -> bytes:
        # The replica's lock may be held by a merge for a while: off the loop, as pulls' merges are.
        outcome = await asyncio.to_thread(self.intake.herald, request, caller)
        if outcome == "heard":
            self.stats["heralds_heard"] += 1
        elif outcome != "ignored":  # a rejection: the intake counted and logged its reason
            self.stats["heralds_refused"] += 1
        return b""

    async def herald(self, update: OuterUpdate) -> None:
        """Herald `update` to every sponsor, each in its own bounded task, and return once each acked it or
        HERALD_WAIT_S (or the RPC timeout, if shorter) passed. Only a proposer's own; at once for anyone else's."""
        sponsors = list(self.sponsors())
        if update.sender in sponsors or update.sender != self.node.peer_id:  # also: no sponsors, nobody heralds
            return
        herald = encode_herald(update)
        tasks = [task for sponsor in sponsors if (task := self._sends.send(sponsor, herald, "herald")) is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=min(HERALD_WAIT_S, self.timeout_s))

    def halt(self) -> list[asyncio.Task]:
        return self._sends.halt()
