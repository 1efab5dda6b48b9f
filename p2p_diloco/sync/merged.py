"""What a replica remembers of the updates it merged: per sender, the update_id of its last `per_sender` merged
seqs (rule 3 of sync/replica.py: a different id for a merged slot is equivocation) and the weight multiplier each
merged with (sync/standing.py; kept only where it is not 1), so that a take-back (`Replica.unmerge`) removes
exactly what the merge added."""

from __future__ import annotations

from collections.abc import Iterable

from p2p_diloco.sync.version_vector import VersionVector


class MergedIds:
    """(sender, seq) -> (update_id, multiplier) for the newest `per_sender` merged seqs of each sender."""

    def __init__(self, per_sender: int) -> None:
        if per_sender < 1:
            raise ValueError(f"need max_ids_per_sender >= 1, got {per_sender}")
        self.per_sender = per_sender
        self._ids: dict[str, dict[int, bytes]] = {}
        self._multipliers: dict[str, dict[int, float]] = {}

    def get(self, sender: str, seq: int) -> bytes | None:
        return self._ids.get(sender, {}).get(seq)

    def multiplier(self, sender: str, seq: int) -> float:
        return self._multipliers.get(sender, {}).get(seq, 1.0)

    def recent(self, sender: str, seqs: Iterable[int], vv: VersionVector) -> list[bytes] | None:
        """The ids of `sender`'s `seqs`, or None if one of them is not merged (in `vv`) or no longer kept."""
        seqs = list(seqs)
        ids = [self.get(sender, seq) for seq in seqs]
        kept = [i for i in ids if i is not None]
        if len(kept) < len(ids) or not all(vv.has(sender, seq) for seq in seqs):
            return None
        return kept

    def reduced(self) -> dict[str, dict[int, float]]:
        """Every kept (sender, seq) that merged at less than its full weight, with its multiplier (a copy)."""
        return {sender: dict(seqs) for sender, seqs in self._multipliers.items() if seqs}

    def record(self, sender: str, seq: int, update_id: bytes, multiplier: float = 1.0) -> None:
        ids = self._ids.setdefault(sender, {})
        ids[seq] = update_id
        if multiplier != 1.0:
            self._multipliers.setdefault(sender, {})[seq] = multiplier
        while len(ids) > self.per_sender:  # keep the newest per_sender seqs
            oldest = min(ids)
            del ids[oldest]
            self._multipliers.get(sender, {}).pop(oldest, None)

    def forget(self, sender: str, seq: int) -> None:
        self._ids.get(sender, {}).pop(seq, None)
        self._multipliers.get(sender, {}).pop(seq, None)

    def clear(self) -> None:
        self._ids.clear()
        self._multipliers.clear()
