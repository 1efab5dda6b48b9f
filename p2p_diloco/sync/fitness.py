"""Which proposals a sponsor checks for fit (train/fit.py: does the work teach the stream its author declares more
than the sponsor's own does?).

A judge of directions (sync/worth.py) values work by how it points along the sponsors' own. Work on a file shard
of its author's own points little along it (BENCHMARKS "Can a paired loss change tell honest work from an
attack?": median cosine -0.07 late in a run), so an honest volunteer there is judged under PROVEN and never
graduates (BENCHMARKS "Graduation"). A fit check sees its compute instead, but costs forwards, so a sponsor makes
at most FIT_CHECKS a round, and only where it can change a record: a proposal that points along the sponsors'
work at all (`keep > 0`: not an echo, not a copy, a positive cosine), too little to count (`value < PROVEN`),
with a declared data position. Authors with a useful mark already come first (a graduate keeps its record; a
stranger that fit once can graduate); strangers share what is left, drawn by the sponsor's secret generator, so
K fresh identities split the strangers' checks as they split the newcomers' share of weight, and none of them can
tell when its turn is.

A check that fits counts as a useful mark for the record (sync/records.py), not as value: what the proposal is
relayed with is still its value, and a graduate's share still needs a positive cosine (`keep`). A stranger's weak
work that no check reached is left off its record (neither useful nor a strike: a budget that allows a check
every few rounds must not make every unchecked round a strike); a graduate's is marked by its value as before,
so a graduate is relayed as a member's only on work that fits or points along the sponsors'. Pure: no model; the
check itself, and its compute budget, are the caller's (`Fit`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from p2p_diloco.sync.decoded import Decoded
from p2p_diloco.sync.records import Records
from p2p_diloco.sync.relayed import Pending
from p2p_diloco.sync.types import Fit

ECHO_BAR = 0.5
"""A proposal this near (|cos| of the samples) one dated before it in the round is an echo of it for the fit
checks. The echo crowd measured sent cosine 0.6 (`echo_soft`)."""
FIT_CHECKS = 1
"""Fit checks a sponsor makes per round, at most. One check is 3 x FIT_BATCHES forwards (train/fit.py): 12 of
a round's ~150 forward-equivalents at H = 50, at most one author's worth per round."""


def to_check(judged: Sequence[tuple[Pending, float, float]], useful: Callable[[str], bool], proven: float,
             rng: random.Random, limit: int = FIT_CHECKS) -> list[Pending]:
    """The proposals of a round to check for fit (see the module docstring), from `judged`: (proposal, value,
    keep) of the round's proposals that were not copies; `useful(author)`: it has a useful mark already."""
    marks = echoes([p for p, _, _ in judged])  # over the whole round: an echo of work valued in full is one too
    eligible = [p for (p, value, keep), echo in zip(judged, marks) if keep > 0 and value < proven and p.data
                and not echo]
    members = [p for p in eligible if useful(p.author)]
    strangers = [p for p in eligible if not useful(p.author)]
    rng.shuffle(members)
    rng.shuffle(strangers)
    return (members + strangers)[:limit]


def echoes(proposals: Sequence[Pending], bar: float = ECHO_BAR) -> list[bool]:
    """For each of `proposals`, whether it is an echo for the fit checks: its sample's |cos| with that of one
    dated before it (by its herald, else by merge order: `Pending.date`) is at least `bar`."""
    if len(proposals) < 2:
        return [False] * len(proposals)
    units = torch.stack([p.unit.reshape(-1) for p in proposals])
    near = (units @ units.T).abs() >= bar
    dates = torch.tensor([p.date for p in proposals], dtype=torch.float64)
    order = torch.arange(len(proposals))
    same = dates[None, :] == dates[:, None]
    before = (dates[None, :] < dates[:, None]) | (same & (order[None, :] < order[:, None]))  # [i, j]: j before i
    return (near & before).any(dim=1).tolist()


class FitChecks:
    """A sponsor's fit checks: which proposals of a round it checks (`to_check`, drawn from its secret `seed`); one
    that fits marks its author's record useful (`Records.note` at `proven`). What they cost and found is counted by
    the check itself (train/fit.py `FitJudge.stats`)."""

    def __init__(self, seed: int, proven: float) -> None:
        self.rng, self.proven = random.Random(seed ^ 0x5EED), proven

    def check(self, judged: Sequence[tuple[Pending, float, float]], theta: Tensor, fit: Fit, records: Records,
              graduated: Callable[[str, int], bool]) -> None:
        """Check the round's proposals `to_check` picks, at `theta`, and mark their records: `proven` for one that
        fits, its value for one that does not. A check the judge could not make (None: no position it can redraw,
        its compute budget spent) marks nothing: a stranger's weak work left unchecked is neither useful nor a
        strike (`Sponsorship._judge` left it off the record), a graduate's was marked by its value already."""
        for p in to_check(judged, records.useful, self.proven, self.rng):
            fits = fit(p.author, p.data, Decoded.of(p.step).whole() * p.factor, theta)
            if fits is None:
                continue
            value = next(v for q, v, _ in judged if q is p)
            if fits:
                records.note(p.author, p.seq, self.proven)
            elif not graduated(p.author, p.seq):
                records.note(p.author, p.seq, value)
