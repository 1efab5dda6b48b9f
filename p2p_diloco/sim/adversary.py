"""Hostile peers for the in-process swarm, in the fault-injection style of hivemind's FaultyAverager: the
defences against hostile input (ARCHITECTURE.md "Invariants", 1) tested end to end.

A hostile peer trains like an honest one (so its updates look plausible in time and size), merges its honest
update into its own replica, and publishes a tampered one instead:

    nan        the payload carries a NaN (hand-made bytes: no codec encodes one)
    scale      the payload is the honest one times `factor` (x100 in the benchmark; a negative factor negates
               it); with `bounded`, its largest coordinate capped just under the spec's norm bound (the
               longest update that passes it: an attacker who knows the spec)
    sign_flip  the payload is minus the honest one
    tilt       the honest one negated, tilted toward the swarm's recent direction until its cosine with it is
               `factor` (`tilted`): built against a judge of directions
    undercut   the honest one, minus just enough of the swarm's recent direction that its cosine with it is
               `factor` (small, positive: too weak for a judge of directions, and its own trained work teaches the
               stream it declares): built against a sponsor's fit check (train/fit.py)
    mask       the honest one on the coordinates every replica's copy test reads (fixed and public: sync/copies.py
               `copy_coordinates`), the honest one times `factor` everywhere else (negated at -1; with `bounded`,
               capped under the norm bound): built against a judge that reads only those coordinates
    spike      the honest one, but on a fraction `factor` of the coordinates (the same ones every time) the most the
               norm bound lets through, pushing theta's values away from 0: built against a judge that reads a
               sample of the coordinates, however secret (the sample rarely holds one of them)
    withhold   seqs in `withhold` are published to nobody and kept by nobody (a lost update: replicas skip its gap);
               with `release_at_s` they are sent to every live peer at that time instead

Every tampered update is correctly signed: the defences under test are the receivers' (sync/intake.py,
sync/robust.py), not the signature check. `HostileSwarm` is `AsyncSwarm` with such peers, its peers' intake
on the simulated clock (gap timeouts), their stores attached to the intake (bans purge them), and the
replica repair of ARCHITECTURE.md "The network" at every anti-entropy tick (`Replica.adopt` on `unservable_for`).
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch

from p2p_diloco.config import RunSpec, SimConfig
from p2p_diloco.sim.crowd_attacks import within_bound
from p2p_diloco.sim.result import Progress, SimResult, divergence
from p2p_diloco.sim.swarm import AsyncSwarm, ReplicaState, SimPeer
from p2p_diloco.sim.tilts import tilt, undercut
from p2p_diloco.sync.copies import copy_coordinates
from p2p_diloco.sync.quorum import merged_by_quorum, skipped_by_quorum
from p2p_diloco.sync.robust import MergePolicy
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.train.data.corpus import Corpus
from p2p_diloco.train.exchange import SwarmView
from p2p_diloco.train.learner import Learner
from p2p_diloco.wire.codecs import Payload
from p2p_diloco.wire.envelope import OuterUpdate, encode_update, make_update

logger = logging.getLogger(__name__)


class Hostility(str, Enum):
    NAN = "nan"
    SCALE = "scale"
    SIGN_FLIP = "sign_flip"
    WITHHOLD = "withhold"
    TILT = "tilt"
    MASK = "mask"
    SPIKE = "spike"
    UNDERCUT = "undercut"


@dataclass(frozen=True)
class Adversary:
    """Peer `peer` of the swarm behaves as `mode`."""

    peer: int
    mode: Hostility
    factor: float = 100.0
    """scale: the payload's multiplier."""
    bounded: bool = False
    """scale: cap the scaled payload's largest coordinate just under the norm bound (sim/crowd_attacks.py)."""
    track: bool = False
    """Start each phase from an honest replica's state (an attacker that keeps an honest replica alongside its
    own), so that its tampered work is computed where the honest peers stand; otherwise from its own replica,
    which merged its honest updates instead of the tampered ones."""
    sleeper: int = 0
    """scale, sign_flip: publish `sleeper` honest updates between two tampered ones (an attack built against a
    run with sponsors: it graduates, sync/sponsorship.py RECORD, then strikes while its record holds)."""
    lag: int = 0
    """tilt: tilt toward theta's move of `lag` updates ago (`tilted`)."""
    withhold: tuple[int, ...] = (2,)
    """withhold: the seqs nobody gets."""
    release_at_s: float | None = None
    """withhold: simulated time at which the withheld updates are sent after all (None: never)."""

    def tamper(self, learner: Learner, honest: OuterUpdate) -> OuterUpdate:
        """The update this peer publishes in place of `honest` (same slot, valid signature)."""
        if self.mode is Hostility.WITHHOLD or (self.sleeper and honest.seq % (self.sleeper + 1)):
            return honest
        if self.mode is Hostility.NAN:
            payload = _with_nan(honest.payload, learner.codec.name)
        else:
            d = learner.codec.decompress(honest.payload, honest.header.numel)
            if self.mode is Hostility.SCALE:
                bound = MergePolicy.from_spec(learner.spec).reject_above if self.bounded else math.inf
                payload = learner.codec.compress(within_bound(d, self.factor, bound))
            elif self.mode is Hostility.TILT:
                payload = learner.codec.compress(tilted(learner, d, self.factor, self.lag))
            elif self.mode is Hostility.UNDERCUT:
                payload = learner.codec.compress(tilted(learner, d, self.factor, self.lag, keep_own=True))
            elif self.mode is Hostility.SPIKE:
                bound = MergePolicy.from_spec(learner.spec).reject_above
                payload = learner.codec.compress(spiked(d, learner.replica.theta, self.factor, bound))
            elif self.mode is Hostility.MASK:
                bound = MergePolicy.from_spec(learner.spec).reject_above if self.bounded else math.inf
                payload = learner.codec.compress(masked(d, copy_coordinates(d.numel()), self.factor, bound))
            else:
                payload = learner.codec.compress(-d)
        h = honest.header
        return make_update(run_id=h.run_id, spec_hash=h.spec_hash, seq=h.seq, tau=h.tau, samples=h.samples,
                           weight=h.weight, codec=h.codec, numel=h.numel, payload=payload,
                           identity=learner.identity, created_at=h.created_at, vouches=h.vouches,
                           data=h.position)  # its data position as declared: what a fit check redraws


