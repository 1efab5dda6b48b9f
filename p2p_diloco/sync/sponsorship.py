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
  round, however many identities bring them: K identities split one share. Within it, a proposal's work is
  relayed at `v(u)` over how crowded its direction already is (sync/relayed.py "Crowding"): k echoes of one
  proposal carry about one's worth.

Why relay rather than re-weight: the weight of everything merged is then a function of the update alone (0, or a
sponsor's probation by seq), so replicas that merged the same updates are equal as before, a joiner's snapshot
needs nothing more, and no verdict can arrive "late". The price: proposals enter the model one sponsor phase
later (one more round of staleness), and a sponsor spends one parameter-sized float32 buffer on them.

How a sponsor judges (FLTrust's rule, Cao et al. 2021, with the founders' work as the root data), at the end of
the phase the proposal merged in: the cosine of the proposal with the sum of every sponsor's latest update or, if
larger, with the sponsor's pseudo-gradient of that phase (a proposer rebases onto what merges while it trains:
BENCHMARKS "What a proposal points along"), on 4,096 coordinates only this sponsor knows, drawn again every few
rounds (sync/judged_at.py: the copy test's are public), floored at 0, scaled down
when the proposal is longer than a sponsor's update, `v = max(0, cos) * min(1, mean_s |u_s| / |u|)`, and 0 for a
near copy (|cos| >= NEAR_COPY) of another author's update merged this round or the last and dated before it (by
its herald, sync/heralds.py; one dated after it that took the credit first gives it over): a crowd re-signing
honest work adds nothing, a graduate's copy included, and a proposal that lost such a race keeps its record. The
values go into the sponsor's signed header (`vouches`; `earned`).

**Echoes.** Before it signs, a sponsor removes from what it relays every component along theta's moves over its
last ECHO phases (sync/echoes.py): they are merged already, and a proposal that echoes them would move theta along
them a second time. It judges by what is new too: once it knows those moves, a proposal's cosine is that of its
part outside their span with the same part of the sponsor's own work of the phase (which no one has seen yet);
one under PROVEN counts as 0 (many proposals of noise each judged a little summed to a full share), and one whose
new part is near (ECHO_OF) that of a sponsor's latest update is an echo of it and counts as 0. Else a crowd with
no compute echoes published work with its own noise: 100 identities echoing a sponsor's update graduated and cost
+84.7%, +6.1% with the span alone (BENCHMARKS "Echo crowds", "Echoes of one update").

**Graduation.** One share for all newcomers would leave an honest volunteer's work at a fraction for ever. So
a sponsor that judged an author's last RECORD proposals useful (each `v >= PROVEN`, its own verdicts or another
sponsor's) relays its next ones **as a member's**: `keep(u) * step(u) / S`, `keep = GRADUATE_SHARE * min(1,
mean_s |u_s| / |u|)` if it points along the sponsors' work (else 0), outside the newcomers' share and not
displacing the sponsor's own work; the sponsor signs a weight that carries it (train/outer.py `relay_payload`). The
record is the sponsor's own (sync/records.py): graduation needs no agreement between replicas. A sleeper (useful
work until it graduates, then an attack) gains nothing: every update is still judged before it enters theta, and a
strike breaks its record.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from p2p_diloco.sync.decoded import Decoded
from p2p_diloco.sync.echoes import moves_at, orthonormal, unit_new_parts, without, without_echoes
from p2p_diloco.sync.fitness import FitChecks
from p2p_diloco.sync.heralds import Heralds, Seen, Window, race, unit_of
from p2p_diloco.sync.judged_at import JudgedAt, Latest
from p2p_diloco.sync.records import Records, bounded
from p2p_diloco.sync.relayed import NOTHING, Carry, Pending, Relayed
from p2p_diloco.sync.types import Fit
from p2p_diloco.sync.worth import Along, along
from p2p_diloco.wire.vouches import MAX_VOUCHES, pack_vouches, slot_key

