"""The crowd harness's attacks designed against the rules (sim/crowd_attacks.py, benchmarks/bench_crowd_poison.py)
produce what they claim: the behaviour of the harness, not of the defence. One small in-process swarm: 3 honest
peers, 2 hostile peers that train (one publishes its update negated, trained from an honest replica's state; one
scaled x5 under the norm bound), a 4th honest peer joining late, and a crowd of 4 identities copying that newcomer
in the modes of `mixed_adaptive`."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch import Tensor

from p2p_diloco.config import DefenceConfig, SimConfig, preset
from p2p_diloco.sim.adversary import Adversary, Hostility
from p2p_diloco.sim.crowd import CrowdAttack, CrowdSwarm
from p2p_diloco.sim.crowd_attacks import BOUND_MARGIN, MIXES, crowd_delta, mode_of
from p2p_diloco.train.data.corpus import load_corpus

pytestmark = pytest.mark.timeout(120)

H, STEPS = 5, 10  # inner steps per phase, steps per peer


def _cos(a: Tensor, b: Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


@pytest.fixture(scope="module")
def swarm() -> CrowdSwarm:
    base = preset("test")
    spec = dataclasses.replace(base, inner=dataclasses.replace(base.inner, inner_steps=H, decay_steps=STEPS),
                               defence=DefenceConfig())
    sim = SimConfig(peers=5, total_steps=7 * STEPS, eval_batches=1, eval_every_s=1e9, join=(str(STEPS / 3),))
    adversaries = [Adversary(3, Hostility.SIGN_FLIP, track=True),
                   Adversary(4, Hostility.SCALE, factor=5.0, bounded=True)]
    swarm = CrowdSwarm(spec, sim, load_corpus(spec.data), CrowdAttack(4, "mixed_adaptive", 1.0, source=5),
                       adversaries=adversaries)
    swarm.run()
    return swarm


def test_crowd_identities_publish_near_copies_of_the_newcomer_that_no_copy_test_pairs(swarm: CrowdSwarm) -> None:
    newcomer, judge = swarm.peers[5], swarm.peers[1]
    codec, numel = judge.learner.codec, judge.learner.numel
    rounds = newcomer.learner.last_seq
    assert rounds >= 2 and all(s == rounds for s in swarm.crowd_seq), (rounds, swarm.crowd_seq)
    for seq in range(1, rounds + 1):
        original = judge.store.get(newcomer.learner.peer_id, seq)
        assert original is not None
        d = codec.decompress(original.payload, numel)
        sent = []
        for identity in swarm.crowd:
            update = judge.store.get(identity.peer_id, seq)
            assert update is not None and update.header.weight == swarm.spec.outer.max_weight
            sent.append(codec.decompress(update.payload, numel))
        near, near_pos, at_bound, shaped = sent
        assert [mode_of("mixed_adaptive", i) for i in range(4)] == list(MIXES["mixed_adaptive"])
        assert -0.9999 < _cos(near, d) < -0.99
        assert 0.99 < _cos(near_pos, d) < 0.9999
        assert -0.9999 < _cos(at_bound, d) < -0.99
        assert 0.9 * BOUND_MARGIN * swarm.bound < float(at_bound.abs().max()) <= swarm.bound
        assert abs(_cos(shaped, d)) < 0.05  # a random direction with the honest magnitudes
        assert float(shaped.norm() / d.norm()) == pytest.approx(1.0, rel=0.05)
        for a, b in itertools.combinations(sent, 2):
            assert abs(_cos(a, b)) < 0.9999  # no two crowd payloads are copies of each other


def test_hostile_trainers_spend_the_token_budget_and_publish_their_own_work_tampered(swarm: CrowdSwarm) -> None:
    steps = {p.index: p.learner.step for p in swarm.peers}
    assert sum(steps.values()) == swarm.steps_started <= swarm.sim.total_steps
    assert steps[3] >= 2 * H and steps[4] >= 2 * H, steps  # they train like the honest ones
    negated = [p for p in swarm.published if p.peer == 3]
    scaled = [p for p in swarm.published if p.peer == 4]
    assert len(negated) == steps[3] // H and len(scaled) == steps[4] // H
    assert all(p.cosine < -0.999 and p.length_ratio == pytest.approx(1.0, rel=0.01) for p in negated)
    assert all(p.cosine > 0.999 and 1.0 < p.length_ratio <= 5.01 and p.peak <= swarm.bound for p in scaled)
    hostile = {swarm.peers[i].learner.peer_id for i in (3, 4)}
    assert hostile <= set(swarm.attackers())
    for peer in swarm.honest():  # their updates reached the honest replicas (merged, whatever weight)
        assert all(peer.learner.replica.version_vector.get(pid) >= 2 for pid in hostile)


def test_exact_modes_are_copies_and_noise_keeps_the_honest_length() -> None:
    rng = torch.Generator().manual_seed(0)
    d = torch.randn(4096, generator=rng) * torch.rand(4096, generator=rng)
    kw = dict(factor=5.0, bound=float("inf"), rng=rng)
    assert torch.equal(crowd_delta("sign_flip", d, **kw), -d) and torch.equal(crowd_delta("copy", d, **kw), d)
    assert torch.equal(crowd_delta("scale", d, **kw), 5 * d)
    assert float(crowd_delta("noise", d, factor=1.0, bound=float("inf"), rng=rng).norm()) == pytest.approx(
        float(d.norm()), rel=1e-5)
    shaped = crowd_delta("noise_shaped", d, **kw)
    assert torch.equal(shaped.abs().sort().values, d.abs().sort().values)
    with pytest.raises(ValueError):
        mode_of("nonsense", 0)


def test_echo_noise_points_along_the_swarms_move_and_no_two_identities_are_near_copies() -> None:
    """`echo_noise`, built against the sponsors' judge of directions: cosine ECHO_COSINE with the swarm's recent
    move, the honest length, under the bound, and two identities' payloads far from the copy rule's 0.95."""
    from p2p_diloco.sim.crowd_attacks import ECHO_COSINE

    rng = torch.Generator().manual_seed(1)
    d, along = torch.randn(4096, generator=rng), torch.randn(4096, generator=rng)
    a, b = (crowd_delta("echo_noise", d, factor=1.0, bound=float("inf"), rng=rng, along=along) for _ in range(2))
    assert _cos(a, along) == pytest.approx(ECHO_COSINE, abs=1e-4) and _cos(b, along) == pytest.approx(ECHO_COSINE,
                                                                                                        abs=1e-4)
    assert float(a.norm()) == pytest.approx(float(d.norm()), rel=1e-5)
    assert abs(_cos(a, b)) < 0.9  # ~ ECHO_COSINE ** 2
    bound = 0.5 * float(a.abs().max())
    assert float(crowd_delta("echo_noise", d, factor=1.0, bound=bound, rng=rng, along=along).abs().max()) \
        <= BOUND_MARGIN * bound + 1e-6


def test_echo_soft_echoes_the_update_itself_at_its_softer_cosine() -> None:
    """`echo_soft`, built against the sponsors' echo test: `echo_source` at SOFT_COSINE with the update it copies."""
    from p2p_diloco.sim.crowd_attacks import SOFT_COSINE

    rng = torch.Generator().manual_seed(2)
    d = torch.randn(4096, generator=rng)
    a, b = (crowd_delta("echo_soft", d, factor=1.0, bound=float("inf"), rng=rng) for _ in range(2))
    assert _cos(a, d) == pytest.approx(SOFT_COSINE, abs=1e-4) and _cos(b, d) == pytest.approx(SOFT_COSINE, abs=1e-4)
    assert float(a.norm()) == pytest.approx(float(d.norm()), rel=1e-5) and abs(_cos(a, b)) < 0.5