def tilted(learner: Learner, honest: torch.Tensor, cosine: float, lag: int = 0, keep_own: bool = False) -> torch.Tensor:
    """Built against a judge of directions (sync/sponsorship.py): the honest update negated, plus just enough of
    the swarm's own recent direction (what theta moved by since this peer's last update: mostly the sponsors'
    work) that its cosine with that direction is `cosine`, at the honest update's length. It passes a judge that
    asks "does it point along our work?" while its component off that direction is the honest one negated. With
    `lag`, theta's move between this peer's updates lag + 1 and lag before this one instead (built against a
    sponsor that removes its own recent moves from what it relays). With `keep_own` (undercut: built against a fit
    check, train/fit.py), the honest update itself, minus just enough of that direction that its cosine with it
    is `cosine` (small and positive: too weak for a judge of directions, checked for fit instead, which its own
    trained work passes): against the sponsors' work, with the fit of real compute. Until it has that much
    history it publishes honest updates."""
    thetas = learner.__dict__.setdefault("_tilt_thetas", [])  # theta at this peer's updates, newest first
    thetas.insert(0, learner.replica.theta.clone())
    del thetas[lag + 2:]
    if len(thetas) < lag + 2:
        return honest
    direction = thetas[lag + 1] - thetas[lag]
    return undercut(honest, direction, cosine) if keep_own else tilt(honest, direction, cosine)


def masked(honest: torch.Tensor, at: torch.Tensor, factor: float, bound: float = math.inf) -> torch.Tensor:
    """`honest` at the coordinates `at`, `honest * factor` (capped under `bound`) everywhere else: to a judge
    that reads only `at`, the honest update; to theta, mostly the attack."""
    out = within_bound(honest, factor, bound)
    out[at] = honest[at]
    return out


