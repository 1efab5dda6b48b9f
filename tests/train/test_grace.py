"""The grace window (train/grace.py): whom a unit waits for after a round, and how the round loop waits."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from p2p_diloco.config import ConfigError, SimConfig, TrainingConfig, preset
from p2p_diloco.sim.runner import simulate
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.train.exchange import CollectingExchange
from p2p_diloco.train.grace import awaited
from p2p_diloco.train.learner import Learner
from p2p_diloco.train.loop import GraceWait, Hooks, PhaseBegun, RoundDone, Schedule, StepDone, rounds, run_rounds
from p2p_diloco.wire.envelope import encode_update
from p2p_diloco.wire.identity import Identity
from tests.train.test_loop import SPEC, VIEW, H  # the loop's tests' spec (H = 3) and swarm view

pytestmark = pytest.mark.timeout(180)



def test_awaited_is_the_authors_exactly_one_update_short_of_ours() -> None:
    vv = VersionVector({"me": 5, "one-short": 4, "level": 5, "ahead": 6, "far-behind": 2, "also-short": 4})
    assert awaited(vv, "me") == ["also-short", "one-short"]
    assert awaited(VersionVector({"me": 1, "other": 3}), "me") == []  # nobody of ours is one short of 1
    assert awaited(VersionVector({"other": 1}), "me", live=3) == []  # before our first update: nothing to wait for
    # After our first update, the live units that have none yet are one short too (not in the vector: "?").
    assert awaited(VersionVector({"me": 1, "a": 1}), "me", live=4) == ["?", "?"]
    assert awaited(VersionVector({"me": 1, "a": 1, "b": 0}), "me", live=3) == ["?"]  # (a zero is no update)
    assert awaited(VersionVector({"me": 2, "a": 1}), "me", live=4) == ["a"]  # later, a unit with none is far behind


class Clock(Hooks):
    """A clock the test moves: every inner step takes 10 s."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


def learner(corpus, shard: int) -> Learner:
    return Learner(SPEC, Identity.generate(), corpus, shard=shard, num_shards=2)


def a_round_behind(corpus):
    """Unit `a` (its loop with a grace window of half a phase) and `b`, one round published; a's intake."""
    a, b = learner(corpus, 0), learner(corpus, 1)
    intake = Intake(SPEC, a.numel, a.replica)
    b_updates = [d.update for d in run_rounds(b, CollectingExchange(VIEW), n=2)]
    intake.receive(encode_update(b_updates[0]))
    clock = Clock()
    ticks = rounds(a, CollectingExchange(VIEW), Schedule(rounds=3, grace=0.5), clock)
    return a, b, b_updates, intake, clock, ticks


def run_until_wait(ticks, clock: Clock) -> list:
    """Drive the loop, 10 s of the clock per inner step, until it waits (or ends); the ticks seen."""
    seen = []
    for tick in ticks:
        seen.append(tick)
        if isinstance(tick, StepDone):
            clock.t += 10.0
        if isinstance(tick, GraceWait):
            break
    return seen


def test_in_a_run_with_sponsors_only_sponsors_wait_and_only_for_one_another() -> None:
    sponsors = ("s1", "s2", "s3")
    vv = VersionVector({"s1": 2, "s2": 1, "s3": 2, "vol": 1})
    assert awaited(vv, "s1", live=4, sponsors=sponsors) == ["s2"]  # the volunteer, one short too, is not awaited
    assert awaited(vv, "vol", live=4, sponsors=sponsors) == []  # a proposer never waits
    assert awaited(VersionVector({"vol": 2, "s1": 3}), "vol", sponsors=sponsors) == []
    # after a sponsor's first round, the sponsors not heard from yet are awaited by name (not by the view's count)
    assert awaited(VersionVector({"s2": 1, "vol": 1}), "s2", live=1, sponsors=sponsors) == ["s1", "s3"]
    assert awaited(VersionVector({"s2": 3, "s1": 1}), "s2", live=4, sponsors=sponsors) == []  # s1, s3 far behind


def test_the_loop_waits_for_the_round_and_goes_on_once_the_awaited_update_lands(corpus) -> None:
    a, b, b_updates, intake, clock, ticks = a_round_behind(corpus)
    seen = run_until_wait(ticks, clock)
    # Round 1: b is level with us (1 and 1), nothing to wait for; round 2: b is one short.
    assert [type(t).__name__ for t in seen if not isinstance(t, StepDone)] == [
        "PhaseBegun", "RoundDone", "PhaseBegun", "RoundDone", "GraceWait"]
    wait = seen[-1]
    assert wait.authors == [b.peer_id] and wait.until == pytest.approx(clock.t + 0.5 * H * 10.0)
    assert isinstance(next(ticks), GraceWait)  # still waiting: the clock did not move, nothing landed
    intake.receive(encode_update(b_updates[1]))
    tick = next(ticks)
    assert isinstance(tick, PhaseBegun) and tick.phase.version_vector[b.peer_id] == 2  # its base holds b's round 2


