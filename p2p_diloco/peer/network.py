"""The network side of one peer: everything that runs on its asyncio loop (DESIGN.md section 5).

One loop in a daemon thread (`NetLoop`, net/transport/netloop.py) runs the SwarmNode, Gossip, the SnapshotServer, the
EvidenceRelay, the replica Repair (net/gossip/repair.py, fed by gossip), the admission check (`hello`) and small
tasks: announcing this peer's signed record, refreshing the list of live peers and meeting lost peers again.
The compute thread talks to it in two ways only, neither of which waits on the network:

- it hands over finished updates with `asyncio.run_coroutine_threadsafe(network.publish(u), loop)`;
- it reads `peers` and `counters`, plain dicts the loop replaces whole (never mutates) every tick, and
  writes `local` (its round summary) the same way. Replacing a reference is atomic under the GIL.

Remote updates merge into the replica here, through `Intake`; the replica's lock makes that safe while the
compute thread snapshots it.

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
from collections import Counter
from typing import Any

from hivemind.utils import get_dht_time

from p2p_diloco.config import ConfigError, RunSpec
from p2p_diloco.net.admission.guard import NOT_IN_ALLOW_LIST, REFUSED_PREFIX, AccessDenied, PeerGuard, ask_admission
from p2p_diloco.net.admission.policy import MEMBER_PROOF_FIELD, MembershipKey, NetPolicy
from p2p_diloco.net.discovery.records import (
    DEFAULT_RECORD_TTL_S,
    MAX_PEER_RECORD_BYTES,
    PeerRecordValidator,
    announce_peer,
    fetch_run_spec,
    list_peers,
    publish_run_spec,
    validator_counts,
)
from p2p_diloco.net.discovery.status import fit_record, live, number, text
from p2p_diloco.net.transport.netloop import NetLoop, Stopped, exit_with_parent
from p2p_diloco.net.transport.node import NodeConfig, SwarmNode
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.train.learner import Learner
from p2p_diloco.wire.envelope import OuterUpdate
from p2p_diloco.wire.identity import Identity

__all__ = ["NetLoop", "PeerNetwork", "SpecMismatchError", "Stopped", "check_spec", "exit_with_parent"]

logger = logging.getLogger(__name__)

TICK_S = 0.5
"""How often the loop refreshes `counters` and checks whether to announce."""
MIN_ANNOUNCE_INTERVAL_S = 2.0
"""Announces asked for between the periodic ones (after a round, on a replica change while lingering) are at
most this frequent: a DHT store per peer every couple of seconds is cheap for tens of peers."""
LEAVE_TIMEOUT_S = 3.0
"""Bound on the farewell record and on stopping each service when leaving: Ctrl-C must be quick."""
MAX_ANNOUNCED_MADDRS = 8
SYNC_ATTEMPTS = 3
SYNC_RETRY_DELAY_S = 2.0
MAX_RECORD_VV_ENTRIES = 16
"""The record carries the full version vector only up to this many senders (it must fit in 8 KiB)."""
MAX_RECORD_OFFENDERS = 4
LOST_PEER_GRACE_TTLS = 2.0
"""A peer whose record vanished without a farewell ("left") counts as lost, not gone, for this many record
TTLs: cut off by a partition, its record expired here while it could not announce, and it comes back once the
partition heals (libp2p's stalled connections and the DHT's routing tables take seconds to recover). A lingering
peer does not call the swarm quiet while a peer is lost (`settling`)."""
MEET_AGAIN_EVERY_S = (5.0, 30.0)
"""How often (half a record TTL, within these bounds) we ping the bootstrap peers and the peers lost without a
farewell (SwarmNode.meet_again): a restarted bootstrap knows nobody until peers call it, and Kademlia never
calls a node again once a request to it failed (the other side of a partition)."""
MAX_MEET_AGAIN = 16
REPAIR_GRACE_ANTI_ENTROPIES = 3.0
"""An update we merged and cannot serve must stay skipped by others for this many anti-entropy periods before
we adopt a skipping peer's state (net/gossip/repair.py): time for a peer that still holds it to fill their holes."""
_NOT_REJECTIONS = ("merged", "buffered")


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


