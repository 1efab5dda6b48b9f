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
   An honest learner checks its own payload against the same bound before signing (`MergePolicy.sender_clip`).
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
   A replica that merged an update others skipped and that it can no longer serve adopts their state
   (`adopt`, triggered on `UpdateStore.unservable_for`), so all replicas meet again. When to skip is each
   replica's own (timing) decision; what it changes is named exactly by V, so the replicas differ only while
   the vectors differ, and pulls or the repair make the vectors equal.
7. Equivocation repair: replicas that merged different versions of one equivocated slot hold equal vectors
   and different `theta`s, which no vector comparison would ever notice. So when a sender is banned for
   equivocation, each replica takes back (`unmerge`) whichever of the two proven versions it merged: the
   slot becomes a hole (or the entry drops below it) everywhere, and what was merged there is the same
   set again. Every later seq of that sender merged here is taken back too (those held: `Intake`), so a
   sender that split several slots leaves the same set everywhere: its seqs below the proven one.

Threading: the network thread offers while the compute thread takes snapshots. Decoding and screening run
outside the lock (sync/screening.py); the state is re-checked under the lock before the axpy, so two threads
decoding the same update merge it once. Each update is decoded once (`offer(decoded=...)`, sync/pending.py).
The replica knows nothing of training: it is built from the run's spec (`Replica.from_spec`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from torch import Tensor

from p2p_diloco.sync.accumulator import Accumulator
from p2p_diloco.sync.bans import MAX_CONFLICTS, Bans, delivers_bans  # noqa: F401 (MAX_CONFLICTS: re-exported)
from p2p_diloco.sync.merged import MergedIds
from p2p_diloco.sync.pending import PendingBuffer, Waiting
from p2p_diloco.sync.robust import MergePolicy
from p2p_diloco.sync.screening import Prepared, check_theta, header_ok, prepare, shaped_step
from p2p_diloco.sync.standing import Standing, weighted
from p2p_diloco.sync.types import Conflict, MergeOutcome, UpdateLike  # noqa: F401 (re-exported)
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.codecs import Codec, get_codec

if TYPE_CHECKING:
    from p2p_diloco.config import RunSpec

logger = logging.getLogger(__name__)


