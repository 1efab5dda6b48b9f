"""The serving half of gossip (the protocol: net/gossip/service.py): the announce and pull RPCs.

Both are served behind the guard (access, rate limits, open streams, the minimum pace). Every vector a remote
sends us, in an announce or a pull request, is recorded (`KnownVectors`), shown to `on_vector` (repair), and
makes us pull from that remote if it holds anything we lack: every exchange runs both ways.

A pull response starts with what the requester's "ids" digests show it merged other versions of (an
equivocation split between us), then what our store holds beyond its vector; never an update of a banned
sender. It is refused as "busy" over `max_serves()` responses at once, and ends early, a short batch, when the
caller's uplink share is spent (asked again before each update after the first). What we serve is recorded in
the guard's ledger: an update we sent the same remote before counts against its fair share once more. An update
served to the same remote twice within the window is not served to it again (`ServedLog`, served.py: a remote
looping pulls with an empty vector gets each update twice, then only what is new), unless its vector fell below
the last one it sent us (it lost them: a restart), at most once per window.

Runs on the gossip's loop; read-only on the store.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Container
from typing import cast

from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.gossip.digests import differing_windows
from p2p_diloco.net.gossip.known import KnownVectors
from p2p_diloco.net.gossip.messages import MAX_VECTOR_BYTES, GossipConfig, Request, parse_request
from p2p_diloco.net.gossip.pulls import FailureLog, Puller, lacks, min_bytes_per_s
from p2p_diloco.net.gossip.served import ServedLog
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import SwarmNode
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.sync.types import UpdateLike
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.envelope import OuterUpdate, encode_update

logger = logging.getLogger(__name__)

MAX_CONCURRENT_ANNOUNCES_SERVED = 64
"""Incoming announces handled at once (each is tiny; more are refused as busy)."""


class GossipServer:
    """Serves the announce and pull RPCs of one run (see the module docstring)."""

    def __init__(self, node: SwarmNode, names: tuple[str, str], intake: Intake, store: UpdateStore,
                 config: GossipConfig, *, guard: PeerGuard | None, known: KnownVectors, puller: Puller,
                 max_serves: Callable[[], int], stats: dict[str, int], failures: FailureLog,
                 on_vector: Callable[[str, VersionVector], None] | None, served: ServedLog | None = None) -> None:
        """`names`: the announce and pull RPCs' names; `max_serves()` is the number of pull responses we may
        send at once now (it follows the uplink); `served`: what we served each remote lately (a `ServedLog()`
        by default; `ServedLog(window_s=0)` re-serves everything, as before the rule)."""
        self.node, self.intake, self.store, self.config, self.guard = node, intake, store, config, guard
        self.known, self.puller, self.max_serves = known, puller, max_serves
        self.stats, self.failures, self.on_vector = stats, failures, on_vector
        self.announce_name, self.pull_name = names
        self.rpc_stats: dict[str, rpc.RpcStats] = {}
        self._serving = 0  # pull responses being sent now
        self.served = served if served is not None else ServedLog()
        for key in ("serves_repeated_skipped", "serves_reset"):
            stats.setdefault(key, 0)

    async def serve(self) -> None:
        """Register both handlers on the node (neither, if the second fails)."""
        p2p, timeout_s = self.node.p2p, self.config.rpc_timeout_s
        guard, pace = self.guard, min_bytes_per_s(self.guard)
        self.rpc_stats["announce"] = await rpc.serve(
            p2p, self.announce_name, self.rpc_announce, max_request_bytes=MAX_VECTOR_BYTES, timeout_s=timeout_s,
            max_concurrent=MAX_CONCURRENT_ANNOUNCES_SERVED, guard=guard, min_bytes_per_s=pace)
        try:
            self.rpc_stats["pull"] = await rpc.serve(
                p2p, self.pull_name, self.rpc_pull, max_request_bytes=MAX_VECTOR_BYTES, timeout_s=timeout_s,
                max_concurrent=self.config.max_concurrent_serves, guard=guard, min_bytes_per_s=pace)
        except BaseException:
            await rpc.unserve(p2p, self.announce_name)
            raise

    async def unserve(self) -> None:
        """Stop serving both; bounded by rpc_timeout_s. A node already shut down is fine."""
        for name in (self.announce_name, self.pull_name):
            try:
                await asyncio.wait_for(rpc.unserve(self.node.p2p, name), self.config.rpc_timeout_s / 2)
            except Exception as e:  # e.g. the node is already shut down
                logger.debug("gossip unserve failed name=%s error=%r", name, e)

    async def rpc_announce(self, request: bytes, caller: str) -> bytes:
        self.stats["announces_received"] += 1
        self.stats["bytes_received"] += len(request)
        remote = self._decode(request, pull=False, caller=caller).vv
        self._heard(caller, remote)
        return b""

    async def rpc_pull(self, request: bytes, caller: str) -> AsyncIterator[bytes]:
        self.stats["pulls_served"] += 1
        self.stats["bytes_received"] += len(request)
        parsed = self._decode(request, pull=True, caller=caller)
        if self._serving >= self.max_serves():  # counted; the caller backs off and retries
            self.stats["serves_busy"] += 1
            raise rpc.RpcError(f"busy: serving {self._serving} pulls, all this peer's measured uplink feeds; retry")
        remote, limit = parsed.vv, min(parsed.limit, self.config.pull_max_updates)
        self._heard(caller, remote)  # the requester may hold what we lack: pull back
        banned = self.intake.replica.banned  # never spread what we refuse ourselves
        others = [u for u in self._other_versions(parsed.ids, remote, limit) if u.sender not in banned]
        fresh = self._fresh(caller, others)
        missing, repeats = self._missing(caller, remote, limit - len(fresh), banned)
        self._skipped(caller, len(others) - len(fresh) + repeats)
        # The gossip's store holds wire envelopes only: ours (publish) and those the intake decoded (pulls).
        return self._encoded([cast(OuterUpdate, u) for u in [*fresh, *missing]], caller)

    def _fresh(self, caller: str, updates: list[UpdateLike]) -> list[UpdateLike]:
        """`updates` less those `caller` had from us twice within the window."""
        return [u for u in updates if self.served.allowed(caller, u.sender, u.seq)]

    def _skipped(self, caller: str, repeats: int) -> None:
        if repeats:
            self.stats["serves_repeated_skipped"] += repeats
            self.served.skip(caller, repeats)

    def _missing(self, caller: str, remote: VersionVector, limit: int,
                 banned: Container[str]) -> tuple[list[UpdateLike], int]:
        """Up to `limit` updates `remote` lacks that we may serve it, and how many repeats were skipped: the
        batch goes on past the repeats, so a peer with a gap (or a looping puller) still gets what is new. Asks
        the store for 4x more each time, at most its whole content (the store is bounded)."""
        want = limit
        while limit > 0:
            held = self.store.missing_for(remote, want, to_serve=True)  # less what an author holds back
            out: list[UpdateLike] = []
            repeats = 0
            for update in (u for u in held if u.sender not in banned):
                if len(out) == limit:
                    break
                if self.served.allowed(caller, update.sender, update.seq):
                    out.append(update)
                else:
                    repeats += 1
            if len(out) == limit or len(held) < want:
                return out, repeats
            want *= 4
        return [], 0

    def _heard(self, peer: str, remote: VersionVector) -> None:
        """`peer` holds `remote`: schedule a pull if it has anything our replica lacks; show it to `on_vector`."""
        before = self.known.get(peer)
        if before is not None and not remote.dominates(before) and self.served.lost(peer):
            self.stats["serves_reset"] += 1  # it holds less than it told us: it lost what we served it
        self.known.record(peer, remote)
        member = self.guard is None or self.guard.is_member(peer)
        if not (self.puller.running and member and peer != self.node.peer_id):
            return
        replica = self.intake.replica
        if lacks(replica.version_vector, remote, replica.banned) and not self.puller.is_dry(peer, remote):
            self.puller.want(peer, remote, force=False)
        if self.on_vector is not None:
            self.on_vector(peer, remote)

    def _other_versions(self, digests: dict[str, str], remote: VersionVector, limit: int) -> list[UpdateLike]:
        """The updates we hold for the slots where the requester merged other versions than we did (its
        `ids` digests differ from ours over the same seqs): handed to it, its intake finds the equivocation
        and proves it, and the proof comes back to us through the evidence relay."""
        out: list[UpdateLike] = []
        for sender, seqs in differing_windows(digests, remote, self.intake.replica.recent_ids):
            self.stats["id_mismatches"] += 1
            self.failures.log(sender, "id comparison", RuntimeError(
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
            self.failures.count(caller, "bad_request")
            raise

    async def _encoded(self, updates: list[OuterUpdate], caller: str) -> AsyncIterator[bytes]:
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
                self.served.record(caller, update.sender, update.seq)
                yield data
        finally:
            self._serving -= 1
