"""What a replica knows of each `(sender, seq)` slot (rules 2, 3 and 5 of sync/replica.py): merged (the version
vector, and the ids and weights of the newest merged seqs), waiting for a gap (the buffer), or its sender banned;
and the admission of an offered update against them (`admit`). Not thread-safe: the replica calls it under its
lock."""

from __future__ import annotations

import logging
from collections.abc import Callable

from p2p_diloco.sync.bans import Bans
from p2p_diloco.sync.decoded import Decoded
from p2p_diloco.sync.merged import MergedIds
from p2p_diloco.sync.pending import PendingBuffer, Waiting
from p2p_diloco.sync.types import MergeOutcome, UpdateLike
from p2p_diloco.sync.version_vector import VersionVector

logger = logging.getLogger(__name__)

LayoutCheck = Callable[[UpdateLike], str | None]
"""The caller's check of an update's layout (`Intake.check_layout`): a reason to reject it, or None."""


class Slots:
    """The version vector `vv`, the ids of merged seqs, the buffer of waiting updates and the bans."""

    def __init__(self, bans: Bans, *, max_buffered: int, max_buffered_bytes: int,
                 max_sender_share: float, max_ids_per_sender: int, version_vector: VersionVector | None) -> None:
        self.vv = version_vector if version_vector is not None else VersionVector()
        self.merged = MergedIds(max_ids_per_sender)  # ids (and weight multipliers) of the last merged seqs
        self.buffer = PendingBuffer(max_buffered, max_buffered_bytes, max_sender_share)  # waiting for a gap
        self.bans = bans  # the replica's

    def admit(self, update: UpdateLike, *, check: LayoutCheck | None = None,
              allow_skip: bool = False) -> MergeOutcome | None:
        """Classify by (sender, seq, update_id): None means ready to merge, BUFFERED that it must wait for a gap
        (the caller buffers it). Runs `check`, records equivocation and bans as side effects."""
        sender, seq, update_id = update.sender, update.seq, update.update_id
        if sender in self.bans.banned:
            return MergeOutcome.REJECTED_BANNED
        if self.vv.has(sender, seq):
            known = self.merged.get(sender, seq)
            if known is None or known == update_id:
                return MergeOutcome.DUPLICATE
            return self._equivocation(sender, seq, known, None, update)
        waiting = self.buffer.get(sender, seq)
        if waiting is not None:
            if waiting.update_id == update_id:
                return MergeOutcome.DUPLICATE
            return self._equivocation(sender, seq, waiting.update_id, waiting, update)
        if check is not None and (reason := check(update)):
            self.ban(sender, f"{reason} seq={seq}")
            return MergeOutcome.REJECTED_LAYOUT
        done = self.vv.get(sender)
        if seq == done + 1 or seq in self.vv.holes(sender) or (allow_skip and seq > done):
            return None
        return MergeOutcome.BUFFERED

    def wait(self, update: UpdateLike, now_s: float, decoded: Decoded | None) -> MergeOutcome:
        """Buffer an update that must wait for a gap: BUFFERED, or REJECTED_BUFFER_FULL past a bound. A delta
        read from its payload is not kept (it is decoded again when it merges): only a tensor already made."""
        kept = decoded.materialized if decoded is not None else None
        if self.buffer.add(update, now_s, kept):
            return MergeOutcome.BUFFERED
        return MergeOutcome.REJECTED_BUFFER_FULL

    def record(self, update: UpdateLike, multiplier: float) -> bool:
        """`update` merged at `multiplier` of its weight: V and the ids take it in. True if it filled a hole."""
        return self.record_slot(update.sender, update.seq, update.update_id, multiplier)

    def record_slot(self, sender: str, seq: int, update_id: bytes, multiplier: float) -> bool:
        """`record` by the slot's names alone (a part of a group sum: sync/sum_merge.py)."""
        late = seq in self.vv.holes(sender)
        self.vv = self.vv.with_merged(sender, seq)
        self.merged.record(sender, seq, update_id, multiplier)
        return late

    def successor(self, merged: UpdateLike, first_sender: str, now_s: float) -> Waiting | None:
        """Pop the buffered update that `merged` made ready (its sender's next seq), if any. When the chain that
        began with `first_sender` stops while that sender still has updates waiting, a new gap starts now."""
        current = self.buffer.pop(merged.sender, self.vv.get(merged.sender) + 1)
        if current is None and self.buffer.has_sender(first_sender):
            self.buffer.gap_since[first_sender] = now_s
        return current

    def holds(self, update: UpdateLike) -> bool:
        """True if this exact update (by update_id) is merged here and its id still kept."""
        merged = self.merged.get(update.sender, update.seq)
        return merged is not None and merged == update.update_id and self.vv.has(update.sender, update.seq)

    def taken_back(self, update: UpdateLike, vv: VersionVector, *, keep_slot: bool) -> None:
        """`update` was taken back (rule 7): `vv` is V without it (or V itself with `keep_slot`: its weight only
        went, and it stays merged at 0)."""
        self.vv = vv
        if keep_slot:
            self.merged.record(update.sender, update.seq, update.update_id, 0.0)
        else:
            self.merged.forget(update.sender, update.seq)

    def load(self, vv: VersionVector) -> list[Waiting]:
        """Take `vv` as the merged set (state sync, restart); returns the buffered updates it makes ready."""
        self.vv = vv
        ready = self.buffer.drop_merged(vv)
        # The new theta was summed elsewhere (a donor, a peer we adopt, a checkpoint): which version of a slot
        # it holds is not ours to know, so no id is kept (rule 3: such seqs read as DUPLICATE, and neither
        # gossip's id digests nor `unmerge` may trust an id we merged before).
        self.merged.clear()
        return ready

    def ban(self, sender: str, reason: str) -> None:
        """The ban, and the sender's buffered updates dropped; its listeners run after the lock is released
        (`delivers_bans`)."""
        self.bans.ban(sender)
        dropped = self.buffer.drop_sender(sender)
        logger.warning("sender banned sender=%s reason=%s dropped_buffered=%d", sender, reason, dropped)

    def _equivocation(self, sender: str, seq: int, known_id: bytes, known: UpdateLike | None,
                      update: UpdateLike) -> MergeOutcome:
        self.bans.equivocation(sender, seq, known_id, known, update)
        self.ban(sender, f"equivocation seq={seq}")
        return MergeOutcome.EQUIVOCATION
