"""The replica: a peer's copy of the global parameters `theta` and the merge rule (ARCHITECTURE.md,
"The merge rule" and "Invariants").

Protocol rules (identical on every peer; changing one changes the protocol):

1. Merge is `theta -= outer_lr * clamp(weight, 0, max_weight) * m * shape(decode(update))`: a weighted sum. The
   outer Nesterov momentum lives at the sender, so a sum is all a receiver does, and **a sum commutes**:
   replicas that merged the same set of updates are equal (to fp tolerance) whatever the arrival order.
   `shape` is the RunSpec's aggregation (sync/robust.py): the identity for `sum`, a per-update clip for
   `coord_clip` (both keep the rule exact), CenteredClip for `centered_clip` (receiver-dependent, documented
   there). `m` is the weight the sender earned here (sync/standing.py): probation by seq (exact), 0 for an
   update that vetting refused (receiver-dependent, documented there); such a slot still counts as merged.
2. Each update merges once: `(sender, seq)` merges when `seq == V[sender] + 1` or when `seq` is a hole of
   `V` (a seq this replica skipped, rule 6). Later seqs wait in a buffer bounded by count (`max_buffered`) and
   bytes (`max_buffered_bytes`), and per sender by `max_sender_share` of each, so one sender cannot fill it;
   beyond that REJECTED_BUFFER_FULL (not a ban: the update comes back through anti-entropy). When a seq merges,
   its buffered successors merge too, in order.
3. A merged `(sender, seq)` offered again is a DUPLICATE if its `update_id` equals the one recorded, and
   EQUIVOCATION otherwise; so is a different `update_id` for a `(sender, seq)` already buffered. Ids of merged
   updates are kept for the last `max_ids_per_sender` seqs of each sender; older seqs (and seqs merged before a
   `load`) have no record and count as DUPLICATE. Equivocation records the two ids (`evidence`) and the
   updates it still holds (`conflicts`, from which `Intake` builds the raw, re-verifiable evidence of
   sync/evidence.py) and bans the sender.
4. Checks in this order, each rejection counted by reason: banned sender; (sender, seq) against V (duplicate,
   equivocation, gap); the caller's layout `check` (Intake: codec and tensor layout against the RunSpec);
   decode (bounded output: the size is the RunSpec's); all values finite; the norm bound (robust.py); the
   merge, whose result must be finite too. A rejected update leaves a gap its sender can never fill (another
   message for that seq would be equivocation, and the same message is rejected again, identically on every
   peer), so every rejection from rule 4 bans the sender at once, which also frees the buffer it would fill.
   An update that must wait for a gap is screened (decode, finiteness, norm bound) before it is buffered, so
   nothing this replica keeps, and its peer serves, has failed a check of the update alone.
   An honest learner clips its own payload to the same bound before signing (`MergePolicy.sender_limit`).
   An update whose header is malformed (the wire layer should have caught it) is REJECTED_INVALID without a
   ban: its sender field cannot be trusted.
5. `ban(sender, reason)` is public: the network side bans a sender on verified evidence from another peer
   (`Intake.accept_evidence`). Ban listeners (`UpdateStore.ban`, wired by `Intake.attach_store`) purge its
   updates so they are never re-served. A ban is queued under the lock and its listeners run right after the
   call that banned releases the lock, so a listener may call back (the take-back of rule 7 does).
6. The lost-update trap (ARCHITECTURE.md "The network" (repair)): if seq k of a sender is lost with every peer that
   held it, its seqs k+1.. would wait forever. `expire_gaps(now_s)` skips a gap that has waited
   `gap_timeout_s` and spans at most `max_hole_span` seqs: the missing seqs become holes of `V`
   (`VersionVector.with_merged`) and the lowest buffered seq merges. If a hole's update turns up later it
   merges late, exactly once; anti-entropy serves holes like any missing seq (`UpdateStore.missing_for`).
   A replica that merged an update others skipped and can no longer serve adopts their state (`adopt`, on
   `UpdateStore.unservable_for`). When to skip is each replica's (timing) decision; V names what it changes.
7. Equivocation repair: replicas that merged different versions of one equivocated slot hold equal vectors
   and different `theta`s, which no vector comparison would ever notice. So when a sender is banned for
   equivocation, each replica takes back (`unmerge`) whichever of the two proven versions it merged: the
   slot becomes a hole (or the entry drops below it) everywhere, and what was merged there is the same
   set again. Every later seq of that sender merged here is taken back too (those held: `Intake`).

Threading: `offer` admits under the lock (`Slots.admit`), screens outside it (sync/screening.py), then buffers or
merges under it, admitted again first (two threads decoding one update merge it once). Group sums merge all
their slots or none, and skip a gap at once: sync/sum_merge.py. Bookkeeping: sync/slots.py; `from_spec`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from p2p_diloco.sync.bans import Bans, delivers_bans
from p2p_diloco.sync.chain import MergeChain
from p2p_diloco.sync.merge_rule import MergeRule
from p2p_diloco.sync.pending import Waiting
from p2p_diloco.sync.relayed import NOTHING, Relayed
from p2p_diloco.sync.robust import MergePolicy
from p2p_diloco.sync.screening import Prepared, check_theta, header_ok
from p2p_diloco.sync.slots import LayoutCheck, Slots
from p2p_diloco.sync.standing import Standing
from p2p_diloco.sync.sum_merge import Held, SumOutcome, SumPart, exact_step, merge_sum
from p2p_diloco.sync.types import Fit, MergeOutcome, UpdateLike
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.codecs import Codec, get_codec

if TYPE_CHECKING:
    from p2p_diloco.config import RunSpec

logger = logging.getLogger(__name__)


class Replica:
    """theta plus its version vector; `offer` merges updates under the rules above."""

    def __init__(self, theta: Tensor, *, outer_lr: float, max_weight: float, codec: Codec, max_buffered: int = 1024,
                 max_buffered_bytes: int = 512 << 20, max_sender_share: float = 0.25,
                 max_ids_per_sender: int = 4096, version_vector: VersionVector | None = None,
                 standing: Standing | None = None) -> None:
        """Takes ownership of `theta` (merges write into it in place; clone it first to keep a copy). `codec`
        decodes every payload (the run's: `from_spec` builds it from the spec). `standing`: the merge weight
        earned by contribution (sync/standing.py); None merges every update at its signed weight."""
        self._rule = MergeRule(theta, outer_lr=outer_lr, max_weight=max_weight, codec=codec, standing=standing)
        self.max_ids_per_sender, self.gap_timeout_s, self.max_hole_span = max_ids_per_sender, math.inf, 16
        self._clock: Callable[[], float] = time.monotonic  # dates gaps and merges (`set_clock`)
        self.lock = threading.RLock()
        self.stats: dict[str, int] = {**{o.value: 0 for o in MergeOutcome}, "holes_skipped": 0, "late_merged": 0}
        self.bans = Bans(self.lock)
        self._slots = Slots(self.bans, max_buffered=max_buffered, max_buffered_bytes=max_buffered_bytes,
                            max_sender_share=max_sender_share, max_ids_per_sender=max_ids_per_sender,
                            version_vector=version_vector)
        self._chain = MergeChain(self.lock, self._slots, self._rule, self.stats)  # the merge stage of `offer`

    @classmethod
    def from_spec(cls, spec: RunSpec, theta: Tensor, *, codec: Codec | None = None, self_id: str = "",
                  judge_seed: int | None = None) -> Replica:
        """The replica of `spec`'s run: constants, codec (the peer's, shared), rules, a sponsor's secret seed."""
        codec = codec or get_codec(spec.outer.codec, spec.outer.codec_block)
        replica = cls(theta, outer_lr=spec.outer.outer_lr, max_weight=spec.outer.max_weight, codec=codec,
                      standing=Standing.from_spec(spec, self_id=self_id, judge_seed=judge_seed))
        replica.bind_rules(MergePolicy.from_spec(spec), gap_timeout_s=spec.defence.gap_timeout_s,
                           max_hole_span=spec.defence.max_hole_span)
        return replica

    def bind_rules(self, policy: MergePolicy, *, gap_timeout_s: float, max_hole_span: int) -> None:
        """Apply the RunSpec's rules (`from_spec` does): screening and shaping, and when gaps are skipped."""
        with self.lock:
            self._rule.policy = policy
            self.gap_timeout_s, self.max_hole_span = float(gap_timeout_s), int(max_hole_span)

    def set_clock(self, clock: Callable[[], float]) -> None:
        """The clock (seconds) that dates gaps and merges: `time.monotonic` unless the simulator sets its own."""
        self._clock = clock

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    def add_ban_listener(self, listener: Callable[[str], None]) -> None:
        """Call `listener(sender)` once for every ban, right after the call that banned releases the lock (or,
        when that call ran under a caller's hold of the lock, after the next call that does): it may call back."""
        self.bans.add_listener(listener)

    @property
    def codec(self) -> Codec:
        return self._rule.codec

    @property
    def policy(self) -> MergePolicy:
        return self._rule.policy

    @property
    def standing(self) -> Standing | None:  # the weight earned by contribution (sync/standing.py); None: signed
        return self._rule.standing

    @property
    def banned(self) -> set[str]:
        return self.bans.banned

    @property
    def version_vector(self) -> VersionVector:
        return self._slots.vv

    @property
    def theta(self) -> Tensor:
        """The live tensor; hold `lock` while reading it if merges may run concurrently."""
        return self._rule.sum.theta

    @property
    def n_buffered(self) -> int:
        return self._slots.buffer.count

    @property
    def buffered_bytes(self) -> int:  # the buffer's bytes, as `max_buffered_bytes` bounds them
        return self._slots.buffer.nbytes

    def snapshot(self) -> tuple[Tensor, VersionVector]:
        """A consistent copy of (theta, V): the vector names exactly the updates summed into the copy."""
        with self.lock:
            return self.theta.clone(), self._slots.vv

    def merged_weight(self, sender: str, seq: int) -> float:
        """The fraction of its signed weight the merged update `(sender, seq)` holds here (its `Standing`
        multiplier; 0 once taken back as a copy); 1.0 where none is kept (the full weight, or no id kept)."""
        with self.lock:
            return self._slots.merged.multiplier(sender, seq)

    def reduced_weights(self) -> dict[str, dict[int, float]]:
        """The kept merged updates that hold less than their full weight here (probation, copies, ties): two
        replicas with one version vector and different theta differ here."""
        with self.lock:
            return self._slots.merged.reduced()

    @delivers_bans
    def offer(self, update: UpdateLike, *, check: LayoutCheck | None = None, now_s: float | None = None,
              decoded: Tensor | None = None) -> tuple[MergeOutcome, list[UpdateLike]]:
        """Offer one update: its outcome and every update merged (it, then buffered successors it released).
        `check`: the layout check, after the (sender, seq) checks (a reason: REJECTED_LAYOUT, a ban). `now_s`
        (default `clock()`) dates a new gap. `decoded`: the codec's output for this payload, if the caller has it."""
        if not header_ok(update):
            return self._reject_malformed(update), []
        now_s = self.clock() if now_s is None else now_s
        admitted = self._admit(update, check)
        if admitted is not None and admitted is not MergeOutcome.BUFFERED:
            return admitted, []
        # Screened before it is buffered too: whatever we keep (and serve to others) passed every check that
        # depends on the update alone, so an honest relay never hands on a poisoned update.
        prepared = self._rule.screen(update, decoded, screen_only=admitted is MergeOutcome.BUFFERED)
        if admitted is MergeOutcome.BUFFERED:
            waited = self._wait(update, prepared, now_s)
            if waited is not None:
                return waited, []
            prepared = self._rule.screen(update, prepared.delta)  # it became ready while we screened it (rare)
        return self._chain.run(Waiting(update, None), now_s=now_s, clock=self.clock, prepared=prepared)

    def offer_sum(self, parts: Sequence[SumPart], total: Tensor, held: Held | None = None) -> SumOutcome:
        """Merge a group sum (exact grid `total` over `parts`) at once, or not at all: sync/sum_merge.py."""
        slots, rule, skip = self._slots, self._rule, self.max_hole_span  # a part this far ahead leaves holes
        return merge_sum(self.lock, slots, rule, self.stats, parts, total, self.clock, held, max_skip=skip)

    def exact_step(self, update: UpdateLike) -> Tensor | None:
        """`update`'s step on the exact grid (an aggregator's part); None: refused, banned or its weight not exact."""
        s, sender = self.standing, update.sender
        multiplier = None if sender in self.banned else s.exact_multiplier(sender, update.seq) if s else 1.0
        return None if multiplier is None else exact_step(self._rule, update, multiplier)

    @delivers_bans
    def expire_gaps(self, now_s: float | None = None) -> tuple[list[UpdateLike], int]:
        """Skip every gap older than `gap_timeout_s` (rule 6). Returns (updates merged, seqs skipped)."""
        now_s = self.clock() if now_s is None else now_s
        if not math.isfinite(self.gap_timeout_s):
            return [], 0
        with self.lock:
            ready = self._slots.buffer.expired(now_s, self.gap_timeout_s, self._slots.vv, self.max_hole_span)
        merged: list[UpdateLike] = []
        for waiting, span, waited_s in ready:
            logger.warning("gap skipped sender=%s holes=%d..%d waited_s=%.0f", waiting.update.sender,
                           waiting.update.seq - span, waiting.update.seq - 1, waited_s)
            merged.extend(self._chain.run(waiting, now_s=now_s, clock=self.clock, skip=True)[1])
        with self.lock:
            self.stats["holes_skipped"] += (skipped := sum(span for _, span, _ in ready))
        return merged, skipped

    @delivers_bans
    def ban(self, sender: str, reason: str) -> bool:
        """Ban `sender` for the run (e.g. on verified evidence from another peer): its buffered updates are
        dropped, its later offers REJECTED_BANNED, ban listeners called. False if it was banned already."""
        with self.lock:
            if sender in self.banned:
                return False
            self._slots.ban(sender, reason)
            return True

    def recent_ids(self, sender: str, seqs: Iterable[int]) -> list[bytes] | None:
        """The update_ids merged here for `sender`'s `seqs`; None if one is not merged or its id is no longer kept
        (gossip compares them with a peer's, to find slots merged in different versions: no vector shows that)."""
        with self.lock:
            return self._slots.merged.recent(sender, seqs, self._slots.vv)

    def unmerge(self, update: UpdateLike, *, keep_slot: bool = False) -> bool:
        """Take back a merged update (rule 7): `theta += outer_lr * w * m * shape(decode(update))` and V loses
        `(sender, seq)`. For the equivocation repair: of two signed versions of one slot, each replica takes back
        the one it merged, so the slot is merged nowhere and the replicas meet again. `keep_slot`: only its weight
        goes (m becomes 0), the slot stays merged: for a copy found after it merged (`Standing.copies_found`). Only
        this exact update (by update_id) is taken back; False if it is not the one merged here, or if the
        aggregation is receiver-dependent (centered_clip: its shaping cannot be redone exactly; left to repair)."""
        with self.lock:
            if not self._rule.take_back(update, self._slots, keep_slot=keep_slot):
                return False
            self.stats["unmerged"] = self.stats.get("unmerged", 0) + 1
        logger.log(logging.INFO if keep_slot else logging.WARNING, "merged update taken back sender=%s seq=%d%s",
                   update.sender, update.seq, " (weight only: a copy)" if keep_slot else "")
        return True

    def staleness(self, base: VersionVector) -> int:
        """tau since `base`; in a run with sponsors only theirs count: a proposal moves theta not at all."""
        s = self.standing
        return self.version_vector.staleness(base, s.sponsorship.sponsors if s and s.sponsorship.active else None)

    def theta_without(self, updates: list[tuple[UpdateLike, float]]) -> Tensor | None:
        """theta with (update, share) less of these merged steps, a new tensor (`MergeRule.without`: round view)."""
        with self.lock:
            return self._rule.without(updates, self._slots)

    def relay(self, current: Tensor | None = None, fit: Fit | None = None) -> Relayed:
        """A sponsor's relayed work for its next update, judged by `current` (its pseudo-gradient) and `fit`."""
        with self.lock:
            return self.standing.sponsorship.relay(self.theta, current, fit) if self.standing is not None else NOTHING

    @delivers_bans
    def load(self, theta: Tensor, version_vector: VersionVector) -> list[UpdateLike]:
        """Replace the state (state sync, restart). Buffered updates the new state already includes are
        dropped; those it makes ready are merged and returned. Bans and evidence persist."""
        check_theta(theta)
        if theta.shape != self.theta.shape:
            raise ValueError(f"theta shape {tuple(theta.shape)} does not match replica {tuple(self.theta.shape)}")
        with self.lock:
            self._rule.sum.load(theta)
            ready = self._slots.load(version_vector)
        merged: list[UpdateLike] = []
        for waiting in ready:
            merged.extend(self._chain.run(waiting, now_s=self.clock(), clock=self.clock)[1])
        return merged

    def max_step(self) -> float:
        """Bound on how far one merge moves a coordinate of theta (inf: unbounded); the repair's unit of distance."""
        return self._rule.max_step()

    @delivers_bans
    def adopt(self, theta: Tensor, version_vector: VersionVector, held: Iterable[UpdateLike]) -> list[UpdateLike]:
        """The repair of rule 6: take a peer's state, then re-merge the updates we hold that it lacks
        (`held`, e.g. `store.missing_for(version_vector, ...)`). Returns every update merged."""
        merged = self.load(theta, version_vector)
        for update in held:
            merged.extend(self.offer(update)[1])
        return merged

    # --- the stages of `offer` ------------------------------------------------------------------------------

    def _admit(self, update: UpdateLike, check: LayoutCheck | None) -> MergeOutcome | None:
        """Admit, under the lock (rules 2-4 before decoding): None (ready to merge), BUFFERED (it must wait for
        a gap: screened first) or a final outcome, counted here."""
        with self.lock:
            outcome = self._slots.admit(update, check=check)
            if outcome is not None and outcome is not MergeOutcome.BUFFERED:
                self._count(outcome)
            return outcome

    def _wait(self, update: UpdateLike, prepared: Prepared, now_s: float) -> MergeOutcome | None:
        """Wait, under the lock: buffer a screened update that must wait for a gap, or ban its sender for the
        rejection screening found. Admitted again first (others ran while we screened): None if it is ready
        now (the caller merges it); else its outcome, counted here."""
        with self.lock:
            outcome: MergeOutcome | None
            if prepared.rejection is not None:
                outcome = prepared.rejection
                if update.sender not in self.banned:
                    self._slots.ban(update.sender, f"{outcome.value} seq={update.seq}")
            else:
                outcome = self._slots.admit(update)
                if outcome is MergeOutcome.BUFFERED:
                    outcome = self._slots.wait(update, now_s, prepared.delta)
            if outcome is not None:
                self._count(outcome)
            return outcome

    def _reject_malformed(self, update: UpdateLike) -> MergeOutcome:
        """A header the wire layer should have caught: REJECTED_INVALID, no ban (its sender cannot be trusted)."""
        logger.warning("update rejected reason=malformed_header update=%r", update)
        with self.lock:
            self._count(MergeOutcome.REJECTED_INVALID)
        return MergeOutcome.REJECTED_INVALID

    def _count(self, outcome: MergeOutcome) -> None:
        self.stats[outcome.value] += 1
