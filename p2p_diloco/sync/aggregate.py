"""An aggregator's side of a group sum (ARCHITECTURE.md "Aggregation"): add the updates it was sent and
the sums of its children into one signed sum, and read a received sum as the parts a replica merges.

The aggregator leaves out what the merge rule would refuse (screening, a weight that is not exact: `step_of`
returns None) and any child sum that overlaps another or the direct parts (a slot must be covered once), so what
it signs is always a sum over a set of distinct, mergeable slots.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from p2p_diloco.sync.exact_sum import ExactSum, decode_grid
from p2p_diloco.sync.sum_audit import StepOf
from p2p_diloco.sync.sum_merge import SumPart
from p2p_diloco.wire.envelope import OuterUpdate
from p2p_diloco.wire.herald import encode_herald
from p2p_diloco.wire.identity import Identity
from p2p_diloco.wire.sums import GroupSum, make_sum


def build_sum(*, identity: Identity, run_id: str, spec_hash: str, epoch: int, numel: int,
              direct: Sequence[OuterUpdate], children: Sequence[GroupSum], step_of: StepOf) -> GroupSum | None:
    """The signed sum of `direct` updates and `children` sums (each slot once); None if nothing is left."""
    total = ExactSum(numel)
    heralds: list[bytes] = []
    covered: set[tuple[str, int]] = set()
    kept: list[GroupSum] = []
    for child in children:
        slots = set(child.header.slots)
        if slots & covered:
            continue  # a slot twice: keep the first child that covers it, drop the overlapping one
        total.add_grid(decode_grid(child.payload, numel))
        heralds.extend(p.herald for p in child.header.parts)
        covered |= slots
        kept.append(child)
    for update in sorted(direct, key=lambda u: (u.sender, u.seq)):
        if (update.sender, update.seq) in covered:
            continue
        step = step_of(update)
        if step is None:
            continue
        total.add_grid(step)
        heralds.append(encode_herald(update))
        covered.add((update.sender, update.seq))
    if not heralds:
        return None
    return make_sum(identity=identity, run_id=run_id, spec_hash=spec_hash, epoch=epoch, heralds=heralds,
                    children=kept, payload=total.encode(), numel=numel)


def sum_parts(s: GroupSum) -> list[SumPart]:
    """The slots a received sum covers, as the replica merges them (`Replica.offer_sum`)."""
    return [SumPart(p.header.sender, p.header.seq, p.update_id, p.header.weight) for p in s.header.parts]


def sum_total(s: GroupSum) -> Tensor:
    """The grid values of a received sum's payload."""
    return decode_grid(s.payload, s.header.numel)
