"""Heralds: which of two near-copy proposals came first, by an order a copier cannot forge.

A sponsor relays a proposal's work and marks its author's record only for the first of a group of near copies
(sync/sponsorship.py); the others get nothing. Judged in the order their payloads merged, a copy that reaches a
sponsor before its original takes the original's judgment: a crowd with a faster path to the sponsors than the
volunteer's graduates copiers (BENCHMARKS "Copy races with a stream per unit": 3 to 14 (sponsor, copier) pairs).

So an author sends its update's **herald** to the sponsors before the payload: the signed header alone
(wire/herald.py: author, seq and the payload's sha256, under the update's own signature; a few hundred bytes).
A sponsor dates a proposal by when it first heard its herald (by when it merged, if that was sooner, if it never
heard one, or if the herald named other content: a slot claimed early cannot be filled with a copy). A copier
can herald its copy only once it holds the original's payload, which left after the original's herald: to come
first, its herald must beat the original's by the payload's whole transfer time.

When an original dated earlier is judged after a copy that took the credit (its payload came first), the copy's
credit passes to the original (`Sponsorship._judge`): nothing waits for a herald whose payload may never come.

A sponsor's own updates are not heralded: a proposal near one is a copy whatever the dates, and one that took credit
before the sponsor's update merged here loses it (`race`).

Bounded, and a flood cannot push a proven author's herald out: heralds cost a crowd nothing but signatures (each
identity signs its own), so with one table of the last MAX_HEARD a crowd heralding more than that between a
volunteer's herald and its payload evicted it, and the volunteer was dated by its merge again. Authors this
sponsor judged useful before (`member`) keep their heralds in a table of their own; everyone else shares the
other, at most MAX_PER_STRANGER heralds per author (an author heralding many seqs pushes out only its own). A
crowd of fresh identities can still crowd a newcomer's first heralds out of the strangers' table. A place in the
members' table costs a proposal judged useful, which a copier holds only until its original reaches that sponsor
(this round or the next: the window keeps the round just relayed, `Sponsorship.relay`).

Pure bookkeeping on the caller's clock (simulated or wall): no I/O, no locks (the replica calls it under its own).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import Tensor

HERALD_WAIT_S = 1.0
"""How long a proposer keeps its payload back for the sponsors' acks of its herald, at most (net/gossip/heralds.py;
the simulator's `SimConfig.herald_wait`): a dead or slow sponsor's cost to a proposer."""
MAX_HEARD = 1024
"""Heralds remembered per table, members' and strangers' (the oldest drop out)."""
MAX_PER_STRANGER = 2
"""Heralds remembered per author in the strangers' table (an honest proposer has one update in flight)."""

Slot = tuple[str, int]


class Heralds:
    """One sponsor's heralds (see the module docstring)."""

    def __init__(self) -> None:
        # slot -> (when, update id), oldest first: authors judged useful here before, and everyone else
        self._members: OrderedDict[Slot, tuple[float, bytes]] = OrderedDict()
        self._strangers: OrderedDict[Slot, tuple[float, bytes]] = OrderedDict()
        self._per_author: dict[str, list[int]] = {}  # a stranger's seqs in its table, oldest first

    def __len__(self) -> int:
        return len(self._members) + len(self._strangers)

    def heard(self, author: str, seq: int, update_id: bytes, now: float, *, member: bool = False) -> bool:
        """A verified herald for `author`'s slot `seq` (`member`: an author judged useful here before); the first
        heard for a slot counts. False if not new."""
        slot = (author, seq)
        if slot in self._members or slot in self._strangers:
            return False
        if member:
            self._members[slot] = (now, update_id)
            if len(self._members) > MAX_HEARD:
                self._members.popitem(last=False)
            return True
        seqs = self._per_author.get(author, [])
        if len(seqs) >= MAX_PER_STRANGER:
            self._forget((author, seqs[0]))
        self._strangers[slot] = (now, update_id)
        self._per_author.setdefault(author, []).append(seq)
        if len(self._strangers) > MAX_HEARD:
            self._forget(next(iter(self._strangers)))
        return True

    def _forget(self, slot: Slot) -> None:
        """A stranger's herald out of its table."""
        del self._strangers[slot]
        seqs = self._per_author[slot[0]]
        seqs.remove(slot[1])
        if not seqs:
            del self._per_author[slot[0]]

    def priority(self, author: str, seq: int, update_id: bytes | None, now: float) -> float:
        """The date of an update merged `now`: when its herald was first heard, if sooner and for this content."""
        heard = self._members.get((author, seq)) or self._strangers.get((author, seq))
        return min(heard[0], now) if heard is not None and heard[1] == update_id else now


class Seen(NamedTuple):
    """An update a sponsor merged this round, as the copy rule sees it (sync/sponsorship.py)."""

    unit: Tensor
    """Its step's sample, unit length."""
    date: float
    """Its herald's date, or its merge's."""
    slot: tuple[str, int] | None
    """A proposal's (author, seq) while it holds the credit as the first of its near copies; else None."""
    sponsor: bool = False
    """A sponsor's update: a proposal near it is a copy whatever the dates (sponsors do not herald)."""
    author: str = ""
    round: int = 0
    """The sponsor's round it merged in: the window holds this round's and the last one's (`Sponsorship.relay`)."""
    ahead: Tensor | None = None
    """Its sample at the next period's coordinates, if gathered there (sync/judged_at.py): its row, at unit length,
    once they turn. The window keeps it in a matrix beside the rows; the entry itself holds None."""


