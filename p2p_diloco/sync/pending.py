"""The replica's buffer of updates waiting for a gap in their sender's seqs (ARCHITECTURE.md "Invariants", 6).

Bounded by count and by bytes, in total and per sender (`max_sender_share` of each), so that no single
sender can fill it: 1024 updates of an 11 MB model would otherwise be 11 GB. It also dates each sender's
current gap, for `Replica.expire_gaps` (the lost-update trap).

Decoded deltas: the replica screens an update (decoding it) before buffering it, and merges it later. The
buffer keeps the decoded delta with the update while payloads and deltas together stay within `max_bytes`, so
the merge need not decode it again; the payloads alone decide admission (as always), and a delta that no
longer fits is dropped (the newest first: the oldest waiting update merges first), to be decoded again at
its merge.

Not thread-safe: the replica calls it under its lock.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from p2p_diloco.sync.types import UpdateLike
from p2p_diloco.sync.version_vector import VersionVector


class Waiting(NamedTuple):
    """A buffered update and its decoded delta (None: decode it again to merge it)."""

    update: UpdateLike
    decoded: Tensor | None


def _size(t: Tensor) -> int:
    return t.numel() * t.element_size()


class PendingBuffer:
    """sender -> seq -> update (anything with `nbytes`), with bounds and gap ages."""

    def __init__(self, max_count: int, max_bytes: int, max_sender_share: float) -> None:
        if max_count < 0 or max_bytes < 0 or not 0 < max_sender_share <= 1:
            raise ValueError(f"need max_count, max_bytes >= 0 and 0 < max_sender_share <= 1, got {max_count}, "
                             f"{max_bytes}, {max_sender_share}")
        self.max_count, self.max_bytes = max_count, max_bytes
        self.max_sender_count = max(1, int(max_count * max_sender_share))
        self.max_sender_bytes = int(max_bytes * max_sender_share)
        self.count = self.nbytes = 0
        self.decoded_bytes = 0  # of the deltas kept; nbytes + decoded_bytes <= max_bytes
        self._by_sender: dict[str, dict[int, UpdateLike]] = {}
        self._sender_bytes: dict[str, int] = {}
        self._decoded: dict[tuple[str, int], Tensor] = {}  # insertion order: the newest is dropped first
        self.gap_since: dict[str, float] = {}  # sender -> when its current gap was first seen

    def get(self, sender: str, seq: int) -> UpdateLike | None:
        return self._by_sender.get(sender, {}).get(seq)

    def has_sender(self, sender: str) -> bool:
        return sender in self._by_sender

    def senders(self) -> list[str]:
        return list(self._by_sender)

    def lowest(self, sender: str) -> int | None:
        waiting = self._by_sender.get(sender)
        return min(waiting) if waiting else None

    def add(self, update: UpdateLike, now_s: float, decoded: Tensor | None = None) -> bool:
        """Keep `update` (and its `decoded` delta, if it fits) unless a bound would be passed (False). Dates
        the sender's gap if it is new."""
        sender, size = update.sender, update.nbytes
        waiting = self._by_sender.get(sender, {})
        if (self.count >= self.max_count or self.nbytes + size > self.max_bytes
                or len(waiting) >= self.max_sender_count
                or self._sender_bytes.get(sender, 0) + size > self.max_sender_bytes):
            return False
        self._by_sender.setdefault(sender, {})[update.seq] = update
        self.count += 1
        self.nbytes += size
        self._sender_bytes[sender] = self._sender_bytes.get(sender, 0) + size
        self.gap_since.setdefault(sender, now_s)
        while self._decoded and self.nbytes + self.decoded_bytes > self.max_bytes:
            _, dropped = self._decoded.popitem()
            self.decoded_bytes -= _size(dropped)
        if decoded is not None and self.nbytes + self.decoded_bytes + _size(decoded) <= self.max_bytes:
            self._decoded[(sender, update.seq)] = decoded
            self.decoded_bytes += _size(decoded)
        return True

    def pop(self, sender: str, seq: int) -> Waiting | None:
        waiting = self._by_sender.get(sender)
        update = waiting.pop(seq, None) if waiting else None
        if update is None:
            return None
        self.count -= 1
        self.nbytes -= update.nbytes
        self._sender_bytes[sender] -= update.nbytes
        if not waiting:
            del self._by_sender[sender]
            del self._sender_bytes[sender]
            self.gap_since.pop(sender, None)
        decoded = self._decoded.pop((sender, seq), None)
        if decoded is not None:
            self.decoded_bytes -= _size(decoded)
        return Waiting(update, decoded)

    def expired(self, now_s: float, timeout_s: float, vv: VersionVector,
                max_span: int) -> list[tuple[Waiting, int, float]]:
        """Pop the lowest waiting update of each sender whose gap has waited `timeout_s` and spans at most
        `max_span` seqs above `vv` (`Replica.expire_gaps`); returns (it, the span, how long it waited)."""
        out: list[tuple[Waiting, int, float]] = []
        for sender, since in list(self.gap_since.items()):
            lowest = self.lowest(sender)
            if lowest is None or now_s - since < timeout_s:
                continue
            span = lowest - vv.get(sender) - 1
            if span > max_span:
                continue  # too far behind for a skip: a state sync's job
            self.gap_since[sender] = now_s  # a further gap behind this one waits its own timeout
            waiting = self.pop(sender, lowest)  # after: popping its last update forgets the gap
            if waiting is not None:  # always: `lowest` is one of its seqs
                out.append((waiting, span, now_s - since))
        return out

    def drop_sender(self, sender: str) -> int:
        seqs = list(self._by_sender.get(sender, ()))
        for seq in seqs:
            self.pop(sender, seq)
        return len(seqs)

    def drop_merged(self, vv: VersionVector) -> list[Waiting]:
        """Forget what `vv` has merged; pop and return what it makes ready (its holes, or entry + 1)."""
        ready: list[Waiting] = []
        for sender in self.senders():
            for seq in sorted(self._by_sender[sender]):
                if vv.has(sender, seq):
                    self.pop(sender, seq)
                elif seq in vv.holes(sender) or seq == vv.get(sender) + 1:
                    waiting = self.pop(sender, seq)
                    if waiting is not None:  # always: `seq` is one of its seqs
                        ready.append(waiting)
        return ready
