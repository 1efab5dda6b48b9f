"""Gossip: how signed outer updates spread through the swarm (ARCHITECTURE.md "The network" (gossip)).

`Gossip` (here) composes the parts, each with one job: `GossipServer` serves both RPCs (serving.py), `Puller`
runs the pulls (pulls.py), `Announcer` sends the announces (announces.py) to peers `PeerPicker` chooses
(targets.py), `AntiEntropy` runs the periodic pull (anti_entropy.py), `Heralds` sends and serves heralds
(heralds.py), and `KnownVectors` keeps what each remote last said it holds (known.py). The "ids" digests are
computed in digests.py, the request codec lives in messages.py.

Protocol: two RPCs per run (three in a run with sponsors) on the node's P2P replica; the caller's PeerID is
authenticated by libp2p and never read from a payload.

  announce  "p2p-diloco/<run_id>/announce"
      request  = msgpack {"vv": {sender: seq}, "holes": {sender: [seq]}}   the announcer's version vector
                 (<= MAX_VECTOR_BYTES); "holes", the seqs below an entry it skipped, only when it has any
      response = b""                                  an ack: the work happens later, in a pull
      If the announcer holds anything our replica lacks (`VersionVector.missing_from`, or one of our holes),
      we schedule a pull from it.

  pull      "p2p-diloco/<run_id>/pull"
      request  = msgpack {"vv": {sender: seq}, "holes": {sender: [seq]}, "limit": n, "ids": {sender: hex16}}
                 the requester's version vector (holes as in an announce), and for up to MAX_ID_DIGESTS senders
                 a digest of the update ids it merged for its newest ID_WINDOW seqs of that sender
                 (net/gossip/digests.py; "ids" may be absent)
      response = a stream, each chunk one encoded update (`encode_update`, <= `Intake.max_bytes`): first, for
                 every sender whose digest differs from ours over the same seqs, the updates we hold for those
                 seqs (the requester merged other versions of them: an equivocation split between us, which
                 vectors cannot show; its intake proves it, bans and takes its version back, and the proof
                 reaches us through the evidence relay); then the updates the responder holds in its store with
                 seq > vv[sender] or in its holes (`UpdateStore.missing_for`); at most min(n, pull_max_updates)
                 in all, the lowest missing seq of every sender first.
      A full batch means more may remain, so the requester pulls again (at most MAX_PULL_ROUNDS rounds).
      The request also tells the responder what the requester holds: if that is anything the responder
      lacks, the responder schedules a pull back, so every exchange runs both ways.

  herald    "p2p-diloco/<run_id>/herald"       in a run with sponsors, served by the sponsors only
      request  = msgpack {"v", "h", "s"}: a proposer's update header and signature, sent to every sponsor
                 before it announces the update (wire/herald.py; net/gossip/heralds.py)
      response = b""; the sponsor dates the proposal by it for the copy rule (sync/heralds.py)

  tree, audit   with `aggregate` > 0: the aggregation tree's RPCs (net/gossip/tree.py, net/gossip/tree_audits.py);
                our own updates go up the tree instead of being announced (announced after `aggregate_fallback_s`
                if no total we merged holds them), and are not served to pulls for `aggregate_settle_s` (the
                tree's head start: a pull that races it fetches the same update whole a second time)

Rules:
  - Every received update goes through `Intake.receive` (size, signature, digest, layout, then the replica's
    merge rule) in a worker thread; if it merged or was buffered, it goes into our store, to serve others.
  - A pull that brought anything new is followed by an announce of our vector to `fanout` random peers other
    than the source: each hop re-announces, which is what makes it gossip. Announces skip peers whose last
    vector (from their announce or pull request; vectors only grow) already holds all of ours.
  - At most one pull in flight per remote and `max_concurrent_pulls` in all; announces that arrive meanwhile
    are folded into the remote's pending pull (their vectors merged), at most MAX_WANTED_PEERS of them. An
    announce is a hint, not a claim on a slot: slots go by track record (net/gossip/slots.py): contributors
    first, by score; remotes that never gave us anything share `probation_pulls` slots and must answer within
    `probation_timeout_s`; a remote whose pull failed or brought nothing of what it claimed backs off (1 s
    doubling to 60 s, reset by a pull that brought something new).
  - Anti-entropy: every `anti_entropy_s` (jittered +-50%), pull from one random peer whatever it holds, and
    let the intake skip gaps that waited out `gap_timeout_s` (a quiet swarm brings nothing that would).
  - Repair (ARCHITECTURE.md "The network"): every member's vector goes to `on_vector` (`Repair.observe`): one
    whose holes name updates we merged and no longer hold, or that merged updates we skipped, is a case pulls cannot
    settle when nobody serves them (net/gossip/repair.py adopts the state of the quorum's side).
  - Every call has `rpc_timeout_s` (per response chunk for pulls), and a pull response must keep the guard's
    minimum pace, so a never-ending trickle is cut. A failure is counted (by reason, against the remote) and
    logged at most once per peer per `log_interval_s`; nothing waits for the whole swarm (announces are
    bounded tasks).

Hostile remotes, with a `PeerGuard` (net/admission/guard.py): both RPCs are served behind it (access, rate
limits, open streams); we pull only from members that are not penalized and whose bytes-in bucket is not in
debt; every rejected update is counted against the remote that sent it, and one that is invalid (bad
signature, garbage, wrong run or shape, non-finite, over the norm bound...) ends that pull at once and
penalizes the remote (`HOSTILE_OUTCOMES`). Updates of banned senders are never served. An equivocation found
in a pull is handed, with the intake's proof (both signed envelopes), to `on_evidence` (net/gossip/evidence_relay.py
spreads it).

Open runs: what remotes gave us and cost us is recorded in the guard's ledger (net/admission/ledger.py) by the
puller, and by `GossipServer` for what we serve (`served_update`: an update we sent the same remote before costs
it more). A pull request is admitted only within the uplink's share its caller draws
from (net/admission/uplink.py: contributors by score, all others together one share), and the response asks
again before each update after the first: when the share is spent it ends early, a short batch (counted).

Bandwidth awareness: the guard measures our uplink (net/admission/meter.py); an update served again
to a remote that had it from us counts against its fair share once more (`served_again`); `fanout()` and
`max_serves()` shrink to the streams the measured rate feeds at `stream_bytes_per_s` (at least 2; at most as
configured) and grow back with it; a pull over `max_serves()` is refused as "busy" (`serves_busy`). Sending
never blocks the compute thread: `publish` returns once the announces are scheduled.

Threading: everything here runs on one asyncio loop, which adds to and serves from the `UpdateStore`. Only
`Intake.receive` runs in worker threads (the replica and the store have their own locks: the intake looks up
and purges banned senders in the store). The compute thread hands its own updates over with
`asyncio.run_coroutine_threadsafe(gossip.publish(update), loop)`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Mapping, Sequence

from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.admission.meter import adapted
from p2p_diloco.net.gossip.announces import Announcer
from p2p_diloco.net.gossip.anti_entropy import AntiEntropy
from p2p_diloco.net.gossip.heralds import Heralds
from p2p_diloco.net.gossip.known import KnownVectors
from p2p_diloco.net.gossip.messages import GossipConfig, decode_request, encode_request
from p2p_diloco.net.gossip.pulls import FailureLog, Puller, lacks
from p2p_diloco.net.gossip.serving import GossipServer
from p2p_diloco.net.gossip.targets import PeerPicker
from p2p_diloco.net.gossip.tree import TreeGossip
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import SwarmNode
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.envelope import OuterUpdate
from p2p_diloco.wire.identity import Identity

__all__ = ["Gossip", "GossipConfig", "decode_request", "encode_request"]  # config/network.py, messages.py

logger = logging.getLogger(__name__)

MIN_FANOUT = MIN_SERVES = 2  # however slow the uplink, announce to and serve at least this many at once
_STATS = ("published", "bytes_sent", "bytes_received", "announces_sent", "announces_received", "announce_failures",
          "announces_dropped", "pulls", "pull_failures", "pulls_served", "pulls_dropped", "updates_received",
          "updates_new", "bad_requests", "pulls_skipped", "evidence_found", "id_mismatches", "serves_cut",
          "serves_busy")


def _sponsors(intake: Intake) -> list[str]:
    standing = intake.replica.standing
    return sorted(standing.sponsorship.sponsors) if standing is not None else []


class Gossip:
    """Announce, pull and anti-entropy for one run on one SwarmNode. `await start()`; always `await stop()`."""

    def __init__(self, node: SwarmNode, run_id: str, intake: Intake, store: UpdateStore, config: GossipConfig,
                 peers: Callable[[], Sequence[str]], *, guard: PeerGuard | None = None,
                 on_evidence: Callable[[bytes, bytes], None] | None = None,
                 on_vector: Callable[[str, VersionVector], None] | None = None,
                 identity: Identity | None = None, tree_members: Callable[[], Mapping[str, float]] | None = None,
                 since: float | None = None):
        """`peers` returns the live peer ids of the run (e.g. from the DHT records); ours is filtered out.
        `guard` (a PeerGuard) enforces access and rate limits; `on_evidence(first, second)` gets the two signed
        envelopes of each equivocation we find; `on_vector(peer, its vector)` every vector a member sends us
        (`Repair.observe`; called on the loop, it must return at once). With `config.aggregate`, `identity` (ours,
        to sign sums) and `tree_members` (the live peers whose record names the same fan-in) make the aggregation
        tree (net/gossip/tree.py) through which our updates go out instead of announces (`since`: when our record
        says we started)."""
        self.node, self.run_id, self.intake, self.store, self.guard = node, run_id, intake, store, guard
        self.config = config.validate()
        intake.attach_store(store)  # banned senders leave the store; the earlier message of an equivocation is found
        self.stats: dict[str, int] = dict.fromkeys(_STATS, 0)
        rng = random.Random()
        failures = FailureLog(guard, self.config.log_interval_s)
        self._known = KnownVectors()
        picker = PeerPicker(node.peer_id, run_id, peers, guard, rng)
        self.announce_name, self.pull_name = f"p2p-diloco/{run_id}/announce", f"p2p-diloco/{run_id}/pull"
        self._announcer = Announcer(node, self.announce_name, intake, self.config, known=self._known, picker=picker,
                                    fanout=self.fanout, stats=self.stats, failures=failures)
        self._puller = Puller(node, self.pull_name, intake, store, self.config, guard=guard, stats=self.stats,
                              failures=failures, rng=rng, on_evidence=on_evidence,
                              on_brought=lambda peer: self._announcer.announce(exclude=(peer,)))
        self._anti_entropy = AntiEntropy(run_id, intake, self.config, puller=self._puller, picker=picker, rng=rng)
        self._server = GossipServer(node, (self.announce_name, self.pull_name), intake, store, self.config,
                                    guard=guard, known=self._known, puller=self._puller, max_serves=self.max_serves,
                                    stats=self.stats, failures=failures, on_vector=on_vector)
        self._heralds = Heralds(node, run_id, intake, sponsors=lambda: _sponsors(intake), guard=guard,
                                timeout_s=self.config.rpc_timeout_s, stats=self.stats)
        self.rpc_stats: dict[str, rpc.RpcStats] = self._server.rpc_stats
        self.tree = TreeGossip(node, run_id, intake.spec.spec_hash(), intake, store, identity,
                               fan_in=self.config.aggregate, epoch_s=self.config.aggregate_epoch_s,
                               wait_s=self.config.aggregate_wait_s, fallback_s=self.config.aggregate_fallback_s,
                               settle_s=self.config.aggregate_settle_s,
                               timeout_s=self.config.rpc_timeout_s, members=tree_members or dict,
                               announce=self._announcer.announce, stats=self.stats, guard=guard, since=since) \
            if self.config.aggregate and identity is not None else None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Serve the announce and pull RPCs and start anti-entropy."""
        if self._loop is not None:
            raise RuntimeError("Gossip.start called twice")
        self._loop = asyncio.get_running_loop()
        await self._server.serve()
        if self._heralds.judging:  # a sponsor: proposers herald their updates to it (net/gossip/heralds.py)
            await self._heralds.serve()
        if self._heralds.rpc_stats is not None:
            self.rpc_stats["herald"] = self._heralds.rpc_stats
        if self.tree is not None:
            await self.tree.serve()
            for name, stats in (("tree", self.tree.rpc_stats), ("audit", self.tree.audits.rpc_stats)):
                if stats is not None:
                    self.rpc_stats[name] = stats
        self._puller.start()
        self._anti_entropy.start()
        logger.info("gossip started run_id=%s peer_id=%s fanout=%d anti_entropy_s=%g", self.run_id,
                    self.node.peer_id, self.config.fanout, self.config.anti_entropy_s)

    async def stop(self) -> None:
        """Cancel every task and stop serving; bounded by about 2 * rpc_timeout_s. Idempotent."""
        tasks = [*self._puller.halt(), *self._anti_entropy.halt(), *self._announcer.halt(), *self._heralds.halt(),
                 *(self.tree.halt() if self.tree is not None else ())]
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.rpc_timeout_s)
        self._puller.clear()
        self._known.clear()
        await self._server.unserve()
        if self._heralds.rpc_stats is not None:
            await self._heralds.unserve()
        if self.tree is not None:
            await self.tree.unserve()
        logger.info("gossip stopped run_id=%s peer_id=%s stats=%s", self.run_id, self.node.peer_id, self.stats)

    async def publish(self, update: OuterUpdate) -> None:
        """Keep our own update to serve pulls, and announce it to `fanout` random peers (without waiting for them).
        A proposer in a run with sponsors heralds it to them first and keeps it back until they acked (at most
        net/gossip/heralds.py HERALD_WAIT_S): no peer can pull it sooner.

        Merge it into our replica first (`Learner.finish_phase` does): the vector we announce must name it.
        Call on the gossip's loop, e.g. `asyncio.run_coroutine_threadsafe(gossip.publish(u), loop)`.
        """
        if asyncio.get_running_loop() is not self._loop or not self._puller.running:
            raise RuntimeError("publish needs a started Gossip, on its own event loop")
        if self.intake.replica.version_vector.get(update.sender) < update.seq:
            logger.warning("publishing an update our replica has not merged sender=%s seq=%d", update.sender,
                           update.seq)
        await self._heralds.herald(update)
        self.store.add(update)
        self.stats["published"] += 1
        if self.tree is not None and self.tree.publish(update):
            return  # up the aggregation tree instead (it announces if no total brings it back in time)
        self._announcer.announce()

    async def request_pull(self, peer: str) -> None:
        """Pull from `peer` soon, whatever it holds (e.g. from the donor right after a state sync, so the joiner
        need not wait for anti-entropy). Returns at once; failures are counted like any pull's."""
        if asyncio.get_running_loop() is not self._loop or not self._puller.running:
            raise RuntimeError("request_pull needs a started Gossip, on its own event loop")
        if peer != self.node.peer_id:
            self._puller.want(peer, VersionVector(), force=True)

    # ---- what remotes hold -------------------------------------------------------------------------------

    def known_vectors(self) -> dict[str, VersionVector]:
        """The last vector each remote sent us (announce or pull request), at most MAX_WANTED_PEERS of them."""
        return self._known.snapshot()

    def pulling_missing(self) -> bool:
        """True while a pull is wanted or running from a remote whose last vector holds updates we lack: our
        replica is about to change. Thread-safe enough for a poll from another thread (copies, no mutation)."""
        replica = self.intake.replica
        ours, banned = replica.version_vector, replica.banned
        pending = [self._known.get(peer) for peer in self._puller.pending_peers()]
        return any(lacks(ours, vv, banned) for vv in pending if vv is not None)

    # ---- how much the uplink feeds ------------------------------------------------------------------------

    def uplink_bps(self) -> float | None:
        """The guard's uplink: min(its budget, measured) in bytes/s, None without a guard or either known."""
        return self.guard.uplink_budget_bps if self.guard is not None and self.config.stream_bytes_per_s else None

    def fanout(self) -> int:
        """Peers to announce to for the measured uplink (at least MIN_FANOUT, at most as configured)."""
        return adapted(self.config.fanout, self.uplink_bps(), self.config.stream_bytes_per_s, MIN_FANOUT)

    def max_serves(self) -> int:
        """Pull responses served at once for the measured uplink (at least MIN_SERVES, at most as configured)."""
        return adapted(self.config.max_concurrent_serves, self.uplink_bps(), self.config.stream_bytes_per_s,
                       MIN_SERVES)