class Replica:
    """theta plus its version vector; `offer` merges updates under the rules above."""

    def __init__(self, theta: Tensor, *, outer_lr: float, max_weight: float, codec: Codec, max_buffered: int = 1024,
                 max_buffered_bytes: int = 512 << 20, max_sender_share: float = 0.25,
                 max_ids_per_sender: int = 4096, version_vector: VersionVector | None = None) -> None:
        """Takes ownership of `theta` (merges write into it in place; clone it first to keep a copy). `codec`
        decodes every payload (the run's: `from_spec` builds it from the spec)."""
        if not (math.isfinite(outer_lr) and outer_lr >= 0 and math.isfinite(max_weight) and max_weight >= 0):
            raise ValueError(f"outer_lr and max_weight must be finite and >= 0, got {outer_lr}, {max_weight}")
        self.outer_lr, self.max_weight, self.max_ids_per_sender = float(outer_lr), float(max_weight), max_ids_per_sender
        self.policy = MergePolicy.passthrough()
        self.gap_timeout_s, self.max_hole_span = math.inf, 16
        self.clock: Callable[[], float] = time.monotonic  # dates gaps; Intake binds its own (the simulator's)
        self.lock = threading.RLock()
        self.stats: dict[str, int] = {outcome.value: 0 for outcome in MergeOutcome}
        self.stats.update(holes_skipped=0, late_merged=0)
        self.bans = Bans(self.lock)
        self.banned, self.evidence, self.conflicts = self.bans.banned, self.bans.evidence, self.bans.conflicts
        self.codec = codec
        self._sum = Accumulator(theta)  # theta, summed into in place
        self._vv = version_vector if version_vector is not None else VersionVector()
        self._buffer = PendingBuffer(max_buffered, max_buffered_bytes, max_sender_share)  # waiting for a gap
        self._merged = MergedIds(max_ids_per_sender)  # ids (and weight multipliers) of the last merged seqs
        self.standing: Standing | None = None  # merge weight earned by contribution (sync/standing.py)

    @classmethod
    def from_spec(cls, spec: RunSpec, theta: Tensor, *, codec: Codec | None = None, self_id: str = "") -> Replica:
        """The replica of `spec`'s run: merge constants, codec (pass the peer's to share it) and every rule."""
        codec = codec or get_codec(spec.outer.codec, spec.outer.codec_block)
        replica = cls(theta, outer_lr=spec.outer.outer_lr, max_weight=spec.outer.max_weight, codec=codec)
        replica.bind_rules(MergePolicy.from_spec(spec), gap_timeout_s=spec.defence.gap_timeout_s,
                           max_hole_span=spec.defence.max_hole_span)
        d = spec.defence
        replica.standing = Standing(probation=d.probation, min_agreement=d.min_agreement, copy_cosine=d.copy_cosine,
                                    max_norm_ratio=d.max_norm_ratio, full_agreement=d.full_agreement, self_id=self_id)
        return replica

    def bind_rules(self, policy: MergePolicy, *, gap_timeout_s: float, max_hole_span: int,
                   clock: Callable[[], float] | None = None) -> None:
        """Apply the RunSpec's rules (`from_spec` and `Intake` do): screening and shaping, when gaps are skipped,
        and the clock (seconds) that dates them."""
        with self.lock:
            self.policy, self.gap_timeout_s, self.max_hole_span = policy, float(gap_timeout_s), int(max_hole_span)
            if clock is not None:
                self.clock = clock

    def add_ban_listener(self, listener: Callable[[str], None]) -> None:
        """Call `listener(sender)` once for every ban, right after the call that banned releases the lock (or,
        when that call ran under a caller's hold of the lock, after the next call that does): it may call back."""
        self.bans.add_listener(listener)

    @property
    def version_vector(self) -> VersionVector:
        return self._vv

    @property
    def theta(self) -> Tensor:
        """The live tensor; hold `lock` while reading it if merges may run concurrently."""
        return self._sum.theta

    n_buffered = property(lambda self: self._buffer.count)
    buffered_bytes = property(lambda self: self._buffer.nbytes)

    def snapshot(self) -> tuple[Tensor, VersionVector]:
        """A consistent copy of (theta, V): the vector names exactly the updates summed into the copy."""
        with self.lock:
            return self._sum.theta.clone(), self._vv

    @delivers_bans
    def offer(self, update: UpdateLike, *, check: Callable[[UpdateLike], str | None] | None = None,
              now_s: float | None = None, decoded: Tensor | None = None) -> tuple[MergeOutcome, list[UpdateLike]]:
        """Offer one update. Returns its outcome and every update this call merged (it first, then any
        buffered successors it released), e.g. for re-announcing them. `check` runs after the (sender, seq)
        checks and before buffering or decoding; a reason from it is REJECTED_LAYOUT and bans the sender.
        `now_s` (default: `clock()`) dates a new gap for `expire_gaps`. `decoded`: the codec's output for this
        payload, when the caller has it (the sender: the tensor it encoded), so it is not decoded again."""
        if not header_ok(update):
            logger.warning("update rejected reason=malformed_header update=%r", update)
            with self.lock:
                self._count(MergeOutcome.REJECTED_INVALID)
            return MergeOutcome.REJECTED_INVALID, []
        now_s = self.clock() if now_s is None else now_s
        with self.lock:
            outcome = self._admit(update, check=check)
            if outcome not in (None, MergeOutcome.BUFFERED):
                self._count(outcome)  # type: ignore[arg-type]
                return outcome, []  # type: ignore[return-value]
        # Screened before it is buffered too: whatever we keep (and serve to others) passed every check that
        # depends on the update alone, so an honest relay never hands on a poisoned update.
        prepared = self._prepare(update, decoded, screen_only=outcome is MergeOutcome.BUFFERED)
        if outcome is MergeOutcome.BUFFERED:
            with self.lock:
                if prepared.rejection is not None:
                    outcome = prepared.rejection
                    if update.sender not in self.banned:
                        self._ban(update.sender, f"{outcome.value} seq={update.seq}")
                else:
                    outcome = self._admit(update)  # re-check: others ran meanwhile
                    if outcome is MergeOutcome.BUFFERED and not self._buffer.add(update, now_s, prepared.delta):
                        outcome = MergeOutcome.REJECTED_BUFFER_FULL
                if outcome is not None:
                    self._count(outcome)
                    return outcome, []
            prepared = self._prepare(update, prepared.delta)  # it became ready while we screened it (rare)
        return self._merge_chain(Waiting(update, None), now_s=now_s, prepared=prepared)

    @delivers_bans
    def expire_gaps(self, now_s: float | None = None) -> tuple[list[UpdateLike], int]:
        """Skip every gap older than `gap_timeout_s` (rule 6). Returns (updates merged, seqs skipped)."""
        now_s = self.clock() if now_s is None else now_s
        if not math.isfinite(self.gap_timeout_s):
            return [], 0
        with self.lock:
            ready = self._buffer.expired(now_s, self.gap_timeout_s, self._vv, self.max_hole_span)
        merged: list[UpdateLike] = []
        for waiting, span, waited_s in ready:
            logger.warning("gap skipped sender=%s holes=%d..%d waited_s=%.0f", waiting.update.sender,
                           waiting.update.seq - span, waiting.update.seq - 1, waited_s)
            merged.extend(self._merge_chain(waiting, now_s=now_s, skip=True)[1])
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
            self._ban(sender, reason)
            return True

    def recent_ids(self, sender: str, seqs: Iterable[int]) -> list[bytes] | None:
        """The update_ids merged here for `sender`'s `seqs`; None if one of them is not merged or its id is no
        longer kept (gossip compares these with a peer's, to find slots where the two merged different
        versions: an equivocation no version vector shows)."""
        with self.lock:
            return self._merged.recent(sender, seqs, self._vv)

    def unmerge(self, update: UpdateLike, *, keep_slot: bool = False) -> bool:
        """Take back a merged update (rule 7): `theta += outer_lr * w * m * shape(decode(update))` and V loses
        `(sender, seq)`. For the equivocation repair: of two signed versions of one slot, some replicas merged
        one and some the other; each takes back the one it merged, so the slot is merged nowhere and the
        replicas meet again. `keep_slot`: only its weight goes (m becomes 0), the slot stays merged: for a copy
        found after it merged (`Standing.copies_found`). Only this exact update (by update_id) is taken back;
        False if it is not the one merged here, or if the aggregation is receiver-dependent (centered_clip:
        its shaping cannot be redone exactly, so that divergence is left to the repair)."""
        with self.lock:
            merged = self._merged.get(update.sender, update.seq)
            if merged is None or merged != update.update_id or not self._vv.has(update.sender, update.seq):
                return False
            if not self.policy.deterministic:
                logger.warning("cannot take back an update under a receiver-dependent aggregation sender=%s "
                               "seq=%d", update.sender, update.seq)
                return False
            prepared = self._prepare(update, None)  # it passed every check when it merged, identically now
            if prepared.scaled is None:
                return False
            vv = self._vv if keep_slot else self._vv.without(update.sender, update.seq)  # may raise: before theta
            multiplier = self._merged.multiplier(update.sender, update.seq)  # the weight it earned when merged
            if multiplier > 0:
                self._sum.add(weighted(prepared.scaled, multiplier))
            self._vv = vv
            if keep_slot:
                self._merged.record(update.sender, update.seq, update.update_id, 0.0)
            else:
                self._merged.forget(update.sender, update.seq)
            self.stats["unmerged"] = self.stats.get("unmerged", 0) + 1
        logger.log(logging.INFO if keep_slot else logging.WARNING, "merged update taken back sender=%s seq=%d%s",
                   update.sender, update.seq, " (weight only: a copy)" if keep_slot else "")
        return True

    @delivers_bans
    def load(self, theta: Tensor, version_vector: VersionVector) -> list[UpdateLike]:
        """Replace the state (state sync, restart). Buffered updates the new state already includes are
        dropped; those it makes ready are merged and returned. Bans and evidence persist."""
        check_theta(theta)
        if theta.shape != self._sum.theta.shape:
            raise ValueError(f"theta shape {tuple(theta.shape)} does not match replica {tuple(self._sum.theta.shape)}")
        with self.lock:
            self._sum.load(theta)
            self._vv = version_vector
            ready = self._buffer.drop_merged(version_vector)
            # The new theta was summed elsewhere (a donor, a peer we adopt, a checkpoint): which version of a
            # slot it holds is not ours to know, so no id is kept (rule 3: such seqs read as DUPLICATE, and
            # neither gossip's id digests nor `unmerge` may trust an id we merged before).
            self._merged.clear()
        merged: list[UpdateLike] = []
        for waiting in ready:
            merged.extend(self._merge_chain(waiting, now_s=self.clock())[1])
        return merged

    def max_step(self) -> float:
        """Bound on how far one merge moves any coordinate of theta (outer_lr * max_weight * the policy's
        ceiling); inf when the RunSpec sets no bound. Two replicas whose merged sets differ by d updates
        differ by at most d times this in every coordinate (the repair checks a peer's state against it)."""
        return self.outer_lr * self.max_weight * self.policy.step_ceiling

    @delivers_bans
    def adopt(self, theta: Tensor, version_vector: VersionVector, held: Iterable[UpdateLike]) -> list[UpdateLike]:
        """The repair of rule 6: take a peer's state, then re-merge the updates we hold that it lacks
        (`held`, e.g. `store.missing_for(version_vector, ...)`). Returns every update merged."""
        merged = self.load(theta, version_vector)
        for update in held:
            merged.extend(self.offer(update)[1])
        return merged

    # --- internals --------------------------------------------------------------------------------------

    def _merge_chain(self, first: Waiting, *, now_s: float, skip: bool = False,
                     prepared: Prepared | None = None) -> tuple[MergeOutcome, list[UpdateLike]]:
        """Merge `first` (found ready under the lock) and then its buffered successors, in seq order."""
        merged: list[UpdateLike] = []
        outcome = MergeOutcome.MERGED
        current: Waiting | None = first
        while current is not None:
            update = current.update
            if prepared is None:
                prepared = self._prepare(update, current.decoded)  # outside the lock: the expensive part
            with self.lock:
                # Re-check: another thread may have merged this seq (or banned the sender) while we decoded.
                result = self._admit(update, allow_skip=skip and current is first)
                if result is MergeOutcome.BUFFERED:  # not ready after all (a load moved V): wait again
                    result = MergeOutcome.BUFFERED if self._buffer.add(update, now_s, prepared.delta) \
                        else MergeOutcome.REJECTED_BUFFER_FULL
                elif result is None:
                    result = self._apply(update, prepared)
                prepared = None
                self._count(result)
                if current is first:
                    outcome = result
                if result is not MergeOutcome.MERGED:
                    break
                merged.append(update)
                # Popped under the same lock as the merge: a successor offered concurrently is either here
                # already or will find seq == V + 1 and merge itself; none is stranded.
                current = self._buffer.pop(update.sender, self._vv.get(update.sender) + 1)
                if current is None and self._buffer.has_sender(first.update.sender):
                    self._buffer.gap_since[first.update.sender] = now_s  # a new gap starts now
        return outcome, merged

    def _prepare(self, update: UpdateLike, decoded: Tensor | None, *, screen_only: bool = False) -> Prepared:
        """Rule 4 after the layout check (sync/screening.py), with this replica's codec, policy and constants."""
        return prepare(update, self._sum.theta, codec=self.codec, policy=self.policy, outer_lr=self.outer_lr,
                       max_weight=self.max_weight, decoded=decoded, screen_only=screen_only)

    def _admit(self, update: UpdateLike, *, check: Callable[[UpdateLike], str | None] | None = None,
                allow_skip: bool = False) -> MergeOutcome | None:
        """Under the lock: classify by (sender, seq, update_id); None means ready to merge, BUFFERED that it
        must wait for a gap (the caller buffers it). Runs `check` and records equivocation as side effects."""
        sender, seq, update_id = update.sender, update.seq, update.update_id
        if sender in self.banned:
            return MergeOutcome.REJECTED_BANNED
        if self._vv.has(sender, seq):
            known = self._merged.get(sender, seq)
            if known is None or known == update_id:
                return MergeOutcome.DUPLICATE
            return self._equivocation(sender, seq, known, None, update)
        waiting = self._buffer.get(sender, seq)
        if waiting is not None:
            if waiting.update_id == update_id:
                return MergeOutcome.DUPLICATE
            return self._equivocation(sender, seq, waiting.update_id, waiting, update)
        if check is not None and (reason := check(update)):
            self._ban(sender, f"{reason} seq={seq}")
            return MergeOutcome.REJECTED_LAYOUT
        done = self._vv.get(sender)
        if seq == done + 1 or seq in self._vv.holes(sender) or (allow_skip and seq > done):
            return None
        return MergeOutcome.BUFFERED

    def _apply(self, update: UpdateLike, prepared: Prepared) -> MergeOutcome:
        """Under the lock: the axpy, or the rejection found by `_prepare`."""
        if prepared.rejection is None and prepared.scaled is None and prepared.delta is not None:
            prepared = shaped_step(prepared.delta, prepared.scale, self.policy)  # centered_clip: against the window now
        if prepared.rejection is not None or prepared.scaled is None:
            reason = prepared.rejection or MergeOutcome.REJECTED_INVALID
            self._ban(update.sender, f"{reason.value} seq={update.seq}")
            return reason
        standing = self.standing
        verdict = standing.judge(update.sender, update.seq, prepared.delta, self.clock()) if standing else None
        multiplier = verdict.multiplier if verdict is not None else 1.0
        if multiplier > 0 and not self._sum.subtract(weighted(prepared.scaled, multiplier), prepared.bound):
            self._ban(update.sender, f"overflow seq={update.seq}")
            return MergeOutcome.REJECTED_NONFINITE
        if update.seq in self._vv.holes(update.sender):
            self.stats["late_merged"] += 1
            logger.info("late merge of a skipped update sender=%s seq=%d", update.sender, update.seq)
        self._vv = self._vv.with_merged(update.sender, update.seq)
        if verdict is not None:
            standing.observe(update.sender, prepared.delta, verdict, self.clock(), seq=update.seq)  # type: ignore
        if multiplier > 0:
            self.policy.observe(prepared.delta)  # type: ignore[arg-type]
        self._merged.record(update.sender, update.seq, update.update_id, multiplier)
        return MergeOutcome.MERGED

    def _equivocation(self, sender: str, seq: int, known_id: bytes, known: UpdateLike | None,
                      update: UpdateLike) -> MergeOutcome:
        self.bans.equivocation(sender, seq, known_id, known, update)
        self._ban(sender, f"equivocation seq={seq}")
        return MergeOutcome.EQUIVOCATION

    def _ban(self, sender: str, reason: str) -> None:
        """Under the lock: the ban; its listeners run after the lock is released (`delivers_bans`)."""
        self.bans.ban(sender)
        dropped = self._buffer.drop_sender(sender)
        logger.warning("sender banned sender=%s reason=%s dropped_buffered=%d", sender, reason, dropped)

    def _count(self, outcome: MergeOutcome) -> None:
        self.stats[outcome.value] += 1
