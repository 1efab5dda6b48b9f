"""The replica: a peer's copy of the global parameters `theta` and the merge rule (DESIGN.md sections 3, 7).

Protocol rules (identical on every peer; changing one changes the protocol):

1. Merge is `theta -= outer_lr * clamp(weight, 0, max_weight) * shape(decode(update))`: a weighted sum. The
   outer Nesterov momentum lives at the sender, so a sum is all a receiver does, and **a sum commutes**:
   replicas that merged the same set of updates are equal (to fp tolerance) whatever the arrival order.
   `shape` is the RunSpec's aggregation (sync/robust.py): the identity for `sum`, a per-update clip for
   `coord_clip` (both keep the rule exact), CenteredClip for `centered_clip` (receiver-dependent, documented
   there).
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
   updates so they are never re-served.
6. The lost-update trap (DESIGN.md section 4, "Repair"): if seq k of a sender is lost with every peer that
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
outside the lock (the expensive part); the state is re-checked under the lock before the axpy, so two threads
decoding the same update still merge it once.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch
from torch import Tensor

from p2p_diloco.sync.pending import PendingBuffer
from p2p_diloco.sync.robust import MergePolicy
from p2p_diloco.sync.version_vector import VersionVector

logger = logging.getLogger(__name__)

_F32_MAX = float(torch.finfo(torch.float32).max)
MAX_CONFLICTS = 16
"""Equivocations whose updates are kept for `Intake` to turn into evidence (the most recent ones)."""


class UpdateLike(Protocol):
    """What the replica needs from an outer update (the wire envelope satisfies it)."""

    @property
    def sender(self) -> str: ...
    @property
    def seq(self) -> int:
        """>= 1, contiguous per sender, starting at 1."""
    @property
    def update_id(self) -> bytes:
        """Digest of the signed header: two different messages with the same (sender, seq) differ here."""
    @property
    def weight(self) -> float: ...
    @property
    def nbytes(self) -> int:
        """Size on the wire."""


class MergeOutcome(str, Enum):
    MERGED = "merged"
    BUFFERED = "buffered"
    DUPLICATE = "duplicate"
    EQUIVOCATION = "equivocation"
    REJECTED_LAYOUT = "bad_layout"
    REJECTED_NONFINITE = "rejected_nonfinite"
    REJECTED_NORM = "norm_bound"
    REJECTED_INVALID = "rejected_invalid"
    REJECTED_BUFFER_FULL = "rejected_buffer_full"
    REJECTED_BANNED = "rejected_banned"


@dataclass(frozen=True)
class Conflict:
    """An equivocation this replica saw: the earlier message's id (and the message, if it was buffered)."""

    seq: int
    first_id: bytes
    first: UpdateLike | None
    second: UpdateLike


@dataclass
class _Prepared:
    delta: Tensor | None = None
    scaled: Tensor | None = None  # None with no rejection: shaped under the lock (centered_clip)
    scale: float = 0.0
    bound: float = 0.0  # max |scaled_i|
    rejection: MergeOutcome | None = None


def _check_theta(theta: Tensor) -> None:
    if not isinstance(theta, Tensor) or theta.dim() != 1 or theta.dtype != torch.float32:
        raise ValueError("theta must be a 1-D float32 tensor (all parameters flattened)")
    if not bool(torch.isfinite(theta).all()):
        raise ValueError("theta must be all finite")


def _peak(t: Tensor) -> float:
    """max |t_i| without allocating a full-size temporary."""
    return float(torch.linalg.vector_norm(t, ord=math.inf)) if t.numel() else 0.0


def _header_ok(update: UpdateLike) -> bool:
    try:
        sender, seq, update_id, weight = update.sender, update.seq, update.update_id, update.weight
        nbytes = update.nbytes
    except AttributeError:
        return False
    return (isinstance(sender, str) and bool(sender)
            and isinstance(seq, int) and not isinstance(seq, bool) and seq >= 1
            and isinstance(update_id, bytes) and isinstance(nbytes, int) and nbytes >= 0
            and isinstance(weight, (int, float)) and not isinstance(weight, bool))


