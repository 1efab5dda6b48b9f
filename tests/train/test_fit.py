"""The fit judge (train/fit.py): work trained on the batches its update declares fits them; what no compute
went into (noise at the same length, a phase declared too short, batches the work never read) does not; an update
that declares nothing cannot be judged. A real model and real batches: no stand-ins."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2p_diloco.config import preset
from p2p_diloco.train.data.corpus import load_corpus
from p2p_diloco.train.fit import FORWARDS_PER_STEP, MAX_CREDIT, FitJudge, declared, proposal_position
from p2p_diloco.train.inner import inner_step, make_inner_optimizer
from p2p_diloco.train.models.build import build_model, flat_params, load_flat_params
from p2p_diloco.train.phase import make_sampler
from p2p_diloco.wire.identity import Identity
from p2p_diloco.wire.position import DataPosition

SPEC = preset("test")
H = SPEC.inner.inner_steps


@pytest.fixture(scope="module")
def run():
    torch.manual_seed(0)
    corpus = load_corpus(SPEC.data)
    model = build_model(SPEC.model, SPEC.seed)
    theta = flat_params(model).clone()
    # A few steps from the init first, so that theta is where a run would judge, not at the random start.
    warm = make_sampler(corpus, SPEC, "warm", shard=0, num_shards=1, stream="warm")
    opt = make_inner_optimizer(model, SPEC.inner)
    for step in range(2 * H):
        inner_step(model, opt, *warm.batch(step), 0, SPEC.inner, lr=SPEC.inner.lr)
    theta = flat_params(model).clone()

    def trained(shard: int, first: int) -> torch.Tensor:  # one honest phase on file shard `shard` of 3
        load_flat_params(model, theta)
        sampler = make_sampler(corpus, SPEC, "", shard=shard, num_shards=3)
        opt = make_inner_optimizer(model, SPEC.inner)
        for step in range(first, first + H):
            inner_step(model, opt, *sampler.batch(step), 0, SPEC.inner, lr=SPEC.inner.lr)
        return theta - flat_params(model)

    me = Identity.generate().peer_id
    spec = dataclasses.replace(SPEC, defence=dataclasses.replace(SPEC.defence, sponsors=(me,)))
    judge = FitJudge.for_sponsor(build_model(SPEC.model, SPEC.seed), corpus, spec, 1, me, share=0.05)
    assert judge is not None and judge.min_steps == H and judge.share == 0.05
    # Only a sponsor judges, only on a model it holds whole (not one rank of a unit of several processes), and only
    # with a share of its compute to spend on it (none by default: FIT_SHARE).
    assert FitJudge.for_sponsor(judge.model, corpus, spec, 1, Identity.generate().peer_id, share=0.05) is None
    assert FitJudge.for_sponsor(judge.model, corpus, spec, 1, me, world=2, share=0.05) is None
    assert FitJudge.for_sponsor(judge.model, corpus, spec, 1, me) is None
    own_sampler, own = make_sampler(corpus, SPEC, "", shard=0, num_shards=3), trained(0, 0)

    def fit(*args):  # noqa: ANN002, ANN202
        """One round's check with credit for it (the compute budget has a test of its own)."""
        judge.share = 100.0
        judge.remember(DataPosition(0, H, 0, 3, 0), own, own_sampler)
        check = judge.for_round()
        assert check is not None
        return check(*args)

    return fit, judge, theta, trained, (own, own_sampler)


def test_honest_work_fits_its_declared_batches_far_better_than_what_no_compute_went_into(run) -> None:
    """The gap itself, averaged over a few draws of 8 + 8 batches (one check reads 4 + 4, drawn afresh: a noisy
    verdict, which is why an author is judged on a record, sync/records.py): work shows it on the batches it
    trained on; noise at its length, and the same work read on batches it never trained on (other steps of its
    stream, another shard), show a fraction of it. Negated work is not this judge's: at full length its curvature
    can show a gap either way; a sponsor checks fit only for work that points along its own (sync/fitness.py)."""
    _, judge, theta, trained, _ = run
    work = trained(1, 100)  # another author's phase: file shard 1 of 3, steps 100..100+H
    noise = torch.randn(work.numel(), generator=torch.Generator().manual_seed(3))
    noise *= work.norm() / noise.norm()
    judge.batches = 8

    def gap(step: torch.Tensor, where: tuple[int, ...]) -> float:
        sampler = judge.sampler_for("", DataPosition(*where))
        return sum(judge.gap(DataPosition(*where), sampler, step, theta) for _ in range(6)) / 6

    honest = gap(work, (100, H, 1, 3, 0))
    others = {"noise": gap(noise, (100, H, 1, 3, 0)), "other steps": gap(work, (500, H, 1, 3, 0)),
              "other shard": gap(work, (100, H, 2, 3, 0))}
    judge.batches = 4
    assert honest > 0 and all(honest > 2.5 * abs(g) for g in others.values()), (honest, others)


