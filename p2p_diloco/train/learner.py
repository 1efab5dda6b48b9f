"""The learner unit: one replica, one local model, and the round loop of DESIGN.md section 3.

    V_base, theta0 <- snapshot(replica);  phi <- theta0
    H inner steps of AdamW on phi                      (compute; never touches the network)
    delta <- theta0 - phi; d <- Nesterov(delta); q <- compress(d + e)
    U <- sign(header{run, sender, seq, tau, samples, w, codec, digest}, q)
    merge(U) locally; publish(U)

The learner knows nothing about networks or clocks: the caller (the simulator, or the swarm's compute
thread) decides when a phase begins and ends and where the update goes. Remote updates reach the replica
through `Intake` on another thread; the replica's lock makes the merge and the snapshot atomic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from p2p_diloco.config import RunSpec
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.replica import MergeOutcome, Replica
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.train.data import Corpus, ShardSampler, evaluate
from p2p_diloco.train.inner import InnerResult, inner_phase, make_inner_optimizer
from p2p_diloco.train.model import build_model, flat_params, load_flat_params
from p2p_diloco.train.outer import OuterState, outer_update, pseudo_gradient, update_weight
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import OuterUpdate, make_update
from p2p_diloco.wire.identity import Identity


@dataclass
class Phase:
    """What a phase starts from: the replica and its version vector at that moment."""

    theta0: torch.Tensor
    version_vector: VersionVector
    started_at: float


@dataclass
class SwarmView:
    """What the sender needs to know of the swarm to weight its update."""

    num_peers: int
    samples_per_round: float  # sum over live peers of the samples in one of their updates


class Learner:
    """One learner unit. Not thread-safe itself; only the replica is shared with the network thread."""

    def __init__(self, spec: RunSpec, identity: Identity, corpus: Corpus, *, shard: int, num_shards: int,
                 replica_state: tuple[torch.Tensor, VersionVector] | None = None):
        self.spec = spec.validate()
        self.identity = identity
        self.peer_id = identity.peer_id
        torch.manual_seed(spec.seed)  # dropout and any other global-RNG use start from the run's seed
        self.model = build_model(spec.model, spec.seed)
        theta = flat_params(self.model)
        self.numel = theta.numel()
        self.codec = get_codec(spec.outer.codec, spec.outer.codec_block)
        self.replica = Replica(theta, outer_lr=spec.outer.outer_lr, max_weight=spec.outer.max_weight,
                               decode=self._decode)
        if replica_state is not None:
            self.replica.load(*replica_state)
        self.intake = Intake(spec, self.numel, self.replica)
        self.optimizer = make_inner_optimizer(self.model, spec.inner)
        self.outer_state = OuterState.zeros(self.numel)
        self.sampler = ShardSampler(corpus.train, shard=shard, num_shards=num_shards,
                                    block_size=spec.model.block_size, batch_size=spec.data.batch_size,
                                    seed=spec.seed)
        self.step = 0  # cumulative inner steps: the schedule's clock and the data position
        self.history: list[dict] = []

    def _decode(self, update) -> torch.Tensor:
        return self.codec.decompress(update.payload, update.header.numel)

    # ---- the round loop, in three named parts so a caller can interleave the network ----------------

    def begin_phase(self) -> Phase:
        theta0, vv = self.replica.snapshot()
        return Phase(theta0=theta0, version_vector=vv, started_at=time.time())

    def run_inner(self, phase: Phase) -> InnerResult:
        """H inner steps from the phase's theta0. The AdamW state carries over between phases (DiLoCo)."""
        load_flat_params(self.model, phase.theta0)
        result = inner_phase(self.model, self.optimizer, self.sampler, self.step, self.spec.inner.inner_steps,
                             self.spec.inner)
        self.step += result.steps
        return result

    def finish_phase(self, phase: Phase, result: InnerResult, swarm: SwarmView) -> OuterUpdate:
        """Pseudo-gradient -> outer update, signed, merged into our own replica; the caller publishes it."""
        phi = flat_params(self.model)
        delta = pseudo_gradient(phase.theta0, phi)
        payload, _ = outer_update(delta, self.outer_state, self.spec.outer, self.codec)
        tau = self.replica.version_vector.staleness(phase.version_vector)
        weight = update_weight(result.samples, swarm.samples_per_round, tau, swarm.num_peers, self.spec.outer)
        update = make_update(
            run_id=self.spec.run_id, spec_hash=self.intake.spec_hash, sender=self.peer_id,
            seq=self.replica.version_vector.get(self.peer_id) + 1, tau=tau, samples=result.samples,
            weight=weight, codec=self.codec.name, numel=self.numel, payload=payload, identity=self.identity)
        outcome, _ = self.replica.offer(update)
        if outcome is not MergeOutcome.MERGED:  # our own next seq always merges; anything else is a bug
            raise RuntimeError(f"own update not merged: {outcome}")
        self.history.append({"step": self.step, "seq": update.seq, "tau": tau, "weight": weight,
                             "loss": result.mean_loss, "compute_s": result.compute_s})
        return update

    def run_round(self, swarm: SwarmView) -> tuple[OuterUpdate, InnerResult]:
        phase = self.begin_phase()
        result = self.run_inner(phase)
        return self.finish_phase(phase, result, swarm), result

    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Eval loss of the replica (not of phi). Call between phases: it reuses the local model."""
        theta, _ = self.replica.snapshot()
        load_flat_params(self.model, theta)
        return evaluate(self.model, batches)
