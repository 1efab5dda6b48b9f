"""Heralds on the real network (sync/heralds.py says why): a proposer sends its update's signed header to each of
the run's sponsors before it announces the update, so a sponsor hears of the original before any copy of it can
exist; a sponsor dates each herald it verifies and judges near copies in that order.

One small unary RPC per sponsor per published update (a few hundred bytes), sent in bounded tasks that nothing
waits for: a herald that fails or comes late only costs the proposer its place in a copy race (its update is then
dated when it merges, the rule without heralds). Sponsors do not herald (their updates are never proposals), and
nobody heralds in a run without sponsors.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import SwarmNode
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
        for key in ("heralds_sent", "herald_failures", "heralds_dropped", "heralds_heard", "heralds_refused"):
            stats.setdefault(key, 0)
        self._tasks: set[asyncio.Task] = set()
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
        try:
            await asyncio.wait_for(rpc.unserve(self.node.p2p, self.name), self.timeout_s / 2)
        except Exception as e:  # e.g. the node is already shut down
            logger.debug("herald unserve failed error=%r", e)

    async def rpc_herald(self, request: bytes, caller: str) -> bytes:
        # The replica's lock may be held by a merge for a while: off the loop, as pulls' merges are.
        outcome = await asyncio.to_thread(self.intake.herald, request, caller)
        if outcome == "heard":
            self.stats["heralds_heard"] += 1
        elif outcome != "ignored":  # a rejection: the intake counted and logged its reason
            self.stats["heralds_refused"] += 1
        return b""

    def send(self, update: OuterUpdate) -> None:
        """Herald `update` to every sponsor but us, each in its own bounded task; returns at once."""
        sponsors = list(self.sponsors())
        if update.sender in sponsors or update.sender != self.node.peer_id:  # also: no sponsors, nobody heralds
            return
        herald = encode_herald(update)
        for sponsor in sponsors:
            if len(self._tasks) >= MAX_HERALD_TASKS:
                self.stats["heralds_dropped"] += 1
                continue
            task = asyncio.create_task(self._send_to(sponsor, herald), name=f"herald:{sponsor[-8:]}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def halt(self) -> list[asyncio.Task]:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        return tasks

    async def _send_to(self, sponsor: str, herald: bytes) -> None:
        try:
            await rpc.call(self.node.p2p, sponsor, self.name, herald, max_response_bytes=16, timeout_s=self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.stats["herald_failures"] += 1
            logger.debug("herald failed sponsor=%s error=%r", sponsor[-8:], e)
            return
        self.stats["heralds_sent"] += 1
