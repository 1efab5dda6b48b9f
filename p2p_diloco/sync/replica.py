"""The replica: a peer's copy of the global parameters `theta` and the merge rule (DESIGN.md sections 3, 7).

Protocol rules (identical on every peer; changing one changes the protocol):

1. Merge is `theta -= outer_lr * clamp(weight, 0, max_weight) * decode(update)`: a plain weighted sum. The
   outer Nesterov momentum lives at the sender, so a sum is all a receiver does, and **a sum commutes**:
   replicas that merged the same set of updates are equal (to fp tolerance) whatever the arrival order.
2. An update merges only when `seq == V[sender] + 1`, so none merges twice and the version vector names
   exactly the merged set. `seq > V + 1` waits in a buffer bounded by `max_buffered` updates in total
   (beyond that: REJECTED_BUFFER_FULL, never unbounded growth); when a seq merges, its buffered successors
   merge too, in order.
3. `seq <= V[sender]` is a DUPLICATE if its `update_id` equals the one recorded for `(sender, seq)`, and
   EQUIVOCATION otherwise; so is a different `update_id` for a `(sender, seq)` already buffered. Ids of merged
   updates are kept for the last `max_ids_per_sender` seqs of each sender; older seqs (and seqs merged
   before a `load`) have no record and count as DUPLICATE. Equivocation records the two ids as evidence and
   bans the sender: its buffered updates are dropped and its later offers are REJECTED_BANNED.
4. The decoded, weighted delta must be all finite, and so must `theta` after the merge; otherwise the update
   is REJECTED_NONFINITE and `theta` and `V` do not change. The sender's `V` then never passes that seq: any
   other message for it would be equivocation and a re-decode gives the same values, so the sender can never
   merge again. We ban it at once, which frees the buffer it would otherwise fill (`evidence` holds only
   equivocation proofs, so a ban without evidence means a non-finite or undecodable update). That is the
   right consequence for a poisoner; an honest learner must check its own delta before signing it.
5. An update whose header is malformed (the wire layer should have caught it), whose payload the decoder
   rejects, or whose delta has the wrong shape is REJECTED_INVALID; the sender is banned as in rule 4 unless
   the header itself is malformed (then the sender field cannot be trusted).

Threading: the network thread offers while the compute thread takes snapshots. Decoding runs outside the
lock (it is the expensive part); the state is re-checked under the lock before the axpy, so two threads
decoding the same update still merge it once.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from enum import Enum
from typing import Protocol

import torch
from torch import Tensor

from p2p_diloco.sync.version_vector import VersionVector

logger = logging.getLogger(__name__)

_F32_MAX = float(torch.finfo(torch.float32).max)


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
    REJECTED_NONFINITE = "rejected_nonfinite"
    REJECTED_INVALID = "rejected_invalid"
    REJECTED_BUFFER_FULL = "rejected_buffer_full"
    REJECTED_BANNED = "rejected_banned"


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
    except AttributeError:
        return False
    return (isinstance(sender, str) and bool(sender)
            and isinstance(seq, int) and not isinstance(seq, bool) and seq >= 1
            and isinstance(update_id, bytes)
            and isinstance(weight, (int, float)) and not isinstance(weight, bool))


class Replica:
    """theta plus its version vector; `offer` merges updates under the rules above."""

    def __init__(self, theta: Tensor, *, outer_lr: float, max_weight: float,
                 decode: Callable[[UpdateLike], Tensor], max_buffered: int = 1024,
                 max_ids_per_sender: int = 4096, version_vector: VersionVector | None = None) -> None:
        """Takes ownership of `theta` (merges write into it in place; clone it first to keep a copy)."""
        _check_theta(theta)
        if not (math.isfinite(outer_lr) and outer_lr >= 0 and math.isfinite(max_weight) and max_weight >= 0):
            raise ValueError(f"outer_lr and max_weight must be finite and >= 0, got {outer_lr}, {max_weight}")
        if max_buffered < 0 or max_ids_per_sender < 1:
            raise ValueError(f"need max_buffered >= 0 and max_ids_per_sender >= 1, got {max_buffered}, "
                             f"{max_ids_per_sender}")
        self.outer_lr = float(outer_lr)
        self.max_weight = float(max_weight)
        self.max_buffered = max_buffered
        self.max_ids_per_sender = max_ids_per_sender
        self.lock = threading.RLock()
        self.stats: dict[str, int] = {outcome.value: 0 for outcome in MergeOutcome}
        self.banned: set[str] = set()
        self.evidence: dict[str, tuple[bytes, bytes]] = {}
        self._decode = decode
        self._theta = theta.detach()
        self._vv = version_vector if version_vector is not None else VersionVector()
        self._buffer: dict[str, dict[int, UpdateLike]] = {}  # sender -> seq -> update waiting for its gap
        self._n_buffered = 0
        self._merged_ids: dict[str, dict[int, bytes]] = {}  # sender -> seq -> update_id, last max_ids seqs
        # Upper bound on max|theta_i|, grown by max|delta_i| per merge (triangle inequality): lets the overflow
        # guard of rule 4 skip a full pass over theta until the bound gets near the float32 range.
        self._peak_bound = _peak(self._theta)

    @property
    def version_vector(self) -> VersionVector:
        return self._vv

    @property
    def theta(self) -> Tensor:
        """The live tensor; hold `lock` while reading it if merges may run concurrently."""
        return self._theta

    @property
    def n_buffered(self) -> int:
        return self._n_buffered

    def snapshot(self) -> tuple[Tensor, VersionVector]:
        """A consistent copy of (theta, V): the vector names exactly the updates summed into the copy."""
        with self.lock:
            return self._theta.clone(), self._vv

    def offer(self, update: UpdateLike) -> tuple[MergeOutcome, list[UpdateLike]]:
        """Offer one update. Returns its outcome and every update this call merged (it first, then any
        buffered successors it released), e.g. for re-announcing them."""
        if not _header_ok(update):
            logger.warning("update rejected reason=malformed_header update=%r", update)
            with self.lock:
                self._count(MergeOutcome.REJECTED_INVALID)
            return MergeOutcome.REJECTED_INVALID, []
        with self.lock:
            outcome = self._admit(update)
            if outcome is not None:
                self._count(outcome)
                return outcome, []
        return self._merge_chain(update)

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
            for sender in list(self._buffer):
                done = version_vector.get(sender)
                for seq in [seq for seq in self._buffer[sender] if seq <= done]:
                    self._pop_buffered(sender, seq)
            for sender, ids in self._merged_ids.items():
                # Ids above the new V were never merged into this state; keeping them would misclassify.
                for seq in [seq for seq in ids if seq > version_vector.get(sender)]:
                    del ids[seq]
            ready = [self._pop_buffered(sender, version_vector.get(sender) + 1) for sender in list(self._buffer)]
        merged: list[UpdateLike] = []
        for update in ready:
            if update is not None:
                merged.extend(self._merge_chain(update)[1])
        return merged

    # --- internals --------------------------------------------------------------------------------------

    def _merge_chain(self, first: UpdateLike) -> tuple[MergeOutcome, list[UpdateLike]]:
        """Merge `first` (found ready under the lock) and then its buffered successors, in seq order."""
        merged: list[UpdateLike] = []
        outcome = MergeOutcome.MERGED
        current: UpdateLike | None = first
        while current is not None:
            scaled, bound, rejection = self._prepare(current)  # outside the lock: the expensive part
            with self.lock:
                # Re-check: another thread may have merged this seq (or banned the sender) while we decoded.
                result = self._admit(current)
                if result is None:
                    result = self._apply(current, scaled, bound, rejection)
                self._count(result)
                if current is first:
                    outcome = result
                if result is not MergeOutcome.MERGED:
                    break
                merged.append(current)
                # Popped under the same lock as the merge: a successor offered concurrently is either here
                # already or will find seq == V + 1 and merge itself; none is stranded.
                current = self._pop_buffered(current.sender, current.seq + 1)
        return outcome, merged

    def _prepare(self, update: UpdateLike) -> tuple[Tensor | None, float, MergeOutcome | None]:
        """Decode and weight the delta; returns (scaled delta, max|scaled|, rejection or None)."""
        try:
            weight = float(update.weight)
        except OverflowError:  # an int weight beyond the float range
            weight = math.inf
        if not math.isfinite(weight):
            return None, 0.0, MergeOutcome.REJECTED_NONFINITE
        scale = self.outer_lr * min(max(weight, 0.0), self.max_weight)  # same clamp on every peer
        try:
            delta = self._decode(update)
        except Exception as exc:  # a remote payload must never crash the peer (invariant 1)
            logger.warning("update rejected reason=decode_error sender=%s seq=%d error=%r",
                           update.sender, update.seq, exc)
            return None, 0.0, MergeOutcome.REJECTED_INVALID
        if not isinstance(delta, Tensor) or delta.shape != self._theta.shape:
            return None, 0.0, MergeOutcome.REJECTED_INVALID
        # A new tensor: the decoder may return a buffer it still owns.
        scaled = delta.detach().to(device=self._theta.device, dtype=torch.float32) * scale
        # 0 * inf and 0 * nan are nan, so this also rejects a non-finite delta carrying weight 0.
        if not bool(torch.isfinite(scaled).all()):
            return None, 0.0, MergeOutcome.REJECTED_NONFINITE
        return scaled, _peak(scaled), None

    def _admit(self, update: UpdateLike) -> MergeOutcome | None:
        """Under the lock: classify by (sender, seq, update_id); None means ready to merge (seq == V + 1).
        Buffers, and records equivocation, as side effects."""
        sender, seq, update_id = update.sender, update.seq, update.update_id
        if sender in self.banned:
            return MergeOutcome.REJECTED_BANNED
        done = self._vv.get(sender)
        if seq <= done:
            known = self._merged_ids.get(sender, {}).get(seq)
            if known is None or known == update_id:
                return MergeOutcome.DUPLICATE
            return self._equivocation(sender, seq, known, update_id)
        waiting = self._buffer.get(sender, {}).get(seq)
        if waiting is not None:
            if waiting.update_id == update_id:
                return MergeOutcome.DUPLICATE
            return self._equivocation(sender, seq, waiting.update_id, update_id)
        if seq == done + 1:
            return None
        if self._n_buffered >= self.max_buffered:
            return MergeOutcome.REJECTED_BUFFER_FULL
        self._buffer.setdefault(sender, {})[seq] = update
        self._n_buffered += 1
        return MergeOutcome.BUFFERED

    def _apply(self, update: UpdateLike, scaled: Tensor | None, bound: float,
               rejection: MergeOutcome | None) -> MergeOutcome:
        """Under the lock: the axpy, or the rejection found by `_prepare`."""
        if rejection is not None or scaled is None:
            reason = rejection or MergeOutcome.REJECTED_INVALID
            self._ban(update.sender, f"{reason.value} seq={update.seq}")
            return reason
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
        self._vv = self._vv.advanced(update.sender, update.seq)
        ids = self._merged_ids.setdefault(update.sender, {})
        ids[update.seq] = update.update_id
        ids.pop(update.seq - self.max_ids_per_sender, None)  # keep the last max_ids_per_sender seqs
        return MergeOutcome.MERGED

    def _equivocation(self, sender: str, seq: int, known_id: bytes, new_id: bytes) -> MergeOutcome:
        self.evidence.setdefault(sender, (known_id, new_id))
        self._ban(sender, f"equivocation seq={seq}")
        return MergeOutcome.EQUIVOCATION

    def _ban(self, sender: str, reason: str) -> None:
        self.banned.add(sender)
        dropped = self._buffer.pop(sender, {})
        self._n_buffered -= len(dropped)
        logger.warning("sender banned sender=%s reason=%s dropped_buffered=%d", sender, reason, len(dropped))

    def _pop_buffered(self, sender: str, seq: int) -> UpdateLike | None:
        waiting = self._buffer.get(sender)
        update = waiting.pop(seq, None) if waiting else None
        if update is not None:
            self._n_buffered -= 1
            if not waiting:
                del self._buffer[sender]
        return update

    def _count(self, outcome: MergeOutcome) -> None:
        self.stats[outcome.value] += 1
