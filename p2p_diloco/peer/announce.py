"""This peer's presence on the swarm: its signed record on the DHT and its view of the others' (ARCHITECTURE.md,
"Threads").

`Presence` announces our record (every third of its TTL, and soon after `request_announce`), reads the
records every few seconds and keeps the members' live ones (`peers`), notes the peers whose record vanished
without a farewell (`lost`), and meets the bootstrap peers and the lost ones again. It exists from the peer's
start (the status page reads it at once); what it works with exists only once the node is up and the replica
is built, so every call that needs them is handed them (`PresenceParts`, built by peer/compose.py). `peers`,
`lost`, `local` and `last_record` are shared with the other threads: each is replaced whole, never mutated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hivemind.utils import get_dht_time

from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.admission.policy import MEMBER_PROOF_FIELD
from p2p_diloco.net.discovery.records import MAX_PEER_RECORD_BYTES, announce_peer, list_peers, validator_counts
from p2p_diloco.net.discovery.status import fit_record, live, number, text
from p2p_diloco.net.transport import relay
from p2p_diloco.net.transport.node import SwarmNode
from p2p_diloco.peer.network_counters import rejection_totals
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.replica import Replica
from p2p_diloco.wire.identity import Identity

logger = logging.getLogger(__name__)

TICK_S = 0.5
"""How often the loop refreshes `counters` and checks whether to announce."""
MIN_ANNOUNCE_INTERVAL_S = 2.0
"""Announces asked for between the periodic ones (after a round, on a replica change while lingering) are at
most this frequent: a DHT store per peer every couple of seconds is cheap for tens of peers."""
MAX_ANNOUNCED_MADDRS = 8
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

Record = dict[str, object]
"""A peer's record as read from the DHT: signed by its peer, but every field untrusted (net/discovery/status.py)."""


def announced_maddrs(record: Record) -> list[str]:
    """Where a peer's record says to dial it: at most MAX_ANNOUNCED_MADDRS strings (the record is untrusted)."""
    maddrs = record.get("maddrs")
    return [m for m in maddrs[:MAX_ANNOUNCED_MADDRS] if isinstance(m, str)] if isinstance(maddrs, list) else []


@dataclass(frozen=True)
class PresenceParts:
    """What `Presence` works with once the node is up and the replica is built."""

    node: SwarmNode
    guard: PeerGuard
    replica: Replica
    intake: Intake
    """The network's: its outcomes are our record's rejection counts."""
    proof: str | None
    """Our proof of the run secret (None: an open run)."""
    static_record: Mapping[str, object]
    """Record fields that do not change (shard, corpus fingerprint, samples per update)."""
    figures: Callable[[], Mapping[str, int]]
    """The live counters our record carries (bytes, merged), as of the network's last tick."""
    on_refreshed: Callable[[], None]
    """After each read of the records: the evidence relay meets the newcomers."""


