"""Small unary calls nobody waits for (announces, heralds): each in its own task, at most `limit` in flight (more
are dropped and counted), every outcome counted in the gossip's `stats`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import SwarmNode


class Sends:
    def __init__(self, node: SwarmNode, name: str, *, limit: int, timeout_s: float, stats: dict[str, int],
                 keys: tuple[str, str, str], failed: Callable[[str, Exception], None]) -> None:
        """`keys`: the stats counted on success, failure and drop (`bytes_sent` too on success); `failed(peer,
        error)` logs a failure."""
        self.node, self.name, self.limit, self.timeout_s, self.stats = node, name, limit, timeout_s, stats
        self.sent_key, self.failed_key, self.dropped_key = keys
        for key in (*keys, "bytes_sent"):
            stats.setdefault(key, 0)
        self.failed = failed
        self._tasks: set[asyncio.Task] = set()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def send(self, peer: str, request: bytes, what: str) -> asyncio.Task | None:
        """Call `peer` with `request` in a task of its own; returns at once (`what` names the task) with the task,
        for a caller that may wait on it, or None if it was dropped."""
        if len(self._tasks) >= self.limit:
            self.stats[self.dropped_key] += 1
            return None
        task = asyncio.create_task(self._call(peer, request), name=f"{what}:{peer[-8:]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def halt(self) -> list[asyncio.Task]:
        """Cancel the calls in flight; returns their tasks, for the caller to wait on."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        return tasks

    async def _call(self, peer: str, request: bytes) -> None:
        try:
            await rpc.call(self.node.p2p, peer, self.name, request, max_response_bytes=16, timeout_s=self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.stats[self.failed_key] += 1
            self.failed(peer, e)
            return
        self.stats[self.sent_key] += 1
        self.stats["bytes_sent"] += len(request)
