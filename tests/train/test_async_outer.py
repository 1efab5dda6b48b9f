"""What the async round does besides the outer step: the lr clock a unit follows and when remote updates reach
its local model. Both are RunSpec settings, the same on every peer and in the simulator."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from p2p_diloco.config import preset
from p2p_diloco.sync.robust import MergePolicy
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.train.exchange import CollectingExchange, SwarmView
from p2p_diloco.train.learner import Learner
from p2p_diloco.train.loop import run_rounds
from p2p_diloco.train.models.build import flat_params
from p2p_diloco.train.phase import swarm_rounds
from p2p_diloco.wire.identity import Identity

pytestmark = pytest.mark.timeout(180)
BASE = preset("test")


def spec(**inner):
    return dataclasses.replace(BASE, inner=dataclasses.replace(BASE.inner, inner_steps=4, **inner))


def make(corpus, s) -> Learner:
    return Learner(s, Identity.generate(), corpus, shard=0, num_shards=2)


def test_the_swarm_clock_is_the_swarm_progress_of_the_phase_start(corpus):
    learner = make(corpus, spec(schedule_clock="swarm"))
    phase = learner.begin_phase()
    phase.swarm_rounds = swarm_rounds(VersionVector({"a": 4, "b": 4, "c": 1}))  # a unit 4x slower than two others
    phase.steps_done = 2
    assert learner.lr_clock(phase) == int(33 / 9 * 4) + 2  # (16 + 16 + 1) / 9 rounds, times H, and this phase
    own = make(corpus, spec(schedule_clock="own"))
    own.step = 17
    assert own.lr_clock(own.begin_phase()) == 17


@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=50))
def test_swarm_rounds_lies_between_the_slowest_and_fastest_sender(counts):
    r = swarm_rounds(VersionVector({f"p{i}": c for i, c in enumerate(counts)}))
    assert min(counts) - 1e-9 <= r <= max(counts) + 1e-9
    if len(set(counts)) == 1:
        assert r == pytest.approx(counts[0])


@given(st.integers(1, 50), st.integers(1, 10_000), st.integers(1, 20))
def test_newcomers_barely_move_the_swarm_clock(n, c, newcomers):
    # A crowd of fresh identities with one update each must not send the established swarm back to warmup.
    swarm = {f"p{i}": c for i in range(n)}
    crowd = {**swarm, **{f"new{j}": 1 for j in range(newcomers)}}
    assert swarm_rounds(VersionVector(crowd)) > c - newcomers / n - 1e-9


def test_with_one_unit_the_swarm_clock_is_its_own_clock(corpus):
    a, b = make(corpus, spec(schedule_clock="swarm")), make(corpus, spec(schedule_clock="own"))
    for learner in (a, b):
        run_rounds(learner, CollectingExchange(SwarmView(1, 4 * BASE.data.batch_size)), n=3)
    assert torch.equal(a.replica.snapshot()[0], b.replica.snapshot()[0])  # bit-identical: the same lr every step


def test_updates_merged_after_the_rebase_window_wait_for_the_next_phase(corpus):
    s = spec(rebase_window=0.5)
    sender, receiver = make(corpus, s), make(corpus, s)
    (update,) = [d.update for d in run_rounds(sender, CollectingExchange(SwarmView(2, 8 * s.data.batch_size)), n=1)]
    phase = receiver.begin_phase()
    receiver.run_inner(phase, 2)  # half the phase: the window is over
    base = phase.base.clone()
    assert receiver.replica.offer(update)[0].name == "MERGED"
    receiver.run_inner(phase, 2)
    assert phase.rebases == 0 and torch.equal(phase.base, base)  # not added to phi mid-phase...
    assert phase.version_vector.get(sender.peer_id) == 0
    nxt = receiver.begin_phase()  # ...but the next phase starts from the replica that holds it
    assert torch.equal(flat_params(receiver.model).cpu(), receiver.replica.snapshot()[0])
    assert nxt.version_vector.get(sender.peer_id) == 1


def test_inside_the_window_a_merged_update_reaches_phi_at_the_next_step(corpus):
    s = spec(rebase_window=1.0)
    sender, receiver = make(corpus, s), make(corpus, s)
    (update,) = [d.update for d in run_rounds(sender, CollectingExchange(SwarmView(2, 8 * s.data.batch_size)), n=1)]
    phase = receiver.begin_phase()
    receiver.run_inner(phase, 1)
    assert receiver.replica.offer(update)[0].name == "MERGED"
    receiver.run_inner(phase, 1)
    assert phase.rebases == 1 and phase.version_vector.get(sender.peer_id) == 1


def test_a_joiner_takes_the_swarms_decay_but_warms_up_its_own_adamw(corpus):
    from p2p_diloco.train.inner import lr_at

    s = spec(schedule_clock="swarm", warmup_steps=4, decay_steps=100)
    joiner = make(corpus, s)
    phase = joiner.begin_phase()
    phase.swarm_rounds = swarm_rounds(VersionVector({"a": 9, "b": 9}))  # the swarm is 9 rounds (36 steps) in
    clock = joiner.lr_clock(phase)
    assert clock == 36
    # Its first step: the warm-up's first lr, below the swarm's decayed lr; past its own warm-up: the swarm's.
    assert lr_at(clock, s.inner, own_step=0) == pytest.approx(s.inner.lr / 4)
    assert s.inner.lr / 4 < lr_at(clock, s.inner)
    assert lr_at(clock, s.inner, own_step=4) == lr_at(clock, s.inner) < lr_at(4, s.inner)  # decayed, not peak
    # The optimizer really runs at that lr.
    joiner.run_inner(phase, 1)
    assert joiner.optimizer.param_groups[0]["lr"] == pytest.approx(s.inner.lr / 4)


def test_an_update_past_the_runs_norm_bound_is_clipped_not_refused(corpus, caplog):
    # A norm bound far tighter than honest updates (as when an attack has driven the model where weight decay's
    # term is large): the unit clips its own payload to what every peer accepts, merges it and goes on, where it
    # used to refuse its own update and stop ("own update not merged: REJECTED_NORM").
    tight = dataclasses.replace(spec(), defence=dataclasses.replace(BASE.defence, norm_bound=1e-4))
    learner = make(corpus, tight)
    exchange = CollectingExchange(SwarmView(num_peers=1, samples_per_round=tight.data.batch_size * 4))
    with caplog.at_level("WARNING", logger="p2p_diloco.train.outer"):
        run_rounds(learner, exchange, 2)
    assert len(exchange.sent) == 2 and learner.outer_state.clipped > 0
    assert "own update clipped" in caplog.text
    decoded = learner.codec.decompress(exchange.sent[-1].payload, learner.numel)
    assert float(decoded.abs().max()) <= learner.sender_limit * (1 + 2 ** -23)  # the limit as a float32 rounds
    assert MergePolicy.from_spec(tight).screen(decoded) is None
