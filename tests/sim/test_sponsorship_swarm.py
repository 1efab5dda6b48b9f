"""A run with founders (sync/sponsorship.py) in the in-process swarm: the 3 honest peers are the spec's sponsors,
10 fresh identities re-sign tampered copies of their work (near copies, negated near copies at the norm bound,
noise shaped like honest work, in turn: attacks built against the copy rule) and an honest volunteer joins
halfway. Every crowd update merges at 0 on every replica, the crowd together earns crumbs of relayed weight
(noise at cosine ~0), the volunteer's proposals are relayed, the replicas stay equal, and the honest loss stays
within 5% of the run without a crowd. benchmarks/bench_crowd_poison.py `--defences sponsors` has the table."""

from __future__ import annotations

import dataclasses

import pytest

from p2p_diloco.config import DefenceConfig, SimConfig, preset
from p2p_diloco.sim.crowd import CrowdAttack, CrowdSwarm
from p2p_diloco.train.data.corpus import load_corpus

pytestmark = pytest.mark.timeout(300)


def _run(crowd: int, steps: int = 240) -> tuple[CrowdSwarm, dict]:
    base = preset("test")
    spec = dataclasses.replace(base, inner=dataclasses.replace(base.inner, inner_steps=20, decay_steps=steps // 3),
                               defence=DefenceConfig())
    sim = SimConfig(peers=3, sponsors=3, total_steps=steps + steps // 3, eval_batches=8,
                    eval_every_s=float(steps), join=(f"{steps // 6}",))
    swarm = CrowdSwarm(spec, sim, load_corpus(spec.data), CrowdAttack(crowd, "mixed_adaptive", 1.0))
    return swarm, swarm.honest_summary(swarm.run())


@pytest.mark.slow  # 30-43 s on 2 cores; the default suite keeps the relay's rules (tests/sync/test_sponsorship.py) and
# the crowd's attacks in a simulated swarm (tests/sim/test_crowd_attacks.py)
def test_a_crowd_against_a_run_with_founders_gets_nothing_and_a_volunteer_is_relayed() -> None:
    _, clean = _run(0)
    swarm, attacked = _run(10)
    assert attacked["finite"] and attacked["eval_loss"] <= 1.05 * clean["eval_loss"], (clean, attacked)
    assert attacked["divergence"] < 1e-6 and clean["divergence"] < 1e-6  # equal replicas, the joiner's too
    crowd = {identity.peer_id for identity in swarm.crowd}
    volunteer = swarm.peers[3].learner.peer_id
    assert volunteer not in swarm.spec.defence.sponsors
    for peer in swarm._alive():
        replica = peer.learner.replica
        if peer.learner.peer_id != volunteer:  # the volunteer loaded the older ones in its snapshot (no ids kept)
            weights = [replica.merged_weight(pid, seq) for pid in crowd
                       for seq in range(1, replica.version_vector.get(pid) + 1)]
            assert weights and not any(weights), "a crowd update merged with a weight somewhere"
        earned = replica.standing.sponsorship.earned
        crowds = sum(w for a, w in earned.items() if a in crowd)  # noise at cosine ~0 may get crumbs
        assert crowds < 0.1, {a: w for a, w in earned.items() if a in crowd}
        if peer.learner.peer_id != volunteer:
            assert earned.get(volunteer, 0.0) > 3 * crowds, "the volunteer's work was not relayed"