NEAR_COPY = 0.95
"""A proposal whose |cosine| with another author's update merged this round or the last is at least this is relayed
with nothing."""
MAX_WINDOW = 256
"""Samples of this and the last round's merged updates a sponsor compares proposals with (the oldest drop out)."""
MAX_EARNED = 4096
"""Authors whose judged worth (and, at a sponsor, record) a replica keeps (the least recent drop out)."""
RECORD = 2
"""Consecutive useful proposals after which a sponsor relays an author's work as a member's (graduation)."""
GRADUATE_SHARE = 0.25
"""The share of a graduate's step a sponsor relays (times `keep`, over S). Not 1: a proposer's own replica never
merges its update (weight 0), so its next phase re-does part of that work; relaying all of it counts that part
twice. The largest share that made no honest run worse (BENCHMARKS "Graduation": `test` +4.6% at 1, -0.5% at 0.25;
`tiny` +2.0% at 0.5, -1.3% at 0.25; since the echo removal, `tiny` 1: +6.8% against 0.25, BENCHMARKS "Echoes")."""
ECHO_OF = 0.65
"""|cos| of a proposal's new part with a sponsor's latest update's at which it is an echo of it. Honest proposals
reach 0.31 on `test` but 0.61 on `tiny` (7 of 90 over 0.5, each near all three sponsors' at once), where at 0.5 they
lost their relay; echoes at cosine 0.9: median 0.79, and without the test 100 of them cost +35%. At 0.65 no echo
cosine from 0.6 to 0.95 costs anything on `test` (BENCHMARKS "Echoes of one update", "The echo bar")."""
MAX_PENDING = 64
"""Proposals a sponsor holds for judging at its phase's end (references to payloads); more are judged on merging."""
PROVEN = 0.1
"""Least value that counts as useful for the record. Honest work on shared data is judged ~0.45 (BENCHMARKS "Can
a paired loss change tell honest work from an attack?"), noise ~0.016 on the 4096 sampled coordinates, negated
work and near copies 0."""


