"""Merge weight earned by contribution (issue 16): what one replica does so that a crowd of fresh identities
cannot steer the model.

An Ed25519 identity costs microseconds, so in an open run the weight an update merges with cannot rest on
the sender's word alone: every identity signs itself the full weight (`max_weight`), and K identities would get
K shares of every outer step. Two rules decide how much of its signed weight an update gets here:

**Probation (deterministic).** An author's k-th update (its signed seq) merges at `probation * 2**(k-1)` of
its weight, capped at 1: with the default 0.25, at 1/4, 1/2, then in full from the 3rd update on. The seq is
signed and the same on every replica (the author's own included), so probation keeps the merge rule exact:
replicas that merged the same set are still equal. An honest volunteer that joins late reaches full weight
after two updates; a fresh identity's first updates are worth a fraction while it is vetted.

**Vetting (local, order-free).** A crowd that computes nothing can only re-sign others' work. So a payload
that is, up to a scale, a recent payload of another author (|cosine| >= `copy_cosine` over COPY_SAMPLE fixed
coordinates, against the last COPY_WINDOW payloads merged here) is a *copy* or a *negated copy*. A re-signed
copy is exact (cosine 1 up to float rounding); honest payloads of different authors measured at most 0.91, so
the test never touches honest work, and an honest swarm's replicas stay exactly equal. Of such a pair, the
payload of an author in good standing is the original: the other merges at 0 with a strike, and if it came
first (a fast copier beats the original to some replicas) its weight is taken back when the original merges
(`copies_found`, `Intake.take_back_copies`). When neither author is in good standing (a crowd copying a
newcomer on probation) no local fact tells them apart, so both merge at 0 (TIED, no strike, no standing
earned). Either way every replica that holds both ends alike, whatever the order. The price: a crowd that
copies each update of a newcomer keeps it at weight 0 until one of its updates goes uncopied (denial, not
poisoning). After `DISTRUST_STRIKES` refusals in a row the author
is *distrusted*: every later update of it merges at 0. The slot still counts as merged (V advances), so
gossip, repair and the vectors work as before; only its weight is gone.

*Good standing* is an author whose last two updates (seqs k-1 and k) merged at full weight (past probation)
pointing along this replica's *reference* (cosine > PROMOTE_AGREEMENT; the reference is an exponential average
of the payloads of authors in good standing, this peer's own included), the first not matched by a copy when
the second came, and never refused since (a copy that beat its original looks like an original until the
original comes, which in a swarm is well before the copier's next copy). This peer earns it the same way, so
its own first updates are judged as everyone else judges them. It is the one local fact vetting uses: where a copy
races an author's update around its promotion, two replicas can still judge differently and differ by that
update's weighted payload (at most `outer_lr * max_weight * step_ceiling` per coordinate, the bound the repair
uses). A joiner, which holds no reference or window before its own first update, merges only its donor's
trusted authors until then (`inherit`).

The reference refuses nothing by default; `min_agreement`, `max_norm_ratio` and `full_agreement` (config/spec.py)
refuse by it opt-in. All three misfired on honest work in real-process runs (a joiner's first update at cos
-0.63 with two replicas' references and not a third's; cosines down to -0.2 late in a run; norms 3.2-3.9x
after a pause at H=2).

Why not a score every peer computes alike: it needs a shared point to evaluate at (a loss change on a batch
fixed by the spec needs a theta every peer holds; the direction of "the others' updates of the same epoch"
needs a set every peer holds), and an async swarm has neither while it runs.

Votes and the swarm's size come from here too (`proven`, `swarm_size`), never from DHT records, which cost
nothing to make: see ARCHITECTURE.md "Who counts".

Bounded: the distrusted set holds at most `MAX_DISTRUSTED` authors (oldest forgotten first: a forgotten one
is vetted again at its next update) and `recent` at most `MAX_STANDING` (the least recent forgotten first).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

COPY_COSINE = 0.9999
"""|cosine| with a recent payload of another author at or above which a payload is a copy (or a negated copy) of
it. A re-signed copy, scaled or negated, decodes to exactly the same direction (the codec's codes are the same
or negated, their block scales scaled), so the bar can sit at 0.9999; honest payloads of different authors
come close only at a run's start (first updates from one init: 0.91 at H=20, and with H=2 close enough that
0.99 refused some: replicas 0.5% apart)."""
COPY_SAMPLE = 4096
"""Coordinates (fixed, drawn once per model size) the copy test compares: a cosine over them is within ~0.02 of
the full one for dense payloads, and a copy, scaled or negated, is exact on any subset."""
COPY_WINDOW = 1024
"""Recent payloads a new one is compared with (4 KiB each). A copy is found only while its original or copy
is still here: at 64, 100 copies of one update pushed the first ones out before the original came (their
authors were never struck; ties had already taken their weight), and a crowd could evict a copy on purpose with
junk; 1024 (4 MiB, one 1024 x 4096 product per update) covers rounds of hundreds of identities."""
MAX_INHERITED = 512
"""Authors of each kind a donor passes to a joiner (`inheritance`), the most recent first."""
MAX_DISTRUSTED = 1 << 16
MAX_STANDING = 1 << 14
REFERENCE_DECAY = 0.7
"""Weight of the old reference when a payload in good standing is folded in (about the last 3 updates)."""
NORM_DECAY = 0.9
"""The reference norm is a decaying maximum of the norms folded in: honest norms grow during warm-up and jump
after a restart, and an average lags behind them (an honest update measured 3.1x an average in a test)."""
LOG_INTERVAL_S = 10.0
COPY_SEED = 0x5EED
REFUSALS = ("disagrees", "too_long", "copy", "negated_copy")
TIED = "tied_copy"
"""Two authors not in good standing sent one payload (up to a scale): both merge at 0, with no strike."""
REFUSED = "refused"  # a window entry found to copy an author in good standing (its author struck)
"""Verdicts that refuse an update and count a strike against its author."""
AGREEMENT_DECAY = 0.5
"""An author's average agreement: each update's cosine counts half, the past the other half."""
AGREEMENT_PRIOR = 0.15
"""A new author's average before its first compared update: its first update counts only if its cosine is at
least 0.05 (honest first updates measured 0.24-0.9; noise ~0.003, so 1000 noise identities never get a weight:
with a prior of 0.3 their first updates passed, at probation, and cost +38% eval loss)."""
PROMOTE_AGREEMENT = 0.0
"""Cosine with the reference above which a full-weight update puts its author in good standing (its payloads win
a copy pair; they are folded into the reference). Only promotion: an update below it still merges (refusing
needs `min_agreement`), so an honest author whose update points away for a round loses only that edge until its
next one; a sign-flipped copy, which points away early in a run, never earns standing."""
DISTRUST_STRIKES = 3
"""Refused updates in a row after which an author is distrusted (all its later updates merge at weight 0). One
refusal costs only that update: an honest sender's rare borderline update must not cost it the run."""


