"""The replica's buffer of updates waiting for a gap in their sender's seqs (DESIGN.md section 7, invariant 6).

Bounded by count and by bytes, in total and per sender (`max_sender_share` of each), so that no single
sender can fill it: 1024 updates of an 11 MB model would otherwise be 11 GB. It also dates each sender's
current gap, for `Replica.expire_gaps` (the lost-update trap).

Not thread-safe: the replica calls it under its lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2p_diloco.sync.version_vector import VersionVector

if TYPE_CHECKING:  # the replica imports this module
    from p2p_diloco.sync.replica import UpdateLike


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
        self._by_sender: dict[str, dict[int, UpdateLike]] = {}
        self._sender_bytes: dict[str, int] = {}
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

    def add(self, update: UpdateLike, now_s: float) -> bool:
        """Keep `update` unless a bound would be passed (False). Dates the sender's gap if it is new."""
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
        return True

    def pop(self, sender: str, seq: int) -> UpdateLike | None:
        waiting = self._by_sender.get(sender)
        update = waiting.pop(seq, None) if waiting else None
        if update is not None:
            self.count -= 1
            self.nbytes -= update.nbytes
            self._sender_bytes[sender] -= update.nbytes
            if not waiting:
                del self._by_sender[sender]
                del self._sender_bytes[sender]
                self.gap_since.pop(sender, None)
        return update

    def drop_sender(self, sender: str) -> int:
        seqs = list(self._by_sender.get(sender, ()))
        for seq in seqs:
            self.pop(sender, seq)
        return len(seqs)

    def drop_merged(self, vv: VersionVector) -> list[UpdateLike]:
        """Forget what `vv` has merged; pop and return what it makes ready (its holes, or entry + 1)."""
        ready = []
        for sender in self.senders():
            for seq in sorted(self._by_sender[sender]):
                if vv.has(sender, seq):
                    self.pop(sender, seq)
                elif seq in vv.holes(sender) or seq == vv.get(sender) + 1:
                    ready.append(self.pop(sender, seq))  # type: ignore[arg-type]
        return ready
