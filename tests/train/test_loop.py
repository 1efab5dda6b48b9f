"""The round loop (train/loop.py) against the in-memory exchange and a collecting one: rounds, seqs, the
stop rule, the finish request, and the hooks' schedule."""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest
import torch

from p2p_diloco.config import preset
from p2p_diloco.sim.events import EventQueue
from p2p_diloco.sim.memory import MemoryExchange, MemoryNetwork
from p2p_diloco.sync.intake import Intake
from p2p_diloco.train.exchange import CollectingExchange
from p2p_diloco.train.learner import Learner, SwarmView
from p2p_diloco.train.loop import Hooks, PhaseBegun, RoundDone, Schedule, StepDone, drive, rounds, run_rounds
from p2p_diloco.wire.identity import Identity

pytestmark = pytest.mark.timeout(180)

BASE = preset("test")
SPEC = dataclasses.replace(BASE, inner=dataclasses.replace(BASE.inner, inner_steps=3))
H = SPEC.inner.inner_steps
VIEW = SwarmView(num_peers=2, samples_per_round=2 * H * SPEC.data.batch_size)


def Collect() -> CollectingExchange:
    """An exchange that keeps what is published: one peer, no network."""
    return CollectingExchange(VIEW)


class Record(Hooks):
    """Hooks that note every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.lines: list[str] = []

    def evaluate(self, at_round: int) -> float:
        self.calls.append(("evaluate", at_round))
        return 1.0

    def round_done(self, done: RoundDone) -> None:
        self.calls.append(("round", done.round))

    def checkpoint(self, at_round: int) -> None:
        self.calls.append(("checkpoint", at_round))

    def say(self, line: str) -> None:
        self.lines.append(line)


def learner(corpus, shard: int = 0) -> Learner:
    return Learner(SPEC, Identity.generate(), corpus, shard=shard, num_shards=2)


def test_n_rounds_against_the_memory_exchange_publish_seqs_in_order_and_replicas_agree(corpus) -> None:
    queue = EventQueue()
    net = MemoryNetwork(queue, latency_s=0.1, bandwidth_mbps=100, loss=0.0, rng=random.Random(0))
    a, b = learner(corpus, 0), learner(corpus, 1)
    for lrn in (a, b):  # each learner's network side: an intake on its replica
        net.attach(lrn.peer_id, lambda data, src, i=Intake(SPEC, lrn.numel, lrn.replica): i.receive(data))
    done = run_rounds(a, MemoryExchange(net, a.peer_id, lambda: VIEW), n=3)
    assert [d.round for d in done] == [1, 2, 3] and [d.update.seq for d in done] == [1, 2, 3]
    assert all(d.result.steps == H for d in done) and a.step == 3 * H
    assert a.replica.version_vector.get(a.peer_id) == 3  # our own updates merged as they were signed
    assert b.replica.version_vector.get(a.peer_id) == 0  # published, not yet delivered
    queue.run()
    assert b.replica.version_vector.get(a.peer_id) == 3
    assert torch.equal(a.replica.snapshot()[0], b.replica.snapshot()[0])


def test_the_loop_yields_each_phase_start_step_and_round(corpus) -> None:
    seen = [(type(t).__name__, t.phase.steps_done if isinstance(t, StepDone) else None)
            for t in rounds(learner(corpus), Collect(), Schedule(rounds=2))]
    steps = [("StepDone", i) for i in range(1, H + 1)]
    assert seen == ([("PhaseBegun", None)] + steps + [("RoundDone", None)]) * 2


def test_hooks_evaluate_log_and_checkpoint_on_their_schedule(corpus) -> None:
    hooks = Record()
    ticks = rounds(learner(corpus), Collect(), Schedule(rounds=4, eval_every=2, checkpoint_every=3), hooks)
    assert drive(ticks) == "rounds"
    assert hooks.calls == [("evaluate", 0), ("round", 1), ("evaluate", 2), ("round", 2), ("round", 3),
                           ("checkpoint", 3), ("evaluate", 4), ("round", 4)]


def test_start_round_counts_towards_the_rounds(corpus) -> None:
    collect = Collect()
    done = [t for t in rounds(learner(corpus), collect, Schedule(rounds=3), start_round=2)
            if isinstance(t, RoundDone)]
    assert [d.round for d in done] == [3] and len(collect.sent) == 1


def stop_after(ticks, stop: threading.Event, steps: int) -> str:
    """Drive the loop; set `stop` once the first phase has done `steps` inner steps."""
    for tick in ticks:
        if isinstance(tick, StepDone) and tick.phase.steps_done == steps:
            stop.set()
    return "ended"


def test_a_stop_mid_phase_drops_the_phase_when_it_would_not_end_in_time(corpus) -> None:
    stop, hooks, collect = threading.Event(), Record(), Collect()
    lrn = learner(corpus)
    ticks = rounds(lrn, collect, Schedule(finish_phase_within_s=0.0), hooks, stop=stop)
    stop_after(ticks, stop, 1)
    assert collect.sent == [] and lrn.last_seq == 0 and lrn.step == 1
    assert hooks.lines == [f"stopping: dropped the unfinished inner phase at step 1/{H}"]


def test_a_stop_mid_phase_finishes_the_phase_when_it_ends_soon_enough(corpus) -> None:
    stop, hooks, collect = threading.Event(), Record(), Collect()
    lrn = learner(corpus)
    ticks = rounds(lrn, collect, Schedule(finish_phase_within_s=3600.0), hooks, stop=stop)
    stop_after(ticks, stop, 1)
    assert [u.seq for u in collect.sent] == [1] and lrn.step == H  # finished and published, then no more
    assert len(hooks.lines) == 1 and hooks.lines[0].startswith("stopping: finishing the inner phase first")


def test_a_stop_before_the_first_step_drops_the_phase_whatever_the_time_left(corpus) -> None:
    stop = threading.Event()
    ticks = rounds(learner(corpus), Collect(), Schedule(finish_phase_within_s=3600.0), stop=stop)
    assert isinstance(next(ticks), PhaseBegun)
    stop.set()
    assert drive(ticks) == "stop"


def test_a_finish_request_ends_the_loop_after_a_whole_round(corpus) -> None:
    finish, collect = threading.Event(), Collect()
    ticks = rounds(learner(corpus), collect, Schedule(), finish=finish)
    for tick in ticks:
        if isinstance(tick, StepDone) and tick.phase.steps_done == 1:
            finish.set()  # mid-phase: this round still ends and is published
    assert [u.seq for u in collect.sent] == [1]
    again = rounds(learner(corpus), Collect(), Schedule(), finish=finish)
    assert drive(again) == "finish"


def test_admit_refusing_ends_the_loop_before_the_phase_begins(corpus) -> None:
    class Budget(Hooks):
        def __init__(self) -> None:
            self.left = 2

        def admit(self) -> bool:
            self.left -= 1
            return self.left >= 0

    lrn, collect = learner(corpus), Collect()
    assert drive(rounds(lrn, collect, Schedule(), Budget())) == "admit"
    assert len(collect.sent) == 2 and lrn.step == 2 * H
