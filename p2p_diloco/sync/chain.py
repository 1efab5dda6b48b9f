"""The merge stage of `Replica.offer` (rule 2 of sync/replica.py): merge an update found ready, then the buffered
successors it releases, in seq order. Each is screened outside the replica's lock (the expensive part) and
admitted again under it before the axpy: another thread may have merged that seq, or banned its sender, while
it was decoded, and then it merges once all the same."""

from __future__ import annotations

import threading
from collections.abc import Callable

from p2p_diloco.sync.merge_rule import MergeRule
from p2p_diloco.sync.pending import Waiting
from p2p_diloco.sync.screening import Prepared
from p2p_diloco.sync.slots import Slots
from p2p_diloco.sync.types import MergeOutcome, UpdateLike


class MergeChain:
    """Merges into one replica's `rule` and `slots` under its `lock`, counting each outcome in its `stats`."""

    def __init__(self, lock: threading.RLock, slots: Slots, rule: MergeRule, stats: dict[str, int]) -> None:
        self._lock = lock
        self._slots = slots
        self._rule = rule
        self._stats = stats

    def run(self, first: Waiting, *, now_s: float, clock: Callable[[], float], skip: bool = False,
            prepared: Prepared | None = None) -> tuple[MergeOutcome, list[UpdateLike]]:
        """Merge `first` (found ready under the lock; `prepared`: screened already) and then its buffered
        successors. `skip`: `first` may skip the seqs below it (rule 6). Returns `first`'s outcome and every
        update merged. `now_s` dates a gap that starts or remains; `clock` dates the merges (`Standing`)."""
        merged: list[UpdateLike] = []
        outcome = MergeOutcome.MERGED
        current: Waiting | None = first
        while current is not None:
            update = current.update
            if prepared is None:
                prepared = self._rule.screen(update, current.decoded)  # outside the lock: the expensive part
            with self._lock:
                # Re-check: another thread may have merged this seq (or banned the sender) while we decoded.
                result = self._slots.admit(update, allow_skip=skip and current is first)
                if result is MergeOutcome.BUFFERED:  # not ready after all (a load moved V): wait again
                    result = self._slots.wait(update, now_s, prepared.delta)
                elif result is None:
                    result, late = self._rule.apply(update, prepared, self._slots, clock)
                    if late:
                        self._stats["late_merged"] += 1
                prepared = None
                self._stats[result.value] += 1
                if current is first:
                    outcome = result
                if result is not MergeOutcome.MERGED:
                    break
                merged.append(update)
                # Popped under the same lock as the merge: a successor offered concurrently is either here
                # already or will find seq == V + 1 and merge itself; none is stranded.
                current = self._slots.successor(update, first.update.sender, now_s)
        return outcome, merged
