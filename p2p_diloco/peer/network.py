"""The network side of one peer: everything that runs on its asyncio loop (ARCHITECTURE.md "Threads").

One loop in a daemon thread (`NetLoop`, net/transport/netloop.py) runs the SwarmNode, Gossip, the SnapshotServer, the
EvidenceRelay, the replica Repair (net/gossip/repair.py, fed by gossip), the admission check (`hello`) and small
tasks: announcing this peer's signed record, refreshing the list of live peers and meeting lost peers again
(`Presence`, peer/announce.py). The counters come from peer/network_counters.py.
The compute thread talks to it in two ways only, neither of which waits on the network:

- it hands over finished updates with `asyncio.run_coroutine_threadsafe(network.publish(u), loop)`;
- it reads `peers` and `counters`, plain dicts the loop replaces whole (never mutates) every tick, and
  writes `local` (its round summary) the same way. Replacing a reference is atomic under the GIL.

Remote updates merge into the replica here, through the network's own `Intake`; the replica's lock makes that
safe while the compute thread snapshots it.

Hostile input (issue 5): one `PeerGuard` (net/admission/guard.py) stands in front of every service: it holds the run's
allow list (RunSpec `defence.allowed_senders`) and this peer's run-secret key, the per-remote rate limits, and
the rejection counts. `peers` holds only members: records of non-members (not in the allow list, or without
a valid proof of the run secret) are dropped. This peer's record carries its own membership proof and what
it rejected (by reason, and its worst offenders), so `status` shows them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from p2p_diloco.config import ConfigError, RunSpec
from p2p_diloco.net.admission.guard import NOT_IN_ALLOW_LIST, REFUSED_PREFIX, AccessDenied, PeerGuard, ask_admission
from p2p_diloco.net.admission.policy import MembershipKey, NetPolicy
from p2p_diloco.net.discovery.records import (
    DEFAULT_RECORD_TTL_S,
    PeerRecordValidator,
    fetch_run_spec,
    list_peers,
    publish_run_spec,
)
from p2p_diloco.net.discovery.status import live, number
from p2p_diloco.net.transport.netloop import NetLoop, Stopped, exit_with_parent
from p2p_diloco.net.transport.node import NodeConfig, SwarmNode
from p2p_diloco.peer.announce import Presence
from p2p_diloco.peer.network_counters import collect_counters
from p2p_diloco.peer.reach import donor_rank, settle_reachability, start_node
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.train.learner import Learner
from p2p_diloco.wire.envelope import OuterUpdate
from p2p_diloco.wire.identity import Identity

__all__ = ["NetLoop", "PeerNetwork", "SpecMismatchError", "Stopped", "check_spec", "exit_with_parent"]

logger = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 3.0
"""Bound on the farewell record and on stopping each service when leaving: Ctrl-C must be quick."""
SYNC_ATTEMPTS = 3
SYNC_RETRY_DELAY_S = 2.0
REPAIR_GRACE_ANTI_ENTROPIES = 3.0
"""An update we merged and cannot serve must stay skipped by others for this many anti-entropy periods before
we adopt a skipping peer's state (net/gossip/repair.py): time for a peer that still holds it to fill their holes."""
PROVEN_WINDOW_S = 600.0
"""A peer votes in repair while an update of its own merged here in good standing within this long (a peer
that trains publishes every round; one that lingers, done, keeps its vote for a while)."""


class SpecMismatchError(ConfigError):
    """The run on the swarm has another RunSpec than ours; the message names the differing fields."""


