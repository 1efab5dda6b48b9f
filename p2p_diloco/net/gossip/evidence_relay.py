"""Equivocation evidence: spread it, check it, ban on it (ARCHITECTURE.md "The merge rule").

Equivocation is a sender signing two different updates for one (sender, seq). The peer whose intake sees it
bans the sender at once and keeps the proof, the two signed envelopes (`Intake.evidence`); gossip hands it to
us and we push it to `fanout` live peers. A receiver never bans on someone else's word: it verifies the pair
itself (`Intake.accept_evidence`, i.e. `sync.evidence.check_evidence`: both signatures by the accused, this
run and spec, the same slot, different contents) and only then bans the sender for the run, and forwards the
proof once to `fanout` peers of its own, so it spreads like an update. Invalid evidence is refused with the
reason and counted against whoever sent it; evidence against a sender we already banned costs a msgpack
header read and nothing more.

Protocol (one RPC per run, behind the PeerGuard):
  evidence  "p2p-diloco/<run_id>/evidence"
      request  = `sync.evidence.encode_evidence(pair)`: msgpack [envelope, envelope], each an `encode_update`
                 envelope of at most the intake's max_bytes
      response = b""                                     an ack; invalid evidence gets an RpcError

The intake keeps the last few proofs (`MAX_EVIDENCE`); we forward each accused sender's proof once. A peer
that joins after the ban would not know it, and would merge what the banned sender sends it: so each peer we
meet for the first time, or again after it was gone (`meet`), gets the proofs we hold, from each holder with
probability 2 * fanout / members (about 2 * fanout pushes per newcomer, whatever the swarm's size; a failed
push is tried again at the next meet). Counted in the guard's
rejections: `evidence_verified` (against the accused) and `evidence_invalid` (against the sender of the bad
evidence).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgpack

from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import SwarmNode
from p2p_diloco.sync.evidence import decode_evidence, encode_evidence
from p2p_diloco.sync.intake import Intake
from p2p_diloco.wire.envelope import WireError

logger = logging.getLogger(__name__)

MAX_FORWARD_TASKS = 16
"""Evidence pushes in flight at once; more are dropped (and counted): each is up to two updates' bytes."""
MAX_PUBLISHED = 4096
"""Accused senders whose proof we already pushed (each is pushed once)."""
_STATS = ("evidence_sent", "evidence_send_failures", "evidence_received", "evidence_verified", "evidence_invalid",
          "evidence_known", "evidence_dropped")


def evidence_name(run_id: str) -> str:
    return f"p2p-diloco/{run_id}/evidence"


def accused_of(envelope: bytes) -> str | None:
    """The sender named in an envelope's header, unverified (only to skip evidence we already acted on)."""
    try:
        header = msgpack.unpackb(msgpack.unpackb(envelope, raw=False, max_ext_len=0)["h"], raw=False, max_ext_len=0)
        sender = header[2]
    except Exception:  # anything malformed: the real check says why
        return None
    return sender if isinstance(sender, str) else None


