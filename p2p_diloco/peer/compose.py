"""The peer's network services, built once and wired in their constructors (ARCHITECTURE.md "Threads").

`build_peer_services` runs when their parts exist: the node is up and its spec checked (`NodeUp`,
peer/startup.py) and the learner's replica is built. It makes the guard in front of every service, the intake
remote updates merge through, the evidence relay, repair, gossip and the snapshot server, and the parts
`Presence` announces and reads records with. Nothing here starts a service or touches the network:
`PeerNetwork.serve` starts the relay, gossip and the snapshot server (repair acts on what gossip hears).

Two pairs need each other; each is tied here, once, by a function that reads the other when called: the
guard re-reads the members through `Presence`, which checks their records with the guard; repair counts the
vectors gossip heard, and gossip hands repair every vector it hears.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from p2p_diloco.config import GossipConfig, RunSpec, StateSyncConfig
from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.admission.invites import Invitations
from p2p_diloco.net.admission.policy import NetPolicy
from p2p_diloco.net.gossip.evidence_relay import EvidenceRelay
from p2p_diloco.net.gossip.repair import Repair
from p2p_diloco.net.gossip.service import Gossip
from p2p_diloco.net.statesync.server import SnapshotServer
from p2p_diloco.peer.announce import Presence, PresenceParts
from p2p_diloco.peer.startup import NodeUp
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.train.learner import Learner
from p2p_diloco.wire.identity import Identity

REPAIR_GRACE_ANTI_ENTROPIES = 3.0
"""An update we merged and cannot serve must stay skipped by others for this many anti-entropy periods before
we adopt a skipping peer's state (net/gossip/repair.py): time for a peer that still holds it to fill their holes."""
PROVEN_WINDOW_S = 600.0
"""A peer votes in repair while an update of its own merged here in good standing within this long (a peer
that trains publishes every round; one that lingers, done, keeps its vote for a while)."""


@dataclass(frozen=True)
class ServiceConfig:
    """What the services are configured by: the run, this peer's access policy and the gossip and state-sync
    settings."""

    spec: RunSpec
    identity: Identity
    policy: NetPolicy
    gossip: GossipConfig
    statesync: StateSyncConfig


@dataclass(frozen=True)
class PeerServices:
    """One peer's network services around one learner."""

    up: NodeUp
    learner: Learner
    guard: PeerGuard
    intake: Intake
    presence: PresenceParts
    relay: EvidenceRelay
    repair: Repair
    gossip: Gossip
    server: SnapshotServer


def proven_among(replica: Replica, others: list[str]) -> list[str]:
    """Of `others`, the members whose own updates merged here in good standing within PROVEN_WINDOW_S
    (sync/standing.py): the only votes repair counts. A DHT record costs nothing to write; a contribution does."""
    if replica.standing is None:
        return others
    with replica.lock:
        proven = replica.standing.proven(replica.clock(), PROVEN_WINDOW_S)
    return [pid for pid in others if pid in proven]


def tree_members(presence: Presence, me: str, fan_in: int) -> dict[str, float]:
    """The live members whose record says they aggregate at `fan_in`, each with when it started (not us)."""
    members = {}
    for pid, record in presence.peers.items():
        agg = record.get("agg")
        if pid != me and isinstance(agg, list) and len(agg) == 2 and agg[0] == fan_in \
                and isinstance(agg[1], (int, float)):
            members[pid] = float(agg[1])
    return members


def build_peer_services(config: ServiceConfig, up: NodeUp, learner: Learner, presence: Presence, *,
                        static_record: Mapping[str, object], figures: Callable[[], Mapping[str, int]],
                        on_repaired: Callable[[dict[str, object]], None]) -> PeerServices:
    """The services of the peer whose node is `up`, around `learner`'s replica; `presence` is the peer's
    (it exists from the start), `static_record` the record fields that never change, `figures` the counters
    each record carries, `on_repaired` called with each repair's summary."""
    spec, node, cfg, replica = config.spec, up.node, config.gossip, learner.replica
    run_id, spec_hash = spec.run_id, spec.spec_hash()
    invites = Invitations.from_access(config.policy.access, run_id, node.peer_id,  # operator keys, our invitation
                                      operators=spec.defence.operators)
    guard = PeerGuard(run_id, self_id=node.peer_id, limits=config.policy.limits, allowed=spec.defence.allowed_senders,
                      key=up.key, invites=invites, refresh_members=lambda: presence.refresh_peers(parts))
    intake = Intake(spec, learner.numel, replica)  # checks, counts, evidence, the take-back of a ban
    relay = EvidenceRelay(node, run_id, intake, presence.other_peer_ids, guard, fanout=cfg.fanout,
                          timeout_s=cfg.rpc_timeout_s)
    since = time.time()
    if cfg.aggregate:  # our record says we take part in trees of this fan-in from now (net/gossip/tree.py)
        static_record = {**static_record, "agg": [cfg.aggregate, since]}
    parts = PresenceParts(node, guard, replica, intake, up.proof, static_record, figures,
                          on_refreshed=relay.meet)  # a newcomer learns of the bans made before it came
    store = UpdateStore(cfg.retained_bytes)
    repair = Repair(node, run_id, spec_hash, replica, store, config.statesync, known=lambda: gossip.known_vectors(),
                    members=lambda: proven_among(replica, presence.other_peer_ids()), guard=guard,
                    grace_s=REPAIR_GRACE_ANTI_ENTROPIES * cfg.anti_entropy_s, on_repaired=on_repaired)
    gossip = Gossip(node, run_id, intake, store, cfg, peers=presence.other_peer_ids, guard=guard,
                    on_evidence=relay.publish, on_vector=repair.observe, identity=config.identity,
                    tree_members=lambda: tree_members(presence, node.peer_id, cfg.aggregate), since=since)
    server = SnapshotServer(node, run_id, spec_hash, replica, config.identity, config.statesync, guard=guard)
    return PeerServices(up, learner, guard, intake, parts, relay, repair, gossip, server)
