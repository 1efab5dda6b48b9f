"""What a sponsor's update carries of others' work (sync/sponsorship.py `Sponsorship.relay`, train/outer.py
`relay_payload`), `Pending`, a proposal waiting to be judged, and `Carry`, where it gathers that work as it judges.

**Crowding.** One share for all newcomers bounds what they weigh together, not what one direction weighs in it: a
crowd with no compute that echoes a late volunteer's proposal (its own noise at cosine 0.9 with it, dated just
after it) filled the share with that one proposal's work, ten times what the volunteer's own value relayed, and an
honest volunteer's work amplified so cost +5.4% / +13.2% (`test`, 100 identities, seeds 0 / 1; BENCHMARKS
"Crowding"). So a proposal's work is relayed at its value divided by how crowded its direction is in this relay:
1 plus the sum of its positive cosines (their parts outside theta's recent moves) with the round's other relayed
proposals and graduates' work. A proposal alone keeps its value; k copies of one direction relay one's worth in
all, k echoes of one proposal about its worth along it, however many identities sign them. Its value itself (its
record, its vouch) is unchanged: crowding decides only how much of its work is carried."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from p2p_diloco.sync.decoded import Decoded


class Relayed(NamedTuple):
    """What a sponsor's next update carries of others' work (`Sponsorship.relay`, train/outer.py `relay_payload`)."""

    step: Tensor | None
    """Theta's units, times 1 + `share`: `1/S sum v(u) step(u)` of the proposals (displacing the sponsor's own
    work) plus `(1 + share)/S sum keep(u) step(u)` of the graduates' (which `relay_payload`'s 1 / (1 + share)
    leaves whole)."""
    vouches: bytes
    """Its verdicts, for its header (wire/vouches.py): graduates' first, then the most useful proposals'."""
    share: float
    """The share `t` (at most 1/S) the proposals take of its update."""
    carried: float
    """The graduates' relayed work in merge-weight units (`outer_lr * w`): the sponsor signs that much more."""


NOTHING = Relayed(None, b"", 0.0, 0.0)


class Proposal(NamedTuple):
    """A proposal a sponsor found useful this round, kept until it relays (`Carry`)."""

    key: bytes
    value: float
    step: Tensor | Decoded
    factor: float
    unit: Tensor | None
    """Its part outside theta's recent moves at the sampled coordinates, unit length (None: nothing new)."""


class Pending(NamedTuple):
    """A proposal merged this phase, to be judged when the phase ends (`Sponsorship.relay`)."""

    author: str
    seq: int
    sample: Tensor
    unit: Tensor
    step: Tensor | Decoded
    factor: float
    date: float
    ahead: Tensor | None = None  # its sample at the next period's coordinates, if gathered (sync/judged_at.py)
    data: tuple[int, ...] = ()  # the data position its header declares: what a fit judge redraws (sync/fitness.py)


class Carry:
    """What a sponsor will relay in its next update, gathered as it judges: proposals' work at the newcomers'
    share (crowded: the module docstring) and graduates' as members'. One per round: a sponsor starts a new one
    when it relays. Holds references to at most MAX_VOUCHES proposals' steps until then."""

    def __init__(self) -> None:
        self.proposals: list[Proposal] = []
        self.full: Tensor | None = None  # sum of keep(u) * step(u) of graduates' proposals
        self.graded: list[tuple[bytes, float]] = []  # graduates' proposals judged: key, v
        self.carried = 0.0  # sum of factor * keep of the graduates'
        self._units: list[Tensor] = []  # the graduates' relayed new parts, unit length: they crowd proposals too

    def propose(self, key: bytes, step: Tensor | Decoded, factor: float, value: float, unit: Tensor | None) -> None:
        self.proposals.append(Proposal(key, value, step, factor, unit))

    def graduate(self, key: bytes, value: float, step: Tensor | Decoded | None, factor: float, keep: float,
                 unit: Tensor | None) -> None:
        """Gather a graduate's judged proposal: its work at `keep` if `step` (None: not relayed, still listed)."""
        if step is not None:
            self.full = add_step(self.full, step, factor * keep)
            self.carried += factor * keep
            if unit is not None:
                self._units.append(unit)
        self.graded.append((key, value))

    def rename(self, lost: bytes, key: bytes) -> None:
        """A vouch still to be signed for the slot `lost` names `key` instead (its original, sync/heralds.py)."""
        self.proposals = [p._replace(key=key) if p.key == lost else p for p in self.proposals]
        self.graded = [(key if k == lost else k, v) for k, v in self.graded]

    def weights(self) -> list[float]:
        """Each proposal's value over its crowding: 1 + its positive cosines with every other proposal and graduate
        gathered this round. k proposals at cosine c with each other weigh k / (1 + (k - 1) c) of one in all."""
        rows = [(i, p.unit) for i, p in enumerate(self.proposals) if p.unit is not None]
        weights = [p.value for p in self.proposals]
        if not rows:
            return weights
        units = torch.stack([unit for _, unit in rows] + self._units)
        crowding = (units[:len(rows)] @ units.T).clamp_min(0.0).sum(1).clamp_min(1.0)  # its own cosine, 1, included
        for (i, _), c in zip(rows, crowding.tolist()):
            weights[i] /= c
        return weights

    def relay(self) -> tuple[Tensor | None, list[float]]:
        """The proposals' work summed at their crowded weights (theta's units, not yet scaled to a share), and
        those weights."""
        weights = self.weights()
        relay = None
        for p, weight in zip(self.proposals, weights):
            relay = add_step(relay, p.step, p.factor * weight)
        return relay, weights


def add_step(into: Tensor | None, step: Tensor | Decoded, factor: float) -> Tensor:
    """into += factor * step, a chunk at a time (a new zero buffer for None)."""
    decoded = step if isinstance(step, Decoded) else Decoded.of(step)
    if into is None:
        into = torch.zeros(decoded.numel, dtype=torch.float32)
    for part, values in decoded.chunks():
        into[part].add_(values, alpha=factor)
    return into
