"""The fit judge: did a proposal's author train on the batches its header says it did? (BENCHMARKS "Did the author
train on its own batches? The fit gap"; templar's Gauntlet on assigned pages.)

A unit's batches are a pure function of its data position (wire/position.py `DataPosition`: seed, shard, stream,
step), so a sponsor holding the run's data can redraw the batches of an author's phase and, from the same stream,
batches at steps no phase reaches. Compute leaves a fit to the batches it was spent on; an echo of published work,
a copy, noise or negated work does not:

    gap(u) = dL(u, trained) - dL(u, unseen),   dL(u, B) = L_B(theta) - L_B(theta - u)

on FIT_BATCHES batches of each kind, drawn from the judge's own secret generator (the author cannot know which
of its steps are read), at the sponsor's theta (the gap does not need the author's base: BENCHMARKS, 1-3 points).
The gap has no scale of its own, so it is read against the judge's own: its last update's gap on that phase's
batches (`remember`), measured again every SCALE_EVERY checks; a proposal longer than the judge's own step is
judged scaled down to it (length buys no fit). `fits` is True when the gap is at least FIT_BAR of that scale.

Where it is used: a direction judge (sync/worth.py) cannot see work on a file shard of the author's own (it points
little along the sponsors'), so the sponsors' record (sync/sponsorship.py "Graduation") counts a proposal that
points along their work at all, too little to be valued, as useful when it fits (sync/fitness.py picks which).
What one check costs: 4 x FIT_BATCHES forwards of one batch (theta and theta - u, trained and unseen batches).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from p2p_diloco.config import RunSpec
from p2p_diloco.sync.types import Fit
from p2p_diloco.train.data.corpus import evaluate
from p2p_diloco.train.models.build import load_flat_params
from p2p_diloco.wire.position import DataPosition

logger = logging.getLogger(__name__)

FIT_BATCHES = 4
"""Trained and unseen batches read per check (each). With 4 + 4 an echo clears a quarter of the honest median gap
27% of the time and honest work falls under it 9-18% (BENCHMARKS "Did the author train on its own batches?"); on a
shard the model has not learned, closer to a coin (BENCHMARKS "Fit checks")."""
FIT_BAR = 0.25
"""The share of the judge's own gap a proposal's gap must reach (at 0.25 of the honest median noise cleared it
0-2%: BENCHMARKS "Did the author train on its own batches?")."""
FIT_SHARE = 0.0
"""The share of a sponsor's own compute its fit checks may take, counted in forwards: each round adds FIT_SHARE x
FORWARDS_PER_STEP x its inner steps of credit (at most MAX_CREDIT checks' worth kept), and a check spends its
forwards. At 0.05 (the issue's budget for judging) that is a check of 4 + 4 batches every ~2 rounds at H = 50,
every ~5 at the `test` preset's H = 20. Off by default (0: no judge is made): at 0.05 it changed nothing measured,
and at 0.25 it added one sponsor carrying a late file-shard volunteer's 3rd update in one seed of two (BENCHMARKS
"Fit checks")."""
FORWARDS_PER_STEP = 3
"""What an inner step costs in forwards of one batch (a forward and a backward: ~2 more)."""
MAX_CREDIT = 2
"""Checks' worth of credit a sponsor may save up (so that a round with two candidates after quiet ones can check
both, and a long quiet spell buys no burst)."""
SCALE_EVERY = 4
"""Checks between two measurements of the judge's own gap (its scale)."""
SCALES = 5
"""Measurements of its own gap whose median is the judge's scale: one, on 4 + 4 batches, is as noisy as a check,
and a bar that moved with it let batches no step trained on pass half the time."""
UNSEEN_FROM = 10**9
"""Unseen batches are drawn at steps from here on: beyond any phase a unit reaches."""