class Sponsorship:
    """One replica's part in sponsorship (see the module docstring). Not thread-safe: the replica calls it under
    its lock."""

    def __init__(self, sponsors: Sequence[str], self_id: str = "", run_id: str = "", seed: int | None = None) -> None:
        """`seed`: where we judge (`sample_at`), a secret (a peer's key's: `Identity.secret`; None: a random one)."""
        self.sponsors = frozenset(sponsors)
        self.self_id, self.run_id = self_id, run_id
        # Where we read what we judge, drawn again every TURN_EVERY rounds.
        self.judged_at = JudgedAt(secrets.randbits(62) if seed is None else seed)
        self.earned: OrderedDict[str, float] = OrderedDict()  # author -> what sponsors judged its work worth
        self.relayed: OrderedDict[str, float] = OrderedDict()  # at a sponsor: author -> updates' worth relayed
        self._authors: OrderedDict[bytes, tuple[str, int]] = OrderedDict()  # proposals merged: slot key -> slot
        self.records = Records(RECORD, PROVEN, MAX_EARNED)  # at a sponsor: who has graduated (sync/records.py)
        self.judged: OrderedDict[tuple[str, int], tuple[float, float]] = OrderedDict()  # at a sponsor, for views:
        # (author, seq) -> (v, the share of its step relayed in full: keep for a graduate's, 0 for a proposal's)
        self._latest = Latest()  # each sponsor's latest update, sampled: what proposals are judged by
        self._window = Window()  # this round's and the last one's merged updates, as the copy rule sees them
        self._round = 0  # relays so far
        self.heralds = Heralds()  # at a sponsor: when each proposal was first heard of (sync/heralds.py)
        self._now = 0.0  # the latest date given to `merged`
        self._carry = Carry()  # what our next update relays, gathered as we judge (sync/relayed.py)
        self._at: Tensor | None = None  # the sampled coordinates (`sample_at`'s) the samples were taken at
        self._relayed_at: Tensor | None = None  # what our last update relayed, theta's units, at `at`
        self._own_length = 0.0  # our own last step's length at `at`, without what it relayed
        self._snapshots: list[Tensor] = []  # at a sponsor: theta at its last ECHO relays, newest first
        self._pending: list[Pending] = []  # at a sponsor: proposals merged this phase, not judged yet
        self._fresh: list[Tensor] = []  # theta's moves at our last relay, sampled, orthonormal: echoes (`_value`)
        self.fitted = FitChecks(self.judged_at.seed, PROVEN)  # at a sponsor (sync/fitness.py)

    def sample_at(self, numel: int) -> Tensor:
        """Where we read every update we judge: this period's coordinates (and, in its last round, the next one's),
        secret, not the copy test's public ones (sync/judged_at.py)."""
        return self.judged_at.both(numel)

    @property
    def active(self) -> bool:
        return bool(self.sponsors)

    @property
    def judging(self) -> bool:
        """This peer is one of the run's sponsors: it judges and relays proposals."""
        return self.self_id in self.sponsors

    def is_sponsor(self, author: str) -> bool:
        return author in self.sponsors

    def graduated(self, author: str, before: int | None = None) -> bool:
        """This sponsor judged `author`'s last RECORD proposals (before seq `before`) useful: it relays the next one
        as a member's. (Another sponsor's vouch for the proposal being judged does not count for it.)"""
        return self.records.graduated(author, before)

    @property
    def graduates(self) -> list[str]:
        return self.records.graduates

    def heard(self, author: str, seq: int, update_id: bytes, now: float) -> None:
        """A verified herald (sync/heralds.py): a proposal's signed header, sent to the sponsors ahead of it."""
        if self.judging and author not in self.sponsors:
            self.heralds.heard(author, seq, update_id, now, member=self.records.useful(author))

    def merged(self, author: str, seq: int, sample: Tensor | None, step: Tensor | Decoded | None,
               factor: float = 1.0, at: Tensor | None = None, *, update_id: bytes | None = None,
               now: float | None = None, data: tuple[int, ...] = ()) -> None:
        """An update merged here (`step * factor`: what it would move theta by at full weight; `sample`: that
        step's values at our coordinates `at` (`sample_at`): a proposal that signs itself a larger weight is longer,
        scaled down). A sponsor keeps its own as the direction to judge by and relays a useful proposal's step;
        near copies are ranked by date (`update_id`, `now`: its herald's, sync/heralds.py; merge order without)."""
        key = slot_key(self.run_id, author, seq)
        ahead = None
        if sample is not None:  # gathered at this period's coordinates, in its last round the next one's too
            sample, ahead, at = self.judged_at.split(sample, at)
        if at is not None:
            self._at = at
        if author not in self.sponsors:
            _bounded(self._authors, key, (author, seq))
        if not self.judging or sample is None:
            return
        self._now = now = self._now if now is None else max(self._now, now)
        unit = unit_of(sample)
        if author in self.sponsors:
            self._latest.set(author, sample, ahead, step if author != self.self_id else None, factor)
            if author == self.self_id:  # the length a graduate is held to: our own work's, not what we carried
                own = sample - self._relayed_at if self._relayed_at is not None else sample
                self._own_length, self._relayed_at = float(own.norm()), None
            if unit is not None:  # proposals near it that took credit lose it: copies of a founder's work
                self._take_back(race(self._window, unit, now, NEAR_COPY, sponsor=True)[1], None)
                self._window.append(Seen(unit, now, None, sponsor=True, author=author, round=self._round,
                                         ahead=ahead))
        elif unit is not None and step is not None:
            date = self.heralds.priority(author, seq, update_id, now)
            if len(self._pending) < MAX_PENDING:  # judged when our phase ends, by the work we did beside it
                self._pending.append(Pending(author, seq, sample, unit, step, factor, date, ahead, data))
            else:
                self._judge(author, seq, sample, unit, step, factor, date, ahead=ahead)
        self._window.trim(MAX_WINDOW)

    def judge(self, current: Tensor | None = None, theta: Tensor | None = None, fit: Fit | None = None) -> None:
        """Judge the proposals merged since the last judgement, in the order they merged; `current`: our pseudo-gradient
        of the phase now ending (`relay`; see the module docstring), else by the sponsors' latest updates alone."""
        direction = None
        if current is not None and self._at is not None and int(self._at[-1]) < current.numel():
            direction = along(without(current[self._at], self._fresh))
        pending, self._pending = self._pending, []
        if pending:  # all at once: a few matrix products, not a Python call per proposal and direction
            samples = torch.stack([p.sample for p in pending])
            values, news = self._worths(samples, direction), unit_new_parts(samples, self._fresh)
            nears = self._window.nears(torch.stack([p.unit for p in pending]), NEAR_COPY)
            judged = []
            for p, value, new, nearby in zip(pending, values, news, nears):
                if self._judge(p.author, p.seq, p.sample, p.unit, p.step, p.factor, p.date, direction, (value, new),
                               nearby, p.ahead, defer_weak=fit is not None and bool(p.data)):
                    judged.append((p, *value))
            if fit is not None and theta is not None:  # too weak for its direction: does it teach its stream?
                self.fitted.check(judged, theta, fit, self.records, self.graduated)
        self._window.trim(MAX_WINDOW)

    def _judge(self, author: str, seq: int, sample: Tensor, unit: Tensor, step: Tensor | Decoded, factor: float,
               date: float, direction: Along | None = None,
               judged: tuple[tuple[float, float], Tensor | None] | None = None, nearby: list[int] | None = None,
               ahead: Tensor | None = None, defer_weak: bool = False) -> bool:
        """Judge a proposal and relay its work if useful: nothing for a near copy of one dated before it (a
        graduate's too: its work is in already), and no mark on its record (it may be the original that lost a
        race); one dated before a near copy that took the credit (its payload came first) takes that credit over,
        and its work, relayed already through the copy, is not relayed again. `judged`: its (value, keep) and new
        part, computed with its phase's batch; `defer_weak`: leave weak work off the record (sync/fitness.py)."""
        key = slot_key(self.run_id, author, seq)
        copied, displaced = race(self._window, unit, date, NEAR_COPY, author=author, nearby=nearby)
        if copied:
            _bounded(self.judged, (author, seq), (0.0, 0.0))
            self._window.append(Seen(unit, date, None, author=author, round=self._round, ahead=ahead))
            return False
        if displaced:
            self._take_back(displaced, key)
        graduate = self.graduated(author, before=seq)
        (value, keep), new = judged or (self._worths(sample[None], direction)[0],
                                        unit_new_parts(sample[None], self._fresh)[0])
        _bounded(self.judged, (author, seq), (value, keep if graduate else 0.0))
        carry = self._carry
        if graduate:
            if keep > 0 and not displaced:
                _bounded(self.relayed, author, self.relayed.get(author, 0.0) + keep / len(self.sponsors))
            if len(carry.graded) < MAX_VOUCHES and not displaced:  # what its header can list
                carry.graduate(key, value, step if keep > 0 else None, factor, keep, new)
        elif value > 0 and not displaced and len(carry.proposals) < MAX_VOUCHES:
            carry.propose(key, step, factor, value, new)
        if not (defer_weak and not graduate and keep > 0 and value < PROVEN):
            self.records.note(author, seq, value)
        self._window.append(Seen(unit, date, (author, seq) if value > 0 else None, author=author, round=self._round,
                                 ahead=ahead))
        return True

    def _take_back(self, displaced: list[int], key: bytes | None) -> None:
        """Near copies that took credit before their original was judged: their marks go (and no sponsor's vouch
        restores them), and a vouch still to be signed for one names the original proposal's `key` instead (the
        relayed work is the same; a sponsor's original, None, is not a proposal: the vouch stays)."""
        for i in displaced:
            seen = self._window[i]
            assert seen.slot is not None
            author, seq = seen.slot
            self._window[i] = seen._replace(slot=None)
            self.records.disown(author, seq)
            _bounded(self.judged, seen.slot, (0.0, 0.0))
            if key is not None:
                self._carry.rename(slot_key(self.run_id, author, seq), key)

    def relay(self, theta: Tensor | None = None, current: Tensor | None = None, fit: Fit | None = None) -> Relayed:
        """What this sponsor's next update carries for the proposals merged since its last one (`Relayed`), judged
        now by `current`, its pseudo-gradient of the phase ending (`judge`):
        the proposals' values scaled to sum to at most 1, so all of them together take at most one share `t` <= 1/S
        of its update, mixed in by displacing its own work, `(own + relayed) / (1 + t)`; the graduates' on top, as
        members' (`GRADUATE_SHARE * keep` of each step, over S); `fit`: the fit check (`judge`). Drains them."""
        if not self.judging:
            return NOTHING
        fresh_ahead: list[Tensor] = []  # the same at the next period's coordinates, for after a turn
        if theta is not None and self._at is not None and self._snapshots and int(self._at[-1]) < theta.numel():
            self._fresh = orthonormal(moves_at(theta, self._snapshots, self._at))  # what is no longer new
            if self.judged_at.owns(self._at) and self.judged_at.turning:
                fresh_ahead = orthonormal(moves_at(theta, self._snapshots, self.judged_at.ahead(theta.numel())))
        self.judge(current, theta, fit if theta is not None else None)
        carry, self._carry, sponsors = self._carry, Carry(), len(self.sponsors)
        (relay, weights), full = carry.relay(), carry.full
        # The window keeps the round just relayed: a copy that reached us before its original and went out in this
        # relay still gives its credit over when the original comes next round (its work is out: the original's
        # is not relayed again), and a copy of last round's work is still a copy.
        self._window.keep([i for i, seen in enumerate(self._window.seen) if seen.round == self._round])
        self._round += 1
        self._turn(fresh_ahead)
        share = 0.0
        if relay is not None and weights:
            total = sum(weights)  # crowded values: what the work was summed at
            relay.mul_(1.0 / (sponsors * max(1.0, total)))
            for p, weight in zip(carry.proposals, weights):
                author = self._authors[p.key][0] if p.key in self._authors else ""
                _bounded(self.relayed, author, self.relayed.get(author, 0.0) + weight / (sponsors * max(1.0, total)))
            share = min(1.0, total) / sponsors
        else:
            relay = None
        if full is not None:
            full.mul_((1.0 + share) / sponsors)
            relay = full if relay is None else relay.add_(full)
        if theta is not None:
            relay, self._snapshots = without_echoes(relay, theta, self._snapshots)
        if relay is not None and self._at is not None and int(self._at[-1]) < relay.numel():
            self._relayed_at = relay[self._at] / (1.0 + share)  # what it will move theta by (`relay_payload`)
        verdicts = [(k, v) for k, v in carry.graded if v > 0] + sorted(((p.key, p.value) for p in carry.proposals),
                                                                       key=lambda kv: -kv[1])
        return Relayed(relay, pack_vouches(verdicts[:MAX_VOUCHES]), share, carry.carried / sponsors)

    def _turn(self, fresh: list[Tensor]) -> None:
        """A round ended; every TURN_EVERY rounds we judge at new coordinates (sync/judged_at.py), and what we compare
        across rounds (the copy window, the sponsors' latest updates, theta's recent moves) is read there from then
        on. Not where a caller chose its own coordinates (`merged`'s `at`)."""
        if not self.judged_at.owns(self._at) or not self.judged_at.rotate():
            return
        self._at = self.judged_at.now(self.judged_at.numel)
        self._window.rotate()
        self._latest.rotate(self._at)
        self._fresh = fresh

    def vouched(self, sponsor: str, values: Iterable[tuple[bytes, float]]) -> None:
        """A sponsor's update merged here: count what each author's proposals were judged worth (views and
        benchmarks only; the weight itself is inside the sponsor's payload)."""
        if sponsor not in self.sponsors:
            return
        for key, value in values:
            slot = self._authors.get(key)
            if slot is not None:
                _bounded(self.earned, slot[0], self.earned.get(slot[0], 0.0) + value / len(self.sponsors))
                if self.judging and sponsor != self.self_id:  # another sponsor's word counts for the record too
                    self.records.note(*slot, value)

    def _worths(self, samples: Tensor, direction: Along | None = None) -> list[tuple[float, float]]:
        """(v, keep) of each row of `samples` (`Latest.worths`, with this module's rules)."""
        length = self._own_length  # ours without the work it carried: carrying graduates must not loosen the cap
        return self._latest.worths(samples, direction, self.self_id, length, self._fresh, ECHO_OF, GRADUATE_SHARE,
                                   PROVEN)


def _bounded(table: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    bounded(table, key, value, MAX_EARNED)
