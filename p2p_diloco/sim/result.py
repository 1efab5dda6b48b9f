"""What a simulated run reports (ARCHITECTURE.md, "What we measure"): loss at equal tokens, bytes, utilization,
staleness, replica divergence."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from p2p_diloco.config.errors import ConfigError
from p2p_diloco.sync.round_view import round_view
from p2p_diloco.train.data.corpus import evaluate
from p2p_diloco.train.models.build import build_model, load_flat_params

if TYPE_CHECKING:
    from p2p_diloco.config import RunSpec

Progress = Callable[[int, int, float | None], None]
"""A run's progress callback: (steps done, steps in all, the last train loss or None)."""

AsyncSwarm = Any  # sim/swarm.py's (not imported: the swarm imports this module)
SimPeer = Any  # sim/swarm.py's (not imported: the swarm imports this module)


TAIL_ROUNDS = 4
"""Complete rounds `SimResult.tail_loss` averages over (BENCHMARKS "Async at parity": 4 of 100 at H=50)."""


@dataclass
class EvalPoint:
    time_s: float
    tokens: int
    loss: float


@dataclass
class PeerReport:
    index: int
    peer_id: str
    alive: bool
    steps: int
    bytes_sent: int
    tokens: int
    utilization: float
    taus: list[int]
    eval_loss: float | None
    rejected: dict[str, int] = field(default_factory=dict)
    waits: list[float] = field(default_factory=list)  # each grace window's length, simulated seconds (async)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_sent / max(1, self.tokens)


@dataclass
class SimResult:
    method: str
    eval_loss: float
    sim_time_s: float
    tokens: int
    divergence: float
    curve: list[EvalPoint]
    peers: list[PeerReport]
    numel: int
    messages_lost: int = 0
    theta: torch.Tensor | None = None  # the mean replica, for callers that want to evaluate further
    round_loss: float | None = None
    """Eval loss of the round view (sync/round_view.py): the model without the round still under way. A
    synchronous run is always at a complete round (its eval_loss); None where an async run has no round view."""
    tail_loss: float | None = None
    """Eval loss of the mean of the last TAIL_ROUNDS complete-round states (the round view averaged; for a
    synchronous run, its last TAIL_ROUNDS round states): tail averaging, the same for both."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("theta")
        for p, rep in zip(d["peers"], self.peers):
            p["bytes_per_token"] = rep.bytes_per_token
        return d

    def time_to_loss(self, target: float) -> float | None:
        """Simulated seconds until the eval curve first reaches `target` (None if never)."""
        return next((p.time_s for p in self.curve if p.loss <= target), None)

    def table(self) -> str:
        lines = [f"{'peer':>4} {'alive':>5} {'steps':>6} {'eval':>7} {'tau med':>7} {'tau max':>7} "
                 f"{'util':>5} {'MB sent':>8} {'B/token':>8} rejected"]
        for p in self.peers:
            med = statistics.median(p.taus) if p.taus else 0
            mx = max(p.taus) if p.taus else 0
            loss = f"{p.eval_loss:.4f}" if p.eval_loss is not None else "-"
            rej = {k: v for k, v in p.rejected.items() if k not in ("merged", "buffered", "duplicate")}
            lines.append(f"{p.index:>4} {str(p.alive):>5} {p.steps:>6} {loss:>7} {med:>7.1f} {mx:>7} "
                         f"{p.utilization:>5.0%} {p.bytes_sent / 1e6:>8.2f} {p.bytes_per_token:>8.2f} {rej or ''}")
        lines.append(f"method={self.method} eval_loss={self.eval_loss:.4f} tokens={self.tokens} "
                     f"sim_time={self.sim_time_s:.0f}s divergence={self.divergence:.2e} lost_msgs={self.messages_lost}")
        return "\n".join(lines)


def divergence(thetas: list[torch.Tensor]) -> float:
    """max_i ||theta_i - mean|| / ||mean|| (ARCHITECTURE.md "What we measure")."""
    if len(thetas) < 2:
        return 0.0
    mean = torch.stack(thetas).mean(0)
    norm = float(mean.norm()) or 1.0
    return max(float((t - mean).norm()) for t in thetas) / norm


def eval_theta(spec: RunSpec, theta: torch.Tensor, batches: list, device: torch.device | str = "cpu") -> float:
    """Eval loss of a flat theta on a model of its own (a view a learner does not hold: the round view)."""
    model = build_model(spec.model, spec.seed).to(device)
    load_flat_params(model, theta)
    return evaluate(model, batches)


def swarm_result(swarm: AsyncSwarm) -> SimResult:
    """What an in-process swarm's run reports, once its queue drained."""
    alive = [p for p in swarm.peers if p.alive]
    if not alive:
        raise ConfigError("every peer crashed before the run ended: nothing is left to evaluate "
                          "(script fewer crashes, or add --join)")
    final = {p.index: p.learner.evaluate(swarm.eval_set) for p in alive}
    losses = list(final.values())
    thetas = [p.learner.replica.snapshot()[0] for p in alive]
    tokens = swarm.steps_started * swarm.spec.data.batch_size * swarm.spec.model.block_size
    swarm.curve.append(EvalPoint(time_s=swarm.queue.now, tokens=tokens, loss=losses[0]))
    reports = []
    for p in swarm.peers:
        end = next(t for t in (p.left_at, p.done_at, swarm.queue.now) if t is not None)
        lifetime = end - p.joined_at
        reports.append(PeerReport(
            index=p.index, peer_id=p.learner.peer_id, alive=p.alive, steps=p.learner.step,
            bytes_sent=swarm.net.bytes_sent[p.learner.peer_id],
            tokens=p.learner.step * swarm.spec.data.batch_size * swarm.spec.model.block_size,
            utilization=p.compute_s / lifetime if lifetime > 0 else 0.0, taus=p.taus, waits=p.waits,
            eval_loss=final.get(p.index),
            rejected=dict(p.intake.counts)))
    return SimResult(method="async", eval_loss=float(sum(losses) / len(losses)), sim_time_s=swarm.queue.now,
                     tokens=tokens, divergence=divergence(thetas), curve=swarm.curve, peers=reports,
                     messages_lost=swarm.net.messages_lost, numel=alive[0].learner.numel,
                     theta=torch.stack(thetas).mean(0), round_loss=_round_loss(swarm, alive[0], 1),
                     tail_loss=_round_loss(swarm, alive[0], TAIL_ROUNDS))


def _round_loss(swarm: AsyncSwarm, peer: SimPeer, rounds: int) -> float | None:
    """Eval loss of `peer`'s round view (sync/round_view.py) on a model of its own; None if it has none."""
    view = round_view(peer.learner.replica, peer.store.get, rounds)
    return None if view is None else eval_theta(swarm.spec, view[0], swarm.eval_set, swarm.device)
