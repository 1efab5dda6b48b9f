"""The in-process async swarm: N learner units on one simulated clock over the in-memory network.

Each unit runs the one round loop (train/loop.py `rounds`) at its own speed and publishes when its phase
ends; nobody waits for anybody. The simulator advances each unit's loop on the simulated clock: a phase
begins (`_start_phase`), and its inner steps are computed lazily: before a remote update lands in its
replica, the unit first runs the steps it would have finished by then (`_advance`), so mid-phase rebasing
sees updates at the step they would reach on a real network (to within one step); at the phase's end the
rest of the steps run and the round is published (`_end_phase`).

Dissemination: the sender pushes a copy to every peer (what gossip achieves on average), a proposer its herald to
the sponsors first; anti-entropy (a periodic pull of what a random peer holds) repairs losses and joiners' gaps.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import cast

import torch

from p2p_diloco.config import ConfigError, RunSpec, SimConfig
from p2p_diloco.sim.aggregation import TreeDissemination
from p2p_diloco.sim.events import EventQueue
from p2p_diloco.sim.memory import MemoryExchange, MemoryNetwork
from p2p_diloco.sim.result import EvalPoint, Progress, SimResult, swarm_result
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.sync.types import UpdateLike
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.train.data.corpus import Corpus, eval_batches
from p2p_diloco.train.hardware.device import resolve_device
from p2p_diloco.train.learner import Learner, SwarmView
from p2p_diloco.train.loop import GraceWait, Hooks, PhaseBegun, RoundDone, Schedule, Tick, rounds
from p2p_diloco.train.phase import Phase
from p2p_diloco.wire.envelope import OuterUpdate, encode_update
from p2p_diloco.wire.identity import Identity

logger = logging.getLogger(__name__)

ReplicaState = tuple[torch.Tensor, VersionVector]
"""A replica's (theta, version vector), as `Replica.snapshot()` gives it: a joiner starts from a donor's."""


def stored_envelope(update: UpdateLike) -> bytes:
    """The wire bytes of an update from a peer's store: the simulator's stores hold wire envelopes only (what
    the peer published, and what its intake decoded)."""
    return encode_update(cast(OuterUpdate, update))


@dataclass
class SimPeer:
    index: int
    learner: Learner
    intake: Intake  # its network side's: checks, counts, evidence
    speed: float
    store: UpdateStore
    exchange: MemoryExchange
    ticks: Generator[Tick, None, str]  # its round loop, advanced on the simulated clock
    alive: bool = True
    busy: bool = False  # inside an inner phase, or between two in the grace window
    waiting_until: float | None = None  # between rounds, in the grace window (train/grace.py) until then
    waiting_since: float = 0.0  # (when that window began)
    waits: list[float] = field(default_factory=list)  # how long each grace window lasted
    phase: Phase | None = None
    phase_started: float = 0.0
    step_s: float = 1.0  # simulated seconds per inner step in the current phase (speed and jitter)
    incarnation: int = 0
    compute_s: float = 0.0
    joined_at: float = 0.0
    left_at: float | None = None
    done_at: float | None = None  # when the token budget ran out for it: utilization is measured until then
    taus: list[int] = field(default_factory=list)
    held_since: dict[tuple[str, int], float] = field(default_factory=dict)


class TokenBudget(Hooks):
    """The simulator's hooks into each unit's loop: a phase begins only if the swarm's token budget (inner
    steps summed over all peers) still covers it; phases are charged when they start."""

    def __init__(self, swarm: AsyncSwarm) -> None:
        self.swarm = swarm

    def admit(self) -> bool:
        H = self.swarm.spec.inner.inner_steps
        if self.swarm.steps_started + H > self.swarm.sim.total_steps:
            return False
        self.swarm.steps_started += H
        return True

    def now(self) -> float:
        return self.swarm.queue.now


class AsyncSwarm:
    """p2p DiLoCo in one process. `run()` returns a `SimResult`."""

    skip_banned_donors = True
    """Anti-entropy never pulls from a peer the puller banned as an author (False: the old rule, for a benchmark's
    before row: a hostile donor then re-offers its banned updates at every tick and the run never goes quiet)."""

    def __init__(self, spec: RunSpec, sim: SimConfig, corpus: Corpus, *, progress: Progress | None = None) -> None:
        self.sim = sim.validate()
        # A run with founders: their keys exist before the spec, which names them (sync/sponsorship.py).
        self.founders = [Identity.generate() for _ in range(sim.sponsors)]
        if self.founders:
            spec = dataclasses.replace(spec, defence=dataclasses.replace(
                spec.defence, sponsors=tuple(i.peer_id for i in self.founders)))
        self.spec = spec.validate()
        if sim.aggregate and spec.defence.reads_payloads():
            raise ConfigError("--sim.aggregate needs exact merge weights: a sum cannot carry vetting that reads "
                              "payloads; add --spec.defence.copy-cosine 0 (and no reference tests)")
        self.device = resolve_device(sim.device)
        self.corpus, self.progress = corpus, progress
        self.heralds_to = self.spec.defence.sponsors if sim.heralds else ()  # a proposer's (sync/heralds.py)
        self.rng = random.Random(spec.seed)
        self.queue = EventQueue()
        # Timing noise has its own generator, so that turning it on leaves the other draws unchanged.
        self.timing_rng = random.Random(f"{spec.seed}/{sim.timing_seed}")
        self.net = MemoryNetwork(self.queue, latency_s=sim.latency_s, bandwidth_mbps=sim.bandwidth_mbps,
                                 loss=sim.loss, rng=self.rng, latency_jitter_s=sim.latency_jitter_s,
                                 jitter_rng=self.timing_rng)
        self.num_shards = sim.peers + len(sim.joins())
        self.peers: list[SimPeer] = []
        self.steps_started = 0  # the budget: phases are admitted against it when they start
        self.steps_published = 0  # the loss curve's x: steps whose update has been published
        self.starting = 0  # peers whose first phase is still scheduled (start_spread_s)
        self.eval_set = eval_batches(corpus, block_size=spec.model.block_size, batch_size=spec.data.batch_size,
                                     num_batches=sim.eval_batches)
        self.curve: list[EvalPoint] = []
        H, speeds = spec.inner.inner_steps, sim.speed_factors()
        self.phase_s = [H * sim.step_time_s / s for s in speeds]
        self.eval_every_s = sim.eval_every_s or (sim.total_steps / sim.peers * sim.step_time_s / 20)
        self.tree = TreeDissemination(self, fan_in=sim.aggregate, epoch_s=sim.epoch_s or 10 * min(self.phase_s),
                                      wait_s=0.25 * min(self.phase_s),
                                      fallback_epochs=sim.fallback_epochs, audit=sim.audits) if sim.aggregate else None

    # ---- peers ----------------------------------------------------------------------------------------

    def _shard_of(self, index: int) -> int:
        return index % self.num_shards

    def _add_peer(self, speed: float, state: ReplicaState | None = None) -> SimPeer:
        index = len(self.peers)
        identity = self.founders[index] if index < len(self.founders) else Identity.generate()
        shard, shards, stream = self.sim.unit_data(index, self._shard_of(index), self.num_shards)
        learner = Learner(self.spec, identity, self.corpus, shard=shard, num_shards=shards, replica_state=state,
                          device=self.device, stream=stream, judge_seed=self.spec.seed * 1009 + index)
        # Gaps, standing and heralds go by the simulated clock (a loaded machine's wall clock would time gaps out)
        learner.replica.set_clock(lambda: self.queue.now)
        exchange = MemoryExchange(self.net, learner.peer_id, self._view, heralds_to=self.heralds_to,
                                  herald_wait=self.sim.herald_wait,
                                  disseminate=self.tree.publish if self.tree is not None else None)
        peer = SimPeer(index=index, learner=learner, intake=Intake(self.spec, learner.numel, learner.replica),
                       speed=speed, store=UpdateStore(max_bytes=256 << 20), exchange=exchange,
                       ticks=rounds(learner, exchange, Schedule(grace=self.sim.grace), TokenBudget(self)),
                       joined_at=self.queue.now)
        peer.intake.attach_store(peer.store)  # as the gossip does: take-backs look updates up there
        self.peers.append(peer)
        tree = self.tree
        on_sum = (lambda data, kind: tree.on_sum(peer, data, kind)) if tree is not None else None
        self.net.attach(learner.peer_id, lambda data, src: self._receive(peer, data, src), peer.intake.herald, on_sum)
        return peer

    def peer_by_id(self, peer_id: str) -> SimPeer | None:
        return next((p for p in self.peers if p.learner.peer_id == peer_id), None)

    def _alive(self) -> list[SimPeer]:
        return [p for p in self.peers if p.alive]

    def _view(self) -> SwarmView:
        n = len(self._alive())
        return SwarmView(num_peers=n, samples_per_round=n * self.spec.inner.inner_steps * self.spec.data.batch_size)

    def _receive(self, peer: SimPeer, data: bytes, src: str = "") -> None:
        if peer.busy and peer.waiting_until is None:
            self._advance(peer)
        outcome, update = peer.intake.receive(data)
        if update is not None and outcome in ("merged", "buffered"):
            peer.store.add(update)
            if self.tree is not None:
                self.tree.received(peer, update, src)
            peer.held_since[(update.sender, update.seq)] = self.queue.now
            if peer.waiting_until is not None:  # in the grace window: was this what it waited for?
                self._start_phase(peer)

    # ---- the round loop on the simulated clock ------------------------------------------------------

    def _start_phase(self, peer: SimPeer) -> None:
        tick = next(peer.ticks, None) if peer.alive else None  # the loop: the budget (admit), then begin_phase
        if isinstance(tick, GraceWait):  # looked at again when an update lands, and at the window's end
            if peer.waiting_until != tick.until:
                self.queue.push(tick.until, self._grace_over, peer, peer.incarnation)
                peer.waiting_since = self.queue.now
            peer.waiting_until = tick.until
            return
        if peer.waiting_until is not None:
            peer.waits.append(self.queue.now - peer.waiting_since)
            peer.waiting_until = None
        if not isinstance(tick, PhaseBegun):  # crashed, or the budget is spent: the loop has ended
            if peer.busy and peer.alive:
                peer.done_at = self.queue.now
            peer.busy = False
            return
        peer.busy = True
        peer.phase = tick.phase
        peer.phase_started = self.queue.now
        jitter = self.sim.phase_jitter
        noise = self.timing_rng.uniform(-jitter, jitter) if jitter else 0.0
        peer.step_s = self.sim.step_time_s / peer.speed * (1 + noise)
        self.queue.push(self.queue.now + self._phase_s(peer), self._end_phase, peer, peer.incarnation)

    def _grace_over(self, peer: SimPeer, incarnation: int) -> None:
        if peer.alive and incarnation == peer.incarnation and peer.waiting_until is not None:
            self._start_phase(peer)

    def _late_start(self, peer: SimPeer) -> None:
        """A peer that arrives after the others (start_spread_s): its lifetime begins now."""
        self.starting -= 1
        peer.joined_at = self.queue.now
        self._start_phase(peer)

    def _phase_s(self, peer: SimPeer) -> float:
        return self.spec.inner.inner_steps * peer.step_s

    def _advance(self, peer: SimPeer) -> None:
        """Run the inner steps this peer would have finished by now on its simulated clock."""
        due = min(self.spec.inner.inner_steps, int((self.queue.now - peer.phase_started) / peer.step_s + 1e-9))
        phase = peer.phase
        assert phase is not None, "only a peer inside a phase (busy) advances"
        while phase.steps_done < due:
            next(peer.ticks)  # one inner step (StepDone)

    def _end_phase(self, peer: SimPeer, incarnation: int) -> None:
        if not peer.alive or incarnation != peer.incarnation:
            return  # crashed mid-phase: the phase is lost, as on a real machine
        tick = next(peer.ticks)  # the phase's remaining inner steps, then finish and publish
        while not isinstance(tick, RoundDone):
            tick = next(peer.ticks)
        update, result = tick.update, tick.result
        peer.taus.append(update.header.tau)
        peer.compute_s += self._phase_s(peer)
        self.steps_published += self.spec.inner.inner_steps
        # Published by the loop just now, in this same simulated instant: nothing was delivered in between.
        peer.store.add(update)
        peer.held_since[(update.sender, update.seq)] = self.queue.now
        if self.progress:
            self.progress(self.steps_published, self.sim.total_steps, result.mean_loss)
        self._start_phase(peer)

    def _anti_entropy(self) -> None:
        """Each live peer pulls from one random live peer what that peer holds and it lacks."""
        alive = self._alive()
        for peer in alive:
            # Never from a peer it banned as an author (the real puller's rule, net/gossip/pulls.py): a hostile
            # peer re-offers its banned updates at every tick, and the swarm would never go quiet.
            banned = peer.learner.replica.banned if self.skip_banned_donors else frozenset()
            others = [p for p in alive if p is not peer and p.learner.peer_id not in banned]
            if not others:
                continue
            donor = self.rng.choice(others)
            # Only what the donor has held for a while: younger updates are most likely still in flight to
            # the puller by the normal path, and sending them again would only cost bytes.
            settled = self.queue.now - self.sim.anti_entropy_s / 2
            for update in donor.store.missing_for(peer.learner.replica.version_vector, limit=64):
                if donor.held_since.get((update.sender, update.seq), 0.0) <= settled:
                    self.net.send(donor.learner.peer_id, peer.learner.peer_id, stored_envelope(update))
        if not self._quiet():
            self.queue.push(self.queue.now + self.sim.anti_entropy_s, self._anti_entropy)

    def _quiet(self) -> bool:
        alive = self._alive()
        if self.starting or any(p.busy for p in alive) or self.net.in_flight:
            return False
        vectors = {p.learner.replica.version_vector for p in alive}
        return len(vectors) <= 1

    def _crash(self, index: int) -> None:
        peer = self.peers[index]
        if not peer.alive:
            return
        if peer.waiting_until is not None:  # died in a grace window: it lasted until now
            peer.waits.append(self.queue.now - peer.waiting_since)
        peer.alive, peer.busy, peer.left_at, peer.waiting_until = False, False, self.queue.now, None
        peer.incarnation += 1
        peer.ticks.close()  # its phase is lost, as on a real machine
        self.net.detach(peer.learner.peer_id)
        logger.info("sim: peer %d crashed at t=%.0fs", index, self.queue.now)

    def _join(self) -> None:
        alive = self._alive()
        if not alive:
            return
        donor = self.rng.choice(alive)
        peer = self._add_peer(1.0, state=donor.learner.replica.snapshot())
        # The snapshot travels at the donor's bandwidth; the joiner starts training once it has it.
        sync_s = peer.learner.numel * 4 / self.net.bytes_per_s + self.sim.latency_s
        self.net.bytes_sent[donor.learner.peer_id] += peer.learner.numel * 4
        for update in donor.store.missing_for(peer.learner.replica.version_vector, limit=1 << 30):
            peer.intake.receive(stored_envelope(update))
        logger.info("sim: peer %d joined at t=%.0fs from donor %d", peer.index, self.queue.now, donor.index)
        self.queue.push(self.queue.now + sync_s, self._start_phase, peer)

    def _eval_point(self) -> None:
        alive = self._alive()
        if alive:
            tokens = self.steps_published * self.spec.data.batch_size * self.spec.model.block_size
            loss = alive[0].learner.evaluate(self.eval_set)
            self.curve.append(EvalPoint(time_s=self.queue.now, tokens=tokens, loss=loss))
        if self.starting or any(p.busy for p in alive):
            self.queue.push(self.queue.now + self.eval_every_s, self._eval_point)

    def run(self) -> SimResult:
        for speed in self.sim.speed_factors():
            self._add_peer(speed)
        for index, at in self.sim.crashes():
            self.queue.push(at, self._crash, index)
        for at in self.sim.joins():
            self.queue.push(at, self._join)
        for peer in self.peers:
            if self.sim.start_spread_s:
                self.starting += 1
                self.queue.push(self.timing_rng.uniform(0.0, self.sim.start_spread_s), self._late_start, peer)
            else:
                self._start_phase(peer)
        self.queue.push(0.0, self._eval_point)
        self.queue.push(self.sim.anti_entropy_s, self._anti_entropy)
        self.queue.run()
        return swarm_result(self)
