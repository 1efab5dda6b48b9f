"""The fit judge: does a proposal's work teach the data its author says it trained on, more than our own work
does? (BENCHMARKS "Fit checks" and "The lift"; templar's Gauntlet on assigned pages.)

A unit's batches are a pure function of its data position (wire/position.py `DataPosition`: seed, shard, stream,
step), so a sponsor holding the run's data can draw batches of the stream an author's phase read, at steps no
phase reaches (nobody trained on them), from its own secret generator (the author cannot know which). On them,
paired, at the sponsor's theta:

    lift(u) = dL(u) - max(0, dL_own),   dL(u) = L(theta) - L(theta - u),   dL_own = L(theta + own) - L(theta)

`dL_own` is what the sponsor's own last step (merged in theta already) did for that stream, read from the point
before it. `u` fits when its lift is at least LIFT_BAR of the stream's loss L(theta): its work teaches the
declared stream clearly more than the sponsors' does. What no compute went into teaches nothing new: an echo of
published work is merged in theta already, so moving along it again overshoots (dL < 0, measured -0.07 to -0.31
for the sponsor's own step applied twice); noise at the same length raises the loss; negated work raises it. A
proposal longer than the judge's own step is judged scaled down to it (length buys no lift).

Why not the fit to the author's own batches (`dL(trained) - dL(unseen)`, what this judge read first): on a shard
the model has not learned, work's effect generalizes to the whole shard and the fit to its own batches is a
residual (+0.001..+0.11 beside +0.29..+0.50), so one check was a coin; the lift of the same proposals was 8-14% of
the shard's loss in every check (BENCHMARKS "The lift").

Where it is used: a direction judge (sync/worth.py) cannot see work on a file shard of the author's own (it points
little along the sponsors'), so the sponsors' record (sync/sponsorship.py "Graduation") counts a proposal that
points along their work at all, too little to be valued, as useful when it fits (sync/fitness.py picks which).
What one check costs: 3 x FIT_BATCHES forwards of one batch (theta, theta - u, theta + own).
"""

from __future__ import annotations

import logging
import math
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
"""Unseen batches of the declared stream read per check."""
LIFT_BAR = 0.02
"""The share of the declared stream's loss a proposal's lift must reach: a late file-shard volunteer's were 8-14%
(BENCHMARKS "The lift")."""
FIT_SHARE = 0.05
"""The share of a sponsor's own compute its fit checks may take, counted in forwards: each round adds FIT_SHARE x
FORWARDS_PER_STEP x its inner steps of credit (at most MAX_CREDIT checks' worth kept), and a check spends its
forwards. At 0.05 (the issue's budget for judging) that is a check (3 x 4 forwards) every ~2 rounds at H = 50,
every ~4 at the `test` preset's H = 20 (BENCHMARKS "The lift"; 0: no judge is made). The default, and
`--training.fit-share`'s (config/join.py)."""
FORWARDS_PER_STEP = 3
"""What an inner step costs in forwards of one batch (a forward and a backward: ~2 more)."""
MAX_CREDIT = 2
"""Checks' worth of credit a sponsor may save up (so that a round with two candidates after quiet ones can check
both, and a long quiet spell buys no burst)."""
UNSEEN_FROM = 10**9
"""Unseen batches are drawn at steps from here on: beyond any phase a unit reaches."""


class FitJudge:
    """A sponsor's fit checks on its own model (the learner's, between phases: the next phase loads theta again).

    `sampler_for(author, position)` redraws an author's stream (train/phase.py `make_sampler`). A round's checks
    are held against the judge's own last update (`remember`, `for_round`)."""

    def __init__(self, model: torch.nn.Module, sampler_for: Callable[[str, DataPosition], Any], seed: int,
                 *, min_steps: int = 1, batches: int = FIT_BATCHES, bar: float = LIFT_BAR) -> None:
        """`min_steps`: the shortest phase credited (the run's H): a position declares the compute behind it."""
        self.model, self.sampler_for, self.batches, self.bar = model, sampler_for, batches, bar
        self.min_steps = max(min_steps, 1)
        self.rng = torch.Generator().manual_seed(seed)
        self.credit = 0.0  # forwards we may still spend on checks (`FIT_SHARE`)
        self.share = FIT_SHARE
        self._own: Tensor | None = None
        self.stats = {"checks": 0, "fits": 0, "forwards": 0}

    @property
    def cost(self) -> int:
        """Forwards of one batch a check spends: theta, theta - u and theta + own on `batches` batches."""
        return 3 * self.batches

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

    def remember(self, position: DataPosition | None, step: Tensor) -> None:
        """Our own update of a round, as it moved theta (`step`), trained at `position`: the next round's
        reference (read on each proposal's stream), and the credit its compute earns. A published step, like the
        proposals it is held against (outer momentum included); kept (one parameter-sized tensor at a sponsor)."""
        self._own = step if position is not None else None
        if position is not None:
            earned = self.share * FORWARDS_PER_STEP * position.steps
            self.credit = min(self.credit + earned, MAX_CREDIT * self.cost)

    def for_round(self) -> Fit | None:
        """This round's checks, held against our last update (None before it, or if it declared no position we
        could credit compute by: no checks)."""
        own = self._own
        if own is None:
            return None
        return lambda author, data, step, theta: self.fits(author, data, step, theta, own)

    def fits(self, author: str, data: tuple[int, ...], step: Tensor, theta: Tensor, own: Tensor) -> bool | None:
        """Whether `author`'s `step` (what it would move theta by) teaches the stream its `data` declares more
        than our `own` last step did (see the module docstring); None if it cannot be judged (nothing declared, a
        position no stream of this run has, no credit left: `FIT_SHARE`); False for a phase shorter than H or an
        empty step."""
        if len(data) != len(DataPosition._fields):
            return None
        position = DataPosition(*data)
        if position.steps < self.min_steps:
            return False
        length, norm = float(own.norm()), float(step.norm())
        if not length > 0 or not math.isfinite(length):
            return None
        if not norm > 0 or not math.isfinite(norm):
            return False
        if self.credit < self.cost:
            return None
        try:  # the position is a remote author's word: one no stream of this run has is judged by nothing
            lift, loss = self.lift(self.sampler_for(author, position), step * min(1.0, length / norm), own, theta)
        except (ValueError, IndexError, OverflowError, RuntimeError) as e:
            logger.info("fit check: cannot draw the stream author=%s declares: %s", author[:12], e)
            return None
        self.stats["checks"] += 1
        ok = math.isfinite(lift) and lift >= self.bar * loss
        self.stats["fits"] += int(ok)
        logger.debug("fit check author=%s lift=%.4g loss=%.4g fits=%s", author[:12], lift, loss, ok)
        return ok

    def lift(self, sampler: Any, step: Tensor, own: Tensor, theta: Tensor) -> tuple[float, float]:
        """(lift, L(theta)) of `step` over our `own` on FIT_BATCHES unseen batches of `sampler` (see the module
        docstring)."""
        unseen = torch.randint(UNSEEN_FROM, 2 * UNSEEN_FROM, (self.batches,), generator=self.rng).tolist()
        fresh = [sampler.batch(s) for s in unseen]
        self.stats["forwards"] += self.cost
        self.credit -= self.cost
        losses = []
        for point in (lambda: theta, lambda: theta - step, lambda: theta + own):  # one parameter-sized at a time
            load_flat_params(self.model, point())
            losses.append(evaluate(self.model, fresh))
        now, moved, before = losses
        return (now - moved) - max(0.0, before - now), now


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
