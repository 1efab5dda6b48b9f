"""Merging a group sum (ARCHITECTURE.md "Aggregation"): many slots at once, by one axpy of their exact
sum, under the same rules a single update merges by (sync/replica.py).

A sum is over a named set of (author, seq) slots. It merges here only when the set fits the version vector as
a whole: every part is its author's next seq (or a hole, or up to `max_skip` seqs past the next: the seqs between
become holes, filled late by their own sum or a pull), or merged here already as the very update it names (its
step is then taken out of the sum: a peer's own update is in every total); none is buffered, no author banned, and
every part's weight exact (a function of its own signed header: probation by seq, a sponsor's or a proposal's in
a run with founders; `Standing.exact_multiplier`). Then the slots enter V together and theta moves by the sum, so
**no slot is merged twice, through two sums or a sum and a pull**, and replicas that merged the same set (by sums
or one by one) are equal, exactly so when by the same sums. Otherwise the sum is refused with the reason and the
caller falls back to pulling its parts (direct dissemination): a sum never merges in part.

Why the skip: without it, one total lost on its way (an audit that timed out, a sum dropped as a loop) or
overtaken (the tree rotated between an author's two updates) left every later total from its authors waiting on
the gap, and with them every update in them: on loopback at 6 peers the whole tree stalled for ~8 rounds, +190%
loss (BENCHMARKS.md "The tree's delay"). With it, only the lost update is late.

What a receiver cannot check itself is that the payload is the sum of the parts' steps; that is the audit's
(sync/sum_audit.py): a holder of the inputs recomputes it bit for bit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from p2p_diloco.sync.exact_sum import SumRangeError, from_grid, to_grid
from p2p_diloco.sync.merge_rule import MergeRule
from p2p_diloco.sync.robust import peak
from p2p_diloco.sync.slots import Slots
from p2p_diloco.sync.types import UpdateLike
from p2p_diloco.sync.version_vector import VersionVector


@dataclass(frozen=True)
class SumPart:
    """One slot a sum covers, as the receiver reads it from the part's signed header."""

    sender: str
    seq: int
    update_id: bytes
    weight: float


@dataclass(frozen=True)
class SumOutcome:
    merged: bool
    reason: str = ""  # why not: "banned", "held" (a part merged or buffered here), "gap", "inexact", "overflow"


def exact_step(rule: MergeRule, update: UpdateLike, multiplier: float) -> Tensor | None:
    """The step `update` moves theta by when it merges at `multiplier`, on the exact grid (an aggregator's part;
    also how an auditor recomputes one); None if screening refuses it (the aggregator leaves it out)."""
    prepared = rule.screen(update, None)
    if prepared.rejection is not None or prepared.scaled is None:
        return None
    step = prepared.scaled.whole() * prepared.factor
    try:
        return to_grid(step * multiplier if multiplier != 1.0 else step)
    except SumRangeError:
        return None


Held = Callable[[str, int], UpdateLike | None]
"""The update a replica merged for (sender, seq), if its store still has it (an aggregated run: its own)."""


def merge_sum(lock: threading.RLock, slots: Slots, rule: MergeRule, stats: dict[str, int],
              parts: Sequence[SumPart], total: Tensor, clock: Callable[[], float],
              held: Held | None = None, max_skip: int = 0) -> SumOutcome:
    """Merge the sum `total` (grid values, sync/exact_sum.py) of `parts` into theta, or say why not. A part this
    replica merged already (its own update, above all: every total holds it) is taken out of the sum first, by
    its exact step, when `held` gives the very update merged here at its exact weight; otherwise the sum is
    "held" and refused."""
    ordered = sorted(parts, key=lambda p: (p.sender, p.seq))
    with lock:
        standing = rule.standing
        fresh: list[tuple[SumPart, float]] = []
        vv: VersionVector = slots.vv
        opened = 0
        rest = total
        for part in ordered:
            if part.sender in slots.bans.banned:
                return _refused(stats, "banned")
            multiplier = standing.exact_multiplier(part.sender, part.seq) if standing is not None else 1.0
            if multiplier is None:
                return _refused(stats, "inexact")
            if vv.has(part.sender, part.seq):
                step = _held_step(rule, slots, part, multiplier, held)
                if step is None:
                    return _refused(stats, "held")
                rest = rest - step
                continue
            if slots.buffer.get(part.sender, part.seq) is not None:
                return _refused(stats, "held")
            after = vv.get(part.sender) + 1
            skipped = range(after, part.seq) if part.seq not in vv.holes(part.sender) else range(0)
            if len(skipped) > max_skip or any(slots.buffer.get(part.sender, q) is not None for q in skipped):
                return _refused(stats, "gap")  # too far ahead, or a skipped seq waits in the buffer to merge
            try:
                vv = vv.with_merged(part.sender, part.seq)
            except ValueError:  # the vector's bound on holes
                return _refused(stats, "gap")
            fresh.append((part, multiplier))
            opened += len(skipped)
        if not fresh:
            return _refused(stats, "held")
        step = from_grid(rest)
        if not rule.sum.subtract(step, peak(step)):
            return _refused(stats, "overflow")
        now = clock()
        for part, multiplier in fresh:
            slots.record_slot(part.sender, part.seq, part.update_id, multiplier)
            if standing is not None:
                standing.summed(part.sender, part.seq, now, multiplier)
        stats["sums_merged"] = stats.get("sums_merged", 0) + 1
        stats["sum_holes_opened"] = stats.get("sum_holes_opened", 0) + opened
        stats["merged"] += len(fresh)
    return SumOutcome(True)


def _held_step(rule: MergeRule, slots: Slots, part: SumPart, multiplier: float, held: Held | None) -> Tensor | None:
    """The exact step of a part merged here already, if it is the same update at the same weight."""
    if held is None or slots.merged.get(part.sender, part.seq) != part.update_id:
        return None
    if slots.merged.multiplier(part.sender, part.seq) != multiplier:
        return None
    update = held(part.sender, part.seq)
    if update is None or update.update_id != part.update_id:
        return None
    return exact_step(rule, update, multiplier)


def _refused(stats: dict[str, int], reason: str) -> SumOutcome:
    key = f"sum_refused_{reason}"
    stats[key] = stats.get(key, 0) + 1
    return SumOutcome(False, reason)