def check_spec(theirs: tuple[dict, str] | None, spec: RunSpec) -> None:
    """Raise SpecMismatchError unless the swarm's (spec_dict, spec_hash) is ours."""
    if theirs is None or theirs[1] == spec.spec_hash():
        return
    spec_dict, spec_hash = theirs
    try:
        diff = RunSpec.from_dict(spec_dict).differing_fields(spec)
    except (ConfigError, TypeError) as e:
        raise SpecMismatchError(
            f"run '{spec.run_id}' on this swarm has a RunSpec this version cannot read ({e}); upgrade p2p-diloco "
            "or use another --run-id") from None
    listed = "\n  ".join(diff) or "(no field differs: the spec hashes are computed differently; upgrade p2p-diloco)"
    raise SpecMismatchError(
        f"run '{spec.run_id}' on this swarm has a different RunSpec (spec hash {spec_hash[:12]} vs ours "
        f"{spec.spec_hash()[:12]}). Differing fields (swarm != ours):\n  {listed}\n"
        "Join with the swarm's values (the matching options, e.g. --inner-steps, or --config), or start a new "
        "run with another --run-id.")


RECORD_COUNTERS = ("bytes_sent", "bytes_received", "merged")
"""Counters every record carries (as of the last tick), for `status` and the status page."""