class Window:
    """A sponsor's copy window: the updates merged this round and the last (`Seen`), their unit samples kept as the
    rows of one matrix so that a race is one matrix-vector product, not one Python call per entry (at N = 64 on the
    smallest preset those calls were half of what judging cost: BENCHMARKS "What judging costs a sponsor")."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self._rows: Tensor | None = None  # row i: seen[i].unit; capacity grows by doubling
        self._ahead: Tensor | None = None  # row i: seen[i]'s sample at the next period's coordinates, if given
        self._has_ahead: list[bool] = []

    def __len__(self) -> int:
        return len(self.seen)

    def __getitem__(self, i: int) -> Seen:
        return self.seen[i]

    def __setitem__(self, i: int, seen: Seen) -> None:
        """Change an entry's bookkeeping (its credit); its sample is the row already held."""
        self.seen[i] = seen

    def append(self, seen: Seen) -> None:
        n = len(self.seen)
        if self._rows is None or self._ahead is None or n == self._rows.shape[0]:
            shape = (max(16, 2 * n), seen.unit.numel())
            rows, ahead = torch.empty(shape, dtype=seen.unit.dtype), torch.zeros(shape, dtype=seen.unit.dtype)
            if self._rows is not None and self._ahead is not None:
                rows[:n], ahead[:n] = self._rows[:n], self._ahead[:n]
            self._rows, self._ahead = rows, ahead
        self._rows[n] = seen.unit
        self._has_ahead.append(seen.ahead is not None)
        if seen.ahead is not None:
            self._ahead[n] = seen.ahead
        self.seen.append(seen._replace(ahead=None))

    def keep(self, which: list[int]) -> None:
        """Keep only the entries at `which` (ascending, distinct), in order."""
        if len(which) == len(self.seen):  # all of them
            return
        if self._rows is not None and self._ahead is not None and which != list(range(len(which))):
            index = torch.tensor(which, dtype=torch.long)
            self._rows[: len(which)], self._ahead[: len(which)] = self._rows[index], self._ahead[index]
        self.seen = [self.seen[i] for i in which]
        self._has_ahead = [self._has_ahead[i] for i in which]

    def rotate(self) -> None:
        """The coordinates turned (sync/judged_at.py): each entry's row becomes its sample at the new ones, at unit
        length (all at once); an entry that came without one is dropped."""
        self.keep([i for i, has in enumerate(self._has_ahead) if has])
        n = len(self.seen)
        if n and self._rows is not None and self._ahead is not None:
            ahead = self._ahead[:n]
            self._rows[:n] = ahead / ahead.norm(dim=1, keepdim=True).clamp_min(1e-30)
        self._has_ahead = [False] * n

    def trim(self, most: int) -> None:
        """Keep the latest `most` entries."""
        if len(self.seen) > most:
            self.keep(list(range(len(self.seen) - most, len(self.seen))))

    def near(self, unit: Tensor, near: float) -> list[int]:
        """The entries whose |cosine| with `unit` (unit length) is at least `near`, in order."""
        if not self.seen or self._rows is None:
            return []
        cos = self._rows[: len(self.seen)] @ unit.to(self._rows.dtype)
        return torch.nonzero(cos.abs() >= near).flatten().tolist()

    def nears(self, units: Tensor, near: float) -> list[list[int]]:
        """`near` for each row of `units`, as it will be when that row is judged: after every row before it was
        appended to the window, one entry each, in order (`Sponsorship.judge`). Two matrix products for all rows
        instead of one per row."""
        old, rows = len(self.seen), self._rows
        units = units.to(rows.dtype if rows is not None else units.dtype)
        among = ((units @ units.T).abs() >= near).tril(-1)  # row j against the rows appended before it
        hits = torch.cat([(units @ rows[:old].T).abs() >= near, among], 1) if rows is not None and old else among
        out: list[list[int]] = [[] for _ in range(units.shape[0])]
        for j, i in torch.nonzero(hits).tolist():  # column i is window entry i; row-major: ascending, as `near`
            out[j].append(i)
        return out


def race(window: Window, unit: Tensor, date: float, near: float, *, sponsor: bool = False,
         author: str = "", nearby: list[int] | None = None) -> tuple[bool, list[int]]:
    """For an update of `author` dated `date` (`unit`: its sample, unit length): (is it a near copy (|cos| >= `near`)
    of another author's in `window` dated no later, or of a sponsor's; the indices of the credited near copies dated
    after it, or of all credited near copies for a `sponsor`'s update). `nearby`: `window.near(unit, near)` if
    known already (`Window.nears`)."""
    copied, later = False, []
    for i in window.near(unit, near) if nearby is None else nearby:
        seen = window[i]
        if author and seen.author == author:  # its own earlier work is no original it could copy
            continue
        if seen.sponsor or (not sponsor and seen.date <= date):
            copied = True
        elif seen.slot is not None:
            later.append(i)
    return copied, later


def unit_of(sample: Tensor) -> Tensor | None:
    """A sample at unit length, as the copy window holds it (None for a zero or non-finite one)."""
    norm = float(sample.norm())
    return sample / norm if norm > 0 and math.isfinite(norm) else None
