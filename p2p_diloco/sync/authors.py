"""What one replica remembers of each author (sync/standing.py): its recent merges here, good standing, strikes
and distrust, and its average agreement with the reference; and what is read from them: the proven contributors
(whose votes count), the swarm's size, and what a joiner inherits from its donor.

*Good standing* is an author whose last two updates (seqs k-1 and k) merged at full weight (past probation)
pointing along this replica's reference (sync/reference.py), the first not matched by a copy when the second
came, and never refused since (a copy that beat its original looks like an original until the original comes,
which in a swarm is well before the copier's next copy). This peer earns it the same way, so its own first
updates are judged as everyone else judges them. After `DISTRUST_STRIKES` refusals in a row an author is
*distrusted*: every later update of it merges at 0.

Votes and the swarm's size come from here (`proven`, `swarm_size`), never from DHT records, which cost nothing to
make: see ARCHITECTURE.md "Who counts".

Bounded: the distrusted set and the strikes hold at most `MAX_DISTRUSTED` authors (oldest forgotten first: a
forgotten one is vetted again at its next update), `recent`, the averages and the candidates at most
`MAX_STANDING` (the least recent forgotten first). Not thread-safe: the replica calls it under its lock.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

MAX_INHERITED = 512
"""Authors of each kind a donor passes to a joiner (`inheritance`), the most recent first."""
MAX_DISTRUSTED = 1 << 16
MAX_STANDING = 1 << 14
AGREEMENT_DECAY = 0.5
"""An author's average agreement: each update's cosine counts half, the past the other half."""
AGREEMENT_PRIOR = 0.15
"""A new author's average before its first compared update: its first update counts only if its cosine is at
least 0.05 (honest first updates measured 0.24-0.9; noise ~0.003, so 1000 noise identities never get a weight:
with a prior of 0.3 their first updates passed, at probation, and cost +38% eval loss)."""
DISTRUST_STRIKES = 3
"""Refused updates in a row after which an author is distrusted (all its later updates merge at weight 0). One
refusal costs only that update: an honest sender's rare borderline update must not cost it the run."""


