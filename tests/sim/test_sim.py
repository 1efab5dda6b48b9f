"""The in-process swarm: real learners, real signed envelopes, a simulated network and clock."""

import dataclasses

import pytest
import torch

from p2p_diloco.config import ConfigError, SimConfig, preset
from p2p_diloco.sim.runner import simulate

SPEC = preset("test")  # H = 20
SPEC = dataclasses.replace(SPEC, data=dataclasses.replace(SPEC.data, max_corpus_mb=1.0))


pytestmark = pytest.mark.corpus_mb(1.0)  # the conftest's `corpus`: 1 MB of the stdlib


@pytest.mark.slow  # 17-34 s; the default suite runs the simulator through its command (tests/cli/test_cli.py)
def test_four_peers_lower_eval_loss_and_agree_when_quiet(corpus):
    sim = SimConfig(peers=4, total_steps=4 * 20 * 4, speeds=("1", "1", "0.7", "1.3"), loss=0.2, eval_batches=4)
    result = simulate(SPEC, sim, corpus)
    assert result.curve[0].loss - result.eval_loss > 0.5  # from ~ln(256)=5.5 down
    assert result.divergence < 1e-5  # every replica merged the same set: equal to fp tolerance
    vectors = {p.peer_id: None for p in result.peers}
    assert len(vectors) == 4
    assert all(p.alive and p.steps > 0 and p.bytes_sent > 0 for p in result.peers)
    assert result.messages_lost > 0  # the lossy network really lost messages, and anti-entropy repaired them
    merged = [p.rejected.get("merged", 0) for p in result.peers]
    assert sum(merged) == sum(len(p.taus) for p in result.peers) * 3  # each update reached the 3 others


@pytest.mark.slow  # the default suite kills a real peer instead (tests/peer/test_swarm.py)
def test_crashed_peer_does_not_stop_the_others(corpus):
    sim = SimConfig(peers=4, total_steps=4 * 20 * 4, crash=("1@30",), eval_batches=2)
    result = simulate(SPEC, sim, corpus)
    crashed, others = result.peers[1], [p for i, p in enumerate(result.peers) if i != 1]
    assert not crashed.alive and crashed.steps < min(p.steps for p in others)
    assert sum(p.steps for p in result.peers) >= sim.total_steps - 20  # the budget was spent by the survivors
    assert result.divergence < 1e-5


@pytest.mark.slow  # the default suite has a real joiner sync (tests/peer/test_swarm.py)
def test_joiner_syncs_and_its_updates_are_merged(corpus):
    sim = SimConfig(peers=3, total_steps=3 * 20 * 5, join=("40",), eval_batches=2)
    result = simulate(SPEC, sim, corpus)
    joiner = result.peers[3]
    assert joiner.alive and joiner.steps >= 20 and joiner.taus
    assert all(p.rejected.get("merged", 0) > 0 for p in result.peers)
    assert result.divergence < 1e-5


@pytest.mark.slow  # 15-19 s; the default suite compares async with sync DiLoCo (tests/sim/test_async_outer_step.py)
@pytest.mark.parametrize("method", ["sync", "dp"])
def test_baselines_train_on_the_same_budget(corpus, method):
    sim = SimConfig(peers=2, method=method, total_steps=2 * 20 * 3, eval_batches=2)
    result = simulate(SPEC, sim, corpus)
    assert result.tokens == 2 * 20 * 3 * SPEC.data.batch_size * SPEC.model.block_size
    assert result.curve[0].loss - result.eval_loss > 0.3
    assert result.divergence < 1e-5


@pytest.mark.slow  # 8-39 s; the default suite keeps async against sync (tests/sim/test_async_outer_step.py)
def test_slow_peer_makes_sync_wait_but_not_async(corpus):
    # (no grace window: it would have the fast unit wait once, after its first round, for the slow one's update)
    base = SimConfig(peers=2, total_steps=2 * 20 * 2, speeds=("1", "0.25"), eval_batches=1, grace=0.0)
    sync = simulate(SPEC, dataclasses.replace(base, method="sync"), corpus)
    async_ = simulate(SPEC, base, corpus)
    assert sync.sim_time_s >= 2 * 20 * 4  # two rounds, each as long as the slow peer's 80 s phase
    assert async_.peers[0].utilization > 0.95 and sync.peers[0].utilization < 0.3


def test_budget_smaller_than_a_round_is_refused(corpus):
    with pytest.raises(ConfigError, match="at least one round"):
        simulate(SPEC, SimConfig(peers=4, total_steps=10), corpus)


