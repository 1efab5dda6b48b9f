"""A crowd of fresh identities in the in-process swarm: poisoning that costs the attacker nothing but keys (an
open run's threat, ARCHITECTURE.md "Who counts").

`CrowdSwarm` is `HostileSwarm` (sim/adversary.py) with `crowd` extra identities on top of the peers. They
train nothing and spend none of the token budget: each time the copied peer (`source`: honest peer 0, or a
late joiner's index) publishes, every crowd identity publishes a tampered copy of that update (the modes of
sim/crowd_attacks.py: exact and near copies, negated, scaled up to the norm bound, noise) under its own identity
and next seq, claiming the full weight (`max_weight`), and sends it to every peer. That is the cheapest attack
an open run admits: K identities for the price of one stolen update per round. Hostile peers that do train
(`adversaries`, spending the token budget like honest ones) can join the same run.

How many peers the honest senders weight by (`SwarmView.num_peers`) is the real peer's rule: `count` "records"
counts every identity with a record (the crowd included: today's main), "proven" only authors in good standing
whose updates merged recently (sync/standing.py `Standing.proven`, what the real peer does now).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from p2p_diloco.config import RunSpec, SimConfig
from p2p_diloco.sim.adversary import Adversary, HostileSwarm
from p2p_diloco.sim.crowd_attacks import crowd_delta, forged, mode_of
from p2p_diloco.sim.result import Progress
from p2p_diloco.sim.swarm import ReplicaState, SimPeer, stored_envelope
from p2p_diloco.sync.authors import MAX_INHERITED
from p2p_diloco.sync.robust import MergePolicy
from p2p_diloco.train.data.corpus import Corpus
from p2p_diloco.train.exchange import SwarmView
from p2p_diloco.wire.envelope import OuterUpdate, decode_update, encode_update
from p2p_diloco.wire.herald import encode_herald
from p2p_diloco.wire.identity import Identity

CROWD = "crowd"
"""The causal crowd's endpoint on the network (`CrowdAttack.causal`)."""
EXACT = ("sign_flip", "scale", "copy")
"""Plain modes whose payload is the same for every identity."""
PROVEN_WINDOW_ROUNDS = 8
"""A proven author's last full-weight update must be at most this many of its own phases old (simulated)."""


@dataclass(frozen=True)
class CrowdAttack:
    size: int
    mode: str = "sign_flip"  # sim/crowd_attacks.py MODES
    factor: float = 5.0
    count: str = "proven"  # proven | records: who counts in the swarm's size
    after: int = 0  # the crowd copies the source's updates from its seq after+1 on (0: from its first)
    source: int = 0  # the index of the peer whose updates the crowd copies (a joiner's: it copies a newcomer)
    causal: bool = False
    """The crowd copies only what it holds: it is one more endpoint of the network (`CROWD`, among the source's
    gossip targets, behind its uplink like any peer), and its copies leave once the source's update has reached
    it. False: they leave the instant the source publishes, each identity on its own uplink, so under latency
    jitter they often beat the original (10 of 32 arrivals in tests/sim/test_crowd_causal.py, 17 of 18 judgments
    in the graduation scenario's noise); no real crowd can send what it has not received, so that is the
    strongest crowd imaginable, not one that exists (with heralds, theirs leave as early: a copier's herald
    before it holds the payload it names)."""
    adjacent: bool = False
    """The strongest crowd a network allows: it holds the source's update the moment the payload could first have
    crossed the source's uplink (its heralds and one copy of the payload, plus the plain latency: first in the
    queue, next door), and its copies and their heralds leave then, each identity on its own uplink."""
    declare: bool = False
    """Each copy declares the source's data position: built against the sponsors' fit check (train/fit.py), which
    then redraws the source's batches for the copy, the batches the source's own work is best at."""


