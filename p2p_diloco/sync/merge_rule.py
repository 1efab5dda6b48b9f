"""The merge rule's arithmetic (rule 1 of sync/replica.py, ARCHITECTURE.md "The merge rule"): theta, and the step
one update moves it by, `outer_lr * clamp(weight, 0, max_weight) * m * shape(decode(update))`.

It screens a payload (decode, finiteness, the norm bound: sync/screening.py), weights it by what its sender earned
here (`m`, sync/standing.py), and subtracts the step from theta, or adds it back (a take-back, rule 7). Which slots
are merged is the replica's bookkeeping (sync/slots.py), handed in. Everything but `screen` runs under the
replica's lock; `screen`, the expensive part, runs outside it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from torch import Tensor

from p2p_diloco.sync.accumulator import Accumulator
from p2p_diloco.sync.decoded import Decoded
from p2p_diloco.sync.robust import MergePolicy
from p2p_diloco.sync.screening import Prepared, prepare, shaped_step
from p2p_diloco.sync.slots import Slots
from p2p_diloco.sync.standing import Standing
from p2p_diloco.sync.types import MergeOutcome, UpdateLike
from p2p_diloco.wire.codecs import Codec
from p2p_diloco.wire.vouches import unpack_vouches

logger = logging.getLogger(__name__)


class MergeRule:
    """theta (summed into in place), the merge constants, the codec, the RunSpec's policy and the standing."""

    def __init__(self, theta: Tensor, *, outer_lr: float, max_weight: float, codec: Codec,
                 standing: Standing | None) -> None:
        if not (math.isfinite(outer_lr) and outer_lr >= 0 and math.isfinite(max_weight) and max_weight >= 0):
            raise ValueError(f"outer_lr and max_weight must be finite and >= 0, got {outer_lr}, {max_weight}")
        self.outer_lr = float(outer_lr)
        self.max_weight = float(max_weight)
        self.codec = codec
        self.standing = standing
        self.policy = MergePolicy.passthrough()  # the RunSpec's, once bound (`Replica.bind_rules`)
        self.sum = Accumulator(theta)

    def screen(self, update: UpdateLike, decoded: Tensor | Decoded | None, *,
               screen_only: bool = False) -> Prepared:
        """Rule 4 after the layout check (sync/screening.py), with this rule's codec, policy and constants."""
        samples = self.standing.sample_indices(self.sum.theta.numel()) if self.standing is not None else []
        return prepare(update, self.sum.theta, codec=self.codec, policy=self.policy, outer_lr=self.outer_lr,
                       max_weight=self.max_weight, decoded=decoded, screen_only=screen_only, samples=samples)

    def apply(self, update: UpdateLike, prepared: Prepared, slots: Slots,
              clock: Callable[[], float]) -> tuple[MergeOutcome, bool]:
        """The axpy at the weight standing grants, recorded in `slots`; or the rejection screening (or the
        overflow guard) found, which bans the sender. Returns the outcome and whether the merge filled a hole."""
        if prepared.rejection is None and prepared.scaled is None and prepared.delta is not None:
            prepared = shaped_step(prepared.delta, prepared.scale, self.policy)  # centered_clip: against the window now
        delta, scaled = prepared.delta, prepared.scaled
        if prepared.rejection is not None or scaled is None or delta is None:
            reason = prepared.rejection or MergeOutcome.REJECTED_INVALID
            slots.ban(update.sender, f"{reason.value} seq={update.seq}")
            return reason, False
        standing = self.standing
        verdict = standing.judge(update.sender, update.seq, delta, clock()) if standing is not None else None
        multiplier = verdict.multiplier if verdict is not None else 1.0
        if multiplier > 0 and not self.sum.subtract(scaled, prepared.bound, factor=prepared.factor,
                                                    multiplier=multiplier):
            slots.ban(update.sender, f"overflow seq={update.seq}")
            return MergeOutcome.REJECTED_NONFINITE, False
        late = slots.record(update, multiplier)
        if late:
            logger.info("late merge of a skipped update sender=%s seq=%d", update.sender, update.seq)
        if standing is not None and verdict is not None:
            standing.observe(update.sender, delta, verdict, clock(), seq=update.seq)
            header = getattr(update, "header", None)  # a sponsor's verdicts ride in its signed header
            standing.sponsored_merge(update.sender, update.seq, delta, scaled, prepared.factor,
                                     unpack_vouches(header.vouches) if header is not None and header.vouches else [],
                                     update_id=update.update_id, now=clock(),
                                     data=header.data if header is not None else ())
        if multiplier > 0:
            self.policy.observe(delta)
        return MergeOutcome.MERGED, late

    def take_back(self, update: UpdateLike, slots: Slots, *, keep_slot: bool) -> bool:
        """Add back the step this exact update (by update_id) merged with (rule 7; `Replica.unmerge`); False if
        it is not the one merged here or the aggregation is receiver-dependent."""
        if not slots.holds(update):
            return False
        if not self.policy.deterministic:
            logger.warning("cannot take back an update under a receiver-dependent aggregation sender=%s "
                           "seq=%d", update.sender, update.seq)
            return False
        merged = self._merged_step(update, slots)
        if merged is None:
            return False
        vv = slots.vv
        if not keep_slot:
            vv = vv.without(update.sender, update.seq)  # may raise: before theta changes
        step, factor, multiplier = merged
        if multiplier > 0:
            self.sum.add(step, factor=factor, multiplier=multiplier)
        slots.taken_back(update, vv, keep_slot=keep_slot)
        return True

    def without(self, updates: list[tuple[UpdateLike, float]], slots: Slots) -> Tensor | None:
        """theta as if these merged updates had merged with `share` less of their step, as a new tensor (the round
        view: sync/round_view.py); None if one is not the one merged here or the aggregation is receiver-dependent.
        theta is unchanged."""
        if not self.policy.deterministic:
            return None
        view = Accumulator(self.sum.theta.clone())
        for update, share in updates:
            merged = self._merged_step(update, slots)
            if merged is None:
                return None
            step, factor, multiplier = merged
            if multiplier * share > 0:
                view.add(step, factor=factor, multiplier=multiplier * share)
        return view.theta

    def _merged_step(self, update: UpdateLike, slots: Slots) -> tuple[Decoded, float, float] | None:
        """(step, factor, multiplier) this exact update (by update_id) merged with here, screened again (it passed
        every check when it merged, identically now); None if it is not the one merged here."""
        if not slots.holds(update):
            return None
        prepared = self.screen(update, None)
        if prepared.scaled is None:
            return None
        return prepared.scaled, prepared.factor, slots.merged.multiplier(update.sender, update.seq)

    def max_step(self) -> float:
        """Bound on how far one merge moves any coordinate of theta (outer_lr * max_weight * the policy's
        ceiling); inf when the RunSpec sets no bound."""
        return self.outer_lr * self.max_weight * self.policy.step_ceiling
