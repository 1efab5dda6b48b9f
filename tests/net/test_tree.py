"""The aggregation tree on real SwarmNodes (net/gossip/tree.py, net/gossip/tree_audits.py): updates go up the
epoch's tree and come back down as one audited, signed total that every replica merges, with no announce or pull;
a lying aggregator is caught by its auditor, the evidence bans it on every peer, and its children's updates still
reach everyone through their authors' fallback."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import pytest
import torch

import p2p_diloco.net.gossip.tree as tree_module
from p2p_diloco.config import preset
from p2p_diloco.net.gossip.service import Gossip, GossipConfig
from p2p_diloco.sim.liars import lie
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import OuterUpdate, make_update
from p2p_diloco.wire.identity import Identity
from p2p_diloco.wire.sums import decode_sum
from tests.helpers.net import LoopThread, Member, start_member
from tests.net.test_gossip import QUIET, wait_until

BASE = preset("test")
SPEC = dataclasses.replace(BASE, run_id="tree-test", defence=dataclasses.replace(BASE.defence, copy_cosine=0.0))
NUMEL = 6000  # two Merkle chunks
CODEC = get_codec(SPEC.outer.codec, SPEC.outer.codec_block)
PEERS = 5  # fan-in 2: a root, two inner nodes, two leaves


@pytest.fixture(scope="module")
def five(loop: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Member]]:
    out: list[Member] = []
    try:
        for _ in range(PEERS):
            out.append(loop.run(start_member(tmp_path_factory, tuple(out[0].node.visible_maddrs()) if out else ())))
        yield out
    finally:
        for m in out:
            loop.run(m.node.shutdown(), timeout_s=30)


def _replica(me: str) -> Replica:
    return Replica.from_spec(SPEC, torch.linspace(-1.0, 1.0, NUMEL), codec=CODEC, self_id=me)


def _update(identity: Identity, seed: int, seq: int = 1) -> OuterUpdate:
    payload = CODEC.compress(0.01 * torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)))
    return make_update(run_id=SPEC.run_id, spec_hash=SPEC.spec_hash(), seq=seq, tau=0, samples=8, weight=0.5,
                       codec=CODEC.name, numel=NUMEL, identity=identity, payload=payload)


@contextlib.contextmanager
def aggregating(loop: LoopThread, members: list[Member], config: GossipConfig) -> Iterator[list[Gossip]]:
    """A started Gossip with the tree on each member; every member started aggregating long before this epoch."""
    gossips: list[Gossip] = []
    everyone = {m.node.peer_id: 0.0 for m in members}
    try:
        for member in members:
            me = member.node.peer_id
            intake = Intake(SPEC, NUMEL, _replica(me))
            gossip = Gossip(member.node, SPEC.run_id, intake, UpdateStore(config.retained_bytes), config,
                            peers=lambda: list(everyone), identity=member.identity, since=0.0,
                            tree_members=lambda: everyone)
            gossips.append(gossip)
            loop.run(gossip.start())
        yield gossips
    finally:
        for gossip in gossips:
            loop.run(gossip.stop(), timeout_s=30)


def _publish(loop: LoopThread, gossip: Gossip, update: OuterUpdate) -> None:
    assert gossip.intake.replica.offer(update)[0].value == "merged"  # the learner merges its own first
    loop.run(gossip.publish(update))


def _reference(updates: list[OuterUpdate], me: str) -> Replica:
    replica = _replica(me)
    for update in sorted(updates, key=lambda u: u.sender):
        replica.offer(update)
    return replica


CONFIG = GossipConfig(fanout=2, anti_entropy_s=QUIET, rpc_timeout_s=5, aggregate=2, aggregate_epoch_s=3600.0,
                      aggregate_wait_s=0.5, aggregate_fallback_s=QUIET)


def test_updates_go_up_the_tree_and_every_replica_merges_the_one_total(loop, five) -> None:
    with aggregating(loop, five, CONFIG) as gossips:
        updates = [_update(m.identity, seed=i) for i, m in enumerate(five)]
        for gossip, update in zip(gossips, updates):
            _publish(loop, gossip, update)
        # Both: the replica's vector moves inside offer_sum's worker thread, the counter only once the event loop
        # is back from it (a loaded run read the vector at 5 and the counter still at 0).
        wait_until(lambda: all(g.intake.replica.version_vector.total() == PEERS and g.stats["tree_totals_merged"]
                               for g in gossips), 30, "every update on every replica, by a merged total")
        for gossip in gossips:
            stats = gossip.stats
            assert stats["tree_fallbacks"] == 0, [g.stats for g in gossips]
            assert stats["announces_sent"] == 0 and stats["pulls"] == 0  # the tree alone carried them
            reference = _reference(updates, gossip.node.peer_id)
            assert gossip.intake.replica.version_vector == reference.version_vector
            torch.testing.assert_close(gossip.intake.replica.theta, reference.theta, rtol=0, atol=1e-6)
        assert sum(g.stats["audits_passed"] for g in gossips) >= 3  # each sum and the total checked before use
        assert all(g.stats["lies_caught"] == 0 and not g.intake.replica.banned for g in gossips)


def test_a_lying_aggregator_is_caught_banned_everywhere_and_its_parts_fall_back(loop, five, monkeypatch) -> None:
    # Anti-entropy on, as in a real run: the liar's leaves get the other subtree's updates from their authors by
    # pulls (no total reaches them through a banned parent, and only an author's store holds a summed update);
    # without it they waited on random announces, and once in CI's loaded default suite none came in 30 s.
    config = dataclasses.replace(CONFIG, aggregate_fallback_s=3.0, anti_entropy_s=2.0)
    with aggregating(loop, five, config) as gossips:
        tree = gossips[0].tree.tree(gossips[0].tree.epoch())
        liar_id = tree.order[1]  # the root's first child: an inner node whose sum the root audits
        liar = next(m for m in five if m.node.peer_id == liar_id)
        honest_build = tree_module.build_sum

        def build(**kwargs):  # type: ignore[no-untyped-def]
            s = honest_build(**kwargs)
            return lie(s, liar.identity, list(kwargs["children"])) if kwargs["identity"] is liar.identity and s else s
        monkeypatch.setattr(tree_module, "build_sum", build)
        updates = [_update(m.identity, seed=10 + i) for i, m in enumerate(five)]
        for gossip, update in zip(gossips, updates):
            _publish(loop, gossip, update)
        honest = [g for g in gossips if g.node.peer_id != liar_id]
        # The counters move after the ban (the event loop's side of it), so the wait is on them too; all but the
        # auditor ban by evidence.
        wait_until(lambda: all(liar_id in g.intake.replica.banned for g in honest)
                   and sum(g.stats["lies_caught"] for g in honest) >= 1
                   and sum(g.stats["evidence_held"] for g in honest) >= len(honest) - 1, 30,
                   "the liar caught, and banned everywhere by evidence")
        kept = [u for u in updates if u.sender != liar_id]
        wait_until(lambda: all(all(g.intake.replica.version_vector.has(u.sender, 1) for u in kept) for g in honest),
                   30, "the honest updates on every honest replica")
        for gossip in honest:  # nothing of the lie, nor of the liar's own update, is in any honest replica
            reference = _reference(kept, gossip.node.peer_id)
            torch.testing.assert_close(gossip.intake.replica.theta, reference.theta, rtol=0, atol=1e-6)


def test_the_default_wait_is_a_quarter_of_our_round(loop, five) -> None:
    """aggregate_wait_s 0 (the default): a node waits a quarter of the time between its last two updates, 1 s
    before it has two, at most half the fallback. A fixed 1 s was a whole round of a 1 s round, and the wait is
    staleness for every update under the node (BENCHMARKS.md "The tree's delay")."""
    assert dataclasses.replace(CONFIG, aggregate_wait_s=0.5).validate().aggregate_wait_s == 0.5
    with pytest.raises(ValueError, match="aggregate_wait_s"):
        dataclasses.replace(CONFIG, aggregate_wait_s=-1.0).validate()
    with aggregating(loop, five, dataclasses.replace(CONFIG, aggregate_wait_s=0.0)) as gossips:
        tree = gossips[0].tree
        assert tree is not None and tree.wait() == tree_module.FIRST_WAIT_S
        t0 = time.monotonic()
        _publish(loop, gossips[0], _update(five[0].identity, seed=1))
        time.sleep(0.4)  # our round: the interval between our two updates, not a wait for a condition
        _publish(loop, gossips[0], _update(five[0].identity, seed=2, seq=2))
        elapsed = time.monotonic() - t0
        assert 0.25 * 0.4 <= tree.wait() <= 0.25 * elapsed
        tree.round_s = 10 * tree.fallback_s  # a very long round: the wait still ends well before the fallback
        assert tree.wait() == tree.fallback_s / 2
        assert gossips[1].tree is not None and gossips[1].tree.wait() == tree_module.FIRST_WAIT_S  # its own round


def test_a_lost_total_does_not_hold_the_next_one_back(loop, five) -> None:
    """A leaf loses the first total (an audit that timed out upstream, a dropped message): the next round's total
    still merges there at once, the lost seqs left as holes for a pull or a late total to fill. Before, it waited
    on the gap, and so did every later total: the whole tree stalled (BENCHMARKS.md "The tree's delay")."""
    with aggregating(loop, five, CONFIG) as gossips:
        order = gossips[0].tree.tree(gossips[0].tree.epoch()).order
        leaf = next(g for g in gossips if g.node.peer_id == order[-1])
        assert leaf.tree is not None
        on_sum, lost = leaf.tree._on_sum, []

        async def lossy(kind: str, data: bytes, caller: str) -> None:
            if kind == tree_module.TOTAL and not lost:  # the first total never reaches this leaf
                lost.append(decode_sum(data, run_id=SPEC.run_id, spec_hash=SPEC.spec_hash(), numel=NUMEL))
                return
            await on_sum(kind, data, caller)
        leaf.tree._on_sum = lossy  # type: ignore[method-assign]
        first = [_update(m.identity, seed=20 + i) for i, m in enumerate(five)]
        for gossip, update in zip(gossips, first):
            _publish(loop, gossip, update)
        others = [g for g in gossips if g is not leaf]
        wait_until(lambda: lost and all(g.intake.replica.version_vector.total() == PEERS for g in others), 30,
                   "the first total merged everywhere but at the leaf")
        second = [_update(m.identity, seed=30 + i, seq=2) for i, m in enumerate(five)]
        for gossip, update in zip(gossips, second):
            _publish(loop, gossip, update)
        wait_until(lambda: all(leaf.intake.replica.version_vector.get(u.sender) == 2 for u in second), 30,
                   "the second total merged at the leaf, ahead of the lost one")
        vv = leaf.intake.replica.version_vector
        # The lost total held the root's own update at least (a first total may be partial: a timer fired first).
        missing = {slot for slot in lost[0].header.slots if slot[0] != leaf.node.peer_id}
        assert missing and {(sender, 1) for sender in vv.senders_with_holes() if vv.holes(sender) == {1}} == missing
        held = [u for u in first if (u.sender, u.seq) not in missing]
        reference = _reference([*held, *second], leaf.node.peer_id)  # the lost seqs' successors wait on the gap,
        reference.gap_timeout_s = 0.0  # until the direct path's own rule skips them: the same holes, the same theta
        reference.expire_gaps(now_s=reference.clock() + 1.0)
        assert reference.version_vector == vv
        torch.testing.assert_close(leaf.intake.replica.theta, reference.theta, rtol=0, atol=1e-6)
        assert leaf.stats["tree_fallbacks"] == 0 and leaf.stats["pulls"] == 0  # the tree alone, at once
