"""The aggregation tree in the in-process swarm: every update merged once through signed exact sums, and a lying
aggregator caught by its auditor before anyone uses its sum, the evidence held on every replica."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2p_diloco.config import SimConfig, preset
from p2p_diloco.sim.liars import lying_aggregator
from p2p_diloco.sim.swarm import AsyncSwarm
from p2p_diloco.sync.exact_sum import from_grid
from p2p_diloco.train.data.corpus import load_corpus

pytestmark = pytest.mark.slow  # 50 s on 2 cores; the default suite's representative is tests/net/test_tree.py

BASE = preset("test")
SPEC = dataclasses.replace(BASE, defence=dataclasses.replace(BASE.defence, copy_cosine=0.0))
PEERS, ROUNDS = 8, 3


class Swarm(AsyncSwarm):
    """Remembers theta at the start, to recompute what every replica must hold."""

    def _add_peer(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        peer = super()._add_peer(*args, **kwargs)
        self.theta0 = getattr(self, "theta0", peer.learner.replica.theta.clone())
        return peer


def run(aggregate: int, liar: bool = False) -> Swarm:
    sim = SimConfig(peers=PEERS, total_steps=PEERS * SPEC.inner.inner_steps * ROUNDS, aggregate=aggregate)
    swarm = Swarm(SPEC, sim, load_corpus(SPEC.data))
    if liar:
        lying_aggregator(swarm)
    swarm.result = swarm.run()  # type: ignore[attr-defined]
    return swarm


def expected_theta(swarm: Swarm) -> torch.Tensor:
    """theta0 less the exact step of every update the live replicas merged, each from its author's store."""
    live = [p for p in swarm.peers if p.alive]
    vv = live[0].learner.replica.version_vector
    judge = live[0].learner.replica
    total = torch.zeros_like(swarm.theta0, dtype=torch.int64)
    for author in swarm.peers:
        for seq in range(1, vv.get(author.learner.peer_id) + 1):
            update = author.store.get(author.learner.peer_id, seq)
            assert update is not None and vv.has(author.learner.peer_id, seq)
            total += judge.exact_step(update) if author.alive else _step_anyway(judge, update)
    return swarm.theta0 - from_grid(total)


def _step_anyway(replica, update):  # type: ignore[no-untyped-def]
    """An update of a peer banned since it merged: its step as it merged then."""
    from p2p_diloco.sync.sum_merge import exact_step
    multiplier = replica.standing.exact_multiplier(update.sender, update.seq)
    return exact_step(replica._rule, update, multiplier)


def test_the_tree_merges_every_update_once_and_trains_as_full_dissemination_does():
    full, tree = run(0), run(4)
    counts = tree.tree.counts  # type: ignore[union-attr]
    assert counts["totals"] >= ROUNDS and counts["audits_passed"] > 0 and counts["caught"] == 0
    expected = expected_theta(tree)
    vectors = {p.learner.replica.version_vector for p in tree.peers}
    assert len(vectors) == 1
    assert sum(next(iter(vectors)).get(p.learner.peer_id) for p in tree.peers) == PEERS * ROUNDS
    for peer in tree.peers:  # each update once, at its exact weight: theta is theta0 less their sum
        assert (peer.learner.replica.theta - expected).abs().max() < 5e-6
    loss_full, loss_tree = full.result.eval_loss, tree.result.eval_loss  # type: ignore[attr-defined]
    assert abs(loss_tree / loss_full - 1) < 0.01


def test_a_lying_aggregator_is_caught_before_its_sum_is_used():
    swarm = run(4, liar=True)
    counts = swarm.tree.counts  # type: ignore[union-attr]
    assert counts["caught"] >= 1
    liar = next(iter(swarm.tree.liars))  # type: ignore[union-attr]
    live = [p for p in swarm.peers if p.alive]
    assert all(liar in p.learner.replica.banned for p in live)  # the evidence reached and held on every replica
    assert counts["evidence_held"] >= len(live) - 1  # each re-checked it (the auditor too, with its own)
    expected = expected_theta(swarm)
    for peer in live:  # nothing of the lie: theta is theta0 less the true steps of what it merged
        assert (peer.learner.replica.theta - expected).abs().max() < 5e-6