class FitJudge:
    """A sponsor's fit checks on its own model (the learner's, between phases: the next phase loads theta again).

    `sampler_for(author, position)` redraws an author's stream (train/phase.py `make_sampler`). A round's checks
    are held against the judge's own last update (`remember`, `for_round`)."""

    def __init__(self, model: torch.nn.Module, sampler_for: Callable[[str, DataPosition], Any], seed: int,
                 *, min_steps: int = 1, batches: int = FIT_BATCHES, bar: float = FIT_BAR) -> None:
        """`min_steps`: the shortest phase judged (the run's H): a phase declared shorter would concentrate its
        fit on fewer batches, and each of them would show more of it for the same compute."""
        self.model, self.sampler_for, self.batches, self.bar = model, sampler_for, batches, bar
        self.min_steps = max(min_steps, batches)
        self.rng = torch.Generator().manual_seed(seed)
        self.scale = 0.0  # the judge's own gap, the median of its last SCALES measurements (0: none yet)
        self._scales: list[float] = []
        self.credit = 0.0  # forwards we may still spend on checks (`FIT_SHARE`)
        self.share = FIT_SHARE
        self._checks = 0
        self._own: tuple[DataPosition, Tensor, Any] | None = None
        self.stats = {"checks": 0, "fits": 0, "scales": 0, "forwards": 0}

    @classmethod
    def for_sponsor(cls, model: torch.nn.Module, corpus: Any, spec: RunSpec, seed: int, peer_id: str,
                    world: int = 1, share: float | None = None) -> FitJudge | None:
        """The fit judge of learner `peer_id` on its `model`, if it is one of the run's sponsors, holds the model
        whole (a unit of `world` 1 process) and may spend a `share` of its compute on checks (FIT_SHARE); else
        None."""
        share = FIT_SHARE if share is None else share
        if peer_id not in spec.defence.sponsors or world != 1 or not share > 0:
            return None
        from p2p_diloco.train.phase import make_sampler

        def sampler_for(author: str, p: DataPosition) -> Any:
            return make_sampler(corpus, spec, author, shard=p.shard, num_shards=p.num_shards,
                                stream=author if p.salted else "")

        judge = cls(model, sampler_for, seed, min_steps=spec.inner.inner_steps)
        judge.share = share
        return judge

    def remember(self, position: DataPosition | None, step: Tensor, sampler: Any) -> None:
        """Our own update of a round, as it moved theta (`step`), trained at `position` of `sampler`: the next
        round's scale. A published step, like the proposals it is held against: outer momentum carries earlier
        phases' work into every update, which fits none of this phase's batches, so a raw pseudo-gradient would
        be a scale no honest update reaches. `step` is kept (one parameter-sized tensor at a sponsor)."""
        self._own = (position, step, sampler) if position is not None else None
        if position is not None:  # a scale and a check: 2 x 4b forwards at most
            earned = self.share * FORWARDS_PER_STEP * position.steps
            self.credit = min(self.credit + earned, MAX_CREDIT * 2 * 4 * self.batches)

    def for_round(self) -> Fit | None:
        """This round's checks, held against our last update (None before it, or if we cannot redraw our own
        batches: no scale, no checks)."""
        own = self._own
        if own is None:
            return None
        return lambda author, data, step, theta: self.fits(author, data, step, theta, own)

    def fits(self, author: str, data: tuple[int, ...], step: Tensor, theta: Tensor,
             own: tuple[DataPosition, Tensor, Any]) -> bool | None:
        """Whether `author`'s `step` (what it would move theta by) fits the batches its `data` declares; None if
        it cannot be judged (nothing declared, no scale of our own yet, or no credit left: `FIT_SHARE`); False for
        a phase shorter than H.
        `own`: our last update's (position, step, sampler), our scale."""
        if len(data) != len(DataPosition._fields):
            return None
        position = DataPosition(*data)
        if position.steps < self.min_steps:
            return False
        own_position, own_step, own_sampler = own
        length, norm = float(own_step.norm()), float(step.norm())
        if not length > 0 or not math.isfinite(length):
            return None
        if not norm > 0 or not math.isfinite(norm):
            return False
        rescale = len(self._scales) < SCALES or self._checks % SCALE_EVERY == 0
        if self.credit < 4 * self.batches * (2 if rescale else 1):
            return None
        if rescale:  # the fit our step gave: from the point before it (theta holds it), to theta
            self._scales = [*self._scales, self.gap(own_position, own_sampler, own_step, theta + own_step)][-SCALES:]
            self.stats["scales"] += 1
            self.scale = max(0.0, statistics.median(self._scales))
        self._checks += 1
        if self.scale <= 0:
            return None
        try:  # the position is a remote author's word: one no stream of this run has is judged by nothing
            gap = self.gap(position, self.sampler_for(author, position), step * min(1.0, length / norm), theta)
        except (ValueError, IndexError, OverflowError, RuntimeError) as e:
            logger.info("fit check: cannot redraw the batches author=%s: %s", author[:12], e)
            return None
        self.stats["checks"] += 1
        ok = gap >= self.bar * self.scale
        self.stats["fits"] += int(ok)
        logger.debug("fit check author=%s gap=%s scale=%.4g fits=%s", author[:12], gap, self.scale, ok)
        return ok

    def gap(self, position: DataPosition, sampler: Any, step: Tensor, theta: Tensor) -> float:
        """dL(step, trained batches) - dL(step, unseen batches) at `theta` (see the module docstring), on
        `sampler`, the stream `position` is a position in."""
        # With replacement: `steps` is the author's word, and a permutation of it would be an allocation it sized.
        picks = torch.randint(position.steps, (self.batches,), generator=self.rng).tolist()
        unseen = torch.randint(UNSEEN_FROM, 2 * UNSEEN_FROM, (self.batches,), generator=self.rng).tolist()
        trained = [sampler.batch(position.first_step + i) for i in picks]
        fresh = [sampler.batch(s) for s in unseen]
        self.stats["forwards"] += 4 * self.batches
        self.credit -= 4 * self.batches
        load_flat_params(self.model, theta)
        before = evaluate(self.model, trained), evaluate(self.model, fresh)
        load_flat_params(self.model, theta - step)
        after = evaluate(self.model, trained), evaluate(self.model, fresh)
        return (before[0] - after[0]) - (before[1] - after[1])


def declared(sampler: Any, peer_id: str, first_step: int, steps: int) -> DataPosition | None:
    """Where a phase of `steps` inner steps from `first_step` read its data, as its update declares it; None for a
    stream no one else can redraw (the simulator's named streams): a judge would read other batches than ours."""
    stream = getattr(sampler, "stream", None)
    if stream is None:  # a token dataset's walk: keyed by the PeerID alone (train/data/tokens.py WalkSampler)
        return DataPosition(first_step, steps, 0, 1, 1) if getattr(sampler, "peer_id", None) == peer_id else None
    if stream not in ("", peer_id) or steps < 1:
        return None
    return DataPosition(first_step, steps, sampler.shard, sampler.num_shards, int(stream == peer_id))


def proposal_position(spec: RunSpec, peer_id: str, position: DataPosition | None) -> DataPosition | None:
    """What `peer_id`'s update declares: its position if it is a proposal (a run with sponsors, and it is none of
    them), else nothing. Only sponsors read it; and a peer of an older version refuses a header with the field, so
    a run without sponsors keeps its headers as they were."""
    sponsors = spec.defence.sponsors
    return position if sponsors and peer_id not in sponsors else None
