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

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgpack

from p2p_diloco.sync.audit_answer import decode_ask, draw_chunks, encode_answer, encode_ask, judge_answer
from p2p_diloco.sync.sum_audit import decode_lie, encode_lie, verify_lie
from p2p_diloco.wire.envelope import OuterUpdate
from p2p_diloco.wire.sums import GroupSum

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
        indices = draw_chunks(auditor.learner.identity.secret(b"sum-audit"), s)
        self.open[(me, s.sum_id)] = (s, indices, accept)
        ask = msgpack.packb({"from": me, "q": encode_ask(s, indices)}, use_bin_type=True)
        self.tree.net.send(me, s.aggregator, ask, kind=ASK)
        self.tree.swarm.queue.push(self.tree.swarm.queue.now + self.timeout_s, self._expire, me, s.sum_id)

    def _expire(self, me: str, sum_id: bytes) -> None:
        if self.open.pop((me, sum_id), None) is not None:
            self.tree.counts["audit_timeouts"] += 1

    def on_message(self, peer: SimPeer, data: bytes, kind: str) -> None:
        if kind == ASK:
            ask = msgpack.unpackb(data, raw=False)
            self._answer(peer, ask["from"], *decode_ask(ask["q"]))
        elif kind == ANSWER:
            answer = msgpack.unpackb(data, raw=False)
            self._judge(peer, answer["id"], answer["a"])
        elif kind == LIE:
            self._evidence(peer, data)

    def _answer(self, peer: SimPeer, auditor: str, sum_id: bytes, indices: list[int]) -> None:
        me = peer.learner.peer_id
        book = self.inputs.get(me)
        kept = book.get(sum_id) if book is not None else None
        if kept is None or me in self.tree.liars_silent:
            return  # not ours (or gone): the auditor's timeout drops the sum
        _, direct, children = kept
        answer = {"id": sum_id, "a": encode_answer(sum_id, direct, children, indices)}
        self.tree.net.send(me, auditor, msgpack.packb(answer, use_bin_type=True), kind=ANSWER)

    def _judge(self, peer: SimPeer, sum_id: bytes, answer: bytes) -> None:
        me = peer.learner.peer_id
        opened = self.open.pop((me, sum_id), None)
        if opened is None:
            return
        s, indices, accept = opened
        spec, numel = self.tree.swarm.spec, peer.learner.numel
        try:
            lie = judge_answer(s, indices, answer, peer.learner.replica.exact_step, run_id=spec.run_id,
                               spec_hash=spec.spec_hash(), max_update_bytes=8 * numel + 4096)
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
