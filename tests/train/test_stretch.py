"""Stretched phases (a slow uplink sends less): while our own published updates back up
(`Exchange.backlog`), the round loop trains the same phase for H more steps, up to `max_stretch` * H, and
publishes one update for them; its signed samples cover every step, its weight one round's share."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch

from p2p_diloco.config import preset
from p2p_diloco.config.errors import ConfigError
from p2p_diloco.config.join import TrainingConfig
from p2p_diloco.peer.exchange import SwarmExchange
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.train.exchange import CollectingExchange
from p2p_diloco.train.learner import Learner, SwarmView
from p2p_diloco.train.loop import Hooks, PhaseStretched, RoundDone, Schedule, StepDone, rounds
from p2p_diloco.train.outer import OuterState, outer_update
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.identity import Identity

pytestmark = pytest.mark.timeout(180)

BASE = preset("test")
SPEC = dataclasses.replace(BASE, inner=dataclasses.replace(BASE.inner, inner_steps=3),  # small: many phases
                           model=dataclasses.replace(BASE.model, n_layer=1, n_embd=32, block_size=32))
H, B = SPEC.inner.inner_steps, SPEC.data.batch_size
VIEW = SwarmView(num_peers=8, samples_per_round=8 * H * B)  # one round's share: 1/8


class Backlogged(CollectingExchange):
    """A lone unit whose backlog follows a script: one value per read, the last one repeated."""

    def __init__(self, *script: int) -> None:
        super().__init__(VIEW)
        self.script, self.reads = list(script) or [0], 0

    def backlog(self) -> int:
        self.reads += 1
        return self.script[min(self.reads, len(self.script)) - 1]


def learner(corpus) -> Learner:
    return Learner(SPEC, Identity.generate(), corpus, shard=0, num_shards=2)


def run(lrn: Learner, exchange, n: int, schedule: Schedule | None = None, hooks: Hooks | None = None):
    schedule = schedule or Schedule(rounds=n)
    return list(rounds(lrn, exchange, schedule, hooks))


def done(ticks) -> list[RoundDone]:
    return [t for t in ticks if isinstance(t, RoundDone)]


def test_no_backlog_phases_of_h(corpus) -> None:
    exchange = Backlogged(0)
    ticks = run(learner(corpus), exchange, 3)
    assert not any(isinstance(t, PhaseStretched) for t in ticks)
    assert [(d.stretch, d.result.steps, d.update.header.samples) for d in done(ticks)] == [(1, H, H * B)] * 3
    assert exchange.reads == 3  # read once per phase, at its end


def test_a_backlog_stretches_phases_up_to_the_max(corpus) -> None:
    lrn = learner(corpus)
    ticks = run(lrn, Backlogged(5), 2, Schedule(rounds=2, max_stretch=3))
    rounds_ = done(ticks)
    assert [(d.stretch, d.result.steps) for d in rounds_] == [(3, 3 * H)] * 2
    assert sum(isinstance(t, PhaseStretched) for t in ticks) == 4
    assert sum(isinstance(t, StepDone) for t in ticks) == 6 * H
    assert [d.update.seq for d in rounds_] == [1, 2] and lrn.step == 6 * H
    assert all(d.update.header.samples == 3 * H * B for d in rounds_)  # the samples: every step's
    assert [h["steps"] for h in lrn.history] == [3 * H, 3 * H]


def test_a_stretched_update_weighs_k_rounds_share_and_sends_their_mean_step(corpus) -> None:
    plain, stretched = learner(corpus), learner(corpus)
    a = done(run(plain, Backlogged(0), 1))[0].update
    b = done(run(stretched, Backlogged(9), 1, Schedule(rounds=1, max_stretch=4)))[0].update
    assert b.header.samples == 4 * a.header.samples
    # tau is 0 for both (no other sender): the weight is the samples' share of the swarm's round
    assert a.header.weight == pytest.approx(1 / 8) and b.header.weight == pytest.approx(4 / 8)
    assert stretched.round_weight == pytest.approx(plain.round_weight) == pytest.approx(1 / 8)


def test_outer_update_of_k_rounds_is_the_mean_of_k_rounds_on_equal_deltas() -> None:
    cfg, codec = SPEC.outer, get_codec("fp32")
    torch.manual_seed(0)
    delta, m0, e0 = torch.randn(64), torch.randn(64), torch.randn(64) * 1e-3
    k = 3
    one = OuterState(momentum=m0.clone(), error=e0.clone())
    _, stretched = outer_update(delta, one, cfg, codec, rounds=k)
    many, total = OuterState(momentum=m0.clone(), error=e0.clone()), torch.zeros(64)
    for _ in range(k):
        total += outer_update(delta / k, many, cfg, codec)[1]
    # theta moves by k * mean = the k rounds' sum (fp32: e carries nothing new), m ends as after k rounds
    assert torch.allclose(k * stretched, total, atol=1e-5)
    assert torch.allclose(one.momentum, many.momentum, atol=1e-6)
    # rounds=1 is the plain outer step, bit for bit
    a, b = OuterState.zeros(64), OuterState.zeros(64)
    assert torch.equal(outer_update(delta, a, cfg, codec)[1], outer_update(delta, b, cfg, codec, rounds=1)[1])


def test_a_lossy_codecs_error_is_carried_in_one_rounds_units() -> None:
    cfg, codec = SPEC.outer, get_codec("int8", 64)
    torch.manual_seed(1)
    delta = torch.randn(256)
    state = OuterState.zeros(256, torch.float32)  # the algorithm, without bf16 storage
    _, decoded = outer_update(delta, state, cfg, codec, rounds=4)
    m = OuterState.zeros(256, torch.float32)
    target = sum(outer_update(delta / 4, m, cfg, get_codec("fp32"))[1] for _ in range(4)) / 4
    # weighted 4 rounds' share, the residual counts 4 times in one round's units
    assert torch.allclose(state.error, 4 * (target - decoded), atol=1e-6)


def test_the_stretch_ends_when_the_backlog_clears_and_below_the_threshold(corpus) -> None:
    ticks = run(learner(corpus), Backlogged(2, 1, 0), 2, Schedule(rounds=2, max_stretch=4, stretch_backlog=2))
    assert [d.stretch for d in done(ticks)] == [2, 1]
    assert [t.backlog for t in ticks if isinstance(t, PhaseStretched)] == [2]


def test_max_stretch_one_turns_it_off(corpus) -> None:
    exchange = Backlogged(100)
    assert [d.stretch for d in done(run(learner(corpus), exchange, 2, Schedule(rounds=2, max_stretch=1)))] == [1, 1]
    assert exchange.reads == 0


def test_an_exchange_without_backlog_never_stretches(corpus) -> None:
    class Plain:
        def __init__(self) -> None:
            self.sent = []

        def publish(self, update) -> None:
            self.sent.append(update)

        def swarm_view(self) -> SwarmView:
            return VIEW

    assert [d.stretch for d in done(run(learner(corpus), Plain(), 2))] == [1, 1]


def test_no_stretch_once_finishing_and_hooks_may_refuse(corpus) -> None:
    finish = threading.Event()
    ticks = rounds(learner(corpus), Backlogged(9), Schedule(), finish=finish)
    seen = []
    for tick in ticks:
        seen.append(tick)
        if isinstance(tick, StepDone) and tick.phase.steps_done == 1:
            finish.set()
    assert [d.stretch for d in done(seen)] == [1]

    class NoMore(Hooks):
        def admit_stretch(self) -> bool:
            return False

    assert [d.stretch for d in done(run(learner(corpus), Backlogged(9), 1, hooks=NoMore()))] == [1]


def test_no_stretch_past_the_weights_clamp(corpus) -> None:
    small = CollectingExchange(SwarmView(num_peers=2, samples_per_round=2 * H * B))  # one round's share: 1/2
    small.pending = 9
    lrn = learner(corpus)
    ticks = run(lrn, small, 3, Schedule(rounds=3, max_stretch=4))
    # the first phase knows no share yet (and no real backlog exists before a first update); then at most 2 rounds
    # (max_weight 1): their weights are not clamped, so none is under-counted
    assert [d.stretch for d in done(ticks)][1:] == [2, 2]
    assert [d.update.header.weight for d in done(ticks)][1:] == pytest.approx([1.0, 1.0])


def test_a_stretched_phase_keeps_rebasing_over_its_whole_length(corpus) -> None:
    lrn, other = learner(corpus), learner(corpus)
    remote = done(run(other, Backlogged(0), 1))[0].update
    phase = lrn.begin_phase()
    lrn.run_inner(phase)  # H steps
    phase.target_steps += H
    lrn.replica.offer(remote)  # merged after the first H steps, inside the stretch
    lrn.run_inner(phase, 1)
    assert phase.rebases == 1 and phase.version_vector.get(other.peer_id) == 1


def test_a_restart_moves_the_data_position_past_a_stretched_update(corpus) -> None:
    lrn = learner(corpus)
    updates = [d.update for d in done(run(lrn, Backlogged(9), 2, Schedule(rounds=2, max_stretch=2)))]
    again = Learner(SPEC, lrn.identity, corpus, shard=0, num_shards=2)
    assert again.adopt_own_updates(updates) == 2 and again.step == lrn.step == 4 * H


def test_training_config_checks_the_stretch_settings() -> None:
    assert TrainingConfig().validate().max_stretch == 4  # on by default
    with pytest.raises(ConfigError):
        TrainingConfig(max_stretch=0).validate()
    with pytest.raises(ConfigError):
        TrainingConfig(stretch_backlog=0).validate()


def fake_network(last_seq: int, known: dict[str, VersionVector], live: set[str], me: str = "me"):
    gossip = SimpleNamespace(known_vectors=lambda: dict(known), tree=None)
    return SimpleNamespace(gossip=gossip, node=SimpleNamespace(peer_id=me), learner=SimpleNamespace(last_seq=last_seq),
                           peers={p: {} for p in live | {me}})


def test_swarm_exchange_backlog_is_what_no_live_peer_holds() -> None:
    known = {"a": VersionVector({"me": 3}), "b": VersionVector({"me": 7}), "gone": VersionVector({"me": 10}),
             "c": VersionVector({})}
    exchange = SwarmExchange(fake_network(10, known, {"a", "b", "c"}), loop=None, samples_per_update=1.0)
    assert exchange.backlog() == 3  # the best-informed live peer holds up to 7; "gone" is not live
    assert SwarmExchange(fake_network(10, {}, {"a"}), None, 1.0).backlog() == 0  # nothing known yet
    assert SwarmExchange(fake_network(5, {"a": VersionVector({"me": 9})}, {"a"}), None, 1.0).backlog() == 0
    network = fake_network(10, known, {"a"})
    exchange = SwarmExchange(network, None, 1.0)
    assert exchange.backlog() == 7

    def torn():
        raise RuntimeError("dictionary changed size during iteration")

    network.gossip.known_vectors = torn
    assert exchange.backlog() == 7  # the last answer stands
    network.gossip = None  # before the network started
    assert exchange.backlog() == 0


def test_the_simulators_exchange_has_no_backlog_unless_given_one() -> None:
    from p2p_diloco.sim.memory import MemoryExchange

    assert MemoryExchange(None, "me", lambda: VIEW).backlog() == 0
    assert MemoryExchange(None, "me", lambda: VIEW, backlog=lambda: 4).backlog() == 4
