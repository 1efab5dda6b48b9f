"""The network side of one peer: everything that runs on its asyncio loop (ARCHITECTURE.md "Threads").

One loop in a daemon thread (`NetLoop`, net/transport/netloop.py) runs the SwarmNode, Gossip, the SnapshotServer, the
EvidenceRelay, the replica Repair (net/gossip/repair.py, fed by gossip), the admission check (`hello`) and small
tasks: announcing this peer's signed record, refreshing the list of live peers and meeting lost peers again
(`Presence`, peer/announce.py). `PeerNetwork` is their lifecycle: `start` (the node, the run's spec:
peer/startup.py), `attach` (the services around the learner, built once: peer/compose.py), `sync_state`, `serve`,
`leave`, `shutdown`. The counters come from peer/network_counters.py.
The compute thread talks to it in two ways only, neither of which waits on the network:

- it hands over finished updates with `asyncio.run_coroutine_threadsafe(network.publish(u), loop)`;
- it reads `peers` and `counters`, plain dicts the loop replaces whole (never mutates) every tick, and
  writes `local` (its round summary) the same way. Replacing a reference is atomic under the GIL.

Remote updates merge into the replica here, through the network's own `Intake`; the replica's lock makes that
safe while the compute thread snapshots it.

Hostile input (ARCHITECTURE.md "Defences"): one `PeerGuard` (net/admission/guard.py) stands in front of every
service: it holds the run's allow list (RunSpec `defence.allowed_senders`) and this peer's run-secret key, the
per-remote rate limits, and the rejection counts. `peers` holds only members: records of non-members (not in the
allow list, or without a valid proof of the run secret) are dropped. This peer's record carries its own
membership proof and what it rejected (by reason, and its worst offenders), so `status` shows them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from p2p_diloco.config import GossipConfig, NetworkConfig, RunSpec, StateSyncConfig
from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.admission.hello import ask_admission, serve_hello
from p2p_diloco.net.admission.policy import NetPolicy
from p2p_diloco.net.discovery.records import list_peers
from p2p_diloco.net.discovery.status import live, number
from p2p_diloco.net.gossip.service import Gossip
from p2p_diloco.net.statesync.client import StateSyncError, fetch_snapshot
from p2p_diloco.net.statesync.manifest import Manifest
from p2p_diloco.net.transport.node import NodeConfig, SwarmNode
from p2p_diloco.peer.announce import Presence, Record, announced_maddrs
from p2p_diloco.peer.compose import PeerServices, ServiceConfig, build_peer_services, proven_among
from p2p_diloco.peer.network_counters import collect_counters
from p2p_diloco.peer.reach import donor_rank
from p2p_diloco.peer.startup import NodeUp, join_run, start_settled
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.train.learner import Learner
from p2p_diloco.wire.envelope import OuterUpdate
from p2p_diloco.wire.identity import Identity

__all__ = ["PeerNetwork"]

logger = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 3.0
"""Bound on the farewell record and on stopping each service when leaving: Ctrl-C must be quick."""
SYNC_ATTEMPTS = 3
SYNC_RETRY_DELAY_S = 2.0
MAX_REPAIRS_KEPT = 64
RECORD_COUNTERS = ("bytes_sent", "bytes_received", "merged", "rejected", "refused")
"""Counters every record carries (as of the last tick), for `status` and the status page."""


class Service(Protocol):
    async def stop(self) -> None: ...


class PeerNetwork:
    """One peer's node and services on one loop, from `start` to `shutdown` (see the module doc)."""

    def __init__(self, spec: RunSpec, identity: Identity, identity_path: str, node_config: NodeConfig, *,
                 network: NetworkConfig, gossip: GossipConfig, statesync: StateSyncConfig, policy: NetPolicy,
                 on_sync_progress: Callable[[int, int], None] | None = None) -> None:
        """`on_sync_progress(bytes done, total)` follows each state sync."""
        self.config = ServiceConfig(spec, identity, policy, gossip, statesync)
        self.identity_path, self.dht_timeout_s = identity_path, network.dht_timeout_s
        self.presence = Presence(spec.run_id, identity, node_config.initial_peers,
                                 record_ttl_s=network.record_ttl_s, dht_timeout_s=network.dht_timeout_s)
        self.on_sync_progress = on_sync_progress
        self.counters: dict[str, int] = {}  # shared with the compute thread: replaced whole, never mutated
        self.repairs: list[Record] = []  # one summary per adoption or re-sync, the last 64, replaced whole
        self.sync_donor: str | None = None  # the last state sync's: gossip pulls from it first
        self.up: NodeUp | None = None  # once `start` is done
        self.services: PeerServices | None = None  # once `attach` is done
        self._node_config = node_config
        self._node: SwarmNode | None = None  # as soon as it runs: `shutdown` stops it whatever failed after
        self._started: list[Service] = []  # stopped by `leave`, in this order
        self._tasks: list[asyncio.Task[None]] = []
        self._admission_checked = False

    # ---- what the other threads read and write (each replaced whole, never mutated in place) ---------------

    @property
    def peers(self) -> dict[str, Record]:
        """The live members' records, refreshed every few seconds."""
        return self.presence.peers

    @property
    def lost(self) -> dict[str, float]:
        """Peers whose record vanished without a farewell -> when."""
        return self.presence.lost

    @property
    def local(self) -> Record:
        """This peer's round summary, announced in its record (`state`, `round`, `loss`...)."""
        return self.presence.local

    @local.setter
    def local(self, value: Record) -> None:
        self.presence.local = value

    @property
    def run_id(self) -> str:
        return self.config.spec.run_id

    @property
    def spec_hash(self) -> str:
        return self.config.spec.spec_hash()

    @property
    def node(self) -> SwarmNode | None:
        return self._node

    @property
    def node_config(self) -> NodeConfig:
        """The config the node runs with (a private one after `--reachability auto` found nobody dials us)."""
        return self.up.node_config if self.up is not None else self._node_config

    @property
    def learner(self) -> Learner | None:
        return self.services.learner if self.services is not None else None

    @property
    def gossip(self) -> Gossip | None:
        return self.services.gossip if self.services is not None else None

    @property
    def guard(self) -> PeerGuard | None:
        return self.services.guard if self.services is not None else None

    # ---- start-up ---------------------------------------------------------------------------------------

    async def start(self) -> NodeUp:
        """Start the node and check the run's spec (the first peer publishes it). AccessDenied if the run's
        allow list (in the spec) does not name this peer."""
        node, node_config, reach_why = await start_settled(self.run_id, self.identity_path, self._node_config,
                                                           dht_timeout_s=self.dht_timeout_s)
        self._node = node
        key, how = await join_run(node, self.config.spec, self.config.policy, dht_timeout_s=self.dht_timeout_s)
        self.up = NodeUp(node, node_config, reach_why, key, how)
        return self.up

    def attach(self, learner: Learner, static_record: Mapping[str, object]) -> PeerServices:
        """Build the services around `learner` (after `start`); `static_record`: the record fields that never
        change (shard, corpus fingerprint, samples per update). Nothing is started yet."""
        if self.up is None:
            raise RuntimeError("PeerNetwork.attach before start")
        self.services = build_peer_services(self.config, self.up, learner, self.presence, static_record=static_record,
                                            figures=self._record_figures, on_repaired=self._repaired)
        return self.services

    def _attached(self) -> PeerServices:
        if self.services is None:
            raise RuntimeError("PeerNetwork used before attach")
        return self.services

    async def check_admission(self) -> None:
        """Ask a few live peers whether we may take part (announce our record first: it carries our proof).
        AccessDenied, with their reason, if every one that answered refused us."""
        if self._admission_checked:
            return
        s = self._attached()
        node = s.up.node
        records = live(await list_peers(node, self.run_id, timeout_s=self.dht_timeout_s))
        records.pop(node.peer_id, None)
        if records:
            answers = await ask_admission(node.p2p, self.run_id, list(records), timeout_s=self.dht_timeout_s)
            logger.info("admission answers=%s", {pid[-8:]: a[:60] for pid, a in answers.items()})
            if s.guard.key is not None and all(s.guard.check_record(p, r) for p, r in records.items()):
                logger.warning("no live peer of the run proves the run secret we hold: is it the right secret?")
        self._admission_checked = True

    # ---- state sync -------------------------------------------------------------------------------------

    async def sync_state(self, attempts: int = SYNC_ATTEMPTS) -> Record | None:
        """Load the replica from the freshest live members (highest V total first), if any has merged updates.

        None if nobody has (we start from the run's seed). Donors that fail are skipped; when all fail, the
        peer list is read again and the sync retried, `attempts` times in all, before StateSyncError.
        """
        s = self._attached()
        # Say we are here at once: peers lingering after their last round keep serving while one is "syncing".
        self.local = {"state": "syncing"}
        await self.presence.announce(s.presence)
        await self.check_admission()
        for attempt in range(1, attempts + 1):
            started = time.monotonic()
            records = await self.presence.members(s.presence, warn_own=attempt == 1)
            logger.info("state sync: %d live member record(s) took_s=%.2f", len(records), time.monotonic() - started)
            # A donor that served an unverifiable snapshot is penalized: as if absent, so a hostile peer that
            # claims the freshest replica cannot keep the first honest peers of a run from starting.
            donors = sorted((pid for pid, r in records.items() if number(r, "version_vector_total") > 0
                             and not s.guard.is_penalized(pid)), key=lambda pid: donor_rank(records[pid]))
            if not donors:
                return None
            started = time.monotonic()
            try:
                donor, vv, numel = await self.load_snapshot(donors)
            except StateSyncError as e:
                if attempt == attempts:
                    raise StateSyncError(f"state sync failed {attempts} times; last: {e}") from None
                logger.warning("state sync failed, retrying attempt=%d/%d error=%s", attempt, attempts, e)
                await asyncio.sleep(SYNC_RETRY_DELAY_S * attempt)
                # The peer we joined through may be the donor that failed: the others are then only names in
                # DHT records to our daemon. Dial them where their records say before we ask again.
                dialled = await s.up.node.dial({pid: announced_maddrs(records[pid]) for pid in donors},
                                               timeout_s=self.dht_timeout_s / 2)
                logger.info("state sync: dialled donors before retrying reached=%s", [pid[-8:] for pid in dialled])
                continue
            return {"donor": donor, "vv_total": vv.total(), "bytes": numel * 4,
                    "seconds": time.monotonic() - started, "candidates": len(donors)}
        return None

    async def load_snapshot(self, donors: list[str]) -> tuple[str, VersionVector, int]:
        """The one state-sync path (a joiner's sync, a restarted peer's stalled catch-up): fetch a verified
        snapshot from the first of `donors` that serves one (net/statesync/client.py) and load it into the
        replica. Returns (donor, its vector, numel); StateSyncError if no donor served one. The donor is
        remembered (`sync_donor`): gossip pulls from it first, so catching up need not wait for anti-entropy."""
        s = self._attached()
        replica = s.learner.replica
        manifests: list[Manifest] = []
        theta, vv, donor = await fetch_snapshot(s.up.node, self.run_id, self.spec_hash, donors, s.learner.numel,
                                                self.config.statesync, guard=s.guard,
                                                on_progress=self.on_sync_progress, on_manifest=manifests.append)
        replica.load(theta, vv)
        if replica.standing is not None and manifests:  # whom to merge before we can vet (standing.py)
            with replica.lock:
                replica.standing.inherit(manifests[0].trusted, manifests[0].distrusted, known=vv)
        self.sync_donor = donor  # serve() pulls from it at once: catch-up need not wait for anti-entropy
        return donor, vv, theta.numel()

    def resynced(self, donor: str, summary: Record) -> None:
        """On the loop, after a running peer re-synced its state from `donor` (peer/resync.py)."""
        self.sync_donor = donor
        self.repairs = [*self.repairs[1 - MAX_REPAIRS_KEPT:], summary]  # as repair's

    # ---- serving ----------------------------------------------------------------------------------------

    async def serve(self) -> None:
        """Start the evidence relay, gossip, the snapshot server, the admission check and the announce/refresh
        tasks; announce at once."""
        s = self._attached()
        self.local = {"state": "training"}
        await self.check_admission()  # a peer restored from a checkpoint did not sync: check here
        await s.relay.start()
        self._started += [s.relay, s.repair]
        await s.gossip.start()
        self._started.append(s.gossip)
        if self.sync_donor:
            await s.gossip.request_pull(self.sync_donor)
        await s.server.start()
        self._started.append(s.server)
        await serve_hello(s.up.node.p2p, self.run_id, s.guard, timeout_s=self.config.gossip.rpc_timeout_s)
        await self.presence.refresh_peers(s.presence)
        await self.presence.announce(s.presence)
        self._tasks = [asyncio.create_task(self.presence.announce_loop(s.presence, self._tick), name="announce"),
                       asyncio.create_task(self.presence.refresh_loop(s.presence), name="refresh-peers"),
                       asyncio.create_task(self.presence.meet_again_loop(s.up.node), name="meet-again")]

    def _repaired(self, summary: Record) -> None:
        self.repairs = [*self.repairs[1 - MAX_REPAIRS_KEPT:], summary]  # replaced whole: the compute thread reads it
        self.request_announce()

    def proven_peer_ids(self) -> list[str]:
        """The live members whose votes repair counts (compose.proven_among)."""
        others = self.presence.other_peer_ids()
        return proven_among(self.services.learner.replica, others) if self.services is not None else others

    def _record_figures(self) -> dict[str, int]:
        return {k: self.counters.get(k, 0) for k in RECORD_COUNTERS}

    def _tick(self) -> None:
        s = self._attached()
        self.counters = collect_counters(s.intake, (s.gossip, s.relay, s.repair), s.server, s.guard)

    # ---- called from the compute thread (through the loop) ----------------------------------------------

    async def publish(self, update: OuterUpdate) -> None:
        try:
            await self._attached().gossip.publish(update)
        except Exception:  # a publish failure must not be lost silently; anti-entropy still spreads the update
            logger.exception("gossip publish failed seq=%d", update.seq)

    def request_announce(self) -> None:
        """Thread-safe: announce soon (rate-limited), e.g. after a round or a change of state."""
        self.presence.request_announce()

    def settling(self) -> bool:
        """Thread-safe: True while updates we lack may still come although every listed peer agrees with us: a
        peer is lost (see announce.LOST_PEER_GRACE_TTLS), or a pull is due from a peer that holds updates we lack."""
        return bool(self.lost) or (self.services is not None and self.services.gossip.pulling_missing())

    # ---- leaving ------------------------------------------------------------------------------------------

    async def leave(self) -> None:
        """Stop announcing (a last record says "left", so others drop us at once), stop gossip and serving."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        s = self.services
        if s is not None and s.up.node.is_alive:
            await self.presence.announce(s.presence, state="left", timeout_s=LEAVE_TIMEOUT_S)
        for service in self._started:
            try:
                await asyncio.wait_for(service.stop(), LEAVE_TIMEOUT_S)
            except Exception as e:
                logger.warning("stopping %s failed error=%r", type(service).__name__, e)
        if s is not None:
            self._tick()

    async def shutdown(self) -> None:
        if self._node is not None:
            await self._node.shutdown()