@dataclass(frozen=True)
class Verdict:
    """How much of its signed weight one update merges with here, and why."""

    multiplier: float
    reason: str = ""  # "" (full weight), "probation", "copy", "negated_copy", TIED, "unvetted", "distrusted",
    #                   and the opt-in "disagrees", "too_long", "low_agreement"
    agreement: float = math.nan  # cosine with the reference (nan: not compared)
    norm_ratio: float = math.nan
    average: float = math.nan  # the author's average agreement, this update included (nan: not compared)

    @property
    def vetted(self) -> bool:
        """Compared with a reference and found in line (agreement above PROMOTE_AGREEMENT): only such an update,
        at full weight, puts its author in good standing (an unvetted full weight earns none)."""
        return not math.isnan(self.agreement) and self.agreement > PROMOTE_AGREEMENT and self.multiplier > 0


def weighted(step: Tensor, multiplier: float) -> Tensor:
    """`step` at `multiplier` of its weight (itself at 1). A bound on `step` still bounds the result (m <= 1)."""
    return step if multiplier == 1.0 else step * multiplier


def probation_multiplier(seq: int, probation: float) -> float:
    """The deterministic part: `probation * 2**(seq-1)`, capped at 1 (1 with probation >= 1)."""
    if probation >= 1.0 or seq >= 64:
        return 1.0
    return min(1.0, probation * 2.0 ** (max(1, seq) - 1))