def test_learner_round_talks_to_an_exchange(corpus):
    """The round loop against the in-memory Exchange: publish returns at once, delivery comes later."""
    import random

    from p2p_diloco.sim.events import EventQueue
    from p2p_diloco.sim.memory import MemoryExchange, MemoryNetwork
    from p2p_diloco.sync.intake import Intake
    from p2p_diloco.train.exchange import SwarmView
    from p2p_diloco.train.learner import Learner
    from p2p_diloco.train.loop import run_rounds
    from p2p_diloco.wire.identity import Identity

    queue = EventQueue()
    net = MemoryNetwork(queue, latency_s=0.1, bandwidth_mbps=100, loss=0.0, rng=random.Random(0))
    a, b = (Learner(SPEC, Identity.generate(), corpus, shard=i, num_shards=2) for i in range(2))
    intake = Intake(SPEC, b.numel, b.replica)  # b's network side
    net.attach(b.peer_id, lambda data, src: intake.receive(data))
    view = SwarmView(num_peers=2, samples_per_round=2 * SPEC.inner.inner_steps * SPEC.data.batch_size)
    (done,) = run_rounds(a, MemoryExchange(net, a.peer_id, lambda: view))
    update, result = done.update, done.result
    assert result.steps == SPEC.inner.inner_steps and update.header.weight == 0.5
    assert b.replica.version_vector.get(a.peer_id) == 0  # published, not yet delivered
    queue.run()
    assert b.replica.version_vector.get(a.peer_id) == 1
    assert torch.equal(a.replica.snapshot()[0], b.replica.snapshot()[0])


@pytest.mark.slow  # three runs (26 s); the default suite keeps the bounds check below
def test_timing_noise_is_seeded_and_changes_only_the_timing(corpus):
    """Staggered starts and jittered phases/latency: replicas still agree, the run is reproducible per
    timing seed, and another timing seed gives another (but equally complete) run."""
    noisy = SimConfig(peers=3, total_steps=3 * 20 * 2, eval_batches=2, step_time_s=0.05, latency_s=0.1,
                      latency_jitter_s=0.4, start_spread_s=1.5, phase_jitter=0.3, grace=0.0)  # (waiting is idling)
    first, again = simulate(SPEC, noisy, corpus), simulate(SPEC, noisy, corpus)
    other = simulate(SPEC, dataclasses.replace(noisy, timing_seed=1), corpus)
    assert first.eval_loss == again.eval_loss and first.sim_time_s == again.sim_time_s
    assert other.eval_loss != first.eval_loss  # updates landed at other moments
    for result in (first, other):
        assert result.divergence < 1e-5
        assert sum(p.steps for p in result.peers) == noisy.total_steps
        # Late starters' lifetimes begin when they arrive, so idle waiting before the start is not charged.
        assert all(p.utilization > 0.9 for p in result.peers)


def test_timing_noise_bounds_are_checked():
    for bad in ({"phase_jitter": 1.0}, {"latency_jitter_s": -1}, {"start_spread_s": -0.1}):
        with pytest.raises(ConfigError):
            SimConfig(**bad).validate()


@pytest.mark.slow  # 17-28 s; the default suite checks the streams on their own (tests/train/test_data.py)
def test_iid_units_draw_their_own_streams_from_the_whole_split(corpus):
    """`SimConfig.iid` (the default): every unit samples the whole training split, as a real peer's units do, each in
    a stream of its own; with iid=False each unit has a file shard."""
    from p2p_diloco.sim.swarm import AsyncSwarm

    def first_batches(iid: bool) -> list[torch.Tensor]:
        swarm = AsyncSwarm(SPEC, SimConfig(peers=3, total_steps=3 * 20, iid=iid), corpus)
        peers = [swarm._add_peer(1.0) for _ in range(3)]
        assert all(p.learner.sampler.num_shards == (1 if iid else 3) for p in peers)
        return [p.learner.sampler.batch(0)[0] for p in peers]

    iid, sharded = first_batches(True), first_batches(False)
    assert not any(torch.equal(a, b) for i, a in enumerate(iid) for b in iid[i + 1:])  # a stream each
    assert not torch.equal(iid[0], sharded[0])
    # both baselines read the same streams, so every method compares on the same data
    for method in ("sync", "dp"):
        base = SimConfig(peers=2, method=method, total_steps=2 * 20, eval_batches=1)
        on_iid, on_shards = (simulate(SPEC, dataclasses.replace(base, iid=flag), corpus) for flag in (True, False))
        assert on_iid.eval_loss != on_shards.eval_loss and on_iid.curve[0].loss - on_iid.eval_loss > 0.3


@pytest.mark.slow  # 20 s on 2 cores; the round view is tested on replicas in tests/sync/test_round_view.py
def test_the_round_view_leaves_out_the_round_under_way(corpus):
    """A unit at half speed: under the swarm's token budget the fast one makes 4 phases, the slow one 2. The round
    view (sync/round_view.py) is the model without the fast unit's last 2 updates; with a complete round it is the
    model itself, and a synchronous run is always at one."""
    # (no grace window: the fast unit would wait for the slow one's first update and make 3 phases, not 4)
    base = SimConfig(peers=2, total_steps=2 * 20 * 3, speeds=("1", "0.5"), eval_batches=2, grace=0.0)
    uneven = simulate(SPEC, base, corpus)
    assert sorted(p.steps for p in uneven.peers) == [40, 80]
    assert uneven.round_loss is not None and abs(uneven.round_loss - uneven.eval_loss) > 1e-3
    even = simulate(SPEC, dataclasses.replace(base, speeds=("1", "1")), corpus)
    assert [p.steps for p in even.peers] == [60, 60]
    assert even.round_loss == pytest.approx(even.eval_loss, abs=1e-5)
    sync = simulate(SPEC, dataclasses.replace(base, method="sync"), corpus)
    assert sync.round_loss == sync.eval_loss
    # tail averaging over the last complete rounds, on both sides
    for result in (uneven, even, sync):
        assert result.tail_loss is not None and abs(result.tail_loss - result.eval_loss) > 1e-4
