"""Merge weight earned by contribution: what one replica does so that a crowd of fresh identities cannot steer
the model.

An Ed25519 identity costs microseconds, so in an open run the weight an update merges with cannot rest on
the sender's word alone: every identity signs itself the full weight (`max_weight`), and K identities would get
K shares of every outer step. Two rules decide how much of its signed weight an update gets here:

**Probation (deterministic, sync/probation.py).** An author's k-th update (its signed seq) merges at
`probation * 2**(k-1)` of its weight, capped at 1: exact on every replica, so the merge rule stays exact.

**Vetting (local, order-free).** A payload that is, up to a scale, a recent payload of another author (the copy
window, sync/copies.py) is a *copy* or a *negated copy*; an honest swarm's replicas stay exactly equal, as the
test never touches honest work. Of such a pair, the payload of an author in good standing (sync/authors.py) is
the original: the other merges at 0 with a strike, and if it came first (a fast copier beats the original to
some replicas) its weight is taken back when the original merges (`copies_found`, `Intake.take_back_copies`).
When neither author is in good standing (a crowd copying a newcomer on probation) no local fact tells them
apart, so both merge at 0 (TIED, no strike, no standing earned). Either way every replica that holds both ends
alike, whatever the order. The price: a crowd that copies each update of a newcomer keeps it at weight 0 until
one of its updates goes uncopied (denial, not poisoning). After `DISTRUST_STRIKES` refusals in a row the author
is *distrusted*: every later update of it merges at 0. The slot still counts as merged (V advances), so gossip,
repair and the vectors work as before; only its weight is gone.

Good standing is the one local fact vetting uses: where a copy races an author's update around its promotion,
two replicas can still judge differently and differ by that update's weighted payload (at most
`outer_lr * max_weight * step_ceiling` per coordinate, the bound the repair uses). A joiner, which holds no
reference or window before its own first update, merges only its donor's trusted authors until then
(`inherit`). The reference (sync/reference.py) refuses nothing by default; `min_agreement`, `max_norm_ratio`
and `full_agreement` refuse by it opt-in.

Why not a score every peer computes alike: it needs a shared point to evaluate at (a loss change on a batch
fixed by the spec needs a theta every peer holds; the direction of "the others' updates of the same epoch"
needs a set every peer holds), and an async swarm has neither while it runs.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from p2p_diloco.sync.authors import Authors
from p2p_diloco.sync.copies import COPY_COSINE, CopyWindow, WindowEntry
from p2p_diloco.sync.decoded import Decoded
from p2p_diloco.sync.probation import probation_multiplier
from p2p_diloco.sync.reference import Reference
from p2p_diloco.sync.sponsorship import Sponsorship
from p2p_diloco.sync.verdict import REFUSALS, REFUSED, TIED, Verdict

if TYPE_CHECKING:
    from p2p_diloco.config import RunSpec

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0


class Standing:
    """One replica's vetting state (see the module docstring). Not thread-safe: the replica calls it under its
    lock."""

    def __init__(self, *, probation: float, min_agreement: float, max_norm_ratio: float,
                 full_agreement: float = 0.0, copy_cosine: float = COPY_COSINE, self_id: str = "",
                 sponsors: Sequence[str] = (), run_id: str = "", judge_seed: int | None = None) -> None:
        if not (0.0 < probation and math.isfinite(probation)):
            raise ValueError(f"probation must be a positive number, got {probation}")
        self.probation = probation
        self.min_agreement = min_agreement
        self.max_norm_ratio = max_norm_ratio
        self.full_agreement = full_agreement
        self.copy_cosine = copy_cosine
        self.self_id = self_id
        self.authors = Authors(self_id)
        self.reference = Reference()
        self.copies = CopyWindow()
        self.sponsorship = Sponsorship(sponsors, self_id, run_id, judge_seed)
        self.stats: dict[str, int] = {"proposal": 0, "probation": 0, "low_agreement": 0, "disagrees": 0, "too_long": 0,
                                      "copy": 0, "negated_copy": 0, TIED: 0, "distrusted": 0, "unvetted": 0}
        self._found: list[tuple[str, int, str]] = []  # copies found after they merged (`copies_found`)
        self._logged_at = -math.inf
        self._suppressed = 0

    @classmethod
    def from_spec(cls, spec: RunSpec, *, self_id: str = "", judge_seed: int | None = None) -> Standing:
        """The standing of `spec`'s run (its `defence` section) for the replica of peer `self_id` (`judge_seed`:
        a sponsor's secret, sync/sponsorship.py `sample_at`)."""
        d = spec.defence
        return cls(probation=d.probation, min_agreement=d.min_agreement, copy_cosine=d.copy_cosine,
                   max_norm_ratio=d.max_norm_ratio, full_agreement=d.full_agreement, self_id=self_id,
                   sponsors=d.sponsors, run_id=spec.run_id, judge_seed=judge_seed)

    @property
    def distrusted(self) -> OrderedDict[str, str]:
        """Distrusted authors -> why (read by the views and the simulator)."""
        return self.authors.distrusted

    @property
    def recent(self) -> OrderedDict[str, tuple[float, float]]:
        """Authors -> (time, multiplier) of their last merge here with a weight, least recent first."""
        return self.authors.recent

    def judge(self, sender: str, seq: int, delta: Tensor | Decoded, now: float = 0.0) -> Verdict:
        """The verdict on `sender`'s update `seq` with decoded payload `delta` (before it merges)."""
        base = probation_multiplier(seq, self.probation)
        if self.sponsorship.active:  # the sponsors decide, nothing local (sync/sponsorship.py)
            if self.sponsorship.is_sponsor(sender):  # probation still damps a run's first rounds: before its
                return Verdict(base, "" if base >= 1.0 else "probation")  # peers see each other, each signs w=1
            return Verdict(0.0, "proposal")  # its weight, if any, comes inside a sponsor's update
        if sender in self.authors.distrusted:
            return Verdict(0.0, "distrusted")
        if self.reference.vector is None and self.authors.unvetted(sender) and base >= 1.0:
            return Verdict(0.0, "unvetted")  # a joiner before its first update: its donor's authors, newcomers
        # Our own updates too: the verdict on a pair must not depend on whose replica judges it (two honest peers
        # that trained on the same batches from one theta publish one payload; if each skipped its own, each
        # would keep its own at weight and tie the other's, and the replicas would differ).
        copied = self._copy_test(sender, seq, delta, now) if self.copy_cosine > 0 else ""
        if copied in REFUSALS:
            return Verdict(0.0, copied)
        if sender == self.self_id or self.reference.vector is None:
            return Verdict(0.0, copied) if copied else Verdict(base, "" if base >= 1.0 else "probation")
        agreement, ratio = self.reference.compare(delta)
        if not math.isfinite(agreement):
            return Verdict(0.0, "disagrees", -1.0, ratio, -1.0)
        average = self.authors.average(sender, agreement)
        if copied:  # a tie: weight 0 (its agreement feeds the author's average only)
            return Verdict(0.0, copied, agreement, ratio, average)
        if self.min_agreement > -1.0 and agreement < self.min_agreement:
            return Verdict(0.0, "disagrees", agreement, ratio, average)
        if self.max_norm_ratio > 0 and ratio > self.max_norm_ratio:
            return Verdict(0.0, "too_long", agreement, ratio, average)
        if self.full_agreement > 0 and average < self.full_agreement:  # all or nothing: a fraction would differ
            return Verdict(0.0, "low_agreement", agreement, ratio, average)
        return Verdict(base, "" if base >= 1.0 else "probation", agreement, ratio, average)

    def observe(self, sender: str, delta: Tensor | Decoded, verdict: Verdict, now: float, *,
                seq: int = 0) -> None:
        """After the merge: count the verdict, distrust a vetoed author, fold a payload in good standing into
        the reference; an author in good standing also unmasks the earlier merged copies of this payload."""
        if verdict.reason:
            self.stats[verdict.reason] += 1
        if not math.isnan(verdict.average) and sender != self.self_id:
            self.authors.note_average(sender, verdict.average)
        if verdict.reason in REFUSALS:
            self._strike(sender, verdict, now)
            return
        tied = verdict.reason == TIED
        if self.copy_cosine > 0 and (verdict.multiplier > 0 or tied):
            self.copies.remember_sample(sender, seq, delta, TIED if tied else "")
        # A tie earns nothing, not even standing: the two are symmetric, and a scaled copy points along the
        # reference as well as its original does.
        if verdict.multiplier <= 0:  # tied, low agreement or distrusted: counts in nothing until it earns it again
            self.authors.weightless(sender)
            return
        own = sender == self.self_id and math.isnan(verdict.agreement)  # ours: judged without the reference
        sponsor = self.sponsorship.is_sponsor(sender)  # a founder is in good standing by the run's spec
        earns = verdict.multiplier >= 1.0 and (verdict.vetted or own or sponsor)
        self.authors.merged(sender, seq, now, verdict.multiplier, earns_standing=earns)
        if sender == self.self_id or sender in self.authors.good:
            self.reference.fold(delta)

    def exact_multiplier(self, sender: str, seq: int) -> float | None:
        """The multiplier of `sender`'s update `seq` when it follows from its signed header alone, as a group sum's
        part needs (sync/sum_merge.py): probation by seq, or in a run with founders a sponsor's probation and a
        proposal's 0. None where vetting reads payloads (the copy window, the reference's tests, a joiner's donor
        rule) or this peer is a sponsor (it judges payloads): such a replica merges the parts one by one."""
        base = probation_multiplier(seq, self.probation)
        if self.sponsorship.active:
            return None if self.sponsorship.judging else base if self.sponsorship.is_sponsor(sender) else 0.0
        vetting = (self.copy_cosine > 0 or self.min_agreement > -1.0 or self.max_norm_ratio > 0
                   or self.full_agreement > 0)
        if vetting or (self.reference.vector is None and self.authors.unvetted(sender)):
            return None
        return 0.0 if sender in self.authors.distrusted else base

    def summed(self, sender: str, seq: int, now: float, multiplier: float) -> None:
        """After a group sum merged `sender`'s update `seq` at `multiplier` (no payload here: nothing to fold into
        the reference or the copy window, which exact-weight runs do not read). A full weight earns standing: in
        such a run nothing but the weight rule stands between an author and it."""
        if multiplier <= 0:
            self.authors.weightless(sender)
        else:
            self.authors.merged(sender, seq, now, multiplier, earns_standing=multiplier >= 1.0)

    def sponsored_merge(self, sender: str, seq: int, delta: Tensor | Decoded, step: Tensor | Decoded | None,
                        factor: float, vouches: list[tuple[bytes, float]], *, update_id: bytes | None = None,
                        now: float | None = None, data: tuple[int, ...] = ()) -> None:
        """After a merge in a run with sponsors: a sponsor judges and relays it (sync/sponsorship.py); a sponsor's
        header says what it relayed. `data`: the data position its header declares (wire/envelope.py)."""
        sponsorship = self.sponsorship
        if not sponsorship.active:
            return
        sample = at = None
        if sponsorship.judging:  # in theta's units, the signed weight included: lengths compare steps, not payloads
            source = Decoded.of(step if step is not None else delta)
            at = sponsorship.sample_at(source.numel)
            sample = source.take(at) * factor
        sponsorship.merged(sender, seq, sample, step, factor, at, update_id=update_id, now=now, data=data)
        if vouches:
            sponsorship.vouched(sender, vouches)

    def sample_indices(self, numel: int) -> list[Tensor]:
        """The coordinates `judge` and `observe` read of a payload of `numel` values: screening takes them in
        its one pass over the payload (sync/decoded.py `Decoded.want`), outside the replica's lock."""
        ats = [self.copies.sample_at(numel)] if self.copy_cosine > 0 else []
        if self.sponsorship.judging:
            ats.append(self.sponsorship.sample_at(numel))
        at = self.reference.sample_at(numel)
        return ats if at is None else [*ats, at]

    def copies_found(self) -> list[tuple[str, int, str]]:
        """(author, seq, reason) of merged updates found to be copies only after they merged (drains the list),
        whose weight must now be taken back (`Replica.unmerge(keep_slot=True)`, run by `Intake`), so that the
        verdict does not depend on the order of arrival (`_copy_test`)."""
        found, self._found = self._found, []
        return found

    def inheritance(self, limit: int) -> tuple[list[str], list[str]]:
        """What a joiner syncing from us merges before its own first update (`Authors.inheritance`)."""
        return self.authors.inheritance(limit)

    def inherit(self, good: Sequence[str], distrusted: Sequence[str], *, known: Iterable[str]) -> None:
        """A donor's word, after a state sync of a snapshot holding updates of the authors `known`
        (`Authors.inherit`)."""
        self.authors.inherit(good, distrusted, known=known)

    def proven(self, now: float, window_s: float) -> set[str]:
        """The members whose votes count (`Authors.proven`)."""
        return self.authors.proven(now, window_s)

    def swarm_size(self, now: float, window_s: float) -> float:
        """How many peers' worth of updates this replica merged within `window_s` (`Authors.swarm_size`)."""
        return self.authors.swarm_size(now, window_s)

    def _copy_test(self, sender: str, seq: int, delta: Tensor | Decoded, now: float) -> str:
        """Is `delta`, up to a scale, a payload of another author in the window? The same verdict whatever the
        order in which a replica gets a pair of copies, once it holds both:
        - one author in good standing, the other not: the other's is the copy, refused with a
          strike ("copy" / "negated_copy"); if it merged first (it beat its original here), its weight is taken
          back when the original comes;
        - neither in good standing (an honest newcomer copied while on probation, or copiers among themselves):
          both merge at 0 (TIED, no strike; the first to come is taken back), as no local fact tells which is
          the original;
        - both in good standing: both merge (it cannot tell either; see `Authors.merged` for how standing is
          earned)."""
        matches = self.copies.matches(sender, seq, delta, self.copy_cosine)
        if not matches:
            return ""
        trusted = self.authors.good  # this peer too only once in good standing: others see its first updates alike
        if sender in trusted:
            for entry, cosine in matches:
                if entry.author not in trusted and entry.state != REFUSED:  # a tie among copiers is a copy too
                    self._take_back(entry, "copy" if cosine > 0 else "negated_copy", now)
            return ""
        for entry, cosine in matches:
            if entry.author in trusted:
                return "copy" if cosine > 0 else "negated_copy"
        for entry, _ in matches:
            if not entry.state:
                self._take_back(entry, TIED, now)
        return TIED

    def _take_back(self, entry: WindowEntry, reason: str, now: float) -> None:
        """A window payload turned out to be a copy: queue the take-back of its weight (none left if it tied)
        and, for a copy of an author in good standing, strike its author."""
        author, seq, state = entry.author, entry.seq, entry.state
        entry.state = REFUSED if reason in REFUSALS else TIED
        if not state:
            self._found.append((author, seq, reason))
        self.authors.matched(author, seq)
        self.stats[reason] += 1
        if reason in REFUSALS:
            self._strike(author, Verdict(0.0, reason), now)
        else:  # a tie: its weight is gone, so it counts in nothing (`swarm_size`) until an update of it merges
            self.authors.recent.pop(author, None)

    def _strike(self, sender: str, verdict: Verdict, now: float) -> None:
        """A refusal: one strike against the author (`Authors.strike`), logged."""
        strikes = self.authors.strike(sender, verdict.reason)
        self._log_refusal(sender, verdict, strikes, now)

    def _log_refusal(self, sender: str, verdict: Verdict, strikes: int, now: float) -> None:
        """One line per LOG_INTERVAL_S at most (a crowd refused by the thousand must not flood the log)."""
        self._suppressed += 1
        if now - self._logged_at < LOG_INTERVAL_S:
            return
        logger.warning("update refused by vetting sender=%s reason=%s agreement=%.3f norm_ratio=%.2f strikes=%d "
                       "(refusals since the last such line: %d)", sender, verdict.reason, verdict.agreement,
                       verdict.norm_ratio, strikes, self._suppressed)
        self._logged_at, self._suppressed = now, 0
