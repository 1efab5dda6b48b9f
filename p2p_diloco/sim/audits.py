"""Audits in the aggregation tree (sim/aggregation.py; ARCHITECTURE.md "Aggregation"): no sum is used before an
honest peer checked it.

A parent that receives a child's sum draws `CHUNKS` chunk indices from a secret of its own and the sum's id (the
child signed the sum before it could know them) and asks the child for the sum's inputs there: its direct parts
as their signed updates, and its children's sums at those chunks, each with its Merkle proof against the root the
sum names (sync/sum_audit.py). Everything in the answer is signed by someone else, so the child can only answer
truly or not at all. The sum is added into the parent's own only if the recomputed chunks match; the root's total
is checked the same way by each of the root's children before it merges it or passes it on. A sum that lies is
**evidence**: the auditor sends it to every peer, each checks it (`verify_lie`) and bans the aggregator (its own
updates too), and the tree's inner places go to others from then on. An aggregator that does not answer within
`timeout_s` has its sum dropped (its parts reach everyone by their authors' fallback).

What a single audit cannot see: a lie outside the drawn chunks (each chunk drawn is a chance to catch it, and the
next sum is drawn again), and a lie a colluding parent lets through.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgpack

from p2p_diloco.sync.sum_audit import ChunkProof, audit_chunks, decode_lie, encode_lie, prove_chunk, verify_lie
from p2p_diloco.wire.envelope import OuterUpdate, decode_update, encode_update
from p2p_diloco.wire.merkle import chunk_count
from p2p_diloco.wire.sums import GroupSum, decode_sum_header

CHUNKS = 4
"""Chunks an auditor draws per sum."""
ASK, ANSWER, LIE = "audit?", "audit!", "lie"
KEPT = 16  # sums a node keeps the inputs of, to answer audits

SimPeer = Any  # sim/swarm.py's (not imported: the swarm imports this module)
TreeDissemination = Any  # sim/swarm.py's (not imported: the swarm imports this module)


class Audits:
    """Every peer's audits of the sums it receives, and the evidence that spreads."""

    def __init__(self, tree: TreeDissemination, *, timeout_s: float) -> None:
        self.tree, self.timeout_s = tree, timeout_s
        self.inputs: dict[str, OrderedDict[bytes, tuple[GroupSum, list[OuterUpdate], list[GroupSum]]]] = {}
        self.open: dict[tuple[str, bytes], tuple[GroupSum, list[int], Callable[[], None]]] = {}
        self.convicted: set[str] = set()

    def kept(self, node: str, s: GroupSum, direct: list[OuterUpdate], children: list[GroupSum]) -> None:
        """What `node` summed into `s`, kept to answer its auditor."""
        book = self.inputs.setdefault(node, OrderedDict())
        book[s.sum_id] = (s, direct, children)
        while len(book) > KEPT:
            book.popitem(last=False)

    def check(self, auditor: SimPeer, s: GroupSum, accept: Callable[[], None]) -> None:
        """Ask `s`'s aggregator for its inputs at secret chunks; `accept()` once they prove it."""
        me = auditor.learner.peer_id
        seed = hashlib.sha256(auditor.learner.identity.secret(b"sum-audit").to_bytes(32, "big") + s.sum_id)
        n = chunk_count(s.header.numel)
        indices = sorted(random.Random(seed.digest()).sample(range(n), min(CHUNKS, n)))
        self.open[(me, s.sum_id)] = (s, indices, accept)
        ask: bytes = msgpack.packb({"from": me, "id": s.sum_id, "j": indices}, use_bin_type=True)
        self.tree.net.send(me, s.aggregator, ask, kind=ASK)
        self.tree.swarm.queue.push(self.tree.swarm.queue.now + self.timeout_s, self._expire, me, s.sum_id)

    def _expire(self, me: str, sum_id: bytes) -> None:
        if self.open.pop((me, sum_id), None) is not None:
            self.tree.counts["audit_timeouts"] += 1

    def on_message(self, peer: SimPeer, data: bytes, kind: str) -> None:
        if kind == ASK:
            self._answer(peer, msgpack.unpackb(data, raw=False))
        elif kind == ANSWER:
            self._judge(peer, msgpack.unpackb(data, raw=False))
        elif kind == LIE:
            self._evidence(peer, data)

    def _answer(self, peer: SimPeer, ask: dict) -> None:
        me = peer.learner.peer_id
        kept = self.inputs.get(me, {}).get(ask["id"])
        if kept is None or me in self.tree.liars_silent:
            return  # not ours (or gone): the auditor's timeout drops the sum
        _, direct, children = kept
        answer = {"id": ask["id"], "d": [encode_update(u) for u in direct],
                  "k": [[c.header_bytes, c.signature, [[i, (p := prove_chunk(c, i)).data, list(p.proof)]
                                                       for i in ask["j"]]] for c in children]}
        self.tree.net.send(me, ask["from"], msgpack.packb(answer, use_bin_type=True), kind=ANSWER)

    def _judge(self, peer: SimPeer, answer: dict) -> None:
        me = peer.learner.peer_id
        opened = self.open.pop((me, answer["id"]), None)
        if opened is None:
            return
        s, indices, accept = opened
        spec, numel = self.tree.swarm.spec, peer.learner.numel
        try:
            direct = [decode_update(d, max_bytes=8 * numel + 4096, run_id=spec.run_id, spec_hash=spec.spec_hash())
                      for d in answer["d"]]
            children, proofs = [], {i: [] for i in indices}  # type: ignore[var-annotated]
            for header_bytes, signature, chunks in answer["k"]:
                header = decode_sum_header(header_bytes, signature, run_id=spec.run_id, spec_hash=spec.spec_hash(),
                                           numel=numel)
                child = GroupSum(header, header_bytes, signature, b"")
                children.append(child)
                for i, data, proof in chunks:
                    proofs.setdefault(i, []).append(ChunkProof(child, data, tuple(proof)))
            lie = audit_chunks(s, children, proofs, direct, peer.learner.replica.exact_step, indices)
        except ValueError:
            self.tree.counts["audit_unanswered"] += 1  # the answer does not hold: the sum is dropped
            return
        if lie is None:
            self.tree.counts["audits_passed"] += 1
            accept()
            return
        self.tree.counts["caught"] += 1
        evidence = encode_lie(lie)
        self._evidence(peer, evidence)
        for other in self.tree.swarm.peers:
            if other.alive and other is not peer:
                self.tree.net.send(me, other.learner.peer_id, evidence, kind=LIE)

    def _evidence(self, peer: SimPeer, data: bytes) -> None:
        spec, numel = self.tree.swarm.spec, peer.learner.numel
        try:
            lie = decode_lie(data, run_id=spec.run_id, spec_hash=spec.spec_hash(), numel=numel,
                             max_update_bytes=8 * numel + 4096)
        except ValueError:
            return
        if lie.aggregator == peer.learner.peer_id:
            return  # the liar itself: it goes on as it likes, and nobody else takes its sums or updates
        if not verify_lie(lie, peer.learner.replica.exact_step):
            self.tree.counts["evidence_refused"] += 1
            return
        self.tree.counts["evidence_held"] += 1
        peer.learner.replica.ban(lie.aggregator, "lying aggregator: a sum that is not the sum of what it names")
        if lie.aggregator not in self.convicted:
            self.convicted.add(lie.aggregator)
            self.tree.convict(lie.aggregator)