class Standing:
    """One replica's vetting state (see the module docstring). Not thread-safe: the replica calls it under its
    lock."""

    def __init__(self, *, probation: float, min_agreement: float, max_norm_ratio: float,
                 full_agreement: float = 0.0, copy_cosine: float = COPY_COSINE, self_id: str = "") -> None:
        if not (0.0 < probation and math.isfinite(probation)):
            raise ValueError(f"probation must be a positive number, got {probation}")
        self.probation, self.min_agreement, self.max_norm_ratio = probation, min_agreement, max_norm_ratio
        self.full_agreement, self.copy_cosine, self.self_id = full_agreement, copy_cosine, self_id
        self.averages: OrderedDict[str, float] = OrderedDict()  # author -> average agreement, least recent first
        self.reference: Tensor | None = None
        self.reference_norm = 0.0  # decaying maximum of the norms of the payloads folded into the reference
        self.distrusted: OrderedDict[str, str] = OrderedDict()  # author -> why
        self.strikes: dict[str, int] = {}  # author -> refusals in a row (insertion order: oldest first)
        # author -> (time of its last merge here that was not refused, the multiplier it merged at), least
        # recent first; `good`: the authors in good standing (`observe`)
        self.recent: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self.good: set[str] = set()
        self._candidates: OrderedDict[str, int] = OrderedDict()  # author -> seq of its last update that could
        # count towards good standing (full weight, along the reference, not matched by a copy so far)
        self.stats: dict[str, int] = {"probation": 0, "low_agreement": 0, "disagrees": 0, "too_long": 0,
                                      "copy": 0, "negated_copy": 0, TIED: 0, "distrusted": 0, "unvetted": 0}
        # [author, seq, row of `_samples`, state: "" (merged with a weight), TIED or REFUSED], newest last; the
        # unit samples sit in one matrix (a ring of COPY_WINDOW rows), so a copy test is one product, not a loop
        self._window: deque[list] = deque(maxlen=COPY_WINDOW)
        self._samples: Tensor | None = None
        self._next_row = 0
        self._last: tuple[str, int, Tensor | None] = ("", 0, None)  # the last sample `_copy_test` took
        self._found: list[tuple[str, int, str]] = []  # copies found after they merged (`copies_found`)
        self._sample_at: Tensor | None = None
        self._logged_at, self._suppressed = -math.inf, 0
        self.inherited: set[str] | None = None  # a joiner's donor's word (`inherit`); None: no donor

    def judge(self, sender: str, seq: int, delta: Tensor, now: float = 0.0) -> Verdict:
        """The verdict on `sender`'s update `seq` with decoded payload `delta` (before it merges)."""
        base = probation_multiplier(seq, self.probation)
        if sender in self.distrusted:
            return Verdict(0.0, "distrusted")
        if self.reference is None and self.inherited is not None and sender != self.self_id \
                and sender not in self.inherited and base >= 1.0:
            return Verdict(0.0, "unvetted")  # a joiner before its first update: its donor's authors, newcomers
        copied = self._copy_test(sender, seq, delta, now) if sender != self.self_id and self.copy_cosine > 0 else ""
        if copied in REFUSALS:
            return Verdict(0.0, copied)
        if sender == self.self_id or self.reference is None:
            return Verdict(0.0, copied) if copied else Verdict(base, "" if base >= 1.0 else "probation")
        norm = float(delta.norm())
        ref_norm = float(self.reference.norm())
        agreement = float(torch.dot(delta, self.reference)) / (norm * ref_norm) if norm > 0 and ref_norm > 0 \
            else 1.0
        ratio = norm / self.reference_norm if self.reference_norm > 0 else 1.0
        if not math.isfinite(agreement):
            return Verdict(0.0, "disagrees", -1.0, ratio, -1.0)
        average = AGREEMENT_DECAY * self.averages.get(sender, AGREEMENT_PRIOR) + (1 - AGREEMENT_DECAY) * agreement
        if copied:  # a tie: weight 0 (its agreement feeds the author's average only)
            return Verdict(0.0, copied, agreement, ratio, average)
        if self.min_agreement > -1.0 and agreement < self.min_agreement:
            return Verdict(0.0, "disagrees", agreement, ratio, average)
        if self.max_norm_ratio > 0 and ratio > self.max_norm_ratio:
            return Verdict(0.0, "too_long", agreement, ratio, average)
        if self.full_agreement > 0 and average < self.full_agreement:  # all or nothing: a fraction would differ
            return Verdict(0.0, "low_agreement", agreement, ratio, average)
        return Verdict(base, "" if base >= 1.0 else "probation", agreement, ratio, average)

    def observe(self, sender: str, delta: Tensor, verdict: Verdict, now: float, *, seq: int = 0) -> None:
        """After the merge: count the verdict, distrust a vetoed author, fold a payload in good standing into
        the reference; an author in good standing also unmasks the earlier merged copies of this payload."""
        if verdict.reason:
            self.stats[verdict.reason] += 1
        if not math.isnan(verdict.average) and sender != self.self_id:
            self.averages.pop(sender, None)
            self.averages[sender] = verdict.average
            while len(self.averages) > MAX_STANDING:
                self.averages.popitem(last=False)
        if verdict.reason in REFUSALS:
            self._strike(sender, verdict, now)
            return
        tied = verdict.reason == TIED
        if self.copy_cosine > 0 and (verdict.multiplier > 0 or tied):
            sample = self._last[2] if self._last[:2] == (sender, seq) else self._sample(delta)
            if sample is not None:
                self._remember(sender, seq, sample, TIED if tied else "")
        # A tie earns nothing, not even standing: the two are symmetric, and a scaled copy points along the
        # reference as well as its original does.
        if verdict.multiplier <= 0:  # tied, low agreement or distrusted: counts in nothing until it earns it again
            self.recent.pop(sender, None)
            self.good.discard(sender)
            self._candidates.pop(sender, None)
            return
        self.recent.pop(sender, None)
        self.recent[sender] = (now, verdict.multiplier)
        if verdict.multiplier >= 1.0 and (verdict.vetted or (sender == self.self_id and
                                                            math.isnan(verdict.agreement))):
            # Good standing takes two such updates in a row (seq k-1 and k), the first still unmatched when the
            # second comes: a copy that beat its original looks like one until the original comes (with one,
            # a copier was promoted and its x5 copies won their pairs there: +385% eval loss, replicas 1.2 apart).
            if self._candidates.pop(sender, None) == seq - 1:
                self.good.add(sender)
                self.strikes.pop(sender, None)  # only on proof of own work: a copy that beat its original
                # would reset them each round (100 such copiers were never distrusted on one replica)
            self._candidates[sender] = seq
            while len(self._candidates) > MAX_STANDING:
                self._candidates.popitem(last=False)
        else:
            self.good.discard(sender)
            self._candidates.pop(sender, None)
        while len(self.recent) > MAX_STANDING:
            author = self.recent.popitem(last=False)[0]
            self.good.discard(author)
            self._candidates.pop(author, None)
        if sender == self.self_id or sender in self.good:
            self._fold(delta)

    def copies_found(self) -> list[tuple[str, int, str]]:
        """(author, seq, reason) of merged updates found to be copies only after they merged (drains the list),
        whose weight must now be taken back (`Replica.unmerge(keep_slot=True)`, run by `Intake`), so that the
        verdict does not depend on the order of arrival (`_copy_test`)."""
        found, self._found = self._found, []
        return found

    def _copy_test(self, sender: str, seq: int, delta: Tensor, now: float) -> str:
        """Is `delta`, up to a scale, a payload of another author in the window? The same verdict whatever the
        order in which a replica gets a pair of copies, once it holds both:
        - one author in good standing, the other not: the other's is the copy, refused with a
          strike ("copy" / "negated_copy"); if it merged first (it beat its original here), its weight is taken
          back when the original comes;
        - neither in good standing (an honest newcomer copied while on probation, or copiers among themselves):
          both merge at 0 (TIED, no strike; the first to come is taken back), as no local fact tells which is
          the original;
        - both in good standing: both merge (it cannot tell either; see `observe` for how standing is earned)."""
        sample = self._sample(delta)
        self._last = (sender, seq, sample)
        if sample is None or not self._window:
            return ""
        cosines = self._samples @ sample  # type: ignore[operator]  (rows not yet written are zero)
        rows = {entry[2]: entry for entry in self._window}
        matches = [(rows[row], float(cosines[row])) for row in
                   (cosines.abs() >= self.copy_cosine).nonzero().flatten().tolist() if rows[row][0] != sender]
        if not matches:
            return ""
        trusted = self.good  # this peer too only once in good standing: others see its first updates alike
        if sender in trusted:
            for entry, cosine in matches:
                if entry[0] not in trusted and entry[3] != REFUSED:  # a tie among copiers is a copy too
                    self._take_back(entry, "copy" if cosine > 0 else "negated_copy", now)
            return ""
        for entry, cosine in matches:
            if entry[0] in trusted:
                return "copy" if cosine > 0 else "negated_copy"
        for entry, _ in matches:
            if not entry[3]:
                self._take_back(entry, TIED, now)
        return TIED

    def _remember(self, sender: str, seq: int, sample: Tensor, state: str) -> None:
        """Add a payload's sample to the window; the ring's row is the oldest entry's, which the deque drops."""
        if self._samples is None or self._samples.shape[1] != sample.numel():
            self._samples, self._next_row = torch.zeros(COPY_WINDOW, sample.numel()), 0
            self._window.clear()
        row = self._next_row
        self._samples[row] = sample
        self._next_row = (row + 1) % COPY_WINDOW
        self._window.append([sender, seq, row, state])

    def _take_back(self, entry: list, reason: str, now: float) -> None:
        """A window payload turned out to be a copy: queue the take-back of its weight (none left if it tied)
        and, for a copy of an author in good standing, strike its author."""
        author, seq, _, state = entry
        entry[3] = REFUSED if reason in REFUSALS else TIED
        if not state:
            self._found.append((author, seq, reason))
        if self._candidates.get(author) == seq:  # no longer an unmatched full-weight update
            self._candidates.pop(author)
        self.stats[reason] += 1
        if reason in REFUSALS:
            self._strike(author, Verdict(0.0, reason), now)
        else:  # a tie: its weight is gone, so it counts in nothing (`swarm_size`) until an update of it merges
            self.recent.pop(author, None)

    def _strike(self, sender: str, verdict: Verdict, now: float) -> None:
        """A refusal: one strike, `DISTRUST_STRIKES` in a row distrust the author; it loses any standing."""
        strikes = self.strikes.pop(sender, 0) + 1
        self._log_refusal(sender, verdict, strikes, now)
        if strikes >= DISTRUST_STRIKES:
            self.distrusted[sender] = verdict.reason
            while len(self.distrusted) > MAX_DISTRUSTED:
                self.distrusted.popitem(last=False)
        else:
            self.strikes[sender] = strikes
            while len(self.strikes) > MAX_DISTRUSTED:
                self.strikes.pop(next(iter(self.strikes)))
        self.recent.pop(sender, None)
        self.good.discard(sender)

    def inheritance(self, limit: int) -> tuple[list[str], list[str]]:
        """(authors whose last update merged here with a weight, distrusted authors), the `limit` most recent of
        each, this peer included: what a joiner syncing from us merges before its own first update (`inherit`)."""
        trusted = list(reversed(self.recent))[:limit]
        if self.self_id and self.self_id not in trusted:
            trusted = [self.self_id, *trusted[:limit - 1]]
        return trusted, list(reversed(self.distrusted))[:limit]

    def inherit(self, good: list[str] | tuple[str, ...], distrusted: list[str] | tuple[str, ...]) -> None:
        """A donor's word, after a state sync: until our own first update gives us a reference, an author past
        its probation merges only if the donor merged it with a weight lately (authors still on probation merge
        at it, as everywhere), and the donor's distrusted never do. Without it a joiner would merge a crowd's
        updates unvetted, at full weight past their probation, and be poisoned at once (measured: a late
        volunteer under 10 sign-flipping identities was then refused by everyone)."""
        self.inherited = set(good)
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

    def _log_refusal(self, sender: str, verdict: Verdict, strikes: int, now: float) -> None:
        """One line per LOG_INTERVAL_S at most (a crowd refused by the thousand must not flood the log)."""
        self._suppressed += 1
        if now - self._logged_at < LOG_INTERVAL_S:
            return
        logger.warning("update refused by vetting sender=%s reason=%s agreement=%.3f norm_ratio=%.2f strikes=%d "
                       "(refusals since the last such line: %d)", sender, verdict.reason, verdict.agreement,
                       verdict.norm_ratio, strikes, self._suppressed)
        self._logged_at, self._suppressed = now, 0

    def _sample(self, delta: Tensor) -> Tensor | None:
        """The payload at the fixed COPY_SAMPLE coordinates, unit length (None if it is zero)."""
        if self._sample_at is None or int(self._sample_at.max()) >= delta.numel():
            g = torch.Generator().manual_seed(COPY_SEED)
            self._sample_at = torch.randint(0, delta.numel(), (min(COPY_SAMPLE, delta.numel()),), generator=g)
        sample = delta.reshape(-1)[self._sample_at].float()
        norm = float(sample.norm())
        return sample / norm if norm > 0 and math.isfinite(norm) else None

    def _fold(self, delta: Tensor) -> None:
        norm = float(delta.norm())
        if not (norm > 0 and math.isfinite(norm)):
            return
        if self.reference is None:
            self.reference, self.reference_norm = delta.detach().clone(), norm
            return
        self.reference.mul_(REFERENCE_DECAY).add_(delta, alpha=1.0 - REFERENCE_DECAY)
        self.reference_norm = max(norm, NORM_DECAY * self.reference_norm)
