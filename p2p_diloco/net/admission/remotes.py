"""What the guard tracks of each remote: its token buckets (per kind of request, bytes in, bytes out), its open
streams and its penalty.

Two LRU tables of `max_tracked_peers` each, one for contributors (the ledger's word) and one for the others, so
a crowd of fresh identities only churns its own (a newcomer's penalty is worth little anyway: a fresh identity
costs nothing). A remote moves to the table of its class whenever it is looked up.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from p2p_diloco.net.admission.ledger import Ledger
from p2p_diloco.net.admission.policy import RateLimitConfig, TokenBucket

logger = logging.getLogger(__name__)


@dataclass
class RemoteState:
    """What we track of one remote."""

    buckets: dict[str, TokenBucket] = field(default_factory=dict)
    streams: int = 0
    penalized_until: float = 0.0


class Remotes:
    """Buckets, open streams and penalties per remote (see the module docstring)."""

    def __init__(self, self_id: str, limits: RateLimitConfig, ledger: Ledger) -> None:
        self.self_id, self.limits, self.ledger = self_id, limits, ledger
        self.others: OrderedDict[str, RemoteState] = OrderedDict()  # remotes that never gave us anything
        self.trusted: OrderedDict[str, RemoteState] = OrderedDict()  # contributors (ledger.is_contributor)

    def get(self, peer: str, now: float | None = None) -> RemoteState:
        """`peer`'s state, in the table of its class now (contributor or not), most recently seen last."""
        table, other = (self.trusted, self.others) if self.ledger.is_contributor(peer) else \
            (self.others, self.trusted)
        remote = table.pop(peer, None) or other.pop(peer, None) or RemoteState()
        table[peer] = remote
        while len(table) > self.limits.max_tracked_peers:
            table.popitem(last=False)
        return remote

    def find(self, peer: str) -> RemoteState | None:
        """`peer`'s state if we track it (no reordering)."""
        return self.trusted.get(peer) or self.others.get(peer)

    def bucket(self, remote: RemoteState, kind: str, now: float | None = None) -> TokenBucket:
        """`remote`'s bucket for `kind` (a request kind, "bytes_in" or "bytes_out"), created full."""
        bucket = remote.buckets.get(kind)
        if bucket is None:
            limits = self.limits
            rate = {"bytes_in": limits.bytes_in_per_s, "bytes_out": limits.bytes_out_per_s}.get(kind) \
                or limits.rate_of(kind)
            bucket = remote.buckets[kind] = TokenBucket(rate, rate * limits.burst_s, now)
        return bucket

    def release(self, peer: str) -> None:
        """One of `peer`'s streams ended."""
        remote = self.find(peer)
        if remote is not None and remote.streams > 0:
            remote.streams -= 1

    def penalize(self, peer: str, reason: str) -> None:
        """`peer` sent us something invalid: ignore it for `penalty_s` (counted under `reason` elsewhere)."""
        if self.limits.penalty_s > 0 and peer != self.self_id:
            self.get(peer).penalized_until = time.monotonic() + self.limits.penalty_s
            logger.info("peer penalized peer=%s reason=%s for_s=%g", peer, reason, self.limits.penalty_s)

    def is_penalized(self, peer: str) -> bool:
        remote = self.find(peer)
        return remote is not None and remote.penalized_until > time.monotonic()