class Replica:
    """theta plus its version vector; `offer` merges updates under the rules above."""

    def __init__(self, theta: Tensor, *, outer_lr: float, max_weight: float,
                 decode: Callable[[UpdateLike], Tensor], max_buffered: int = 1024,
                 max_buffered_bytes: int = 512 << 20, max_sender_share: float = 0.25,
                 max_ids_per_sender: int = 4096, version_vector: VersionVector | None = None) -> None:
        """Takes ownership of `theta` (merges write into it in place; clone it first to keep a copy)."""
        _check_theta(theta)
        if not (math.isfinite(outer_lr) and outer_lr >= 0 and math.isfinite(max_weight) and max_weight >= 0):
            raise ValueError(f"outer_lr and max_weight must be finite and >= 0, got {outer_lr}, {max_weight}")
        if max_ids_per_sender < 1:
            raise ValueError(f"need max_ids_per_sender >= 1, got {max_ids_per_sender}")
        self.outer_lr = float(outer_lr)
        self.max_weight = float(max_weight)
        self.max_ids_per_sender = max_ids_per_sender
        self.policy = MergePolicy.passthrough()
        self.gap_timeout_s, self.max_hole_span = math.inf, 16
        self.clock: Callable[[], float] = time.monotonic  # dates gaps; Intake binds its own (the simulator's)
        self.lock = threading.RLock()
        self.stats: dict[str, int] = {outcome.value: 0 for outcome in MergeOutcome}
        self.stats.update(holes_skipped=0, late_merged=0)
        self.banned: set[str] = set()
        self.evidence: dict[str, tuple[bytes, bytes]] = {}  # sender -> (earlier id, later id)
        self.conflicts: OrderedDict[str, Conflict] = OrderedDict()
        self._ban_listeners: list[Callable[[str], None]] = []
        self._decode = decode
        self._theta = theta.detach()
        self._vv = version_vector if version_vector is not None else VersionVector()
        self._buffer = PendingBuffer(max_buffered, max_buffered_bytes, max_sender_share)  # waiting for a gap
        self._merged_ids: dict[str, dict[int, bytes]] = {}  # sender -> seq -> update_id, last max_ids seqs
        # Upper bound on max|theta_i|, grown by max|delta_i| per merge (triangle inequality): lets the overflow
        # guard of rule 4 skip a full pass over theta until the bound gets near the float32 range.
        self._peak_bound = _peak(self._theta)

    def bind_rules(self, policy: MergePolicy, *, gap_timeout_s: float, max_hole_span: int,
                   clock: Callable[[], float] | None = None) -> None:
        """Apply the RunSpec's rules (Intake does this): screening and shaping, when gaps are skipped, and the
        clock (seconds) that dates them."""
        with self.lock:
            self.policy, self.gap_timeout_s, self.max_hole_span = policy, float(gap_timeout_s), int(max_hole_span)
            if clock is not None:
                self.clock = clock

    def add_ban_listener(self, listener: Callable[[str], None]) -> None:
        """Call `listener(sender)` on every ban (under the replica's lock: keep it short, never call back)."""
        self._ban_listeners.append(listener)

    @property
    def version_vector(self) -> VersionVector:
        return self._vv

    @property
    def theta(self) -> Tensor:
        """The live tensor; hold `lock` while reading it if merges may run concurrently."""
        return self._theta

    @property
    def n_buffered(self) -> int:
        return self._buffer.count

    @property
    def buffered_bytes(self) -> int:
        return self._buffer.nbytes

    def snapshot(self) -> tuple[Tensor, VersionVector]:
        """A consistent copy of (theta, V): the vector names exactly the updates summed into the copy."""
        with self.lock:
            return self._theta.clone(), self._vv

    def offer(self, update: UpdateLike, *, check: Callable[[UpdateLike], str | None] | None = None,
              now_s: float | None = None) -> tuple[MergeOutcome, list[UpdateLike]]:
        """Offer one update. Returns its outcome and every update this call merged (it first, then any
        buffered successors it released), e.g. for re-announcing them. `check` runs after the (sender, seq)
        checks and before buffering or decoding; a reason from it is REJECTED_LAYOUT and bans the sender.
        `now_s` (default: `clock()`) dates a new gap for `expire_gaps`."""
        if not _header_ok(update):
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
        prepared = self._prepare(update, screen_only=outcome is MergeOutcome.BUFFERED)
        if outcome is MergeOutcome.BUFFERED:
            with self.lock:
                if prepared.rejection is not None:
                    outcome = prepared.rejection
                    if update.sender not in self.banned:
                        self._ban(update.sender, f"{outcome.value} seq={update.seq}")
                else:
                    outcome = self._admit(update)  # re-check: others ran meanwhile
                    if outcome is MergeOutcome.BUFFERED and not self._buffer.add(update, now_s):
                        outcome = MergeOutcome.REJECTED_BUFFER_FULL
                if outcome is not None:
                    self._count(outcome)
                    return outcome, []
            prepared = self._prepare(update)  # it became ready while we screened it (rare)
        return self._merge_chain(update, now_s=now_s, prepared=prepared)

    def expire_gaps(self, now_s: float | None = None) -> tuple[list[UpdateLike], int]:
        """Skip every gap older than `gap_timeout_s` (rule 6). Returns (updates merged, seqs skipped)."""
        now_s = self.clock() if now_s is None else now_s
        if not math.isfinite(self.gap_timeout_s):
            return [], 0
        ready: list[UpdateLike] = []
        skipped = 0
        with self.lock:
            for sender, since in list(self._buffer.gap_since.items()):
                lowest = self._buffer.lowest(sender)
                if lowest is None or now_s - since < self.gap_timeout_s:
                    continue
                span = lowest - self._vv.get(sender) - 1
                if span > self.max_hole_span:
                    continue  # too far behind for a skip: a state sync's job
                self._buffer.gap_since[sender] = now_s  # a further gap behind this one waits its own timeout
                ready.append(self._buffer.pop(sender, lowest))  # type: ignore[arg-type]
                skipped += span
                logger.warning("gap skipped sender=%s holes=%d..%d waited_s=%.0f", sender,
                               lowest - span, lowest - 1, now_s - since)
        merged: list[UpdateLike] = []
        for update in ready:
            merged.extend(self._merge_chain(update, now_s=now_s, skip=True)[1])
        with self.lock:
            self.stats["holes_skipped"] += skipped
        return merged, skipped

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
            known = self._merged_ids.get(sender, {})
            ids = [known.get(seq) for seq in seqs]
            if any(i is None for i in ids) or not all(self._vv.has(sender, seq) for seq in seqs):
                return None
            return ids  # type: ignore[return-value]

    def unmerge(self, update: UpdateLike) -> bool:
        """Take back a merged update (rule 7): `theta += outer_lr * w * shape(decode(update))` and V loses
        `(sender, seq)`. For the equivocation repair: of two signed versions of one slot, some replicas merged
        one and some the other; each takes back the one it merged, so the slot is merged nowhere and the
        replicas meet again. Only this exact update (by update_id) is taken back; False if it is not the
        one merged here, or if the aggregation is receiver-dependent (centered_clip: its shaping cannot be
        redone exactly, so that divergence is left to the repair)."""
        with self.lock:
            merged = self._merged_ids.get(update.sender, {}).get(update.seq)
            if merged is None or merged != update.update_id or not self._vv.has(update.sender, update.seq):
                return False
            if not self.policy.deterministic:
                logger.warning("cannot take back an update under a receiver-dependent aggregation sender=%s "
                               "seq=%d", update.sender, update.seq)
                return False
            prepared = self._prepare(update)  # it passed every check when it merged, identically now
            if prepared.scaled is None:
                return False
            vv = self._vv.without(update.sender, update.seq)  # may raise (hole bound): before theta changes
            self._theta.add_(prepared.scaled)
            self._peak_bound = _peak(self._theta)
            self._vv = vv
            del self._merged_ids[update.sender][update.seq]
            self.stats["unmerged"] = self.stats.get("unmerged", 0) + 1
        logger.warning("merged update taken back sender=%s seq=%d", update.sender, update.seq)
        return True

    def load(self, theta: Tensor, version_vector: VersionVector) -> list[UpdateLike]:
        """Replace the state (state sync, restart). Buffered updates the new state already includes are
        dropped; those it makes ready are merged and returned. Bans and evidence persist."""
        _check_theta(theta)
        if theta.shape != self._theta.shape:
            raise ValueError(f"theta shape {tuple(theta.shape)} does not match replica {tuple(self._theta.shape)}")
        with self.lock:
            # Copy in place so references to the live tensor stay valid.
            self._theta.copy_(theta)
            self._vv = version_vector
            self._peak_bound = _peak(self._theta)
            ready = self._buffer.drop_merged(version_vector)
            # The new theta was summed elsewhere (a donor, a peer we adopt, a checkpoint): which version of a
            # slot it holds is not ours to know, so no id is kept (rule 3: such seqs read as DUPLICATE, and
            # neither gossip's id digests nor `unmerge` may trust an id we merged before).
            self._merged_ids.clear()
        merged: list[UpdateLike] = []
        for update in ready:
            merged.extend(self._merge_chain(update, now_s=self.clock())[1])
        return merged

    def max_step(self) -> float:
        """Bound on how far one merge moves any coordinate of theta (outer_lr * max_weight * the policy's
        ceiling); inf when the RunSpec sets no bound. Two replicas whose merged sets differ by d updates
        differ by at most d times this in every coordinate (the repair checks a peer's state against it)."""
        return self.outer_lr * self.max_weight * self.policy.step_ceiling

    def adopt(self, theta: Tensor, version_vector: VersionVector, held: Iterable[UpdateLike]) -> list[UpdateLike]:
        """The repair of rule 6: take a peer's state, then re-merge the updates we hold that it lacks
        (`held`, e.g. `store.missing_for(version_vector, ...)`). Returns every update merged."""
        merged = self.load(theta, version_vector)
        for update in held:
            merged.extend(self.offer(update)[1])
        return merged

    # --- internals --------------------------------------------------------------------------------------

    def _merge_chain(self, first: UpdateLike, *, now_s: float, skip: bool = False,
                     prepared: _Prepared | None = None) -> tuple[MergeOutcome, list[UpdateLike]]:
        """Merge `first` (found ready under the lock) and then its buffered successors, in seq order."""
        merged: list[UpdateLike] = []
        outcome = MergeOutcome.MERGED
        current: UpdateLike | None = first
        while current is not None:
            if prepared is None:
                prepared = self._prepare(current)  # outside the lock: the expensive part
            with self.lock:
                # Re-check: another thread may have merged this seq (or banned the sender) while we decoded.
                result = self._admit(current, allow_skip=skip and current is first)
                if result is MergeOutcome.BUFFERED:  # not ready after all (a load moved V): wait again
                    result = MergeOutcome.BUFFERED if self._buffer.add(current, now_s) \
                        else MergeOutcome.REJECTED_BUFFER_FULL
                elif result is None:
                    result = self._apply(current, prepared)
                prepared = None
                self._count(result)
                if current is first:
                    outcome = result
                if result is not MergeOutcome.MERGED:
                    break
                merged.append(current)
                # Popped under the same lock as the merge: a successor offered concurrently is either here
                # already or will find seq == V + 1 and merge itself; none is stranded.
                current = self._buffer.pop(current.sender, self._vv.get(current.sender) + 1)
                if current is None and self._buffer.has_sender(first.sender):
                    self._buffer.gap_since[first.sender] = now_s  # a new gap starts now
        return outcome, merged

    def _prepare(self, update: UpdateLike, *, screen_only: bool = False) -> _Prepared:
        """Decode, check finiteness and the norm bound, shape and weight (rule 4, after the layout check).
        `screen_only`: only the rejection (or none) is wanted."""
        try:
            weight = float(update.weight)
        except OverflowError:  # an int weight beyond the float range
            weight = math.inf
        if not math.isfinite(weight):
            return _Prepared(rejection=MergeOutcome.REJECTED_NONFINITE)
        scale = self.outer_lr * min(max(weight, 0.0), self.max_weight)  # same clamp on every peer
        try:
            delta = self._decode(update)
        except Exception as exc:  # a remote payload must never crash the peer (invariant 1)
            logger.warning("update rejected reason=decode_error sender=%s seq=%d error=%r",
                           update.sender, update.seq, exc)
            return _Prepared(rejection=MergeOutcome.REJECTED_INVALID)
        if not isinstance(delta, Tensor) or delta.shape != self._theta.shape:
            return _Prepared(rejection=MergeOutcome.REJECTED_INVALID)
        delta = delta.detach().to(device=self._theta.device, dtype=torch.float32)
        if not bool(torch.isfinite(delta).all()):
            return _Prepared(rejection=MergeOutcome.REJECTED_NONFINITE)
        if self.policy.screen(delta):
            return _Prepared(rejection=MergeOutcome.REJECTED_NORM)
        if screen_only:
            return _Prepared()
        if not self.policy.deterministic:
            return _Prepared(delta=delta, scale=scale)  # shaped against the window, under the lock
        return self._scaled(delta, scale)

    def _scaled(self, delta: Tensor, scale: float) -> _Prepared:
        scaled = self.policy.shape(delta) * scale  # a new tensor: the decoder may return a buffer it owns
        if not bool(torch.isfinite(scaled).all()):  # lr * w * delta can overflow float32
            return _Prepared(rejection=MergeOutcome.REJECTED_NONFINITE)
        return _Prepared(delta=delta, scaled=scaled, scale=scale, bound=_peak(scaled))

    def _admit(self, update: UpdateLike, *, check: Callable[[UpdateLike], str | None] | None = None,
                allow_skip: bool = False) -> MergeOutcome | None:
        """Under the lock: classify by (sender, seq, update_id); None means ready to merge, BUFFERED that it
        must wait for a gap (the caller buffers it). Runs `check` and records equivocation as side effects."""
        sender, seq, update_id = update.sender, update.seq, update.update_id
        if sender in self.banned:
            return MergeOutcome.REJECTED_BANNED
        if self._vv.has(sender, seq):
            known = self._merged_ids.get(sender, {}).get(seq)
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

    def _apply(self, update: UpdateLike, prepared: _Prepared) -> MergeOutcome:
        """Under the lock: the axpy, or the rejection found by `_prepare`."""
        if prepared.rejection is None and prepared.scaled is None and prepared.delta is not None:
            prepared = self._scaled(prepared.delta, prepared.scale)  # centered_clip: against the window now
        if prepared.rejection is not None or prepared.scaled is None:
            reason = prepared.rejection or MergeOutcome.REJECTED_INVALID
            self._ban(update.sender, f"{reason.value} seq={update.seq}")
            return reason
        scaled, bound = prepared.scaled, prepared.bound
        if self._peak_bound + bound > _F32_MAX:
            self._peak_bound = _peak(self._theta)  # the cheap bound is too loose; measure
        if self._peak_bound + bound > _F32_MAX:
            trial = self._theta - scaled  # rare: the merge may overflow, so try it on a copy
            if not bool(torch.isfinite(trial).all()):
                self._ban(update.sender, f"overflow seq={update.seq}")
                return MergeOutcome.REJECTED_NONFINITE
            self._theta.copy_(trial)
            self._peak_bound = _peak(self._theta)
        else:
            self._theta.sub_(scaled)
            self._peak_bound += bound
        if update.seq in self._vv.holes(update.sender):
            self.stats["late_merged"] += 1
            logger.info("late merge of a skipped update sender=%s seq=%d", update.sender, update.seq)
        self._vv = self._vv.with_merged(update.sender, update.seq)
        self.policy.observe(prepared.delta)  # type: ignore[arg-type]
        ids = self._merged_ids.setdefault(update.sender, {})
        ids[update.seq] = update.update_id
        while len(ids) > self.max_ids_per_sender:  # keep the newest max_ids_per_sender seqs
            del ids[min(ids)]
        return MergeOutcome.MERGED

    def _equivocation(self, sender: str, seq: int, known_id: bytes, known: UpdateLike | None,
                      update: UpdateLike) -> MergeOutcome:
        self.evidence.setdefault(sender, (known_id, update.update_id))
        if sender not in self.conflicts:
            self.conflicts[sender] = Conflict(seq=seq, first_id=known_id, first=known, second=update)
            while len(self.conflicts) > MAX_CONFLICTS:
                self.conflicts.popitem(last=False)
        self._ban(sender, f"equivocation seq={seq}")
        return MergeOutcome.EQUIVOCATION

    def _ban(self, sender: str, reason: str) -> None:
        self.banned.add(sender)
        dropped = self._buffer.drop_sender(sender)
        logger.warning("sender banned sender=%s reason=%s dropped_buffered=%d", sender, reason, dropped)
        for listener in self._ban_listeners:
            try:
                listener(sender)
            except Exception:  # a listener's bug must not undo or skip the ban
                logger.exception("ban listener failed sender=%s", sender)

    def _count(self, outcome: MergeOutcome) -> None:
        self.stats[outcome.value] += 1
