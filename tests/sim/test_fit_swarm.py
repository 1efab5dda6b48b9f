"""Fit checks in the in-process swarm (train/fit.py, sync/fitness.py): a late volunteer on a file shard of its
own, whose work points too little along the sponsors' for a judge of directions, graduates because its work
teaches its shard; a crowd next to it that echoes its updates with its own noise and declares its data position
(built against the check: the check then reads the volunteer's stream for them) graduates nowhere, because only
the earliest-dated of a round's near proposals is checked. Replicas equal throughout. The scenario and seed are
bench_graduation.py's `volunteer_echo` row (BENCHMARKS "The lift"), where without checks the volunteer was
carried by no sponsor at any update."""

from __future__ import annotations

import dataclasses

import pytest

from p2p_diloco.config import DefenceConfig, SimConfig, preset
from p2p_diloco.sim.crowd import CrowdAttack, CrowdSwarm
from p2p_diloco.train import fit
from p2p_diloco.train.data.corpus import load_corpus

pytestmark = pytest.mark.timeout(300)
STEPS = 600


def _run(share: float, monkeypatch: pytest.MonkeyPatch) -> tuple[CrowdSwarm, dict]:
    monkeypatch.setattr(fit, "FIT_SHARE", share)  # the learners' default (`--training.fit-share`'s)
    base = dataclasses.replace(preset("test"), seed=1)
    spec = dataclasses.replace(base, inner=dataclasses.replace(base.inner, inner_steps=20, decay_steps=STEPS // 3),
                               defence=DefenceConfig())
    sim = SimConfig(peers=3, sponsors=3, total_steps=STEPS + STEPS // 3, eval_batches=8, eval_every_s=float(STEPS),
                    join=(f"{STEPS // 6}",), iid=False)  # a file shard per unit: the volunteer's is its own
    attack = CrowdAttack(10, "echo_soft", source=3, adjacent=True, declare=True)
    swarm = CrowdSwarm(spec, sim, load_corpus(spec.data), attack)
    return swarm, swarm.honest_summary(swarm.run())


@pytest.mark.slow  # 50 s on 2 cores; the default suite keeps the fit check on a real model (tests/train/test_fit.py)
# and its selection (tests/sync/test_fitness.py)
def test_a_file_shard_volunteer_graduates_by_what_its_work_teaches_and_its_echoes_do_not(monkeypatch) -> None:
    swarm, summary = _run(0.25, monkeypatch)
    assert summary["finite"] and summary["divergence"] < 1e-6
    volunteer = swarm.peers[3].learner.peer_id
    by_seq = swarm.relayed_by_seq(volunteer)
    assert not any(by_seq[1]) and not any(by_seq[2]), by_seq  # its first 2: a newcomer's share
    assert sum(share > 0 for share in by_seq[3]) >= 2, by_seq  # a member's from its 3rd, at 2 sponsors or more
    judges = [p.learner.fit for p in swarm.peers[:3]]
    assert all(j is not None for j in judges)
    assert sum(j.stats["fits"] for j in judges) >= 4  # 2 in a row at 2 sponsors, at least
    crowd = {identity.peer_id for identity in swarm.crowd}
    for p in swarm.peers[:3]:
        assert not set(p.learner.replica.standing.sponsorship.graduates) & crowd  # no echoer graduated anywhere


@pytest.mark.slow  # the default suite's representative: the test above
def test_without_fit_checks_the_same_volunteer_is_carried_by_no_sponsor(monkeypatch) -> None:
    """The same run with no checks: the direction judge alone never carries it as a member's."""
    swarm, summary = _run(0.0, monkeypatch)
    assert summary["divergence"] < 1e-6 and all(p.learner.fit is None for p in swarm.peers[:3])
    assert not any(any(shares) for shares in swarm.relayed_by_seq(swarm.peers[3].learner.peer_id).values())
