"""The round loop: one function, top to bottom, whoever runs it (ARCHITECTURE.md, "The round loop").

    for each round, until `schedule.rounds` are done, a finish request, or a stop request:
        begin phase        phi <- snapshot of the replica
        H inner steps      one at a time; between steps phi takes what the replica merged meanwhile
        stretch?           if our own published updates back up (`exchange.backlog()`): H more steps, same phase
        finish phase       pseudo-gradient, outer step, compress, sign, merge into our own replica
        publish            `exchange.publish(update)`: returns at once, the network spreads it
        evaluate           every `schedule.eval_every` rounds
        log                `hooks.round_done`
        checkpoint         every `schedule.checkpoint_every` rounds

The network is one argument, an `Exchange` (train/exchange.py): the real swarm (peer/exchange.py), the
in-memory network (sim/memory.py) or a test's list. It never owns the loop, and the loop never waits on it:
remote updates reach the replica on the exchange's schedule (its Intake, on another thread or at another
simulated moment) and the loop only reads the replica.

`rounds` is a generator that yields after each step of the story (`PhaseBegun`, `StepDone`, `RoundDone`), so
that every caller runs this same loop at its own pace: the real peer drives it to the end (`drive`), the tests
for a few rounds (`run_rounds`), and the simulator (sim/swarm.py) one step at a time on its simulated clock,
so that remote updates land between the inner steps they would fall between on a real network.

**Stretching** (a slow uplink sends less). At the end of H steps the loop reads `exchange.backlog()`:
how many of our own published updates no live peer is known to hold yet (a plain local read). If it is at
least `schedule.stretch_backlog`, the phase goes on for H more steps (yielding `PhaseStretched`), at most
`schedule.max_stretch` times H in all, and then publishes one update that covers them: a slow uplink sends
one update per k*H steps instead of queueing k of them, so what it sends is fresh. Such an update stands for k
rounds: its signed `samples` are all k*H steps' and its `weight` k rounds' share (`update_weight`, as for any
update), and its payload is the mean of the k Nesterov outputs of the rounds it replaces (the sender's momentum
runs k rounds on delta/k: train/outer.py `outer_update`), so theta moves as k updates would have, and the
payload stays inside the bound on one round's honest update. The learner refuses a stretch whose weight the
receivers would clamp (`Learner.may_stretch`: a swarm smaller than the stretch).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from p2p_diloco.train.grace import awaited
from p2p_diloco.train.hardware.host_heap import trim_free_heap

if TYPE_CHECKING:  # light at import time (the peer process imports this before torch is needed)
    from p2p_diloco.train.exchange import Exchange, SwarmView
    from p2p_diloco.train.inner import InnerResult
    from p2p_diloco.train.learner import Learner
    from p2p_diloco.train.phase import Phase
    from p2p_diloco.wire.envelope import OuterUpdate


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Schedule:
    """How long the loop runs and how often it evaluates and checkpoints (plain values, from any config)."""

    rounds: int = 0
    """Stop once the round counter reaches this (0: until a stop or finish request, or `Hooks.admit` says no)."""
    eval_every: int = 0
    """Evaluate the replica every this many rounds (0: only at the start)."""
    checkpoint_every: int = 0
    """Checkpoint every this many rounds (0: never)."""
    finish_phase_within_s: float = 0.0
    """On a stop request, finish the inner phase if it ends within this many seconds, else drop it."""
    max_stretch: int = 4
    """A phase is stretched to at most this many times H steps while our own updates back up (1: never)."""
    stretch_backlog: int = 3
    """Stretch when at least this many of our published updates are held by no live peer yet."""
    grace: float = 0.0
    """After each round, wait at most this share of the phase just done for the round's other updates
    (train/grace.py; 0: never wait)."""


class Hooks:
    """What the loop reports to, and asks. Every method does nothing here; a caller overrides what it needs
    (the peer: peer/report.py; the simulator: `admit`, its token budget)."""

    def admit(self) -> bool:
        """Before each phase begins: may it? (False ends the loop; the simulator charges its budget here.)"""
        return True

    def admit_stretch(self) -> bool:
        """Before a phase is stretched by H more steps: may it? (The simulator charges its budget here.)"""
        return True

    def evaluate(self, at_round: int) -> float | None:
        """Eval loss of the replica, or None for no evaluation."""
        return None

    def round_done(self, done: RoundDone) -> None:
        """After each published round (and its evaluation): print it, log it."""

    def checkpoint(self, at_round: int) -> None:
        """Every `schedule.checkpoint_every` rounds, after `round_done`."""

    def say(self, line: str) -> None:
        """A line for the person running this (why a phase was dropped or finished early)."""

    def now(self) -> float:
        """The clock the grace window is timed on (the simulator's: its simulated one)."""
        return time.monotonic()


@dataclass
class PhaseBegun:
    """A phase has begun (phi is the replica's snapshot); the next ticks are its inner steps."""

    phase: Phase


@dataclass
class StepDone:
    """One inner step is done (`phase.steps_done` of them so far)."""

    phase: Phase


@dataclass
class PhaseStretched:
    """The phase goes on for H more steps (our own updates back up): `phase.target_steps` is its new length."""

    phase: Phase
    backlog: int


@dataclass
class RoundDone:
    """A round is published: its update, the inner phase's result, the swarm it was weighted for."""

    round: int
    update: OuterUpdate
    result: InnerResult
    view: SwarmView
    round_s: float
    samples_per_s: float
    eval_loss: float | None  # evaluated after this round, else None
    stretch: int = 1  # the phase ran stretch * H inner steps (1: not stretched)
    waited_s: float = 0.0  # the grace window before its phase (train/grace.py), on `Hooks.now`'s clock


GRACE_POLL_S = 0.02
"""How often a waiting real peer looks at its replica again (a version vector read)."""


@dataclass
class GraceWait:
    """Between rounds: the loop waits for these authors' next updates until `until` (on `Hooks.now`). The caller
    lets time pass before the next `next()` (a real peer sleeps a moment; the simulator until an update lands)."""

    authors: list[str]
    until: float


Tick = PhaseBegun | StepDone | PhaseStretched | RoundDone | GraceWait  # (what `rounds` yields)


def rounds(learner: Learner, exchange: Exchange, schedule: Schedule, hooks: Hooks | None = None, *,
           start_round: int = 0, stop: threading.Event | None = None, finish: threading.Event | None = None,
           ) -> Generator[Tick, None, str]:
    """THE round loop. Yields after each phase start, inner step and round; returns why it ended: "rounds"
    (schedule.rounds reached), "finish" (`finish` was set: end after a whole round), "stop" (`stop` was set;
    the unfinished phase was dropped) or "admit" (`hooks.admit()` said no).

    `start_round`: rounds already done (restored from a checkpoint, or our journaled updates adopted).
    """
    hooks = hooks or Hooks()
    stop = stop or threading.Event()
    finish = finish or threading.Event()
    H = learner.spec.inner.inner_steps
    round_ = start_round
    until, live = 0.0, 0  # the grace window's end (none before the first round), the live units then
    hooks.evaluate(0)  # the starting point (logged as round 0, even after a restore)
    while not stop.is_set() and (schedule.rounds == 0 or round_ < schedule.rounds):
        if finish.is_set():
            return "finish"
        if not hooks.admit():
            return "admit"
        # the grace window: the last round's other updates, a moment (train/grace.py)
        waited_s = yield from _grace(learner, live, hooks, until, stop, finish)
        if stop.is_set() or finish.is_set():  # (asked for while waiting)
            continue
        trim_free_heap()  # what the last round's outer step, evaluation and checkpoint freed, back to the system
        phase = learner.begin_phase()
        began = hooks.now()  # (before the yield: a simulator resumes the loop only at a later moment)
        yield PhaseBegun(phase)
        t0 = time.monotonic()
        finish_anyway: bool | None = None
        while True:
            while phase.steps_done < phase.target_steps:
                # A stop request is seen within one step: drop the phase, or finish it if it ends soon enough.
                if stop.is_set() and finish_anyway is None:
                    finish_anyway = _finish_anyway(phase, phase.target_steps, schedule.finish_phase_within_s,
                                                   hooks.say)
                    if not finish_anyway:
                        return "stop"
                # Merge what arrived: remote updates merge into the replica on the exchange's side; before each
                # step `run_inner` rebases phi onto what merged since the last step (Learner._rebase).
                learner.run_inner(phase, 1)
                yield StepDone(phase)
            backlog = _stretch_backlog(learner, exchange, schedule, phase, H, stop.is_set() or finish.is_set())
            if backlog is None or not hooks.admit_stretch():
                break
            phase.target_steps += H
            logger.debug("phase stretched to %d steps: %d own updates not held by any live peer yet",
                         phase.target_steps, backlog)
            yield PhaseStretched(phase, backlog)
        result = phase.result()
        view = exchange.swarm_view()
        # The gradients just freed sit in the heap; the outer step's payload-sized buffers are mapped afresh, so
        # without this they would come on top of them.
        trim_free_heap()
        update = learner.finish_phase(phase, result, view)  # pseudo-gradient, outer step, encode, sign, merge
        exchange.publish(update)  # returns at once: the network spreads it
        ended_at, live = hooks.now(), view.num_peers  # (the view is read once a round: it dates its window)
        until = ended_at + schedule.grace * (ended_at - began)  # timed from here: evaluating is waiting too
        round_ += 1
        round_s = time.monotonic() - t0
        evaluated = schedule.eval_every and round_ % schedule.eval_every == 0
        eval_loss = hooks.evaluate(round_) if evaluated else None
        done = RoundDone(round=round_, update=update, result=result, view=view, round_s=round_s,
                         samples_per_s=result.samples / max(round_s, 1e-9), eval_loss=eval_loss,
                         stretch=phase.target_steps // H, waited_s=waited_s)
        hooks.round_done(done)
        if schedule.checkpoint_every and round_ % schedule.checkpoint_every == 0:
            hooks.checkpoint(round_)
        yield done
        # The update's payload lives on in the exchange's store (once); this frame's copy would stay through the
        # whole next phase, a byte per parameter, until the next update rebinds the name.
        del update, done
    return "stop" if stop.is_set() else "rounds"


def _grace(learner: Learner, live: int, hooks: Hooks, until: float, stop: threading.Event,
           finish: threading.Event) -> Generator[GraceWait, None, float]:
    """Wait (yielding) for the awaited authors' next updates until `until` (train/grace.py); how long it waited.
    `live`: the units the swarm view counted at the last round's end."""
    began = None
    while hooks.now() < until and not (stop.is_set() or finish.is_set()):
        authors = awaited(learner.replica.version_vector, learner.peer_id, live, learner.spec.defence.sponsors)
        if not authors:
            break
        began = hooks.now() if began is None else began
        yield GraceWait(authors, until)
    return 0.0 if began is None else hooks.now() - began


def _stretch_backlog(learner: Learner, exchange: Exchange, schedule: Schedule, phase: Phase, H: int,
                     stopping: bool) -> int | None:
    """At the end of the phase's steps: the backlog that stretches it by H more steps, or None to finish it now.
    Not while stopping or finishing, not past `schedule.max_stretch` * H, not past the weight's clamp. The
    backlog is a plain read (an exchange without `backlog` has none): the loop never waits on the network."""
    if stopping or phase.target_steps + H > schedule.max_stretch * H:
        return None
    read = getattr(exchange, "backlog", None)
    backlog = read() if read is not None else 0
    if backlog < max(1, schedule.stretch_backlog) or not learner.may_stretch(phase, H):
        return None
    return backlog


def _finish_anyway(phase: Phase, steps: int, within_s: float, say: Callable[[str], None]) -> bool:
    """On a stop request: finish the phase only if it has begun and the rest takes at most `within_s` (at the
    pace of its steps so far). Says which."""
    done = phase.steps_done
    remaining_s = phase.compute_s / max(done, 1) * (steps - done)
    if done > 0 and remaining_s <= within_s:
        say(f"stopping: finishing the inner phase first ({remaining_s:.1f}s left)")
        return True
    say(f"stopping: dropped the unfinished inner phase at step {done}/{steps}")
    return False


def drive(ticks: Generator[Tick, None, str]) -> str:
    """Run a loop to its end; returns why it ended (see `rounds`)."""
    while True:
        try:
            tick = next(ticks)
        except StopIteration as end:
            return end.value
        if isinstance(tick, GraceWait):
            time.sleep(GRACE_POLL_S)


def run_rounds(learner: Learner, exchange: Exchange, n: int = 1, hooks: Hooks | None = None) -> list[RoundDone]:
    """Run `n` whole rounds of the loop (tests, benchmarks); their `RoundDone`s."""
    return [t for t in rounds(learner, exchange, Schedule(rounds=n), hooks) if isinstance(t, RoundDone)]