def test_masked_work_is_honest_only_where_the_copy_test_reads_and_spikes_sit_at_the_bound() -> None:
    """`masked` (built against a judge reading the public copy coordinates) and `spiked` (against any sample)."""
    from p2p_diloco.sim.adversary import masked, spiked
    from p2p_diloco.sync.copies import copy_coordinates

    rng = torch.Generator().manual_seed(1)
    d, theta = torch.randn(40_000, generator=rng), torch.randn(40_000, generator=rng)
    at = copy_coordinates(d.numel())
    out = masked(d, at, -1.0)
    elsewhere = torch.ones(d.numel(), dtype=torch.bool)
    elsewhere[at] = False
    assert torch.equal(out[at], d[at]) and torch.equal(out[elsewhere], -d[elsewhere])
    assert _cos(out, d) < -0.75  # to theta: mostly negated (4,096 of 40,000 coordinates honest)
    capped = masked(d, at, -5.0, bound=2.0)
    assert float(capped[elsewhere].abs().max()) <= BOUND_MARGIN * 2.0 + 1e-6  # x5 capped under the bound
    spikes = spiked(d, theta, 0.01, bound=10.0)
    moved = spikes != d
    assert 390 <= int(moved.sum()) <= 400  # the fraction asked (a coordinate already at the value stays)
    assert torch.allclose(spikes[moved].abs(), torch.tensor(9.9))
    assert bool((torch.sign(spikes[moved]) == -torch.sign(theta[moved])).all())  # theta - step: away from 0
    assert torch.equal(spikes[~moved], d[~moved])


def test_undercut_work_keeps_its_length_and_points_along_the_swarm_just_as_far_as_asked() -> None:
    """The attack built against a sponsor's fit check (sim/tilts.py `undercut`): its own work, minus enough of the
    swarm's direction that the cosine with it is the one asked for (too weak to count, still positive), at the
    work's length; work already under that cosine is left as it is. Against `tilt`, which negates the work."""
    from p2p_diloco.sim.tilts import tilt, undercut

    g = torch.Generator().manual_seed(11)
    swarm = torch.randn(2048, generator=g)
    work = 0.6 * swarm + torch.randn(2048, generator=g)

    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.dot(a, b) / (a.norm() * b.norm()))

    for target in (0.01, 0.05, 0.2):
        out = undercut(work, swarm, target)
        assert cos(out, swarm) == pytest.approx(target, abs=1e-4)
        assert float(out.norm()) == pytest.approx(float(work.norm()), rel=1e-5)
        assert cos(out, work) > 0.5  # still mostly the work itself: its fit stays
        assert cos(tilt(work, swarm, target), work) < 0  # tilt's is the work negated
    against = -work
    assert torch.equal(undercut(against, swarm, 0.05), against)  # already under: unchanged
