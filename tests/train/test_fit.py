"""The fit judge (train/fit.py): work trained on the stream its update declares teaches that stream more than
the judge's own step did; what no compute went into (noise at the same length, an echo of the judge's own merged
step, the same work negated, a phase declared too short) does not; an update that declares nothing cannot be
judged. A real model and real batches: no stand-ins."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2p_diloco.config import TrainingConfig, preset
from p2p_diloco.train.data.corpus import load_corpus
from p2p_diloco.train.fit import FIT_SHARE, FORWARDS_PER_STEP, MAX_CREDIT, FitJudge, declared, proposal_position
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

    def trained(shard: int, first: int, start: torch.Tensor | None = None) -> torch.Tensor:
        """One honest phase on file shard `shard` of 3 from `start` (the warm theta)."""
        start = theta if start is None else start
        load_flat_params(model, start)
        sampler = make_sampler(corpus, SPEC, "", shard=shard, num_shards=3)
        opt = make_inner_optimizer(model, SPEC.inner)
        for step in range(first, first + H):
            inner_step(model, opt, *sampler.batch(step), 0, SPEC.inner, lr=SPEC.inner.lr)
        return start - flat_params(model)

    me = Identity.generate().peer_id
    spec = dataclasses.replace(SPEC, defence=dataclasses.replace(SPEC.defence, sponsors=(me,)))
    judge = FitJudge.for_sponsor(build_model(SPEC.model, SPEC.seed), corpus, spec, 1, me, share=0.05)
    assert judge is not None and judge.min_steps == H and judge.share == 0.05
    # Only a sponsor judges, only on a model it holds whole (not one rank of a unit of several processes), and only
    # with a share of its compute to spend on it (FIT_SHARE by default, 0: none).
    assert FitJudge.for_sponsor(judge.model, corpus, spec, 1, Identity.generate().peer_id, share=0.05) is None
    assert FitJudge.for_sponsor(judge.model, corpus, spec, 1, me, world=2, share=0.05) is None
    assert FitJudge.for_sponsor(judge.model, corpus, spec, 1, me, share=0.0) is None
    default = FitJudge.for_sponsor(judge.model, corpus, spec, 1, me)
    assert default is not None and default.share == FIT_SHARE == TrainingConfig().fit_share > 0
    own = trained(0, 0)  # the judge's own phase on shard 0, merged: the judge stands at theta - own

    def fit(*args):  # noqa: ANN002, ANN202
        """One round's check with credit for it (the compute budget has a test of its own)."""
        judge.share = 100.0
        judge.remember(DataPosition(0, H, 0, 3, 0), own)
        check = judge.for_round()
        assert check is not None
        return check(*args)

    return fit, judge, theta - own, trained, own


def test_honest_work_teaches_its_declared_stream_what_no_compute_went_into_does_not(run) -> None:
    """The lift itself, over 8 batches of the declared stream nobody trained on: a phase of honest work on file
    shard 2, which the judge's model has not learned (loss 3.7 against 2.8-2.9 on shards 0 and 1, the late
    volunteer's case in BENCHMARKS "Fit checks"), teaches shard 2 far more than the judge's own step (on shard 0,
    merged already) did; noise at its length, the judge's own step echoed (merged: moving along it again
    overshoots), and the work negated teach nothing; the check passes the honest work and none of the others.
    (Honest work on shard 1, which is like shard 0, lifts only ~1% (`benchmarks/results/crowd/fit/lift_probe.txt`):
    it is not the fit check's to find; it points along the sponsors' and is judged by that.)"""
    fit, judge, theta, trained, own = run
    work = trained(2, 100, theta)  # another author's phase: file shard 2 of 3, steps 100..100+H, from the judge's theta
    noise = torch.randn(work.numel(), generator=torch.Generator().manual_seed(3))
    noise *= work.norm() / noise.norm()
    echo = own + 0.3 * noise * (own.norm() / noise.norm())
    shard2 = judge.sampler_for("", DataPosition(100, H, 2, 3, 0))
    judge.batches = 8
    lifts = {name: judge.lift(shard2, step * min(1.0, float(own.norm() / step.norm())), own, theta)[0]
             for name, step in {"honest": work, "noise": noise, "echo": echo, "negated": -work}.items()}
    judge.batches = 4
    honest = lifts.pop("honest")
    assert honest > 0 and all(honest > 3 * g for g in lifts.values()), (honest, lifts)
    assert fit("author", (100, H, 2, 3, 0), work, theta) is True
    for name, step in {"noise": noise, "echo": echo, "negated": -work}.items():
        assert fit("author", (100, H, 2, 3, 0), step, theta) is False, name


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
    _, judge, theta, trained, own = run
    work, rounds = trained(1, 100), 40
    judge.share, judge.credit, before = 0.05, 0.0, dict(judge.stats)
    answers = []
    for _ in range(rounds):
        judge.remember(DataPosition(0, H, 0, 3, 0), own)
        check = judge.for_round()
        assert check is not None
        answers.append(check("author", (100, H, 1, 3, 0), work, theta))
    used, spent = judge.stats["forwards"] - before["forwards"], {k: judge.stats[k] - before[k] for k in before}
    assert 0 < used <= 0.05 * FORWARDS_PER_STEP * H * rounds + MAX_CREDIT * judge.cost
    assert answers.count(None) > 0 and sum(a is not None for a in answers) > 0  # some rounds wait, some check
    assert used == judge.cost * spent["checks"] == 3 * judge.batches * spent["checks"]  # what the checks cost
    judge.remember(None, own)
    assert judge.for_round() is None  # no position of our own: no credit, no checks