class PeerNetwork:
    """SwarmNode + spec handshake + admission + state sync + Gossip + SnapshotServer + EvidenceRelay + Repair
    + announce/refresh, on one loop."""

    def __init__(self, spec: RunSpec, identity: Identity, identity_path: str, node_config: NodeConfig, *,
                 gossip_config: Any, sync_config: Any, record_ttl_s: float = DEFAULT_RECORD_TTL_S,
                 dht_timeout_s: float = 10.0, static_record: dict | None = None,
                 policy: NetPolicy | None = None) -> None:
        self.spec = spec
        self.spec_hash = spec.spec_hash()
        self.run_id = spec.run_id
        self.identity = identity
        self.identity_path = identity_path
        self.node_config = node_config
        self.gossip_config = gossip_config
        self.sync_config = sync_config
        self.record_ttl_s = record_ttl_s
        self.dht_timeout_s = dht_timeout_s
        self.static_record = dict(static_record or {})
        self.policy = policy or NetPolicy()
        # Shared with the compute thread: each is replaced whole, never mutated in place.
        self.peers: dict[str, dict] = {}
        self.counters: dict[str, int] = {}
        self.local: dict[str, Any] = {"state": "training"}
        self.sync_donor: str | None = None
        self.node: SwarmNode | None = None
        self.learner: Learner | None = None
        self.guard: PeerGuard | None = None
        self.gossip: Any = None
        self.server: Any = None
        self.relay: Any = None
        self.repair: Any = None
        self.repairs: list[dict] = []  # one summary per adoption (net/gossip/repair.py), the last 64, replaced whole
        self._services: list[Any] = []
        self._tasks: list[asyncio.Task] = []
        self._announce_wanted = False
        self._announced_digest: str | None = None
        self._warned_corpus: set[str] = set()
        self._admission_checked = False
        self._dht_rejected: dict[str, int] = {}
        self._proof: str | None = None
        self._announced_at: float | None = None  # updated_at of our last record (another one: another process)
        self.lost: dict[str, float] = {}  # peer -> when its record vanished without a farewell (replaced whole)
        self._known_maddrs: dict[str, list[str]] = {}  # members' and lost peers' last announced addresses

    # ---- start-up ---------------------------------------------------------------------------------------

    async def start(self) -> str:
        """Start the node and check the run's spec; returns "published" (we are the first) or "matched".

        AccessDenied if the run's allow list (in the spec) does not name this peer."""
        started = time.monotonic()
        self.node = await SwarmNode.start(self.identity_path, self.node_config,
                                          record_validators=[PeerRecordValidator([self.run_id])])
        exit_with_parent(self.node)
        logger.info("node up took_s=%.2f", time.monotonic() - started)
        self.guard = await asyncio.to_thread(self._make_guard)  # scrypt: ~50 ms of CPU, off the loop
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
        self._proof = key.proof(self.node.peer_id) if key else None
        allowed = getattr(getattr(self.spec, "defence", None), "allowed_senders", ())
        logger.info("access policy allow_list=%d run_secret=%s", len(allowed), key is not None)
        return PeerGuard(self.run_id, self_id=self.node.peer_id, limits=self.policy.limits, allowed=allowed, key=key,
                         refresh_members=self._refresh_peers)

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

    async def sync_state(self, learner: Learner, attempts: int = SYNC_ATTEMPTS) -> dict | None:
        """Load the replica from the freshest live members (highest V total first), if any has merged updates.

        None if nobody has (we start from the run's seed). Donors that fail are skipped; when all fail, the
        peer list is read again and the sync retried, `attempts` times in all, before StateSyncError.
        """
        from p2p_diloco.net.statesync.client import StateSyncError, fetch_snapshot

        # Say we are here at once: peers lingering after their last round keep serving while one is "syncing".
        self.learner, self.local = learner, {"state": "syncing"}
        await self._announce()
        await self.check_admission()
        for attempt in range(1, attempts + 1):
            started = time.monotonic()
            records = await self._members(warn_own=attempt == 1)
            logger.info("state sync: %d live member record(s) took_s=%.2f", len(records), time.monotonic() - started)
            # A donor that served an unverifiable snapshot is penalized: as if absent, so a hostile peer that
            # claims the freshest replica cannot keep the first honest peers of a run from starting.
            donors = sorted((pid for pid, r in records.items() if number(r, "version_vector_total") > 0
                             and not self.guard.is_penalized(pid)),
                            key=lambda pid: -number(records[pid], "version_vector_total"))
            if not donors:
                return None
            started = time.monotonic()
            try:
                theta, vv, donor = await fetch_snapshot(self.node, self.run_id, self.spec_hash, donors,
                                                        learner.numel, self.sync_config, guard=self.guard)
            except StateSyncError as e:
                if attempt == attempts:
                    raise StateSyncError(f"state sync failed {attempts} times; last: {e}") from None
                logger.warning("state sync failed, retrying attempt=%d/%d error=%s", attempt, attempts, e)
                await asyncio.sleep(SYNC_RETRY_DELAY_S * attempt)
                continue
            learner.replica.load(theta, vv)
            self.sync_donor = donor  # serve() pulls from it at once: catch-up need not wait for anti-entropy
            return {"donor": donor, "vv_total": vv.total(), "bytes": theta.numel() * 4,
                    "seconds": time.monotonic() - started, "candidates": len(donors)}
        return None

    async def _members(self, *, warn_own: bool) -> dict[str, dict]:
        """Live member records other than ours, read from the DHT now."""
        records = live(await list_peers(self.node, self.run_id, timeout_s=self.dht_timeout_s))
        own = records.pop(self.node.peer_id, None)
        if own is not None and warn_own and own.get("updated_at") != self._announced_at:  # not the one we wrote
            logger.warning("this identity already has a live record (updated %.0fs ago): if another process "
                           "runs with it, give each peer its own --identity", time.time() - number(own, "updated_at"))
        return {pid: r for pid, r in records.items() if self.guard.check_record(pid, r) is None}

    async def serve(self, learner: Learner) -> None:
        """Start the evidence relay, gossip, the snapshot server, the admission check and the announce/refresh
        tasks; announce at once."""
        from p2p_diloco.net.admission.guard import serve_hello
        from p2p_diloco.net.gossip.evidence_relay import EvidenceRelay
        from p2p_diloco.net.gossip.repair import Repair
        from p2p_diloco.net.gossip.service import Gossip
        from p2p_diloco.net.statesync.server import SnapshotServer

        self.learner, self.local = learner, {"state": "training"}
        await self.check_admission()  # a peer restored from a checkpoint did not sync: check here
        cfg = self.gossip_config
        self.relay = EvidenceRelay(self.node, self.run_id, learner.intake, self._other_peer_ids, self.guard,
                                   fanout=cfg.fanout, timeout_s=cfg.rpc_timeout_s)
        await self.relay.start()
        self._services.append(self.relay)
        store = UpdateStore(cfg.retained_bytes)
        self.repair = Repair(self.node, self.run_id, self.spec_hash, learner.replica, store, self.sync_config,
                             known=lambda: self.gossip.known_vectors(), members=self._other_peer_ids,
                             guard=self.guard, grace_s=REPAIR_GRACE_ANTI_ENTROPIES * cfg.anti_entropy_s,
                             on_repaired=self._repaired)
        self._services.append(self.repair)
        self.gossip = Gossip(self.node, self.run_id, learner.intake, store, cfg, peers=self._other_peer_ids,
                             guard=self.guard, on_evidence=self.relay.publish, on_unservable=self.repair.consider)
        await self.gossip.start()
        self._services.append(self.gossip)
        if self.sync_donor:
            await self.gossip.request_pull(self.sync_donor)
        self.server = SnapshotServer(self.node, self.run_id, self.spec_hash, learner.replica, self.identity,
                                     self.sync_config, guard=self.guard)
        await self.server.start()
        self._services.append(self.server)
        await serve_hello(self.node.p2p, self.run_id, self.guard, timeout_s=cfg.rpc_timeout_s)
        await self._refresh_peers()
        await self._announce()
        self._tasks = [asyncio.create_task(self._announce_loop(), name="announce"),
                       asyncio.create_task(self._refresh_loop(), name="refresh-peers"),
                       asyncio.create_task(self._meet_again_loop(), name="meet-again")]

    def _repaired(self, summary: dict) -> None:
        self.repairs = [*self.repairs[-63:], summary]  # replaced whole: the compute thread reads it
        self.request_announce()

    def _other_peer_ids(self) -> list[str]:
        me = self.node.peer_id if self.node else ""
        return [pid for pid in self.peers if pid != me]

    # ---- called from the compute thread (through the loop) ----------------------------------------------

    async def publish(self, update: OuterUpdate) -> None:
        try:
            await self.gossip.publish(update)
        except Exception:  # a publish failure must not be lost silently; anti-entropy still spreads the update
            logger.exception("gossip publish failed seq=%d", update.seq)

    def request_announce(self) -> None:
        """Thread-safe: announce soon (rate-limited), e.g. after a round or a change of state."""
        self._announce_wanted = True

    # ---- the loop's own tasks -----------------------------------------------------------------------------

    def _record(self, state: str | None = None) -> dict:
        vv = self.learner.replica.version_vector
        record = {**self.static_record, **self.local}
        record.update(maddrs=self.node.visible_maddrs()[:MAX_ANNOUNCED_MADDRS], version_vector_total=vv.total(),
                      vv_digest=vv.digest().hex()[:16], seq=vv.get(self.node.peer_id), updated_at=get_dht_time())
        if state is not None:
            record["state"] = state
        if self._proof:
            record[MEMBER_PROOF_FIELD] = self._proof
        if self.guard is not None:
            record.update(rejected_by=self._rejection_totals(),
                          offenders=self.guard.rejections.offenders(MAX_RECORD_OFFENDERS, max_reasons=16),
                          banned=len(self.learner.replica.banned), dht_rejected=dict(self._dht_rejected))
        if len(vv) <= MAX_RECORD_VV_ENTRIES:
            record["vv"] = vv.to_dict()
        return fit_record(record, MAX_PEER_RECORD_BYTES)

    def _rejection_totals(self) -> dict[str, int]:
        """Everything refused, by reason: the intake's update outcomes and the guard's network refusals."""
        totals = Counter({k: n for k, n in dict(self.learner.intake.counts).items() if k not in _NOT_REJECTIONS})
        if self.guard is not None:
            totals.update(self.guard.rejections.totals)
        return dict(totals)

    async def _announce(self, state: str | None = None, timeout_s: float | None = None) -> bool:
        record = self._record(state)
        try:
            ok = await announce_peer(self.node, self.run_id, record, self.identity, ttl_s=self.record_ttl_s,
                                     timeout_s=timeout_s or self.dht_timeout_s)
        except Exception as e:  # the DHT being slow or down must not stop training
            logger.warning("announce failed error=%r", e)
            return False
        if not ok:  # hivemind reports the first replica's answer: one holding a forged record says no
            logger.warning("announce: the first DHT node asked did not store our record")
        self._announced_digest, self._announced_at = record["vv_digest"], record["updated_at"]
        return ok

    async def _announce_loop(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            try:  # one bad tick must not end the task: without announces the swarm forgets us
                self.counters = self._collect_counters()
                now = time.monotonic()
                lingering = self.local.get("state") == "done"
                digest = self.learner.replica.version_vector.digest().hex()[:16]
                if now - last >= self.record_ttl_s / 3 or ((self._announce_wanted or (
                        lingering and digest != self._announced_digest)) and now - last >= MIN_ANNOUNCE_INTERVAL_S):
                    self._announce_wanted = False
                    last = now
                    await self._announce()
            except Exception:
                logger.exception("announce tick failed")

    async def _refresh_peers(self) -> None:
        """Read the records, keep the members' (`peers`), note the DHT's rejections; also the guard's refresh."""
        dropped: Counter = Counter()
        try:
            records = await list_peers(self.node, self.run_id, timeout_s=self.dht_timeout_s, rejected=dropped)
        except Exception as e:
            logger.warning("listing peers failed error=%r", e)
            return
        fingerprint = self.static_record.get("corpus")
        members: dict[str, dict] = {}
        for pid, record in records.items():
            if pid != self.node.peer_id and self.guard is not None and self.guard.check_record(pid, record):
                dropped["not_member"] += 1
                continue
            members[pid] = record
            if fingerprint and text(record, "corpus") not in ("", fingerprint) and pid not in self._warned_corpus:
                self._warned_corpus.add(pid)
                logger.warning("peer %s trains on another corpus (fingerprint %s, ours %s): a different Python "
                               "version's stdlib or another file", pid, text(record, "corpus"), fingerprint)
        self._note_lost(members)
        self._known_maddrs = {pid: [m for m in r["maddrs"][:MAX_ANNOUNCED_MADDRS] if isinstance(m, str)]
                              for pid, r in members.items() if isinstance(r.get("maddrs"), list)} | {
            pid: m for pid, m in self._known_maddrs.items() if pid in self.lost}
        self.peers = live(members)
        if self.relay is not None:
            self.relay.meet()  # a newcomer learns of the bans made before it came
        try:  # what our DHT node refused (cumulative), plus what this read dropped (records visible now)
            dropped.update(await validator_counts(self.node, timeout_s=self.dht_timeout_s))
        except Exception as e:
            logger.debug("reading the DHT validator's counts failed error=%r", e)
        self._dht_rejected = dict(dropped)

    def _note_lost(self, members: dict[str, dict]) -> None:
        """Peers listed live before and now without any record (a "left" one stays listed until it expires)."""
        now, grace_s = time.monotonic(), LOST_PEER_GRACE_TTLS * self.record_ttl_s
        lost = {pid: t for pid, t in self.lost.items() if pid not in members and now - t < grace_s}
        lost.update({pid: now for pid in self.peers if pid not in members and pid != self.node.peer_id})
        vanished = [pid[-8:] for pid in lost.keys() - self.lost.keys()]
        if vanished:
            logger.info("peer record(s) vanished without a farewell peers=%s", vanished)
        self.lost = lost

    def settling(self) -> bool:
        """Thread-safe: True while updates we lack may still come although every listed peer agrees with us: a
        peer is lost (see LOST_PEER_GRACE_TTLS), or a pull is due from a peer that holds updates we lack."""
        return bool(self.lost) or (self.gossip is not None and self.gossip.pulling_missing())

    async def _refresh_loop(self) -> None:
        started = time.monotonic()
        while True:
            lingering = self.local.get("state") == "done"
            # Every second at first: peers that start together must see each other before they sign their
            # first weights (a peer that sees nobody signs w=1, an N-fold overshoot).
            starting = time.monotonic() - started < 15.0
            await asyncio.sleep(1.0 if lingering or starting else min(5.0, self.record_ttl_s / 6))
            try:
                await self._refresh_peers()
            except Exception:
                logger.exception("peer list refresh failed")

    def _meet_again_targets(self) -> dict[str, list[str]]:
        """The bootstrap peers (the entry points a new peer is given) and the peers lost without a farewell."""
        targets: dict[str, list[str]] = {}
        for maddr in self.node_config.initial_peers:
            pid = maddr.rsplit("/p2p/", 1)[-1]
            targets.setdefault(pid, []).append(maddr)
        for pid in sorted(self.lost, key=self.lost.get, reverse=True):  # the most recently lost first
            targets.setdefault(pid, self._known_maddrs.get(pid, []))
        return dict(list(targets.items())[:MAX_MEET_AGAIN])

    async def _meet_again_loop(self) -> None:
        low, high = MEET_AGAIN_EVERY_S
        while True:
            await asyncio.sleep(min(max(self.record_ttl_s / 2, low), high))
            try:
                met = await self.node.meet_again(self._meet_again_targets(), timeout_s=self.dht_timeout_s)
                if met:
                    logger.info("met DHT peer(s) again peers=%s", [pid[-8:] for pid in met])
            except Exception as e:
                logger.debug("meeting DHT peers again failed error=%r", e)

    def _collect_counters(self) -> dict[str, int]:
        counts = dict(self.learner.intake.counts)
        out = {"merged": counts.get("merged", 0), "duplicate": counts.get("duplicate", 0),
               "rejected": sum(n for k, n in counts.items() if k not in ("merged", "buffered", "duplicate"))}
        for service in (self.gossip, self.relay, self.repair):
            stats = getattr(service, "stats", None) or {}
            out.update({k: int(v) for k, v in dict(stats).items() if isinstance(v, (int, float))})
        out.setdefault("bytes_sent", 0)
        out.setdefault("bytes_received", 0)
        served = getattr(self.server, "stats", None) or {}
        out["snapshot_bytes_sent"] = int(served.get("bytes_sent", 0))
        out["bytes_sent"] += out["snapshot_bytes_sent"]  # everything we uploaded: updates and snapshots
        if self.guard is not None:
            out["refused"] = sum(self.guard.rejections.totals.values())
        return out

    # ---- leaving ------------------------------------------------------------------------------------------

    async def leave(self) -> None:
        """Stop announcing (a last record says "left", so others drop us at once), stop gossip and serving."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.learner is not None and self.node is not None and self.node.is_alive:
            await self._announce(state="left", timeout_s=LEAVE_TIMEOUT_S)
        for service in self._services:
            try:
                await asyncio.wait_for(service.stop(), LEAVE_TIMEOUT_S)
            except Exception as e:
                logger.warning("stopping %s failed error=%r", type(service).__name__, e)
        if self.learner is not None:
            self.counters = self._collect_counters()

    async def shutdown(self) -> None:
        if self.node is not None:
            await self.node.shutdown()