class PeerNetwork:
    """SwarmNode + spec handshake + admission + state sync + Gossip + SnapshotServer + EvidenceRelay + Repair
    + announce/refresh (`Presence`), on one loop."""

    def __init__(self, spec: RunSpec, identity: Identity, identity_path: str, node_config: NodeConfig, *,
                 gossip_config: Any, sync_config: Any, record_ttl_s: float = DEFAULT_RECORD_TTL_S,
                 dht_timeout_s: float = 10.0, static_record: dict | None = None,
                 policy: NetPolicy | None = None) -> None:
        self.spec, self.spec_hash, self.run_id = spec, spec.spec_hash(), spec.run_id
        self.identity, self.identity_path, self.node_config = identity, identity_path, node_config
        self.gossip_config, self.sync_config = gossip_config, sync_config
        self.dht_timeout_s = dht_timeout_s
        self.policy = policy or NetPolicy()
        self.presence = Presence(self.run_id, identity, node_config.initial_peers, record_ttl_s=record_ttl_s,
                                 dht_timeout_s=dht_timeout_s, static_record=static_record)
        self.counters: dict[str, int] = {}  # shared with the compute thread: replaced whole, never mutated
        self.sync_donor: str | None = None
        self.sync_progress: Callable[[int, int], None] | None = None  # (bytes done, total) of a state sync
        self.node: SwarmNode | None = None
        self.learner: Learner | None = None
        self.intake: Intake | None = None  # built on the learner's replica by `_use`
        self.guard: PeerGuard | None = None
        # The services, started by `serve` in this order and stopped by `leave`.
        self.relay: Any = None
        self.repair: Any = None
        self.gossip: Any = None
        self.server: Any = None
        self.repairs: list[dict] = []  # one summary per adoption (net/gossip/repair.py), the last 64, replaced whole
        self._services: list[Any] = []
        self._tasks: list[asyncio.Task] = []
        self._admission_checked = False
        self.reach_why = ""  # how --reachability auto decided (peer/reach.py)

    # ---- what the compute thread reads and writes (each replaced whole, never mutated in place) ------------

    @property
    def peers(self) -> dict[str, dict]:
        """The live members' records, refreshed every few seconds."""
        return self.presence.peers

    @property
    def lost(self) -> dict[str, float]:
        """Peers whose record vanished without a farewell -> when."""
        return self.presence.lost

    @property
    def local(self) -> dict[str, Any]:
        """This peer's round summary, announced in its record (`state`, `round`, `loss`...)."""
        return self.presence.local

    @local.setter
    def local(self, value: dict[str, Any]) -> None:
        self.presence.local = value

    @property
    def static_record(self) -> dict:
        """Record fields that do not change (shard, corpus fingerprint, samples per update)."""
        return self.presence.static_record

    @static_record.setter
    def static_record(self, value: dict) -> None:
        self.presence.static_record = value

    @property
    def record_ttl_s(self) -> float:
        return self.presence.record_ttl_s

    # ---- start-up ---------------------------------------------------------------------------------------

    async def start(self) -> str:
        """Start the node and check the run's spec; returns "published" (we are the first) or "matched".

        AccessDenied if the run's allow list (in the spec) does not name this peer."""
        started = time.monotonic()
        self.node = await start_node(self.identity_path, self.node_config, [PeerRecordValidator([self.run_id])])
        if self.node_config.force_reachability is None and self.node_config.initial_peers:  # --reachability auto
            self.node, self.node_config, self.reach_why = await settle_reachability(
                self.node, self.identity_path, [PeerRecordValidator([self.run_id])], self.dht_timeout_s)
        exit_with_parent(self.node)
        self.presence.node = self.node
        logger.info("node up took_s=%.2f", time.monotonic() - started)
        self.guard = await asyncio.to_thread(self._make_guard)  # scrypt: ~50 ms of CPU, off the loop
        self.presence.guard = self.guard
        theirs = await fetch_run_spec(self.node, self.run_id, timeout_s=self.dht_timeout_s)
        logger.info("run spec read found=%s took_s=%.2f", theirs is not None, time.monotonic() - started)
        check_spec(theirs, self.spec)
        if self.guard.allowed and self.node.peer_id not in self.guard.allowed:
            raise AccessDenied(f"{REFUSED_PREFIX}{NOT_IN_ALLOW_LIST}: this peer ({self.node.peer_id}) is not in the "
                               "run's allow list; ask the run's operator to add it, or join with another --identity")
        how = "matched" if theirs else "published"
        await publish_run_spec(self.node, self.run_id, self.spec.to_dict(), self.spec_hash,
                               timeout_s=self.dht_timeout_s)  # first peer: publish; later ones: refresh expiry
        if theirs is None:  # two first peers may race with different specs: the DHT keeps one; check again
            check_spec(await fetch_run_spec(self.node, self.run_id, timeout_s=self.dht_timeout_s), self.spec)
        logger.info("run spec %s took_s=%.2f", how, time.monotonic() - started)
        return how

    def _make_guard(self) -> PeerGuard:
        secret = self.policy.access.secret()
        key = MembershipKey(secret, self.run_id) if secret else None
        self.presence.proof = key.proof(self.node.peer_id) if key else None
        allowed = getattr(getattr(self.spec, "defence", None), "allowed_senders", ())
        logger.info("access policy allow_list=%d run_secret=%s", len(allowed), key is not None)
        return PeerGuard(self.run_id, self_id=self.node.peer_id, limits=self.policy.limits, allowed=allowed, key=key,
                         refresh_members=self.presence.refresh_peers)

    async def check_admission(self) -> None:
        """Ask a few live peers whether we may take part (announce our record first: it carries our proof).
        AccessDenied, with their reason, if every one that answered refused us."""
        if self._admission_checked:
            return
        records = live(await list_peers(self.node, self.run_id, timeout_s=self.dht_timeout_s))
        records.pop(self.node.peer_id, None)
        if records:
            answers = await ask_admission(self.node.p2p, self.run_id, list(records), timeout_s=self.dht_timeout_s)
            logger.info("admission answers=%s", {pid[-8:]: a[:60] for pid, a in answers.items()})
            if self.guard.key is not None and all(self.guard.check_record(p, r) for p, r in records.items()):
                logger.warning("no live peer of the run proves the run secret we hold: is it the right secret?")
        self._admission_checked = True

    # ---- state sync -------------------------------------------------------------------------------------

    async def sync_state(self, learner: Learner, attempts: int = SYNC_ATTEMPTS) -> dict | None:
        """Load the replica from the freshest live members (highest V total first), if any has merged updates.

        None if nobody has (we start from the run's seed). Donors that fail are skipped; when all fail, the
        peer list is read again and the sync retried, `attempts` times in all, before StateSyncError.
        """
        from p2p_diloco.net.statesync.client import StateSyncError

        # Say we are here at once: peers lingering after their last round keep serving while one is "syncing".
        self._use(learner)
        self.local = {"state": "syncing"}
        await self.presence.announce()
        await self.check_admission()
        for attempt in range(1, attempts + 1):
            started = time.monotonic()
            records = await self.presence.members(warn_own=attempt == 1)
            logger.info("state sync: %d live member record(s) took_s=%.2f", len(records), time.monotonic() - started)
            # A donor that served an unverifiable snapshot is penalized: as if absent, so a hostile peer that
            # claims the freshest replica cannot keep the first honest peers of a run from starting.
            donors = sorted((pid for pid, r in records.items() if number(r, "version_vector_total") > 0
                             and not self.guard.is_penalized(pid)), key=lambda pid: donor_rank(records[pid]))
            if not donors:
                return None
            started = time.monotonic()
            try:
                donor, vv, numel = await self.load_snapshot(learner, donors)
            except StateSyncError as e:
                if attempt == attempts:
                    raise StateSyncError(f"state sync failed {attempts} times; last: {e}") from None
                logger.warning("state sync failed, retrying attempt=%d/%d error=%s", attempt, attempts, e)
                await asyncio.sleep(SYNC_RETRY_DELAY_S * attempt)
                continue
            return {"donor": donor, "vv_total": vv.total(), "bytes": numel * 4,
                    "seconds": time.monotonic() - started, "candidates": len(donors)}
        return None

    async def load_snapshot(self, learner: Learner, donors: list[str]) -> tuple[str, VersionVector, int]:
        """The one state-sync path (a joiner's sync, a restarted peer's stalled catch-up): fetch a verified
        snapshot from the first of `donors` that serves one (net/statesync/client.py) and load it into the
        replica. Returns (donor, its vector, numel); StateSyncError if no donor served one. The donor is
        remembered (`sync_donor`): gossip pulls from it first, so catching up need not wait for anti-entropy."""
        from p2p_diloco.net.statesync.client import fetch_snapshot

        manifests: list = []
        theta, vv, donor = await fetch_snapshot(self.node, self.run_id, self.spec_hash, donors, learner.numel,
                                                self.sync_config, guard=self.guard, on_progress=self.sync_progress,
                                                on_manifest=manifests.append)
        learner.replica.load(theta, vv)
        if learner.replica.standing is not None and manifests:  # whom to merge before we can vet (standing.py)
            with learner.replica.lock:
                learner.replica.standing.inherit(manifests[0].trusted, manifests[0].distrusted)
        self.sync_donor = donor  # serve() pulls from it at once: catch-up need not wait for anti-entropy
        return donor, vv, theta.numel()

    # ---- serving ----------------------------------------------------------------------------------------

    async def serve(self, learner: Learner) -> None:
        """Start the evidence relay, gossip, the snapshot server, the admission check and the announce/refresh
        tasks; announce at once."""
        from p2p_diloco.net.admission.guard import serve_hello

        self._use(learner)
        self.local = {"state": "training"}
        await self.check_admission()  # a peer restored from a checkpoint did not sync: check here
        await self._start_services(learner)
        await serve_hello(self.node.p2p, self.run_id, self.guard, timeout_s=self.gossip_config.rpc_timeout_s)
        await self.presence.refresh_peers()
        await self.presence.announce()
        self._tasks = [asyncio.create_task(self.presence.announce_loop(self._tick), name="announce"),
                       asyncio.create_task(self.presence.refresh_loop(), name="refresh-peers"),
                       asyncio.create_task(self.presence.meet_again_loop(), name="meet-again")]

    def _use(self, learner: Learner) -> None:
        """The learner whose replica this network feeds and serves. The intake (checks, counts, evidence, the
        take-back of a ban) is the network's: built once, here, on the learner's replica."""
        if self.intake is None:
            self.intake = Intake(self.spec, learner.numel, learner.replica)
        self.learner = self.presence.learner = learner
        self.presence.intake = self.intake

    async def _start_services(self, learner: Learner) -> None:
        from p2p_diloco.net.gossip.evidence_relay import EvidenceRelay
        from p2p_diloco.net.gossip.repair import Repair
        from p2p_diloco.net.gossip.service import Gossip
        from p2p_diloco.net.statesync.server import SnapshotServer

        cfg = self.gossip_config
        self.relay = EvidenceRelay(self.node, self.run_id, self.intake, self._other_peer_ids, self.guard,
                                   fanout=cfg.fanout, timeout_s=cfg.rpc_timeout_s)
        self.presence.on_refreshed = self.relay.meet  # a newcomer learns of the bans made before it came
        await self.relay.start()
        self._services.append(self.relay)
        store = UpdateStore(cfg.retained_bytes)
        self.repair = Repair(self.node, self.run_id, self.spec_hash, learner.replica, store, self.sync_config,
                             known=lambda: self.gossip.known_vectors(), members=self.proven_peer_ids,
                             guard=self.guard, grace_s=REPAIR_GRACE_ANTI_ENTROPIES * cfg.anti_entropy_s,
                             on_repaired=self._repaired)
        self._services.append(self.repair)
        self.gossip = Gossip(self.node, self.run_id, self.intake, store, cfg, peers=self._other_peer_ids,
                             guard=self.guard, on_evidence=self.relay.publish, on_vector=self.repair.observe)
        await self.gossip.start()
        self._services.append(self.gossip)
        if self.sync_donor:
            await self.gossip.request_pull(self.sync_donor)
        self.server = SnapshotServer(self.node, self.run_id, self.spec_hash, learner.replica, self.identity,
                                     self.sync_config, guard=self.guard)
        await self.server.start()
        self._services.append(self.server)

    def _repaired(self, summary: dict) -> None:
        self.repairs = [*self.repairs[-63:], summary]  # replaced whole: the compute thread reads it
        self.request_announce()

    def _other_peer_ids(self) -> list[str]:
        me = self.node.peer_id if self.node else ""
        return [pid for pid in self.peers if pid != me]

    def proven_peer_ids(self) -> list[str]:
        """Live members whose own updates merged here in good standing within PROVEN_WINDOW_S (sync/standing.py):
        the only votes repair counts. A DHT record costs nothing to write; a contribution does."""
        replica = self.learner.replica if self.learner is not None else None
        if replica is None or replica.standing is None:
            return self._other_peer_ids()
        with replica.lock:
            proven = replica.standing.proven(replica.clock(), PROVEN_WINDOW_S)
        return [pid for pid in self._other_peer_ids() if pid in proven]

    def _tick(self) -> None:
        self.counters = collect_counters(self.intake, (self.gossip, self.relay, self.repair), self.server,
                                         self.guard)
        self.presence.figures = {k: self.counters.get(k, 0) for k in RECORD_COUNTERS}

    # ---- called from the compute thread (through the loop) ----------------------------------------------

    async def publish(self, update: OuterUpdate) -> None:
        try:
            await self.gossip.publish(update)
        except Exception:  # a publish failure must not be lost silently; anti-entropy still spreads the update
            logger.exception("gossip publish failed seq=%d", update.seq)

    def request_announce(self) -> None:
        """Thread-safe: announce soon (rate-limited), e.g. after a round or a change of state."""
        self.presence.request_announce()

    def settling(self) -> bool:
        """Thread-safe: True while updates we lack may still come although every listed peer agrees with us: a
        peer is lost (see announce.LOST_PEER_GRACE_TTLS), or a pull is due from a peer that holds updates we lack."""
        return bool(self.lost) or (self.gossip is not None and self.gossip.pulling_missing())

    # ---- leaving ------------------------------------------------------------------------------------------

    async def leave(self) -> None:
        """Stop announcing (a last record says "left", so others drop us at once), stop gossip and serving."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.learner is not None and self.node is not None and self.node.is_alive:
            await self.presence.announce(state="left", timeout_s=LEAVE_TIMEOUT_S)
        for service in self._services:
            try:
                await asyncio.wait_for(service.stop(), LEAVE_TIMEOUT_S)
            except Exception as e:
                logger.warning("stopping %s failed error=%r", type(service).__name__, e)
        if self.learner is not None:
            self._tick()

    async def shutdown(self) -> None:
        if self.node is not None:
            await self.node.shutdown()
