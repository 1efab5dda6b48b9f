"""Sponsorship: in a run with founders (its spec's `defence.sponsors`), only they decide what others' work weighs.

A fresh identity costs nothing, so weight that any identity can earn by itself belongs to whoever brings the most
of them. In a run with sponsors:

- a sponsor's update merges at its signed weight (after probation, which damps every run's first rounds);
- every other author's update merges at weight 0 on every replica (its slot counts, V advances, gossip serves
  it): it is a proposal;
- each sponsor judges the proposals it merged and **relays** the ones it finds useful inside its own next update:
  its step becomes `(own + 1/S * sum_u v(u) step(u)) / (1 + t)`, S sponsors, `v(u)` in [0, 1], a sponsor's
  values of one update summing to at most 1, `t` = their sum / S. Proposals displace a part of the sponsors' own
  work rather than add to it (adding one more share a round cost +5% loss even when it was an honest
  volunteer's: a longer outer step), and all of them together weigh at most one sponsor's update per sponsor
  round, however many identities bring them: K identities split one share.

Why relay rather than re-weight: the weight of everything merged is then a function of the update alone (0, or a
sponsor's probation by seq), so replicas that merged the same updates are equal as before, a joiner's snapshot
needs nothing more, and no verdict can arrive "late". The price: proposals enter the model one sponsor phase
later (one more round of staleness), and a sponsor spends one parameter-sized float32 buffer on them.

How a sponsor judges (FLTrust's rule, Cao et al. 2021, with the founders' work as the root data): the cosine of
the proposal with the sum of every sponsor's latest update (its own included: with a file shard per unit one
unit's direction is mostly its own files, the sponsors' sum is what they share), on the copy window's sampled
coordinates, floored at 0, scaled down when the proposal is longer than the sponsors' updates are on average,
`v = max(0, cos) * min(1, mean_s |u_s| / |u|)` (against the sum's length, x5 work clipped at the norm bound was
relayed at up to three updates' length: +8.3% loss from 3 such identities), and 0 for a proposal
that is a near copy (|cos| >= NEAR_COPY) of any update merged this round: a crowd re-signing honest work with
noise adds nothing. Measured (BENCHMARKS "Can a paired loss change tell honest work from an attack?"): with units
drawing from the whole data the cosine judges 0% of honest updates harmful and 0% of negated ones useful, one
update at a time; with a file shard per unit honest updates point slightly against each other late in a run, so
honest proposals there get little weight (denial, not poisoning: the one-share bound holds whatever the judge
says). The values go into the sponsor's signed header (wire/envelope.py `vouches`) so that every peer can count
what each author's work earned (`earned`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from p2p_diloco.sync.decoded import Decoded
from p2p_diloco.wire.vouches import MAX_VOUCHES, VOUCH_ID_BYTES, pack_vouches

NEAR_COPY = 0.95
"""A proposal whose |cosine| with another update merged this round is at least this is relayed with nothing."""
MAX_WINDOW = 256
"""Samples of this round's merged updates a sponsor compares proposals with (the oldest drop out)."""
MAX_EARNED = 4096
"""Authors whose relayed weight a replica counts (the least recent drop out)."""