class CrowdSwarm(HostileSwarm):
    """Honest (and hostile) peers plus a crowd of identities that re-sign tampered copies of one peer's updates."""

    def __init__(self, spec: RunSpec, sim: SimConfig, corpus: Corpus, attack: CrowdAttack, *,
                 adversaries: Sequence[Adversary] = (), progress: Progress | None = None) -> None:
        self.attack = attack
        self.crowd = [Identity.generate() for _ in range(attack.size)]
        self.crowd_seq = [0] * attack.size
        self.modes = [mode_of(attack.mode, i) for i in range(attack.size)]
        self.noise_rng = torch.Generator().manual_seed(spec.seed + 1)
        self.bound = MergePolicy.from_spec(spec).reject_above
        self._theta_before: torch.Tensor | None = None  # the source's theta at its last update (`echo_noise`)
        super().__init__(spec, sim, corpus, adversaries, progress=progress)

    def _add_peer(self, speed: float, state: ReplicaState | None = None) -> SimPeer:
        peer = super()._add_peer(speed, state)
        if peer.index != self.attack.source or not self.crowd:
            return peer
        if self.attack.causal:
            self.net.attach(CROWD, lambda data, sender: self._crowd_receives(peer, data, sender))
            return peer
        honest_publish = peer.exchange.publish

        def publish(update: OuterUpdate) -> None:
            honest_publish(update)
            if not self.attack.adjacent:
                self._crowd_publishes(peer, update)
                return
            # the payload leaves once the sponsors acked its heralds (or behind them on the uplink, without the wait)
            heralds = len(encode_herald(update)) * len(peer.exchange.heralds_to)
            heralds_done = self.queue.now + heralds / self.net.bytes_per_s
            leaves = max(peer.exchange.released_at, heralds_done)
            held_at = leaves + len(encode_update(update)) / self.net.bytes_per_s + self.net.latency_s
            self.queue.push(held_at, self._crowd_publishes, peer, update)

        peer.exchange.publish = publish  # type: ignore[method-assign]
        return peer

    def _join(self) -> None:
        """AsyncSwarm._join, plus what the real joiner does: it inherits its donor's standing with the snapshot
        (net/statesync/server.py), before it merges the donor's newer updates."""
        alive = self._alive()
        if not alive:
            return
        donor = self.rng.choice(alive)
        peer = self._add_peer(1.0, state=donor.learner.replica.snapshot())
        if donor.learner.replica.standing is not None and peer.learner.replica.standing is not None:
            peer.learner.replica.standing.inherit(*donor.learner.replica.standing.inheritance(MAX_INHERITED),
                                                  known=donor.learner.replica.version_vector)
        sync_s = peer.learner.numel * 4 / self.net.bytes_per_s + self.sim.latency_s
        self.net.bytes_sent[donor.learner.peer_id] += peer.learner.numel * 4
        for update in donor.store.missing_for(peer.learner.replica.version_vector, limit=1 << 30):
            peer.intake.receive(stored_envelope(update))
        self.queue.push(self.queue.now + sync_s, self._start_phase, peer)

    def _crowd_receives(self, source: SimPeer, data: bytes, sender: str) -> None:
        """The causal crowd holds the source's update now (other senders' it ignores): copies leave."""
        if sender == source.learner.peer_id and source.alive:
            self._crowd_publishes(source, decode_update(data, max_bytes=len(data)))

    def _crowd_publishes(self, source: SimPeer, honest: OuterUpdate) -> None:
        if honest.seq <= self.attack.after:
            return
        codec, h = source.learner.codec, honest.header
        d = codec.decompress(honest.payload, h.numel)
        exact: dict[str, bytes] = {}  # the exact copies are one payload for the whole crowd
        along = None
        if "echo_noise" in self.modes:  # the swarm's move since the source's last update: public knowledge
            theta = source.learner.replica.theta.clone()
            along = self._theta_before - theta if self._theta_before is not None else None
            self._theta_before = theta
        targets = [p for p in self._alive() if p is not source] + [source]
        for i, identity in enumerate(self.crowd):
            mode = self.modes[i]
            payload = exact.get(mode)
            if payload is None:
                payload = codec.compress(crowd_delta(mode, d, factor=self.attack.factor, bound=self.bound,
                                                     rng=self.noise_rng, along=along))
                if mode in EXACT:
                    exact[mode] = payload
            self.crowd_seq[i] += 1
            update = forged(honest, payload, identity, self.crowd_seq[i], self.spec.outer.max_weight,
                            declare=self.attack.declare)
            data, herald = encode_update(update), encode_herald(update) if self.sim.heralds else b""
            for target in targets:
                if herald and target.learner.peer_id in self.spec.defence.sponsors:
                    self.net.send(identity.peer_id, target.learner.peer_id, herald, herald=True)
                self.net.send(identity.peer_id, target.learner.peer_id, data)

    def _view(self) -> SwarmView:
        per_peer = self.spec.inner.inner_steps * self.spec.data.batch_size
        alive = self._alive()
        if self.attack.count == "records":
            n = len(alive) + self.attack.size
        else:  # the real peer's rule (peer/exchange.py): what the replicas merged recently, here their mean
            window = PROVEN_WINDOW_ROUNDS * self.spec.inner.inner_steps * self.sim.step_time_s
            sizes = [p.learner.replica.standing.swarm_size(self.queue.now, window)
                     for p in alive if p.learner.replica.standing is not None and p.index not in self.adversaries]
            size = sum(sizes) / len(sizes) if sizes else float(len(alive))
            return SwarmView(num_peers=max(1, round(size)), samples_per_round=size * per_peer)
        return SwarmView(num_peers=max(1, n), samples_per_round=max(1, n) * per_peer)

    def honest(self) -> list[SimPeer]:
        """The live peers that are not hostile (the crowd has no peers)."""
        return [p for p in self._alive() if p.index not in self.adversaries]

    def attackers(self) -> list[str]:
        """The peer ids of the crowd and of the hostile peers."""
        return [i.peer_id for i in self.crowd] + [p.learner.peer_id for p in self.peers if p.index in self.adversaries]

    def weights_by_seq(self, peer_id: str) -> dict[int, list[float]]:
        """The multiplier each update of `peer_id` holds at the end on the other honest replicas, by seq."""
        by_seq: dict[int, list[float]] = {}
        for peer in self.honest():
            replica = peer.learner.replica
            if peer.learner.peer_id != peer_id:
                for seq in range(1, replica.version_vector.get(peer_id) + 1):
                    by_seq.setdefault(seq, []).append(replica.merged_weight(peer_id, seq))
        return {k: sorted(v) for k, v in sorted(by_seq.items())}

    def crowd_summary(self) -> dict:
        """What the honest replicas made of the attack: verdict counts summed over them, the attackers' weight
        (the mean multiplier their merged updates hold there: 0 refused, 1 full) and, for a crowd copying
        a peer other than peer 0, that peer's multipliers by seq."""
        stats: dict[str, int] = {}
        honest = self.honest()
        for p in honest:
            standing = p.learner.replica.standing
            for k, v in (standing.stats.items() if standing is not None else ()):
                stats[k] = stats.get(k, 0) + v
        distrusted = [len(p.learner.replica.standing.distrusted) for p in honest
                      if p.learner.replica.standing is not None]
        held = [w for pid in self.attackers() for ws in self.weights_by_seq(pid).values() for w in ws]
        attackers = set(self.attackers())  # in a run with sponsors: their updates' worth the sponsors relayed
        relayed = [sum(w for a, w in p.learner.replica.standing.sponsorship.relayed.items() if a in attackers)
                   for p in honest if p.learner.replica.standing is not None]
        out = {"verdicts": stats, "distrusted_min": min(distrusted) if distrusted else 0,
               "crowd": self.attack.size, "mode": self.attack.mode, "count": self.attack.count,
               "crowd_published": sum(self.crowd_seq), "hostile": len(self.adversaries),
               "attacker_weight": sum(held) / len(held) if held else 0.0, "attacker_updates": len(held),
               "attacker_relayed": sum(relayed)}
        if self.attack.source and len(self.peers) > self.attack.source:
            source = self.peers[self.attack.source].learner.peer_id
            # by seq: the weight it merged with, or in a run with sponsors the share each relayed as a member's
            out["source_weights"] = self.relayed_by_seq(source) if self.spec.defence.sponsors \
                else self.weights_by_seq(source)
        return out

    def relayed_by_seq(self, author: str) -> dict[int, list[float]]:
        """In a run with sponsors: `author`'s updates by seq, the share of its step each sponsor relayed as a
        graduate's (sync/sponsorship.py `keep`; 0 while its work is relayed at the newcomers' share)."""
        by_seq: dict[int, list[float]] = {}
        for p in self.honest():
            standing = p.learner.replica.standing
            if standing is not None and standing.sponsorship.judging:
                for (a, seq), (_, keep) in standing.sponsorship.judged.items():
                    if a == author:
                        by_seq.setdefault(seq, []).append(round(keep, 3))
        return {k: sorted(v) for k, v in sorted(by_seq.items())}