def spiked(honest: torch.Tensor, theta: torch.Tensor, fraction: float, bound: float) -> torch.Tensor:
    """`honest`, with a fixed `fraction` of its coordinates at 0.99 of `bound`, signed so that the merge (theta minus
    the step) pushes theta's values there away from 0."""
    g = torch.Generator().manual_seed(0x5B1CE)
    at = torch.randperm(honest.numel(), generator=g)[:max(1, round(fraction * honest.numel()))]
    out = honest.clone()
    out[at] = -0.99 * bound * torch.where(theta[at] >= 0, 1.0, -1.0)
    return out


class Published(NamedTuple):
    """A poisoning peer's published update `seq` against the honest one it trained: their cosine, its length
    relative to the honest one's and its largest coordinate."""

    peer: int
    seq: int
    cosine: float
    length_ratio: float
    peak: float


def _with_nan(payload: Payload, codec: str) -> bytes:
    """The payload with its first value (fp32, fp16) or first block scale (int8, int4) set to NaN."""
    nan = struct.pack("<e", math.nan) if codec == "fp16" else struct.pack("<f", math.nan)
    return nan + payload[len(nan):]


class WithholdingStore(UpdateStore):
    """The store of a peer that keeps nothing of its own withheld seqs (so nothing can serve them)."""

    def __init__(self, max_bytes: int, owner: str, withheld: frozenset[int]) -> None:
        super().__init__(max_bytes)
        self.owner, self.withheld = owner, withheld

    def add(self, update) -> bool:  # noqa: ANN001 (UpdateLike)
        if update.sender == self.owner and update.seq in self.withheld:
            return False
        return super().add(update)