class Sponsorship:
    """One replica's part in sponsorship (see the module docstring). Not thread-safe: the replica calls it under
    its lock."""

    def __init__(self, sponsors: Sequence[str], self_id: str = "") -> None:
        self.sponsors = frozenset(sponsors)
        self.self_id = self_id
        self.earned: OrderedDict[str, float] = OrderedDict()  # author -> weight its proposals were relayed with
        self._authors: OrderedDict[bytes, str] = OrderedDict()  # proposals merged here: update_id prefix -> author
        self._latest: dict[str, Tensor] = {}  # each sponsor's latest update, sampled: what proposals are judged by
        self._window: list[Tensor] = []  # unit samples of this round's merged updates
        self._relay: Tensor | None = None  # sum of v(u) * step(u), in theta's units
        self._values: list[tuple[bytes, float]] = []

    @property
    def active(self) -> bool:
        return bool(self.sponsors)

    @property
    def judging(self) -> bool:
        """This peer is one of the run's sponsors: it judges and relays proposals."""
        return self.self_id in self.sponsors

    def is_sponsor(self, author: str) -> bool:
        return author in self.sponsors

    def merged(self, author: str, update_id: bytes, sample: Tensor | None, step: Tensor | Decoded | None,
               factor: float = 1.0) -> None:
        """An update merged here (`step * factor`: what it would move theta by at full weight; `sample`: that
        step's values at the copy coordinates, so a proposal that signs itself a larger weight is longer and
        scaled down). A sponsor keeps its own as the direction to judge by, and relays a useful proposal's step."""
        if author not in self.sponsors:
            self._authors[update_id[:VOUCH_ID_BYTES]] = author
            while len(self._authors) > MAX_EARNED:
                self._authors.popitem(last=False)
        if not self.judging or sample is None:
            return
        unit = _unit(sample)
        if author in self.sponsors:
            self._latest[author] = sample
        elif unit is not None and step is not None:
            value = self._value(sample, unit)
            if value > 0 and len(self._values) < MAX_VOUCHES:
                self._add(step, factor * value)
                self._values.append((update_id, value))
        if unit is not None:
            self._window.append(unit)
            del self._window[:-MAX_WINDOW]

    def relay(self) -> tuple[Tensor | None, bytes, float]:
        """What this sponsor's next update carries for the proposals it judged since its last one: the step
        `1/S * sum v(u) step(u)` (theta's units; the values scaled to sum to at most 1), the values for its header,
        and the share `t` (at most 1/S) the proposals take of its update, which mixes them in by displacing its own
        work, `(own + relayed) / (1 + t)`, so the step it signs stays one round's. Drains them; (None, b"", 0) when
        there is nothing to relay."""
        relay, values = self._relay, self._values
        self._relay, self._values, self._window = None, [], []
        if relay is None or not values:
            return None, b"", 0.0
        total = sum(v for _, v in values)
        relay.mul_(1.0 / (len(self.sponsors) * max(1.0, total)))
        share = min(1.0, total) / len(self.sponsors)
        return relay, pack_vouches([(i, min(1.0, v / max(1.0, total))) for i, v in values]), share

    def vouched(self, sponsor: str, values: Iterable[tuple[bytes, float]]) -> None:
        """A sponsor's update merged here: count what each relayed author earned (views and benchmarks only; the
        weight itself is inside the sponsor's payload), for the proposals this replica merged."""
        if sponsor not in self.sponsors:
            return
        for key, value in values:
            author = self._authors.get(key)
            if author is not None:
                self.earned[author] = self.earned.pop(author, 0.0) + value / len(self.sponsors)
                while len(self.earned) > MAX_EARNED:
                    self.earned.popitem(last=False)

    def _value(self, sample: Tensor, unit: Tensor) -> float:
        if self.self_id not in self._latest:
            return 0.0  # no work of our own yet to judge by
        latest = list(self._latest.values())
        own = torch.stack(latest).sum(0)  # the direction: what the sponsors' work shares
        length = sum(float(x.norm()) for x in latest) / len(latest)  # the length: one update's, not the sum's
        for other in self._window:
            if abs(float(torch.dot(other, unit))) >= NEAR_COPY:
                return 0.0
        norm, own_norm = float(sample.norm()), float(own.norm())
        if not (own_norm > 0 and math.isfinite(own_norm)):
            return 0.0
        cos = float(torch.dot(sample, own)) / (norm * own_norm)
        return max(0.0, cos) * min(1.0, length / norm)

    def _add(self, step: Tensor | Decoded, factor: float) -> None:
        decoded = step if isinstance(step, Decoded) else Decoded.of(step)
        if self._relay is None:
            self._relay = torch.zeros(decoded.numel, dtype=torch.float32)
        for part, values in decoded.chunks():
            self._relay[part].add_(values, alpha=factor)


def _unit(sample: Tensor) -> Tensor | None:
    norm = float(sample.norm())
    return sample / norm if norm > 0 and math.isfinite(norm) else None
