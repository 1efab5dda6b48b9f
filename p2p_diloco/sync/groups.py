"""Who sums whose updates in an epoch: a k-ary tree every peer computes alike (ARCHITECTURE.md
"Aggregation").

Members are put in one order by `sha256(seed | epoch | PeerID)` and laid out as a heap: the member at index i
sums what the members at `k*i + 1 .. k*i + k` send it (their updates, or their own sums) with its own update and
sends the sum to index `(i - 1) // k`; index 0's sum is the epoch's total, which goes back down the same edges.
Each member then sends about one update (or sum) up and receives one total, whatever the swarm's size: per-peer
traffic stays flat as peers join (an inner node also receives its k children's and sends k copies of the total:
k + 2 payloads, about one member in k).

Why a heap and not groups by hash prefix: every index is filled, so the depth is ceil(log_k N) for any N, and a
member's place needs only the member list (the DHT's records) and the seed. Who may aggregate follows the
contribution record: `aggregators` (proven members) take the inner places first, so a crowd of fresh identities
sits at the leaves, where all it can do is send an update or nothing. The seed rotates per epoch and should be
something nobody knew long before (the previous epoch's total id): an identity cannot grind its way to the root.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

FAN_IN = 8


def place_key(seed: bytes, epoch: int, peer: str) -> bytes:
    """The sort key of `peer` in `epoch`'s tree (lowest first)."""
    return hashlib.sha256(seed + epoch.to_bytes(8, "big", signed=False) + peer.encode()).digest()


@dataclass(frozen=True)
class Tree:
    """One epoch's aggregation tree over `order` (index 0 the root), `fan_in` children per inner node."""

    order: tuple[str, ...]
    fan_in: int = FAN_IN

    @classmethod
    def of(cls, members: Iterable[str], *, seed: bytes, epoch: int, aggregators: Iterable[str] | None = None,
           fan_in: int = FAN_IN) -> Tree:
        """The tree of `members` in `epoch`: `aggregators` (None: every member) take the inner places first."""
        if fan_in < 2:
            raise ValueError(f"fan_in must be >= 2, got {fan_in}")
        everyone = sorted(set(members), key=lambda p: place_key(seed, epoch, p))
        if aggregators is None:
            return cls(tuple(everyone), fan_in)
        able = set(aggregators)
        first = [p for p in everyone if p in able]
        return cls(tuple(first + [p for p in everyone if p not in able]), fan_in)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {p: i for i, p in enumerate(self.order)})

    def index(self, peer: str) -> int:
        """`peer`'s place; KeyError if it is not a member."""
        return self._index[peer]  # type: ignore[attr-defined, no-any-return]

    def __contains__(self, peer: object) -> bool:
        return peer in self._index  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self.order)

    @property
    def root(self) -> str:
        return self.order[0]

    def parent(self, peer: str) -> str | None:
        """Whom `peer` sends its sum (or update) to; None for the root."""
        i = self.index(peer)
        return self.order[(i - 1) // self.fan_in] if i > 0 else None

    def children(self, peer: str) -> tuple[str, ...]:
        """Whose sums (or updates) `peer` waits for, in order."""
        first = self.fan_in * self.index(peer) + 1
        return self.order[first:first + self.fan_in]

    def depth(self) -> int:
        """Edges from the root to the deepest leaf."""
        depth, last = 0, 0
        while last < len(self.order) - 1:
            last = self.fan_in * last + self.fan_in
            depth += 1
        return depth

    def is_inner(self, peer: str) -> bool:
        return bool(self.children(peer))