class HostileSwarm(AsyncSwarm):
    """The async swarm with hostile peers; `run()` as usual, then `honest_summary(result)`."""

    def __init__(self, spec: RunSpec, sim: SimConfig, corpus: Corpus, adversaries: Sequence[Adversary] = (), *,
                 progress: Progress | None = None, weigh_banned: bool = True) -> None:
        """`weigh_banned=False`: senders weight their updates as if the peers every live peer has banned were
        gone (the plain simulator, like the real swarm's peer list, counts every live peer)."""
        self.adversaries = {a.peer: a for a in adversaries}
        self.repairs = 0
        self.published: list[Published] = []  # what each poisoning peer published, against its honest update
        self.weigh_banned = weigh_banned
        super().__init__(spec, sim, corpus, progress=progress)

    def _add_peer(self, speed: float, state: ReplicaState | None = None) -> SimPeer:
        peer = super()._add_peer(speed, state)
        intake = peer.intake  # its replica dates gaps on the simulated clock (AsyncSwarm._add_peer)
        adversary = self.adversaries.get(peer.index)
        if adversary is not None:
            self._make_hostile(peer, adversary)
        intake.attach_store(peer.store)
        return peer

    def _make_hostile(self, peer: SimPeer, adversary: Adversary) -> None:
        learner, honest_finish = peer.learner, peer.learner.finish_phase
        withheld = frozenset(adversary.withhold) if adversary.mode is Hostility.WITHHOLD else frozenset()
        if withheld:
            peer.store = WithholdingStore(peer.store.max_bytes, learner.peer_id, withheld)
            publish = peer.exchange.publish

            def publish_some(update: OuterUpdate) -> None:
                if update.seq not in withheld:
                    publish(update)
                elif adversary.release_at_s is not None:
                    self.queue.push(max(self.queue.now, adversary.release_at_s), self._release, peer, update)

            peer.exchange.publish = publish_some  # type: ignore[method-assign]

        def finish_phase(phase, result, swarm) -> OuterUpdate:  # noqa: ANN001
            honest = honest_finish(phase, result, swarm)
            tampered = adversary.tamper(learner, honest)
            if adversary.mode in (Hostility.SCALE, Hostility.SIGN_FLIP, Hostility.TILT, Hostility.MASK,
                                  Hostility.SPIKE):
                d, t = (learner.codec.decompress(u.payload, u.header.numel) for u in (honest, tampered))
                cosine = float(torch.nn.functional.cosine_similarity(d, t, dim=0))
                self.published.append(Published(peer.index, tampered.seq, cosine, float(t.norm() / d.norm()),
                                                float(t.abs().max())))
            return tampered

        learner.finish_phase = finish_phase  # type: ignore[method-assign]

    def _start_phase(self, peer: SimPeer) -> None:
        adversary = self.adversaries.get(peer.index)
        honest = [p for p in self._alive() if p.index not in self.adversaries]
        if adversary is not None and adversary.track and honest and peer.alive:  # between its phases
            peer.learner.replica.load(*honest[0].learner.replica.snapshot())
        super()._start_phase(peer)

    def _view(self) -> SwarmView:
        view = super()._view()
        if self.weigh_banned:
            return view
        alive = self._alive()
        judges = [p.learner.replica.banned for p in alive if p.index not in self.adversaries]
        banned = set.intersection(*judges) if judges else set()
        n = max(1, view.num_peers - sum(1 for p in alive if p.learner.peer_id in banned))
        return SwarmView(num_peers=n, samples_per_round=n * self.spec.inner.inner_steps * self.spec.data.batch_size)

    def _release(self, peer: SimPeer, update: OuterUpdate) -> None:
        if peer.alive:
            self.net.broadcast(peer.learner.peer_id, encode_update(update))
            # Anti-entropy may have stopped (the swarm was quiet): the release is news to spread.
            self.queue.push(self.queue.now + self.sim.anti_entropy_s, self._anti_entropy)

    def _anti_entropy(self) -> None:
        for peer in self._alive():
            peer.intake.expire_gaps()  # the timer a quiet swarm needs (nothing arrives to trigger it)
        super()._anti_entropy()
        self._repair()

    def _repair(self) -> None:
        """ARCHITECTURE.md "The network" (repair): a replica that merged an update another skipped, and can no longer
        serve it, adopts that peer's state and re-merges what it holds beyond it, if at least as many peers
        skipped it as merged it; a skipper outvoted by mergers adopts a merger's state (net/gossip/repair.py's rules;
        the simulator knows every vector and needs no grace)."""
        alive = self._alive()
        for peer in alive:
            vectors = [p.learner.replica.version_vector for p in alive if p is not peer]
            for other in alive:
                if other is peer:
                    continue
                local, remote = peer.learner.replica.version_vector, other.learner.replica.version_vector
                items = peer.store.unservable_for(local, remote)
                # The other side of the vote: our holes it merged that no live store can serve us.
                lost = [(s, q) for s, q in local.holes_merged_by(remote) if not any(p.store.get(s, q) for p in alive)]
                if (items and skipped_by_quorum(items, vectors)) or (lost and merged_by_quorum(lost, vectors)):
                    theta, vv = other.learner.replica.snapshot()
                    held = peer.store.missing_for(vv, limit=1 << 30)
                    peer.learner.replica.adopt(theta, vv, held)
                    self.repairs += 1
                    logger.info("sim: peer %d adopted the state of peer %d (repair)", peer.index, other.index)
                    break

    def _quiet(self) -> bool:
        # A poisoner's own replica never agrees with the others' (it merged its honest updates); a withholder's does.
        alive = [p for p in self._alive()
                 if p.index not in self.adversaries or self.adversaries[p.index].mode is Hostility.WITHHOLD]
        if self.starting or any(p.busy for p in self._alive()) or self.net.in_flight:
            return False
        return len({p.learner.replica.version_vector for p in alive}) <= 1

    def honest_summary(self, result: SimResult) -> dict:
        """Eval loss, divergence and rejection counts over the honest peers only."""
        honest = [p for p in self._alive() if p.index not in self.adversaries]
        losses = [r.eval_loss for r in result.peers if r.index not in self.adversaries and r.eval_loss is not None]
        thetas = [p.learner.replica.snapshot()[0] for p in honest]
        rejected: dict[str, int] = {}
        for p in honest:
            for reason, n in p.intake.counts.items():
                rejected[reason] = rejected.get(reason, 0) + n
        return {"eval_loss": float(sum(losses) / len(losses)) if losses else math.nan,
                "divergence": divergence(thetas) if len(thetas) > 1 else 0.0,
                "banned": sorted({s[-8:] for p in honest for s in p.learner.replica.banned}),
                "counts": rejected, "repairs": self.repairs,
                "finite": all(bool(torch.isfinite(t).all()) for t in thetas)}