class EvidenceRelay:
    """Serves the evidence RPC and pushes evidence to peers. `await start()`; always `await stop()`."""

    def __init__(self, node: SwarmNode, run_id: str, intake: Intake, peers: Callable[[], Sequence[str]],
                 guard: PeerGuard | None, *, fanout: int, timeout_s: float) -> None:
        """`intake` checks evidence and bans (`accept_evidence`); `peers` returns live member peer ids."""
        self.node = node
        self.run_id = run_id
        self.intake = intake
        self.max_update_bytes = intake.max_bytes
        self.guard = guard
        self.fanout = fanout
        self.timeout_s = timeout_s
        self.name = evidence_name(run_id)
        self.stats: dict[str, int] = dict.fromkeys(_STATS, 0)
        self.rpc_stats: rpc.RpcStats | None = None
        self._peers = peers
        self._tasks: set[asyncio.Task] = set()
        self._published: OrderedDict[str, None] = OrderedDict()
        self._met: set[str] = set()  # the peers listed at the last `meet` (told, or told by others)
        self._unmet: set[str] = set()  # newcomers whose push failed: told again at the next `meet`
        self._rng = random.Random()

    async def start(self) -> None:
        self.rpc_stats = await rpc.serve(
            self.node.p2p, self.name, self.rpc_evidence, max_request_bytes=2 * self.max_update_bytes + 1024,
            timeout_s=self.timeout_s, max_concurrent=4, guard=self.guard,
            min_bytes_per_s=self.guard.limits.min_stream_bytes_per_s if self.guard is not None else 0.0)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.timeout_s)
        await rpc.unserve(self.node.p2p, self.name, timeout_s=self.timeout_s / 2)

    def publish(self, first: bytes, second: bytes, exclude: Sequence[str] = ()) -> None:
        """Push the two envelopes of an equivocation to `fanout` random live peers, once per accused sender
        (call on the loop)."""
        accused = accused_of(first) or ""
        if accused in self._published:
            return
        self._published[accused] = None
        while len(self._published) > MAX_PUBLISHED:
            self._published.popitem(last=False)
        candidates = [p for p in dict.fromkeys(self._peers()) if p != self.node.peer_id and p not in exclude]
        request = encode_evidence((first, second))
        for peer in self._rng.sample(candidates, min(self.fanout, len(candidates))):
            self._spawn(peer, request)

    def meet(self) -> None:
        """Hand the proofs we hold to the peers newly listed (call on the loop, after each refresh of the peer
        list): peers that joined, or came back (a restarted peer forgot its bans). Peers listed before a ban got
        its proof by `publish` and forwarding."""
        members = [p for p in dict.fromkeys(self._peers()) if p != self.node.peer_id][:MAX_PUBLISHED]
        new = [p for p in members if p not in self._met or p in self._unmet]
        self._met, self._unmet = set(members), self._unmet - set(new)
        proofs = list(self.intake.evidence.values())
        if not proofs or not new:
            return
        # Each holder tells a newcomer with this chance: about 2*fanout pushes per newcomer in all, and the
        # chance that none does is about exp(-2*fanout) (0.25% at fanout 3), whatever the swarm's size.
        chance = min(1.0, 2 * self.fanout / len(members))
        for peer in new:
            if self._rng.random() >= chance:
                continue
            for first, second in proofs:
                self._spawn(peer, encode_evidence((first, second)), newcomer=True)

    def _spawn(self, peer: str, request: bytes, *, newcomer: bool = False) -> None:
        if len(self._tasks) >= MAX_FORWARD_TASKS:
            self.stats["evidence_dropped"] += 1
            if newcomer:
                self._unmet.add(peer)
            return
        task = asyncio.create_task(self._push(peer, request, newcomer=newcomer), name=f"evidence:{peer[-8:]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _push(self, peer: str, request: bytes, *, newcomer: bool = False) -> None:
        try:
            await rpc.call(self.node.p2p, peer, self.name, request, max_response_bytes=16, timeout_s=self.timeout_s)
            self.stats["evidence_sent"] += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:  # counted; the evidence may still reach it through another peer
            self.stats["evidence_send_failures"] += 1
            if newcomer and len(self._unmet) < MAX_PUBLISHED:
                self._unmet.add(peer)  # try again at the next meet
            logger.info("evidence push failed peer=%s error=%s", peer, e)

    async def rpc_evidence(self, request: bytes, caller: str) -> bytes:
        self.stats["evidence_received"] += 1
        try:
            first, second = decode_evidence(request, max_bytes=self.max_update_bytes)
            if accused_of(first) in self.intake.evidence:  # proven before: banned and repaired already
                self.stats["evidence_known"] += 1
                return b""
            # Two signature checks and two payload hashes (off the loop); bans only if the proof holds.
            sender = await asyncio.to_thread(self.intake.accept_evidence, first, second)
        except WireError as e:  # EvidenceError is one: malformed, or not a proof of equivocation
            self.stats["evidence_invalid"] += 1
            self._count(caller, "evidence_invalid")
            raise rpc.RpcError(f"invalid evidence: {e}") from None
        self.stats["evidence_verified"] += 1
        self._count(sender, "evidence_verified")
        logger.warning("sender banned on verified evidence sender=%s from=%s", sender, caller)
        self.publish(first, second, exclude=(caller,))
        return b""

    def _count(self, peer: str, reason: str) -> None:
        if self.guard is not None:
            self.guard.count(peer, reason)