def test_a_phase_declared_too_short_or_not_at_all_is_not_credited(run) -> None:
    fit, _, theta, trained, _ = run
    work = trained(1, 100)
    assert fit("author", (100, H - 1, 1, 3, 0), work, theta) is False  # concentrated on fewer batches than H
    assert fit("author", (), work, theta) is None
    assert fit("author", (100, H, 1, 3, 0), torch.zeros_like(work), theta) is False  # nothing in it
    # A position no stream of this run has, or steps no sampler can reach: judged by nothing, no exception.
    for hostile in ((100, H, 5, 2**40, 0), (2**62, 2**62, 0, 1, 1), (2**63 - 1, H, 0, 1, 0)):
        assert fit("author", hostile, work, theta) in (None, False, True)


def test_what_an_update_declares() -> None:
    corpus = load_corpus(SPEC.data)
    salted = make_sampler(corpus, SPEC, "me", shard=1, num_shards=2, stream="me")
    assert declared(salted, "me", 40, H) == DataPosition(40, H, 1, 2, 1)
    assert declared(make_sampler(corpus, SPEC, "me", shard=0, num_shards=1), "me", 0, H) == DataPosition(0, H, 0, 1, 0)
    # Only a proposal declares it (a run with sponsors, and we are none): no one else reads it, and an older peer
    # refuses a header with the field.
    where = DataPosition(40, H, 1, 2, 1)
    me, sponsor = Identity.generate().peer_id, Identity.generate().peer_id
    founded = dataclasses.replace(SPEC, defence=dataclasses.replace(SPEC.defence, sponsors=(sponsor,)))
    assert proposal_position(founded, me, where) == where and proposal_position(founded, sponsor, where) is None
    assert proposal_position(SPEC, me, where) is None
    # A stream only its owner can name (the simulator's "unit3"): nothing a judge could redraw.
    assert declared(make_sampler(corpus, SPEC, "me", shard=0, num_shards=1, stream="unit3"), "me", 0, H) is None


def test_checks_take_at_most_their_share_of_the_sponsors_compute(run) -> None:
    """A share (here 0.05) of a sponsor's own inner steps, in forwards (FORWARDS_PER_STEP each): with a candidate every
    round, the checks spend no more than that (plus the credit one may save up), and still check."""
    _, judge, theta, trained, (own, own_sampler) = run
    work, rounds = trained(1, 100), 40
    judge.share, judge.credit, before = 0.05, 0.0, dict(judge.stats)
    answers = []
    for _ in range(rounds):
        judge.remember(DataPosition(0, H, 0, 3, 0), own, own_sampler)
        check = judge.for_round()
        assert check is not None
        # At the sponsor's replica, which holds its own update: its scale is read from the point before it.
        answers.append(check("author", (100, H, 1, 3, 0), work, theta - own))
    used, spent = judge.stats["forwards"] - before["forwards"], {k: judge.stats[k] - before[k] for k in before}
    assert 0 < used <= 0.05 * FORWARDS_PER_STEP * H * rounds + MAX_CREDIT * 2 * 4 * judge.batches
    assert answers.count(None) > 0 and sum(a is not None for a in answers) > 0  # some rounds wait, some check
    # What was spent is what the checks and the measurements of our own scale cost: 4 x 4 forwards each.
    assert used == 4 * judge.batches * (spent["checks"] + spent["scales"])
    judge.remember(None, own, own_sampler)
    assert judge.for_round() is None  # no position of our own: no scale, no checks
