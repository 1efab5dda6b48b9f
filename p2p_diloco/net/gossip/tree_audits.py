"""Audits of group sums on the real network (ARCHITECTURE.md "Aggregation"; the simulator's are sim/audits.py,
and both ask and judge with sync/audit_answer.py): no sum is used before an honest peer checked it.

A parent that receives a child's sum, and each child of the root for the total, draws chunk indices from a
secret of its own and the sum's id and asks the aggregator, over the `audit` RPC, for the sum's inputs there;
it uses the sum only if they prove it. A sum that lies becomes evidence: the auditor bans the aggregator and
sends the evidence to every live member (the `audit` RPC again); each re-checks it (`verify_lie`) before it bans.
An aggregator that does not answer in `timeout_s` has its sum dropped: its parts reach everyone by their authors'
fallback (net/gossip/tree.py).

    audit   "p2p-diloco/<run_id>/audit"
        request  = msgpack {"q": question} (sync/audit_answer.py encode_ask) or {"lie": evidence} (encode_lie)
        response = the answer (encode_answer), or b"" for a sum we did not make (or for evidence)
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgpack

from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.gossip.sends import Sends
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import SwarmNode
from p2p_diloco.sync.audit_answer import decode_ask, draw_chunks, encode_answer, encode_ask, judge_answer
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.sum_audit import decode_lie, encode_lie, verify_lie
from p2p_diloco.wire.envelope import OuterUpdate
from p2p_diloco.wire.identity import Identity
from p2p_diloco.wire.merkle import CHUNK
from p2p_diloco.wire.sums import MAX_CHILDREN, GroupSum

logger = logging.getLogger(__name__)

KEPT = 16
"""Sums we keep the inputs of, to answer their audits."""
MAX_EVIDENCE_SENDS = 64
MAX_AUDITS_SERVED = 8


class TreeAudits:
    """Ask about the sums we receive, answer about the ones we made, act on evidence (see the module doc)."""

    def __init__(self, node: SwarmNode, run_id: str, spec_hash: str, replica: Replica, identity: Identity, *,
                 members: Callable[[], Sequence[str]], numel: int, max_update_bytes: int, timeout_s: float,
                 stats: dict[str, int], guard: PeerGuard | None = None) -> None:
        self.node, self.run_id, self.spec_hash, self.replica = node, run_id, spec_hash, replica
        self.members, self.numel, self.max_update_bytes = members, numel, max_update_bytes
        self.timeout_s, self.guard = timeout_s, guard
        self.secret = identity.secret(b"sum-audit")
        self.name = f"p2p-diloco/{run_id}/audit"
        self.stats = stats
        for key in ("audits_passed", "audits_failed", "audit_timeouts", "lies_caught", "evidence_held",
                    "evidence_refused", "audits_answered"):
            stats.setdefault(key, 0)
        self._kept: OrderedDict[bytes, tuple[list[OuterUpdate], list[GroupSum]]] = OrderedDict()
        self._sends = Sends(node, self.name, limit=MAX_EVIDENCE_SENDS, timeout_s=timeout_s, stats=stats,
                            keys=("evidence_sent", "evidence_failures", "evidence_dropped"),
                            failed=lambda peer, e: logger.debug("evidence send failed peer=%s error=%r", peer[-8:], e))
        self.rpc_stats: rpc.RpcStats | None = None

    # ---- serving -----------------------------------------------------------------------------------------

    async def serve(self) -> None:
        self.rpc_stats = await rpc.serve(self.node.p2p, self.name, self.rpc_audit,
                                         max_request_bytes=MAX_CHILDREN * self.max_update_bytes,
                                         timeout_s=self.timeout_s, max_concurrent=MAX_AUDITS_SERVED, guard=self.guard)

    async def unserve(self) -> None:
        await rpc.unserve(self.node.p2p, self.name, timeout_s=self.timeout_s / 2)

    def halt(self) -> list[asyncio.Task]:
        return self._sends.halt()

    def kept(self, s: GroupSum, direct: list[OuterUpdate], children: list[GroupSum]) -> None:
        """What we summed into `s`, kept to answer its auditor."""
        self._kept[s.sum_id] = (direct, children)
        while len(self._kept) > KEPT:
            self._kept.popitem(last=False)

    async def rpc_audit(self, request: bytes, caller: str) -> bytes:
        self.stats["bytes_received"] += len(request)
        try:
            m = msgpack.unpackb(request, raw=False, max_map_len=1, max_bin_len=len(request))
            if not isinstance(m, dict) or len(m) != 1:
                raise ValueError("an audit request is {q} or {lie}")
            if "lie" in m and isinstance(m["lie"], bytes):
                await self.on_evidence(m["lie"])
                return b""
            sum_id, indices = decode_ask(m["q"] if isinstance(m.get("q"), bytes) else b"")
        except ValueError as e:
            raise rpc.RpcError(f"bad audit request: {e}") from None
        kept = self._kept.get(sum_id)
        if kept is None:
            return b""
        answer = await asyncio.to_thread(encode_answer, sum_id, *kept, indices)
        self.stats["audits_answered"] += 1
        self.stats["bytes_sent"] += len(answer)
        return answer

    # ---- asking ------------------------------------------------------------------------------------------

    async def check(self, s: GroupSum) -> bool:
        """Ask `s`'s aggregator for its inputs at our secret chunks; True once they prove `s`. A lie is caught,
        banned and spread; no answer, or one that does not hold together, drops the sum (False)."""
        indices = draw_chunks(self.secret, s)
        proof_bytes = len(indices) * (4 * CHUNK + 64 * 40)
        bound = (len(s.header.parts) * self.max_update_bytes
                 + len(s.header.children) * (len(s.header_bytes) + 256 + proof_bytes) + 4096)
        ask = msgpack.packb({"q": encode_ask(s, indices)}, use_bin_type=True)
        try:
            answer = await rpc.call(self.node.p2p, s.aggregator, self.name, ask, max_response_bytes=bound,
                                    timeout_s=self.timeout_s)
        except rpc.RpcError as e:
            self.stats["audit_timeouts"] += 1
            logger.debug("audit unanswered aggregator=%s error=%r", s.aggregator[-8:], e)
            return False
        self.stats["bytes_received"] += len(answer)
        self.stats["bytes_sent"] += len(ask)
        try:
            lie = await asyncio.to_thread(judge_answer, s, indices, answer, self.replica.exact_step,
                                          run_id=self.run_id, spec_hash=self.spec_hash,
                                          max_update_bytes=self.max_update_bytes)
        except ValueError as e:
            self.stats["audits_failed"] += 1
            logger.info("audit answer refused aggregator=%s: %s", s.aggregator[-8:], e)
            return False
        if lie is None:
            self.stats["audits_passed"] += 1
            return True
        self.stats["lies_caught"] += 1
        logger.warning("lying aggregator caught aggregator=%s chunk=%d", s.aggregator, lie.index)
        evidence = encode_lie(lie)
        await self._ban(s.aggregator)
        request = msgpack.packb({"lie": evidence}, use_bin_type=True)
        for peer in self.members():
            if peer not in (self.node.peer_id, s.aggregator):
                self._sends.send(peer, request, "evidence")
        return False

    async def on_evidence(self, data: bytes) -> None:
        """Evidence another peer found: re-checked here before we ban on it."""
        try:
            lie = await asyncio.to_thread(decode_lie, data, run_id=self.run_id, spec_hash=self.spec_hash,
                                          numel=self.numel, max_update_bytes=self.max_update_bytes)
        except ValueError:
            self.stats["evidence_refused"] += 1
            return
        if lie.aggregator == self.node.peer_id or lie.aggregator in self.replica.banned:
            return
        if not await asyncio.to_thread(verify_lie, lie, self.replica.exact_step):
            self.stats["evidence_refused"] += 1
            return
        self.stats["evidence_held"] += 1
        await self._ban(lie.aggregator)

    async def _ban(self, aggregator: str) -> None:
        # Off the loop: a ban takes the aggregator's own merged updates back (the intake's ban listener).
        await asyncio.to_thread(self.replica.ban, aggregator,
                                "lying aggregator: a sum that is not the sum of what it names")