class Authors:
    """Per-author records of one replica's standing, this peer (`self_id`) included."""

    def __init__(self, self_id: str = "") -> None:
        self.self_id = self_id
        self.averages: OrderedDict[str, float] = OrderedDict()  # author -> average agreement, least recent first
        self.distrusted: OrderedDict[str, str] = OrderedDict()  # author -> why
        self.strikes: dict[str, int] = {}  # author -> refusals in a row (insertion order: oldest first)
        # author -> (time of its last merge here that was not refused, the multiplier it merged at), least
        # recent first; `good`: the authors in good standing (`merged`)
        self.recent: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self.good: set[str] = set()
        # author -> seq of its last update that could count towards good standing (full weight, along the
        # reference, not matched by a copy so far)
        self.candidates: OrderedDict[str, int] = OrderedDict()
        self.inherited: set[str] | None = None  # a joiner's donor's word (`inherit`); None: no donor
        self.snapshot_authors: frozenset[str] = frozenset()  # the authors its snapshot held updates of

    def average(self, sender: str, agreement: float) -> float:
        """`sender`'s average agreement with an update at `agreement` included (not recorded: `note_average`)."""
        return AGREEMENT_DECAY * self.averages.get(sender, AGREEMENT_PRIOR) + (1 - AGREEMENT_DECAY) * agreement

    def note_average(self, sender: str, average: float) -> None:
        self.averages.pop(sender, None)
        self.averages[sender] = average
        while len(self.averages) > MAX_STANDING:
            self.averages.popitem(last=False)

    def strike(self, sender: str, reason: str) -> int:
        """A refusal: one strike, `DISTRUST_STRIKES` in a row distrust the author; it loses any standing.
        Returns its strikes in a row, this one included."""
        strikes = self.strikes.pop(sender, 0) + 1
        if strikes >= DISTRUST_STRIKES:
            self.distrusted[sender] = reason
            while len(self.distrusted) > MAX_DISTRUSTED:
                self.distrusted.popitem(last=False)
        else:
            self.strikes[sender] = strikes
            while len(self.strikes) > MAX_DISTRUSTED:
                self.strikes.pop(next(iter(self.strikes)))
        self.recent.pop(sender, None)
        self.good.discard(sender)
        return strikes

    def weightless(self, sender: str) -> None:
        """An update of `sender` merged at 0 (tied, low agreement or distrusted): it counts in nothing until it
        earns a weight again."""
        self.recent.pop(sender, None)
        self.good.discard(sender)
        self.candidates.pop(sender, None)

    def merged(self, sender: str, seq: int, now: float, multiplier: float, *, earns_standing: bool) -> None:
        """`sender`'s update `seq` merged at `multiplier` > 0; `earns_standing`: at full weight and in line with
        the reference, so it counts towards good standing."""
        self.recent.pop(sender, None)
        self.recent[sender] = (now, multiplier)
        if earns_standing:
            # Good standing takes two such updates in a row (seq k-1 and k), the first still unmatched when the
            # second comes: a copy that beat its original looks like one until the original comes (with one,
            # a copier was promoted and its x5 copies won their pairs there: +385% eval loss, replicas 1.2 apart).
            if self.candidates.pop(sender, None) == seq - 1:
                self.good.add(sender)
                self.strikes.pop(sender, None)  # only on proof of own work: a copy that beat its original
                # would reset them each round (100 such copiers were never distrusted on one replica)
            self.candidates[sender] = seq
            while len(self.candidates) > MAX_STANDING:
                self.candidates.popitem(last=False)
        else:
            self.good.discard(sender)
            self.candidates.pop(sender, None)
        while len(self.recent) > MAX_STANDING:
            author = self.recent.popitem(last=False)[0]
            self.good.discard(author)
            self.candidates.pop(author, None)

    def matched(self, author: str, seq: int) -> None:
        """`author`'s update `seq` turned out to be matched by a copy: no longer an unmatched full-weight update."""
        if self.candidates.get(author) == seq:
            self.candidates.pop(author)

    def unvetted(self, sender: str) -> bool:
        """A joiner before its first update (no reference yet): an author its snapshot holds updates of that the
        donor did not merge with a weight lately, nor itself. An author the snapshot holds nothing of is not:
        the joiner sees it from its first update, as the donor did, and judges it as the donor does (with the
        rule applied to it, a peer that started while its donor's snapshot was cut merged at 0 on the joiner
        what it merged at 1 everywhere else, and the replicas differed for good)."""
        return (self.inherited is not None and sender != self.self_id and sender not in self.inherited
                and sender in self.snapshot_authors)

    def inheritance(self, limit: int) -> tuple[list[str], list[str]]:
        """(authors whose last update merged here with a weight, distrusted authors), the `limit` most recent of
        each, this peer included: what a joiner syncing from us merges before its own first update (`inherit`)."""
        trusted = list(reversed(self.recent))[:limit]
        if self.self_id and self.self_id not in trusted:
            trusted = [self.self_id, *trusted[:limit - 1]]
        return trusted, list(reversed(self.distrusted))[:limit]

    def inherit(self, good: Sequence[str], distrusted: Sequence[str], *, known: Iterable[str]) -> None:
        """A donor's word, after a state sync of a snapshot that held updates of the authors `known`: until our
        own first update gives us a reference, such an author past its probation merges only if the donor merged
        it with a weight lately (authors still on probation merge at it, as everywhere; authors not `known`, as
        the donor judges them), and the donor's distrusted never do. Without it a joiner would merge a crowd's
        updates unvetted, at full weight past their probation, and be poisoned at once (measured: a late
        volunteer under 10 sign-flipping identities was then refused by everyone)."""
        self.inherited = set(good)
        self.snapshot_authors = frozenset(known)
        for author in distrusted:
            if author != self.self_id:
                self.distrusted[author] = "inherited"
        while len(self.distrusted) > MAX_DISTRUSTED:
            self.distrusted.popitem(last=False)

    def proven(self, now: float, window_s: float) -> set[str]:
        """Authors in good standing (past probation, vetted, never refused) with an update merged here within
        `window_s`, this peer included: the members whose votes count (repair's quorum)."""
        return {a for a in self.good if now - self.recent.get(a, (-math.inf, 0.0))[0] <= window_s}

    def swarm_size(self, now: float, window_s: float) -> float:
        """How many peers' worth of updates this replica merged within `window_s`: each recent author counts
        what its next update will merge at (a newcomer on probation a fraction, a distrusted one nothing), this
        peer 1. What a sender weights its update by (`SwarmView.num_peers`): a refused crowd adds nothing."""
        others = sum(min(1.0, 2.0 * m) for a, (at, m) in self.recent.items()
                     if a != self.self_id and now - at <= window_s)
        return 1.0 + others
