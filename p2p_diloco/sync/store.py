"""Retention of recent updates, to serve pulls from peers (DESIGN.md section 4, "Gossip").

Peers keep recent updates in bounded bytes; the oldest (by insertion) go first. A peer whose gap is older
than what the swarm retains does a state sync instead: `oldest_seq` lets it see that a gap can no longer be
filled from us.

Not thread-safe: the store belongs to the network loop (the compute thread hands its own updates over
through the outbox).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict

from p2p_diloco.sync.replica import UpdateLike
from p2p_diloco.sync.version_vector import VersionVector


class UpdateStore:
    """Updates keyed by (sender, seq), at most `max_bytes` of them by their `nbytes`."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        # (sender, seq) -> (update, nbytes as counted at insertion); insertion order = eviction order
        self._by_key: OrderedDict[tuple[str, int], tuple[UpdateLike, int]] = OrderedDict()
        self._seqs: dict[str, list[int]] = {}  # sender -> sorted seqs held
        self._nbytes = 0

    def __len__(self) -> int:
        return len(self._by_key)

    @property
    def nbytes(self) -> int:
        """Sum of `nbytes` of the updates held; always <= max_bytes."""
        return self._nbytes

    def add(self, update: UpdateLike) -> bool:
        """Keep `update`, evicting the oldest as needed. False if (sender, seq) is already held (the first
        message wins; a different one is the replica's business: equivocation) or if the update alone is
        larger than max_bytes (evicting everything for it would still not make it fit)."""
        key = (update.sender, update.seq)
        size = update.nbytes
        if size < 0:
            raise ValueError(f"update nbytes must be >= 0, got {size}")
        if key in self._by_key or size > self.max_bytes:
            return False
        while self._nbytes + size > self.max_bytes:
            self._remove(next(iter(self._by_key)))
        self._by_key[key] = (update, size)
        bisect.insort(self._seqs.setdefault(update.sender, []), update.seq)
        self._nbytes += size
        return True

    def get(self, sender: str, seq: int) -> UpdateLike | None:
        held = self._by_key.get((sender, seq))
        return held[0] if held else None

    def has(self, sender: str, seq: int) -> bool:
        return (sender, seq) in self._by_key

    def oldest_seq(self, sender: str) -> int | None:
        """Smallest seq of `sender` still held (None if none): a remote needing an older one must look
        elsewhere or state-sync."""
        seqs = self._seqs.get(sender)
        return seqs[0] if seqs else None

    def senders(self) -> list[str]:
        return list(self._seqs)

    def missing_for(self, remote: VersionVector, limit: int) -> list[UpdateLike]:
        """Updates we hold with `seq > remote[sender]`, at most `limit`, in seq order per sender.

        Senders are interleaved round-robin (each sender's lowest missing seq first), so that a tight limit
        still moves every sender's gap forward instead of serving one sender only: the remote can merge only
        a sender's next seq, so the low seqs of all senders are worth more than the high seqs of one.
        """
        if limit <= 0:
            return []
        queues: list[list[int]] = []
        senders: list[str] = []
        for sender in sorted(self._seqs):
            seqs = self._seqs[sender]
            start = bisect.bisect_right(seqs, remote.get(sender))
            if start < len(seqs):
                senders.append(sender)
                queues.append(seqs[start:start + limit])
        out: list[UpdateLike] = []
        rank = 0
        while len(out) < limit and any(rank < len(q) for q in queues):
            for sender, queue in zip(senders, queues, strict=True):
                if rank < len(queue) and len(out) < limit:
                    out.append(self._by_key[(sender, queue[rank])][0])
            rank += 1
        return out

    def drop_sender(self, sender: str) -> int:
        """Forget every update of `sender` (e.g. once it is banned); returns how many were dropped."""
        seqs = list(self._seqs.get(sender, ()))
        for seq in seqs:
            self._remove((sender, seq))
        return len(seqs)

    def _remove(self, key: tuple[str, int]) -> None:
        _, size = self._by_key.pop(key)
        self._nbytes -= size
        seqs = self._seqs[key[0]]
        del seqs[bisect.bisect_left(seqs, key[1])]
        if not seqs:
            del self._seqs[key[0]]