def test_the_window_ends_on_the_clock_when_the_update_never_comes(corpus) -> None:
    a, b, _, _, clock, ticks = a_round_behind(corpus)
    wait = run_until_wait(ticks, clock)[-1]
    clock.t = wait.until - 1e-3
    assert isinstance(next(ticks), GraceWait)
    clock.t = wait.until
    tick = next(ticks)
    assert isinstance(tick, PhaseBegun) and tick.phase.version_vector[b.peer_id] == 1
    done = [t for t in ticks if isinstance(t, RoundDone)]
    assert [d.round for d in done] == [3]  # and then the loop runs to its end (b, 2 short now, is not awaited)


def test_a_stop_request_ends_the_wait(corpus) -> None:
    a, b = learner(corpus, 0), learner(corpus, 1)
    Intake(SPEC, a.numel, a.replica).receive(encode_update(run_rounds(b, CollectingExchange(VIEW), n=1)[0].update))
    stop, clock = threading.Event(), Clock()
    ticks = rounds(a, CollectingExchange(VIEW), Schedule(grace=1.0), clock, stop=stop)
    assert isinstance(run_until_wait(ticks, clock)[-1], GraceWait)
    stop.set()
    with pytest.raises(StopIteration) as end:
        next(ticks)
    assert end.value.value == "stop" and a.last_seq == 2


SIM_SPEC = dataclasses.replace(preset("test"), data=dataclasses.replace(preset("test").data, max_corpus_mb=1.0))


@pytest.mark.corpus_mb(1.0)
@pytest.mark.slow  # 25 s on 2 cores; the default suite has a real peer's grace window (tests/peer/test_swarm.py)
def test_in_the_simulator_units_wait_until_the_round_lands_or_the_window_ends(corpus) -> None:
    # Latency is 30% of a phase (1 s): without a window each phase begins before the others' round has landed.
    # Unit 1 dies in its third phase: the others wait for its third update once, for the whole window, and then
    # no more (it falls two short). (It died waiting: its last window lasted until then.)
    base = SimConfig(peers=3, total_steps=3 * 20 * 5, step_time_s=0.05, latency_s=0.3, crash=("1@2.5",),
                     eval_batches=1, grace=0.0)
    plain = simulate(SIM_SPEC, base, corpus)
    graced = simulate(SIM_SPEC, dataclasses.replace(base, grace=0.5), corpus)
    for result in (plain, graced):
        assert result.divergence < 1e-5  # the window is timing, not merging: replicas stay equal
        assert sum(p.steps for p in result.peers) >= base.total_steps - 20  # (the dead phase is lost)
    assert all(not p.waits for p in plain.peers) and plain.peers[0].utilization > 0.99
    window = 0.5 * 20 * base.step_time_s
    for peer in (graced.peers[0], graced.peers[2]):
        # A window after each round but the last (after the first too: the units with no update yet). The round
        # lands at most a latency (and a transmission) after we finished, well inside the window; the dead unit's
        # never does.
        assert len(peer.waits) == 5 and peer.utilization < 0.85
        assert [w == pytest.approx(window) for w in peer.waits] == [False, False, True, False, False]
        assert all(0 < w < window - 0.1 for i, w in enumerate(peer.waits) if i != 2)
    dead = graced.peers[1]
    assert not dead.alive and len(dead.waits) == 2 and all(w < window + 1e-9 for w in dead.waits)


@pytest.mark.corpus_mb(1.0)
@pytest.mark.slow  # 11 s; the default suite has a real peer's grace window (tests/peer/test_swarm.py)
def test_in_a_simulated_run_with_sponsors_the_proposer_never_waits(corpus) -> None:
    # 2 sponsors and a volunteer, latency 30% of a phase: the sponsors wait after every round but the last (for
    # each other), the volunteer's update merges at weight 0 everywhere, so nobody waits for it and it waits for
    # nobody (train/grace.py).
    sim = SimConfig(peers=3, sponsors=2, total_steps=3 * 20 * 4, step_time_s=0.05, latency_s=0.3, grace=0.5,
                    eval_batches=1)
    result = simulate(SIM_SPEC, sim, corpus)
    assert result.divergence < 1e-5
    sponsors, volunteer = result.peers[:2], result.peers[2]
    assert all(len(p.waits) == 3 and all(0 < w < 0.5 * 20 * sim.step_time_s for w in p.waits) for p in sponsors)
    assert not volunteer.waits and volunteer.utilization > 0.99


@pytest.mark.parametrize("grace", [-0.1, 4.5])
def test_a_window_out_of_range_is_a_clear_error(grace: float) -> None:
    with pytest.raises(ConfigError, match="grace must be in"):
        SimConfig(grace=grace).validate()
    with pytest.raises(ConfigError, match="grace must be in"):
        TrainingConfig(grace=grace).validate()
