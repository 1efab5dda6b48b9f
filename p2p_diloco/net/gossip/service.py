"""Gossip: how signed outer updates spread through the swarm (ARCHITECTURE.md "The network" (gossip)).

`Gossip` (here) serves both RPCs, announces and runs anti-entropy; its `Puller` (net/gossip/pulls.py) runs the
pulls; the "ids" digests are computed in net/gossip/digests.py, the request codec lives in messages.py.

Protocol: two RPCs per run on the node's P2P replica; the caller's PeerID is authenticated by libp2p and never
read from a payload.

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
  - Repair (ARCHITECTURE.md "The network"): every member's vector goes to `on_vector` (`Repair.observe`): one whose
    holes name updates we merged and no longer hold, or that merged updates we skipped, is a case pulls cannot
    settle when nobody serves them (net/gossip/repair.py adopts the state of the quorum's side).
  - Every call has `rpc_timeout_s` (per response chunk for pulls), and a pull response must keep the guard's
    minimum pace, so a never-ending trickle is cut. A failure is counted (by reason, against the remote) and
    logged at most once per peer per `log_interval_s`; nothing waits for the whole swarm (announces are
    bounded tasks).

Hostile remotes (issue 5), with a `PeerGuard` (net/admission/guard.py): both RPCs are served behind it (access, rate
limits, open streams); we pull only from members that are not penalized and whose bytes-in bucket is not in
debt; every rejected update is counted against the remote that sent it, and one that is invalid (bad
signature, garbage, wrong run or shape, non-finite, over the norm bound...) ends that pull at once and
penalizes the remote (`HOSTILE_OUTCOMES`). Updates of banned senders are never served. An equivocation found
in a pull is handed, with the intake's proof (both signed envelopes), to `on_evidence` (net/gossip/evidence_relay.py
spreads it).

Open runs (issue 16): what remotes gave us and cost us is recorded in the guard's ledger
(net/admission/ledger.py) by the puller, and here for what we serve (`served_update`: an update we sent the
same remote before costs it more). A pull request is admitted only within the uplink's share its caller draws
from (net/admission/uplink.py: contributors by score, all others together one share), and the response asks
again before each update after the first: when the share is spent it ends early, a short batch (counted).

Bandwidth awareness (issue 12): the guard measures our uplink (net/admission/meter.py); an update served again
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
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from p2p_diloco.net.admission.meter import adapted
from p2p_diloco.net.gossip.digests import differing_windows
from p2p_diloco.net.gossip.messages import (
    MAX_VECTOR_BYTES,
    GossipConfig,
    Request,
    decode_request,
    encode_request,
    parse_request,
)
from p2p_diloco.net.gossip.pulls import MAX_WANTED_PEERS, FailureLog, Puller, lacks, min_bytes_per_s
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import SwarmNode
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.envelope import OuterUpdate, encode_update

__all__ = ["Gossip", "GossipConfig", "decode_request", "encode_request"]  # config/network.py, messages.py

logger = logging.getLogger(__name__)

MAX_ANNOUNCE_TASKS = 64
"""Announces in flight, at most; more are dropped and counted."""
NEWCOMER_PICK_EVERY = 4
"""With contributors enough to fill an announce or anti-entropy pick, one pick in this many includes a peer we
have no record of (a new honest peer is reached; a crowd of records gets a quarter of one pick)."""
MIN_FANOUT = MIN_SERVES = 2  # however slow the uplink, announce to and serve at least this many at once
MAX_CONCURRENT_ANNOUNCES_SERVED = 64
"""Incoming announces handled at once (each is tiny; more are refused as busy)."""
_STATS = ("published", "bytes_sent", "bytes_received", "announces_sent", "announces_received", "announce_failures",
          "announces_dropped", "pulls", "pull_failures", "pulls_served", "pulls_dropped", "updates_received",
          "updates_new", "bad_requests", "pulls_skipped", "evidence_found", "id_mismatches", "serves_cut",
          "serves_busy")


class Gossip:
    """Announce, pull and anti-entropy for one run on one SwarmNode. `await start()`; always `await stop()`."""

    def __init__(self, node: SwarmNode, run_id: str, intake: Intake, store: UpdateStore, config: GossipConfig,
                 peers: Callable[[], Sequence[str]], *, guard: Any = None,
                 on_evidence: Callable[[bytes, bytes], None] | None = None,
                 on_vector: Callable[[str, VersionVector], None] | None = None):
        """`peers` returns the live peer ids of the run (e.g. from the DHT records); ours is filtered out.
        `guard` (a PeerGuard) enforces access and rate limits; `on_evidence(first, second)` gets the two signed
        envelopes of each equivocation we find; `on_vector(peer, its vector)` every vector a member sends us
        (`Repair.observe`; called on the loop, it must return at once)."""
        self.node = node
        self.guard = guard
        self.on_vector = on_vector
        self.run_id = run_id
        self.intake = intake
        self.store = store
        self.config = config.validate()
        intake.attach_store(store)  # banned senders leave the store; the earlier message of an equivocation is found
        self.announce_name = f"p2p-diloco/{run_id}/announce"
        self.pull_name = f"p2p-diloco/{run_id}/pull"
        self.stats: dict[str, int] = dict.fromkeys(_STATS, 0)
        self.rpc_stats: dict[str, rpc.RpcStats] = {}
        self._peers = peers
        self._rng = random.Random()
        self._failures = FailureLog(guard, self.config.log_interval_s)
        self._puller = Puller(node, self.pull_name, intake, store, self.config, guard=guard, stats=self.stats,
                              failures=self._failures, rng=self._rng, on_evidence=on_evidence,
                              on_brought=lambda peer: self._announce(exclude=(peer,)))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._anti_entropy: asyncio.Task | None = None
        self._announces: set[asyncio.Task] = set()
        self._known: OrderedDict[str, VersionVector] = OrderedDict()  # remote -> the last vector it sent us
        self._serving = 0  # pull responses being sent now

    @property
    def _running(self) -> bool:
        return self._puller.running

    # ---- lifecycle ----------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Serve the announce and pull RPCs and start anti-entropy."""
        if self._loop is not None:
            raise RuntimeError("Gossip.start called twice")
        self._loop = asyncio.get_running_loop()
        p2p, timeout_s = self.node.p2p, self.config.rpc_timeout_s
        limits = dict(guard=self.guard, min_bytes_per_s=min_bytes_per_s(self.guard))
        self.rpc_stats["announce"] = await rpc.serve(
            p2p, self.announce_name, self.rpc_announce, max_request_bytes=MAX_VECTOR_BYTES, timeout_s=timeout_s,
            max_concurrent=MAX_CONCURRENT_ANNOUNCES_SERVED, **limits)
        try:
            self.rpc_stats["pull"] = await rpc.serve(
                p2p, self.pull_name, self.rpc_pull, max_request_bytes=MAX_VECTOR_BYTES, timeout_s=timeout_s,
                max_concurrent=self.config.max_concurrent_serves, **limits)
        except BaseException:
            await rpc.unserve(p2p, self.announce_name)
            raise
        self._puller.running = True
        self._anti_entropy = asyncio.create_task(self._anti_entropy_loop(), name=f"anti-entropy:{self.run_id}")
        logger.info("gossip started run_id=%s peer_id=%s fanout=%d anti_entropy_s=%g", self.run_id,
                    self.node.peer_id, self.config.fanout, self.config.anti_entropy_s)

    async def stop(self) -> None:
        """Cancel every task and stop serving; bounded by about 2 * rpc_timeout_s. Idempotent."""
        self._puller.running = False
        tasks = [t for t in (self._anti_entropy, *self._puller.tasks.values(), *self._announces) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.rpc_timeout_s)
        self._anti_entropy = None
        self._puller.clear()
        self._known.clear()
        for name in (self.announce_name, self.pull_name):
            try:
                await asyncio.wait_for(rpc.unserve(self.node.p2p, name), self.config.rpc_timeout_s / 2)
            except Exception as e:  # e.g. the node is already shut down
                logger.debug("gossip unserve failed name=%s error=%r", name, e)
        logger.info("gossip stopped run_id=%s peer_id=%s stats=%s", self.run_id, self.node.peer_id, self.stats)

    async def publish(self, update: OuterUpdate) -> None:
        """Keep our own update to serve pulls, and announce it to `fanout` random peers (without waiting for them).

        Merge it into our replica first (`Learner.finish_phase` does): the vector we announce must name it.
        Call on the gossip's loop, e.g. `asyncio.run_coroutine_threadsafe(gossip.publish(u), loop)`.
        """
        if asyncio.get_running_loop() is not self._loop or not self._running:
            raise RuntimeError("publish needs a started Gossip, on its own event loop")
        if self.intake.replica.version_vector.get(update.sender) < update.seq:
            logger.warning("publishing an update our replica has not merged sender=%s seq=%d", update.sender,
                           update.seq)
        self.store.add(update)
        self.stats["published"] += 1
        self._announce()

    async def request_pull(self, peer: str) -> None:
        """Pull from `peer` soon, whatever it holds (e.g. from the donor right after a state sync, so the joiner
        need not wait for anti-entropy). Returns at once; failures are counted like any pull's."""
        if asyncio.get_running_loop() is not self._loop or not self._running:
            raise RuntimeError("request_pull needs a started Gossip, on its own event loop")
        if peer != self.node.peer_id:
            self._puller.want(peer, VersionVector(), force=True)

    # ---- serving (on the loop; read-only on the store) ------------------------------------------------------

    async def rpc_announce(self, request: bytes, caller: str) -> bytes:
        self.stats["announces_received"] += 1
        self.stats["bytes_received"] += len(request)
        remote = self._decode(request, pull=False, caller=caller).vv
        self._consider(caller, remote)
        return b""

    async def rpc_pull(self, request: bytes, caller: str) -> AsyncIterator[bytes]:
        self.stats["pulls_served"] += 1
        self.stats["bytes_received"] += len(request)
        parsed = self._decode(request, pull=True, caller=caller)
        if self._serving >= self.max_serves():  # counted; the caller backs off and retries
            self.stats["serves_busy"] += 1
            raise rpc.RpcError(f"busy: serving {self._serving} pulls, all this peer's measured uplink feeds; retry")
        remote, limit = parsed.vv, min(parsed.limit, self.config.pull_max_updates)
        self._consider(caller, remote)  # the requester may hold what we lack: pull back
        banned = self.intake.replica.banned  # never spread what we refuse ourselves
        others = self._other_versions(parsed.ids, remote, limit)
        missing = self.store.missing_for(remote, limit - len(others))
        return self._encoded([u for u in [*others, *missing] if u.sender not in banned], caller)

    def _other_versions(self, digests: dict[str, str], remote: VersionVector, limit: int) -> list[OuterUpdate]:
        """The updates we hold for the slots where the requester merged other versions than we did (its
        `ids` digests differ from ours over the same seqs): handed to it, its intake finds the equivocation
        and proves it, and the proof comes back to us through the evidence relay."""
        out: list[OuterUpdate] = []
        for sender, seqs in differing_windows(digests, remote, self.intake.replica.recent_ids):
            self.stats["id_mismatches"] += 1
            self._failures.log(sender, "id comparison", RuntimeError(
                f"a peer merged other updates of this sender than we did for seqs {seqs[0]}-{seqs[-1]}"))
            for seq in seqs:
                update = self.store.get(sender, seq)
                if update is not None and len(out) < limit:
                    out.append(update)
        return out

    def _decode(self, request: bytes, *, pull: bool, caller: str) -> Request:
        try:
            return parse_request(request, pull=pull)
        except rpc.RpcError:
            self.stats["bad_requests"] += 1
            self._failures.count(caller, "bad_request")
            raise

    async def _encoded(self, updates: list, caller: str) -> AsyncIterator[bytes]:
        self._serving += 1
        try:
            for i, update in enumerate(updates):
                if i and self.guard is not None and self.guard.uplink_refusal(caller):
                    self.stats["serves_cut"] += 1  # the caller's uplink share is spent: a short batch
                    return
                data = encode_update(update)
                self.stats["bytes_sent"] += len(data)
                if self.guard is not None and self.guard.ledger.served_update(caller, update.sender, update.seq,
                                                                              len(data)):
                    self.guard.uplink.served_again(caller, len(data))  # it had it from us: counts again
                yield data
        finally:
            self._serving -= 1

    def uplink_bps(self) -> float | None:
        """The guard's uplink: min(its budget, measured) in bytes/s, None without a guard or either known."""
        return self.guard.uplink_budget_bps if self.guard is not None and self.config.stream_bytes_per_s else None

    def fanout(self) -> int:  # peers to announce to, and below pulls served at once, for the measured uplink
        return adapted(self.config.fanout, self.uplink_bps(), self.config.stream_bytes_per_s, MIN_FANOUT)

    def max_serves(self) -> int:
        return adapted(self.config.max_concurrent_serves, self.uplink_bps(), self.config.stream_bytes_per_s,
                       MIN_SERVES)

    # ---- what remotes hold -------------------------------------------------------------------------------

    def _consider(self, peer: str, remote: VersionVector) -> None:
        """`peer` holds `remote`: schedule a pull if it has anything our replica lacks; show it to `on_vector`."""
        self._known.pop(peer, None)
        self._known[peer] = remote  # replaced, not merged: a peer restarted from a checkpoint may hold less
        while len(self._known) > MAX_WANTED_PEERS:
            self._known.popitem(last=False)
        member = self.guard is None or self.guard.is_member(peer)
        if not (self._running and member and peer != self.node.peer_id):
            return
        if self._lacks(self._vector(), remote) and not self._puller.is_dry(peer, remote):
            self._puller.want(peer, remote, force=False)
        if self.on_vector is not None:
            self.on_vector(peer, remote)

    def known_vectors(self) -> dict[str, VersionVector]:
        """The last vector each remote sent us (announce or pull request), at most MAX_WANTED_PEERS of them."""
        return dict(self._known)

    # ---- announcing and anti-entropy ----------------------------------------------------------------------

    def _announce(self, exclude: Iterable[str] = ()) -> None:
        """Send our vector to `fanout` random peers that may lack part of it, each in its own bounded task."""
        ours = self._vector()
        satisfied = [peer for peer, theirs in self._known.items() if theirs.dominates(ours)]
        targets = self._pick(self.fanout(), (*exclude, *satisfied))
        if not targets:
            return
        request = encode_request(ours)
        for peer in targets:
            if len(self._announces) >= MAX_ANNOUNCE_TASKS:
                self.stats["announces_dropped"] += 1
                continue
            task = asyncio.create_task(self._announce_to(peer, request), name=f"announce:{peer[-8:]}")
            self._announces.add(task)
            task.add_done_callback(self._announces.discard)

    async def _announce_to(self, peer: str, request: bytes) -> None:
        try:
            await rpc.call(self.node.p2p, peer, self.announce_name, request, max_response_bytes=16,
                           timeout_s=self.config.rpc_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.stats["announce_failures"] += 1
            self._failures.log(peer, "announce", e)
            return
        self.stats["announces_sent"] += 1
        self.stats["bytes_sent"] += len(request)

    async def _anti_entropy_loop(self) -> None:
        while self._running:
            await asyncio.sleep(self.config.anti_entropy_s * self._rng.uniform(0.5, 1.5))
            try:
                await asyncio.to_thread(self.intake.expire_gaps)  # may merge a released chain: CPU, off the loop
                targets = self._pick(1, ())
                if targets:
                    self._puller.want(targets[0], VersionVector(), force=True)
            except Exception:  # a bug here must not silently end anti-entropy
                logger.exception("anti-entropy round failed run_id=%s", self.run_id)

    def pulling_missing(self) -> bool:
        """True while a pull is wanted or running from a remote whose last vector holds updates we lack: our
        replica is about to change. Thread-safe enough for a poll from another thread (copies, no mutation)."""
        ours, known = self._vector(), self._known
        pending = [known.get(peer) for peer in self._puller.pending_peers()]
        return any(self._lacks(ours, vv) for vv in pending if vv is not None)

    # ---- helpers ------------------------------------------------------------------------------------------

    def _lacks(self, ours: VersionVector, remote: VersionVector) -> bool:
        return lacks(ours, remote, self.intake.replica.banned)

    def _vector(self) -> VersionVector:
        # Vectors are immutable and swapped whole by the replica: reading one needs no lock.
        return self.intake.replica.version_vector

    def _pick(self, k: int, exclude: Iterable[str]) -> list[str]:
        try:
            peers = list(dict.fromkeys(self._peers()))
        except Exception:
            logger.exception("the peers callback failed run_id=%s", self.run_id)
            return []
        skip = {self.node.peer_id, *exclude}
        candidates = [p for p in peers if isinstance(p, str) and p not in skip
                      and (self.guard is None or not self.guard.is_penalized(p))]
        if self.guard is None:
            return self._rng.sample(candidates, min(k, len(candidates)))
        # Peers we trade with first (issue 16): records cost nothing, and a crowd of them in the view would
        # otherwise take almost every announce and anti-entropy pull. One pick in NEWCOMER_PICK_EVERY still goes
        # to anyone, so a new honest peer is reached too.
        contributors = [p for p in candidates if self.guard.is_contributor(p)]
        others = [p for p in candidates if not self.guard.is_contributor(p)]
        picked = self._rng.sample(contributors, min(k, len(contributors)))
        if others and (len(picked) < k or self._rng.random() < 1 / NEWCOMER_PICK_EVERY):
            extra = self._rng.sample(others, min(max(1, k - len(picked)), len(others)))
            picked = (picked + extra)[-k:] if len(picked) >= k else picked + extra
        return picked[:k]