class Presence:
    """Our record and the others', on the network loop."""

    def __init__(self, run_id: str, identity: Identity, initial_peers: tuple[str, ...], *,
                 record_ttl_s: float, dht_timeout_s: float) -> None:
        self.run_id, self.identity, self.initial_peers = run_id, identity, initial_peers
        self.record_ttl_s, self.dht_timeout_s = record_ttl_s, dht_timeout_s
        # Shared with the other threads: each is replaced whole, never mutated in place.
        self.local: Record = {"state": "training"}  # written by the compute thread: its round summary
        self.peers: dict[str, Record] = {}
        self.lost: dict[str, float] = {}  # peer -> when its record vanished without a farewell
        self._known_maddrs: dict[str, list[str]] = {}  # members' and lost peers' last announced addresses
        self._warned_corpus: set[str] = set()
        self.dht_rejected: dict[str, int] = {}
        self._announce_wanted = False
        self._announced_digest: str | None = None
        self.announced_at: float | None = None  # updated_at of our last record (another one: another process)
        self.last_record: Record = {}  # the record we last announced (the status page shows it)

    def request_announce(self) -> None:
        """Thread-safe: announce soon (rate-limited), e.g. after a round or a change of state."""
        self._announce_wanted = True

    # ---- our record -----------------------------------------------------------------------------------------

    def other_peer_ids(self) -> list[str]:
        """The live members but us."""
        return [pid for pid in self.peers if pid != self.identity.peer_id]

    def record(self, parts: PresenceParts, state: str | None = None) -> Record:
        node, guard, vv = parts.node, parts.guard, parts.replica.version_vector
        record: Record = {**parts.static_record, **parts.figures(), **self.local}
        record.update(maddrs=node.visible_maddrs()[:MAX_ANNOUNCED_MADDRS], reach=node.reachability,
                      version_vector_total=vv.total(),
                      vv_digest=vv.digest().hex()[:16], seq=vv.get(node.peer_id), updated_at=get_dht_time())
        if state is not None:
            record["state"] = state
        if parts.proof:
            record[MEMBER_PROOF_FIELD] = parts.proof
        record.update(guard.membership.record_fields())  # operator keys' digest, our invitation, revocations
        record.update(rejected_by=rejection_totals(parts.intake, guard),
                      offenders=guard.rejections.offenders(MAX_RECORD_OFFENDERS, max_reasons=16),
                      banned=len(parts.replica.banned), dht_rejected=dict(self.dht_rejected))
        if len(vv) <= MAX_RECORD_VV_ENTRIES:
            record["vv"] = vv.to_dict()
        return fit_record(record, MAX_PEER_RECORD_BYTES)

    async def announce(self, parts: PresenceParts, state: str | None = None, timeout_s: float | None = None) -> bool:
        try:  # addresses change after the start (a relay reservation adds a /p2p-circuit one): publish the latest
            await parts.node.refresh_visible_maddrs(timeout_s=min(self.dht_timeout_s, 5.0))
        except Exception as e:
            logger.debug("refreshing our addresses failed error=%r", e)
        record = self.record(parts, state)
        try:
            ok = await announce_peer(parts.node, self.run_id, record, self.identity, ttl_s=self.record_ttl_s,
                                     timeout_s=timeout_s or self.dht_timeout_s)
        except Exception as e:  # the DHT being slow or down must not stop training
            logger.warning("announce failed error=%r", e)
            return False
        if not ok:  # hivemind reports the first replica's answer: one holding a forged record says no
            logger.warning("announce: the first DHT node asked did not store our record")
        self._announced_digest, self.announced_at = str(record["vv_digest"]), number(record, "updated_at")
        self.last_record = record
        return ok

    async def announce_loop(self, parts: PresenceParts, on_tick: Callable[[], None]) -> None:
        """Every TICK_S: `on_tick()` (the counters), then announce if due."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            try:  # one bad tick must not end the task: without announces the swarm forgets us
                on_tick()
                now = time.monotonic()
                lingering = self.local.get("state") == "done"
                digest = parts.replica.version_vector.digest().hex()[:16]
                if now - last >= self.record_ttl_s / 3 or ((self._announce_wanted or (
                        lingering and digest != self._announced_digest)) and now - last >= MIN_ANNOUNCE_INTERVAL_S):
                    self._announce_wanted = False
                    last = now
                    await self.announce(parts)
            except Exception:
                logger.exception("announce tick failed")

    # ---- the others' records --------------------------------------------------------------------------------

    async def members(self, parts: PresenceParts, *, warn_own: bool) -> dict[str, Record]:
        """Live member records other than ours, read from the DHT now."""
        records = live(await list_peers(parts.node, self.run_id, timeout_s=self.dht_timeout_s))
        own = records.pop(self.identity.peer_id, None)
        if own is not None and warn_own and own.get("updated_at") != self.announced_at:  # not the one we wrote
            logger.warning("this identity already has a live record (updated %.0fs ago): if another process "
                           "runs with it, give each peer its own --identity", time.time() - number(own, "updated_at"))
        return {pid: r for pid, r in records.items() if parts.guard.check_record(pid, r) is None}

    async def refresh_peers(self, parts: PresenceParts) -> None:
        """Read the records, keep the members' (`peers`), note the DHT's rejections; also the guard's refresh."""
        node, me = parts.node, self.identity.peer_id
        dropped: Counter[str] = Counter()
        try:
            records = await list_peers(node, self.run_id, timeout_s=self.dht_timeout_s, rejected=dropped)
        except Exception as e:
            logger.warning("listing peers failed error=%r", e)
            return
        members: dict[str, Record] = {}
        for pid, record in records.items():
            if pid != me and parts.guard.check_record(pid, record):
                dropped["not_member"] += 1
                continue
            members[pid] = record
            self._check_corpus(parts.static_record, pid, record)
        self._note_lost(members)
        self._known_maddrs = {pid: maddrs for pid, r in members.items() if (maddrs := announced_maddrs(r))} | {
            pid: m for pid, m in self._known_maddrs.items() if pid in self.lost}
        self.peers = live(members)
        for pid, record in self.peers.items():  # peers that said nobody can dial them: through a relay first
            if record.get("reach") == "private":
                relay.mark_private(node.p2p, pid)
        parts.on_refreshed()
        try:  # what our DHT node refused (cumulative), plus what this read dropped (records visible now)
            dropped.update(await validator_counts(node, timeout_s=self.dht_timeout_s))
        except Exception as e:
            logger.debug("reading the DHT validator's counts failed error=%r", e)
        self.dht_rejected = dict(dropped)

    def _check_corpus(self, static_record: Mapping[str, object], pid: str, record: Record) -> None:
        fingerprint = static_record.get("corpus")
        if fingerprint and text(record, "corpus") not in ("", fingerprint) and pid not in self._warned_corpus:
            self._warned_corpus.add(pid)
            logger.warning("peer %s trains on another corpus (fingerprint %s, ours %s): a different Python "
                           "version's stdlib or another file", pid, text(record, "corpus"), fingerprint)

    def _note_lost(self, members: dict[str, Record]) -> None:
        """Peers listed live before and now without any record (a "left" one stays listed until it expires)."""
        now, grace_s = time.monotonic(), LOST_PEER_GRACE_TTLS * self.record_ttl_s
        lost = {pid: t for pid, t in self.lost.items() if pid not in members and now - t < grace_s}
        lost.update({pid: now for pid in self.peers if pid not in members and pid != self.identity.peer_id})
        vanished = [pid[-8:] for pid in lost.keys() - self.lost.keys()]
        if vanished:
            logger.info("peer record(s) vanished without a farewell peers=%s", vanished)
        self.lost = lost

    async def refresh_loop(self, parts: PresenceParts) -> None:
        started = time.monotonic()
        while True:
            lingering = self.local.get("state") == "done"
            # Every second at first: peers that start together must see each other before they sign their
            # first weights (a peer that sees nobody signs w=1, an N-fold overshoot).
            starting = time.monotonic() - started < 15.0
            await asyncio.sleep(1.0 if lingering or starting else min(5.0, self.record_ttl_s / 6))
            try:
                await self.refresh_peers(parts)
            except Exception:
                logger.exception("peer list refresh failed")

    # ---- meeting lost peers again -----------------------------------------------------------------------------

    def meet_again_targets(self) -> dict[str, Sequence[str]]:
        """The bootstrap peers (the entry points a new peer is given) and the peers lost without a farewell."""
        targets: dict[str, list[str]] = {}
        for maddr in self.initial_peers:
            pid = maddr.rsplit("/p2p/", 1)[-1]
            targets.setdefault(pid, []).append(maddr)
        lost = self.lost  # replaced whole by the loop: one snapshot
        for pid in sorted(lost, key=lambda p: lost[p], reverse=True):  # the most recently lost first
            targets.setdefault(pid, self._known_maddrs.get(pid, []))
        return dict(list(targets.items())[:MAX_MEET_AGAIN])

    async def meet_again_loop(self, node: SwarmNode) -> None:
        low, high = MEET_AGAIN_EVERY_S
        while True:
            await asyncio.sleep(min(max(self.record_ttl_s / 2, low), high))
            try:
                met = await node.meet_again(self.meet_again_targets(), timeout_s=self.dht_timeout_s)
                if met:
                    logger.info("met DHT peer(s) again peers=%s", [pid[-8:] for pid in met])
            except Exception as e:
                logger.debug("meeting DHT peers again failed error=%r", e)
