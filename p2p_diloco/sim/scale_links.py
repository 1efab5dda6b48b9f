"""Each unit's uplink in the scale simulator: a FIFO of transfers sent one at a time.

A transfer occupies the sender's uplink for bytes / bandwidth and lands `latency_s` later. Transfers to or from
a unit that failed are dropped when their turn comes (no bytes spent), and a failing unit's queue is flushed at
once, so a dead peer never holds a link. Downlinks are not modelled: under full dissemination and tree
aggregation every unit receives about what it sends, and the real gossip bounds concurrent serves, not
receives. Callbacks get `ok` first: False when the transfer was dropped or its sender died while sending.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2p_diloco.sim.scale_state import SwarmHost, Unit


class Transfer:
    __slots__ = ("src", "dst", "payload", "meta", "ready_at", "src_life", "dst_life", "fn", "args")

    def __init__(self, src: Unit, dst: Unit, payload: int, meta: int, ready_at: float,
                 fn: Callable[..., Any], args: tuple) -> None:
        self.src, self.dst, self.payload, self.meta, self.ready_at = src, dst, payload, meta, ready_at
        self.src_life, self.dst_life = src.life, dst.life
        self.fn, self.args = fn, args


class Uplinks:
    """The uplinks of every unit of a swarm."""

    def __init__(self, swarm: SwarmHost) -> None:
        self.sw = swarm
        self.queues: list[deque[Transfer]] = [deque() for _ in range(swarm.n)]
        self.busy = [False] * swarm.n
        self.bytes_per_s = swarm.cfg.bandwidth_mbps * 1e6 / 8
        self.dropped = 0

    def send(self, src: Unit, dst: Unit, payload: int, meta: int, ready_at: float, fn: Callable[..., Any],
             *args: Any) -> None:
        """Queue `payload + meta` bytes from src to dst, not before `ready_at`; then `fn(ok, *args)`."""
        self.queues[src.index].append(Transfer(src, dst, payload, meta, ready_at, fn, args))
        if not self.busy[src.index]:
            self._next(src)

    def abort(self, u: Unit) -> None:
        """`u` failed: everything it was going to send fails now."""
        queue = self.queues[u.index]
        self.busy[u.index] = False
        while queue:
            tr = queue.popleft()
            self.dropped += 1
            tr.fn(False, *tr.args)

    def _next(self, src: Unit) -> None:
        queue, now = self.queues[src.index], self.sw.queue.now
        while queue:
            tr = queue.popleft()
            if tr.dst_life != tr.dst.life:  # the receiver failed while this waited: drop it, free
                self.dropped += 1
                tr.fn(False, *tr.args)
                continue
            self.busy[src.index] = True
            self.sw.count(src, tr.dst, tr.payload, tr.meta)
            start = max(now, tr.ready_at)
            self.sw.at(start + (tr.payload + tr.meta) / self.bytes_per_s, self._sent, src, tr)
            return
        self.busy[src.index] = False

    def _sent(self, src: Unit, tr: Transfer) -> None:
        if tr.src_life != src.life:  # the sender failed while sending; abort() already freed its link
            tr.fn(False, *tr.args)
            return
        self.sw.at(self.sw.queue.now + self.sw.cfg.latency_s, tr.fn, True, *tr.args)
        self._next(src)
