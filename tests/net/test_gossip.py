"""Gossip on real SwarmNodes (127.0.0.1, port 0): announce + pull, anti-entropy, buffering, failing peers.

Nodes start once per module on one event loop in a background thread; each test starts its own Gossip
instances on them and stops them in `finally`. The standard assertion: replicas that hold the same updates
are equal (ARCHITECTURE.md "Invariants"), and equal to merging each update exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
import torch

from p2p_diloco.config import preset
from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.admission.policy import RateLimitConfig
from p2p_diloco.net.gossip.evidence_relay import EvidenceRelay, evidence_name
from p2p_diloco.net.gossip.service import Gossip, GossipConfig, decode_request, encode_request
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import SwarmNode
from p2p_diloco.sync import evidence as sync_evidence
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import OuterUpdate, encode_update, make_update
from p2p_diloco.wire.identity import Identity
from tests.helpers.net import LoopThread, Member, start_member

pytestmark = pytest.mark.timeout(120)

SPEC = dataclasses.replace(preset("test"), run_id="gossip-test")
NUMEL = 2000
CODEC = get_codec(SPEC.outer.codec, SPEC.outer.codec_block)
QUIET = 3600.0  # anti_entropy_s that never fires within a test


@dataclasses.dataclass
class Peer:
    """One learner unit's network side: replica, intake, store and gossip on a node."""

    node: SwarmNode
    identity: Identity
    replica: Replica
    intake: Intake
    store: UpdateStore
    gossip: Gossip
    view: list[str]  # what its `peers` callback returns; tests edit it
    guard: PeerGuard | None = None
    relay: EvidenceRelay | None = None

    @property
    def vv(self) -> VersionVector:
        return self.replica.version_vector


def _replica() -> Replica:
    return Replica.from_spec(SPEC, torch.linspace(-1.0, 1.0, NUMEL), codec=CODEC)


def _updates(identity: Identity, count: int, seed: int) -> list[OuterUpdate]:
    """`count` consecutive signed updates of `identity`, as a learner would make them."""
    generator = torch.Generator().manual_seed(seed)
    return [make_update(run_id=SPEC.run_id, spec_hash=SPEC.spec_hash(), seq=seq, tau=0, samples=8, weight=0.5,
                        codec=CODEC.name, numel=NUMEL, identity=identity,
                        payload=CODEC.compress(0.01 * torch.randn(NUMEL, generator=generator)))
            for seq in range(1, count + 1)]


def _reference(updates: list[OuterUpdate]) -> Replica:
    """Every update merged exactly once, in seq order, into a fresh replica."""
    replica = _replica()
    for update in sorted(updates, key=lambda u: (u.sender, u.seq)):
        replica.offer(update)
    return replica


@contextlib.contextmanager
def gossiping(loop: LoopThread, members: list[Member], *configs: GossipConfig,
              limits: RateLimitConfig | None = None, allowed: tuple[str, ...] = ()) -> Iterator[list[Peer]]:
    """A started Gossip on each member (config i for member i, the last one repeated); all stopped in finally.
    With `limits`, each peer also gets a PeerGuard (and `allowed` as its allow list) and an EvidenceRelay."""
    peers: list[Peer] = []
    everyone = [m.node.peer_id for m in members]
    try:
        for i, member in enumerate(members):
            config = configs[min(i, len(configs) - 1)]
            replica = _replica()
            intake = Intake(SPEC, NUMEL, replica)
            store = UpdateStore(config.retained_bytes)
            view = list(everyone)
            guard = relay = None
            if limits is not None:
                guard = PeerGuard(SPEC.run_id, self_id=member.node.peer_id, limits=limits, allowed=allowed)
                relay = EvidenceRelay(member.node, SPEC.run_id, intake, lambda v=view: v, guard, fanout=3,
                                      timeout_s=config.rpc_timeout_s)
                loop.run(relay.start())
            gossip = Gossip(member.node, SPEC.run_id, intake, store, config, peers=lambda v=view: v, guard=guard,
                            on_evidence=relay.publish if relay else None)
            peers.append(Peer(member.node, member.identity, replica, intake, store, gossip, view, guard, relay))
            loop.run(gossip.start())
        yield peers
    finally:
        for peer in peers:
            loop.run(peer.gossip.stop(), timeout_s=30)
            if peer.relay is not None:
                loop.run(peer.relay.stop(), timeout_s=30)


def publish(loop: LoopThread, peer: Peer, update: OuterUpdate) -> None:
    """What the learner does: merge our own update, then hand it to gossip on the loop."""
    outcome, _ = peer.replica.offer(update)
    assert outcome.value == "merged"
    loop.run(peer.gossip.publish(update))


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - started


def assert_replicas_match_reference(peers: list[Peer], updates: list[OuterUpdate]) -> None:
    """Every in-process replica merged exactly `updates`, once each, and equals a replica that merged them in order."""
    reference = _reference(updates)
    for peer in peers:
        assert peer.vv == reference.version_vector
        assert peer.replica.stats["merged"] == len(updates)  # each update merged once, none twice
        torch.testing.assert_close(peer.replica.theta, reference.theta, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------- tests


def test_updates_reach_every_peer_by_announce_and_pull(loop, members) -> None:
    config = GossipConfig(fanout=2, anti_entropy_s=QUIET, rpc_timeout_s=5)
    with gossiping(loop, members, config) as peers:
        updates = {p.node.peer_id: _updates(p.identity, 3, seed=i) for i, p in enumerate(peers)}
        latencies = []
        for seq in range(3):
            for peer in peers:
                update = updates[peer.node.peer_id][seq]
                publish(loop, peer, update)
                latencies.append(wait_until(lambda u=update: all(q.vv.get(u.sender) >= u.seq for q in peers),
                                            10, "one update to reach every peer"))
        everything = [u for us in updates.values() for u in us]
        wait_until(lambda: all(p.vv.total() == len(everything) for p in peers), 10, "all updates everywhere")
        wait_until(lambda: all(p.gossip.stats["updates_new"] == len(everything) - 3 for p in peers), 5,
                   "every peer to count the others' updates")  # counted a moment after the merge moves the vector
        assert_replicas_match_reference(peers, everything)
        for peer in peers:
            stats = peer.gossip.stats
            assert stats["announces_received"] > 0 and stats["pulls"] > 0 and stats["pull_failures"] == 0
            assert stats["updates_new"] == len(everything) - 3  # the others' updates; ours were published
            assert len(peer.store) == len(everything)  # every peer can serve every update
        print(f"gossip latency to 2 peers: median {sorted(latencies)[len(latencies) // 2] * 1e3:.1f} ms, "
              f"max {max(latencies) * 1e3:.1f} ms")


def test_anti_entropy_reaches_a_peer_nobody_announces_to(loop, members) -> None:
    quiet = GossipConfig(fanout=3, anti_entropy_s=QUIET, rpc_timeout_s=5)
    eager = dataclasses.replace(quiet, anti_entropy_s=0.2)
    with gossiping(loop, members, quiet, quiet, eager) as peers:
        a, b, c = peers
        a.view[:] = [b.node.peer_id]  # A and B know only each other: nobody ever announces to C
        b.view[:] = [a.node.peer_id]
        everything = _updates(a.identity, 3, seed=10) + _updates(b.identity, 2, seed=11)
        for update in everything:
            publish(loop, a if update.sender == a.node.peer_id else b, update)
        wait_until(lambda: all(p.vv.total() == len(everything) for p in peers), 15, "C to catch up")
        # The vector moves inside the merge, the count a moment later on the gossip's loop: wait for both.
        wait_until(lambda: c.gossip.stats["updates_new"] == len(everything), 5, "C to count what it pulled")
        assert_replicas_match_reference(peers, everything)
        assert c.gossip.stats["announces_received"] == 0


def test_an_update_held_back_reaches_a_puller_only_once_its_hold_is_up(loop, members) -> None:
    """What an author does with the update it sends up an aggregation tree (net/gossip/tree.py): it holds it back
    from pulls `aggregate_settle_s`, so the tree can bring it in a total first. Here no tree brings it: B, pulling
    all along (anti-entropy), gets it no sooner than the hold's end, and merges it like any other."""
    hold_s = 3.0
    config = GossipConfig(anti_entropy_s=0.2, rpc_timeout_s=5)
    with gossiping(loop, members[:2], config) as (a, b):
        a.view[:] = []  # no announce: only B's anti-entropy asks
        update = _updates(a.identity, 1, seed=14)[0]

        async def hold() -> None:  # the store belongs to the loop: touch it there
            a.store.add(update)
            a.store.hold_back(update.sender, update.seq, hold_s)

        held_at = time.monotonic()
        loop.run(hold())
        pulls = b.gossip.stats["pulls"]
        wait_until(lambda: b.vv.get(a.node.peer_id) == 1 and b.replica.stats["merged"] == 1, 30,
                   "B to pull A's update once its hold is up")  # V moves just before the count: wait on both
        assert time.monotonic() - held_at >= hold_s
        assert b.gossip.stats["pulls"] >= pulls + 3  # B did ask meanwhile: the hold kept the update back
        assert_replicas_match_reference([b], [update])


def test_request_pull_catches_up_at_once(loop, members) -> None:
    """What a joiner does right after state sync: pull from the donor without waiting for anti-entropy."""
    config = GossipConfig(fanout=3, anti_entropy_s=QUIET, rpc_timeout_s=5)
    with gossiping(loop, members[:2], config) as (a, b):
        a.view[:] = []  # A announces to nobody
        everything = _updates(a.identity, 4, seed=12)
        for update in everything:
            publish(loop, a, update)
        time.sleep(0.2)
        assert b.vv.total() == 0
        loop.run(b.gossip.request_pull(a.node.peer_id))
        wait_until(lambda: b.vv.total() == len(everything), 5, "B to pull A's updates")
        assert_replicas_match_reference([a, b], everything)


def test_out_of_order_updates_are_buffered_then_released(loop, members) -> None:
    config = GossipConfig(anti_entropy_s=0.1, rpc_timeout_s=5, pull_max_updates=8)
    with gossiping(loop, members[:2], config) as (a, b):
        u1, u2, u3 = _updates(a.identity, 3, seed=20)

        async def hold(*updates: OuterUpdate) -> None:  # the store belongs to the loop: touch it there
            for u in updates:
                a.store.add(u)

        loop.run(hold(u3, u2))  # A can serve seq 2 and 3 but not yet seq 1
        wait_until(lambda: b.replica.n_buffered == 2, 10, "B to buffer seq 2 and 3")
        assert b.vv.get(a.node.peer_id) == 0
        wait_until(lambda: b.replica.stats["duplicate"] > 0, 10, "a pull that re-sends the buffered updates")
        loop.run(hold(u1))
        # V moves inside the merge and the count just after it, both under the replica's lock; this thread reads
        # them without it, so wait on both (CI once read V = 3 with merged = 2).
        wait_until(lambda: b.vv.get(a.node.peer_id) == 3 and b.replica.stats["merged"] == 3, 10,
                   "seq 1 to release seq 2 and 3")
        assert b.replica.n_buffered == 0 and b.intake.counts["buffered"] == 2
        # Duplicates arrived (every anti-entropy pull re-sent the buffered updates) and none merged twice.
        assert b.replica.stats["merged"] == 3 and b.replica.stats["duplicate"] >= 2
        torch.testing.assert_close(b.replica.theta, _reference([u1, u2, u3]).theta, rtol=0, atol=1e-6)
        # Publishing an update again changes nothing anywhere.
        for u in (u1, u2, u3):
            a.replica.offer(u)
        loop.run(a.gossip.publish(u1))
        time.sleep(0.3)
        assert b.replica.stats["merged"] == 3 and len(a.store) == 3


def _pull_failures(peers: list[Peer]) -> int:
    return sum(p.gossip.stats["pull_failures"] for p in peers)


def test_a_hung_then_vanished_peer_does_not_stall_gossip(loop, members, tmp_path_factory) -> None:
    """D first accepts calls and never answers (pulls to it time out), then shuts down (calls fail fast)."""
    d = loop.run(start_member(tmp_path_factory, tuple(members[0].node.visible_maddrs())))
    release = asyncio.Event()

    async def hang(request: bytes, caller: str) -> bytes:
        await release.wait()
        return b""

    try:
        for name in ("announce", "pull"):
            loop.run(rpc.serve(d.node.p2p, f"p2p-diloco/{SPEC.run_id}/{name}", hang, max_request_bytes=1 << 20,
                               timeout_s=3600))
        config = GossipConfig(fanout=3, anti_entropy_s=0.2, rpc_timeout_s=2.0)
        with gossiping(loop, members, config) as peers:
            # First each live peer gives the others an update: a pull from a remote that never gave us anything
            # takes the one probation slot, which D's hung pulls hold up to their timeout (slots.py); once they
            # are contributors, their pulls never wait for D (without this, one run in many took 2.04 s).
            sent: list[OuterUpdate] = []
            for i, peer in enumerate(peers):
                sent.append(_updates(peer.identity, 3, seed=30 + i)[0])
                publish(loop, peer, sent[-1])
            wait_until(lambda: all(q.vv.get(u.sender) >= u.seq for q in peers for u in sent), 10,
                       "the live peers to trade one update each")
            for peer in peers:
                peer.view.append(d.node.peer_id)
            for phase in ("hung", "gone"):
                if phase == "gone":
                    loop.run(d.node.shutdown(), timeout_s=30)
                for i, peer in enumerate(peers):
                    update = _updates(peer.identity, 3, seed=30 + i)[len(sent) // 3]
                    publish(loop, peer, update)
                    sent.append(update)
                    # D sits in every fanout (3 of 3 others), yet the live peers get it at once.
                    took = wait_until(lambda u=update: all(q.vv.get(u.sender) >= u.seq for q in peers), 5,
                                      f"an update to reach the live peers while D is {phase}")
                    assert took < config.rpc_timeout_s
                before = _pull_failures(peers)
                wait_until(lambda b=before: _pull_failures(peers) > b, 10,
                           f"anti-entropy pulls from the {phase} D to fail")
            assert_replicas_match_reference(peers, sent)
            assert sum(p.gossip.stats["announce_failures"] for p in peers) >= 3
    finally:
        loop.loop.call_soon_threadsafe(release.set)  # let D's hanging handlers end before the loop closes
        loop.run(d.node.shutdown(), timeout_s=30)


def test_hostile_requests_and_responses_are_refused(loop, members) -> None:
    config = GossipConfig(anti_entropy_s=QUIET, rpc_timeout_s=5)
    a_member, b_member = members[:2]
    with gossiping(loop, [a_member], config) as (a,):
        name = f"p2p-diloco/{SPEC.run_id}/announce"
        for garbage in (b"\xc1", b"\x80", encode_request(VersionVector(), limit=3),
                        encode_request(VersionVector())[:-1] + b"\x01"):
            with pytest.raises(rpc.RpcRemoteError, match="malformed announce request"):
                loop.run(rpc.call(b_member.node.p2p, a.node.peer_id, name, garbage, max_response_bytes=16,
                                  timeout_s=5))
        assert a.gossip.stats["bad_requests"] == 4

    # B serves junk on the pull RPC: a wrong-run update, garbage, and a good update. No honest peer relays an
    # invalid update, so A reads no further than the first one (it spends nothing more on that stream); once B
    # serves only good updates, A merges them.
    good = _updates(b_member.identity, 1, seed=40)[0]
    wrong_run = make_update(run_id="other-run", spec_hash=SPEC.spec_hash(), seq=1, tau=0, samples=1, weight=0.5,
                            codec=CODEC.name, numel=NUMEL, identity=b_member.identity, payload=good.payload)
    served = [encode_update(wrong_run), b"garbage", encode_update(good)]
    pull_name = _serve_pull(loop, b_member, served)
    try:
        with gossiping(loop, [a_member], dataclasses.replace(config, anti_entropy_s=0.1)) as (a,):
            a.view[:] = [b_member.node.peer_id]
            wait_until(lambda: a.gossip.stats["pull_failures"] >= 2, 10, "A to give up on B's junk twice")
            assert a.intake.counts["wrong_run"] >= 2 and a.intake.counts["malformed"] == 0
            assert a.vv.get(b_member.node.peer_id) == 0 and len(a.store) == 0
            served[:] = [encode_update(good)]
            # the merge happens on a worker thread, the store add right after on the loop: wait for both
            wait_until(lambda: a.vv.get(b_member.node.peer_id) == 1 and a.store.has(good.sender, 1), 10,
                       "A to merge and retain B's good update")
            assert len(a.store) == 1
    finally:
        loop.run(rpc.unserve(b_member.node.p2p, pull_name))


def test_request_codec_round_trip_and_bounds() -> None:
    vv = VersionVector({Identity.generate().peer_id: 3, Identity.generate().peer_id: 1})
    assert decode_request(encode_request(vv, limit=7), pull=True) == (vv, 7)
    assert decode_request(encode_request(vv), pull=False)[0] == vv
    sender = next(iter(vv))
    holed = VersionVector({sender: 5}, holes={sender: [2, 4]})
    for pull in (True, False):  # holes travel in both: the responder serves them, or repairs
        request = decode_request(encode_request(holed, limit=3 if pull else None), pull=pull)[0]
        assert request == holed and request.holes(sender) == {2, 4}
    with pytest.raises(rpc.RpcError, match="malformed"):  # a hole at or above its entry
        decode_request(msgpack.packb({"vv": {sender: 2}, "holes": {sender: [2]}}), pull=False)
    for bad, pull in ((encode_request(vv), True), (encode_request(vv, limit=0), True),
                      (encode_request(vv, limit=2), False), (b"\x00" * (2 << 20), False)):
        with pytest.raises(rpc.RpcError, match="malformed"):
            decode_request(bad, pull=pull)
    with pytest.raises(ValueError):
        GossipConfig(fanout=0).validate()
    with pytest.raises(ValueError, match="aggregate_settle_s"):
        GossipConfig(aggregate=4, aggregate_settle_s=601.0).validate()


# ---------------------------------------------------------------------------------------------- hostile peers


def _serve_pull(loop: LoopThread, member: Member, served: list[bytes]) -> str:
    """`member` answers every pull with `served` (edit the list to change it); returns the handler name."""
    async def pull(request: bytes, caller: str):
        decode_request(request, pull=True)
        for data in list(served):
            yield data

    name = f"p2p-diloco/{SPEC.run_id}/pull"
    loop.run(rpc.serve(member.node.p2p, name, pull, max_request_bytes=1 << 20, timeout_s=5))
    return name


def test_a_peer_that_sends_invalid_updates_is_counted_and_penalized(loop, members) -> None:
    """B serves a forged update: A counts it against B, stops reading, and then ignores B for penalty_s (no
    pulls, its announces refused with the reason), while it still takes a good update from C."""
    a_member, b_member, c_member = members
    good = _updates(b_member.identity, 1, seed=50)[0]
    forged = encode_update(dataclasses.replace(good, signature=bytes(64)))
    name = _serve_pull(loop, b_member, [forged, encode_update(good)])
    config = GossipConfig(anti_entropy_s=QUIET, rpc_timeout_s=5)
    try:
        with gossiping(loop, [a_member, c_member], config, limits=RateLimitConfig(penalty_s=60)) as (a, c):
            a.view[:] = [b_member.node.peer_id, c.node.peer_id]
            loop.run(a.gossip.request_pull(b_member.node.peer_id))
            wait_until(lambda: a.guard.is_penalized(b_member.node.peer_id), 10, "A to penalize B")
            assert a.guard.rejections.of(b_member.node.peer_id) == {"bad_signature": 1}
            assert a.intake.counts["bad_signature"] == 1 and a.vv.total() == 0  # the good one was never read
            with pytest.raises(rpc.RpcRemoteError, match="refused for [0-9]+s more: you sent invalid updates"):
                loop.run(rpc.call(b_member.node.p2p, a.node.peer_id, f"p2p-diloco/{SPEC.run_id}/announce",
                                  encode_request(VersionVector({good.sender: 1})), max_response_bytes=16,
                                  timeout_s=5))
            loop.run(a.gossip.request_pull(b_member.node.peer_id))  # even when asked: no pull from B
            time.sleep(0.3)
            assert a.gossip.stats["pulls_skipped"] >= 1 and a.intake.counts["bad_signature"] == 1
            publish(loop, c, _updates(c.identity, 1, seed=51)[0])  # honest gossip goes on
            wait_until(lambda: a.vv.get(c.node.peer_id) == 1, 10, "A to merge C's update")
    finally:
        loop.run(rpc.unserve(b_member.node.p2p, name))


def test_a_catch_up_put_off_by_the_bytes_in_bucket_goes_on_when_it_refills(loop, members) -> None:
    """A catch-up pull that fills its batch asks again at once; when our bytes-in bucket for that remote is in
    debt by then, the wish is kept and retried after the shortest backoff (it was dropped: nothing brought the
    rest until the next announce or anti-entropy)."""
    a_member, b_member, _ = members
    updates = _updates(b_member.identity, 6, seed=70)
    limits = RateLimitConfig(bytes_in_per_s=float(len(encode_update(updates[0]))), burst_s=1.0)  # one a second
    config = GossipConfig(anti_entropy_s=QUIET, rpc_timeout_s=5, pull_max_updates=2)
    with gossiping(loop, [a_member, b_member], config, limits=limits) as (a, b):
        a.view[:], b.view[:] = [], []  # no announces: only the one pull A is asked for
        for update in updates:
            publish(loop, b, update)
        loop.run(a.gossip.request_pull(b.node.peer_id))
        wait_until(lambda: a.vv.get(b.node.peer_id) == 6, 30, "A to pull all 6 of B's updates, 2 a batch")
        assert a.gossip.stats["pulls_skipped"] >= 1  # the bucket did put the catch-up off


def test_equivocation_evidence_is_verified_before_others_ban(loop, members) -> None:
    """C serves two signed updates for one (sender, seq) to A only. A bans the sender and pushes the proof;
    B verifies it itself and bans too. Invalid evidence is refused with the reason and counted."""
    a_member, b_member, c_member = members
    equivocator = Identity.generate()
    first, second = (_updates(equivocator, 2, seed=seed)[1] for seed in (60, 61))  # seq 2 twice: both wait
    name = _serve_pull(loop, c_member, [encode_update(first), encode_update(second)])
    config = GossipConfig(anti_entropy_s=QUIET, rpc_timeout_s=5)
    try:
        with gossiping(loop, [a_member, b_member], config, limits=RateLimitConfig(penalty_s=0)) as (a, b):
            loop.run(a.gossip.request_pull(c_member.node.peer_id))
            wait_until(lambda: equivocator.peer_id in b.replica.banned, 10, "B to ban on A's evidence")
            assert equivocator.peer_id in a.replica.banned and a.intake.counts["equivocation"] == 1
            wait_until(lambda: a.relay.stats["evidence_sent"] >= 1, 10, "A's push to be acknowledged")
            assert b.relay.stats["evidence_verified"] == 1
            assert b.guard.rejections.of(equivocator.peer_id) == {"evidence_verified": 1}
            assert b.vv.total() == 0 and b.replica.n_buffered == 0  # nothing of the equivocator is kept
            # C (hostile) claims D equivocated, with two updates of two different senders.
            accused, other = (_updates(Identity.generate(), 1, seed=seed)[0] for seed in (62, 63))
            bogus = sync_evidence.encode_evidence((encode_update(accused), encode_update(other)))
            with pytest.raises(rpc.RpcRemoteError, match="invalid evidence: bad_evidence: the two updates have "
                                                         "different senders"):
                loop.run(rpc.call(c_member.node.p2p, b.node.peer_id, evidence_name(SPEC.run_id), bogus,
                                  max_response_bytes=16, timeout_s=5))
            assert b.guard.rejections.of(c_member.node.peer_id) == {"evidence_invalid": 1}
            assert accused.sender not in b.replica.banned and other.sender not in b.replica.banned
            # Evidence against a sender already banned costs a header read, nothing more.
            loop.run(rpc.call(c_member.node.p2p, b.node.peer_id, evidence_name(SPEC.run_id),
                              sync_evidence.encode_evidence((encode_update(first), b"junk")), max_response_bytes=16,
                              timeout_s=5))
            assert b.relay.stats["evidence_known"] == 1
    finally:
        loop.run(rpc.unserve(c_member.node.p2p, name))


def test_a_peer_met_after_the_ban_gets_the_proof(loop, members) -> None:
    """A bans an equivocator before it knows B; when B shows up in A's peer list, A hands B the proof, and B
    (which would otherwise merge whatever the banned sender sends it) verifies it and bans too."""
    a_member, b_member, c_member = members
    equivocator = Identity.generate()
    first, second = (_updates(equivocator, 2, seed=seed)[1] for seed in (64, 65))
    name = _serve_pull(loop, c_member, [encode_update(first), encode_update(second)])
    config = GossipConfig(anti_entropy_s=QUIET, rpc_timeout_s=5)
    try:
        with gossiping(loop, [a_member, b_member], config, limits=RateLimitConfig(penalty_s=0)) as (a, b):
            a.view[:] = [a.node.peer_id]  # A does not know B yet

            async def meet() -> None:
                a.relay.meet()

            loop.run(meet())
            loop.run(a.gossip.request_pull(c_member.node.peer_id))
            # the proof handed to the relay (on the loop, just after the ban in the intake's thread)
            wait_until(lambda: a.gossip.stats["evidence_found"] == 1, 10, "A to find the equivocation")
            assert equivocator.peer_id in a.replica.banned and equivocator.peer_id not in b.replica.banned
            assert a.relay.stats["evidence_sent"] == 0
            a.view.append(b.node.peer_id)
            loop.run(meet())
            wait_until(lambda: b.relay.stats["evidence_verified"] == 1, 10, "B to verify the proof A handed it")
            assert equivocator.peer_id in b.replica.banned
            loop.run(meet())  # B is met: nothing is sent again
            wait_until(lambda: not a.relay._tasks, 10, "A's pushes to finish")
            assert a.relay.stats["evidence_sent"] == 1
    finally:
        loop.run(rpc.unserve(c_member.node.p2p, name))


def test_a_split_equivocation_is_found_and_both_replicas_take_their_version_back(loop, members) -> None:
    """The equivocator gives A one version of its seq 2 and B another: their vectors are equal, so no pull
    by vector would ever bring either the other's version. The ids digests in A's pull request tell B that A
    merged other updates for those slots; B hands A its versions; A's intake finds the equivocation, bans,
    takes its version back and passes on the proof; B verifies it, bans and takes its version back. Then
    both replicas equal one that merged the honest updates only."""
    a_member, b_member, _ = members
    equivocator = Identity.generate()
    first = _updates(equivocator, 1, seed=70)[0]
    two_a, two_b = (_updates(equivocator, 2, seed=seed)[1] for seed in (71, 72))
    honest = _updates(Identity.generate(), 2, seed=73)
    clean = _replica()
    for u in (first, *honest):
        clean.offer(u)
    config = GossipConfig(anti_entropy_s=QUIET, rpc_timeout_s=5)
    with gossiping(loop, [a_member, b_member], config, limits=RateLimitConfig(penalty_s=0)) as (a, b):

        async def hand(peer: Peer, updates: list[OuterUpdate]) -> None:  # as if pulled from the equivocator
            for u in updates:
                assert peer.intake.receive(encode_update(u))[0] == "merged"
                peer.store.add(u)

        loop.run(hand(a, [first, two_a, *honest]))
        loop.run(hand(b, [first, two_b, *honest]))
        assert a.vv == b.vv and not torch.allclose(a.replica.theta, b.replica.theta)
        loop.run(a.gossip.request_pull(b.node.peer_id))  # what anti-entropy does every few seconds
        wait_until(lambda: all(equivocator.peer_id in p.replica.banned for p in (a, b)), 15,
                   "both to ban the equivocator")
        wait_until(lambda: a.intake.events["taken_back"] == 1 and b.intake.events["taken_back"] == 1, 15,
                   "both to take their version back")
        assert b.gossip.stats["id_mismatches"] >= 1 and a.gossip.stats["evidence_found"] >= 1
        for p in (a, b):
            assert p.vv == clean.version_vector
            torch.testing.assert_close(p.replica.theta, clean.theta, rtol=0, atol=1e-6)


def test_a_closed_run_refuses_outsiders_on_every_rpc(loop, members) -> None:
    a_member, b_member, c_member = members
    allowed = (a_member.node.peer_id, b_member.node.peer_id)
    config = GossipConfig(anti_entropy_s=QUIET, rpc_timeout_s=5)
    with gossiping(loop, [a_member, b_member], config, limits=RateLimitConfig(), allowed=allowed) as (a, b):
        for rpc_name in ("announce", "pull", "evidence"):
            with pytest.raises(rpc.RpcRemoteError, match="^.*not allowed in this run: PeerID not in allow list$"):
                loop.run(rpc.call(c_member.node.p2p, a.node.peer_id, f"p2p-diloco/{SPEC.run_id}/{rpc_name}",
                                  encode_request(VersionVector(), 1), max_response_bytes=1 << 20, timeout_s=5))
        assert a.guard.rejections.of(c_member.node.peer_id) == {"not_allowed": 3}
        publish(loop, a, _updates(a.identity, 1, seed=70)[0])  # members still gossip
        wait_until(lambda: b.vv.get(a.node.peer_id) == 1, 10, "B to merge A's update")



def test_two_announcers_of_one_update_cost_one_fetch(loop, members) -> None:
    """Two peers holding the same updates announce them to C at once: C fetches each update once (the pulls
    started after the first ask only beyond what it will bring, net/gossip/pulls.py `_claims`), batch after batch.
    Without the claims a second announcer's pull fetched the same payloads again (the scale simulator: 36-50% of
    all pulls, 1.6-2x the bytes)."""
    config = GossipConfig(fanout=3, anti_entropy_s=QUIET, rpc_timeout_s=5, pull_max_updates=64)
    with gossiping(loop, members, config) as (a, b, d):
        holders = (a, b)
        for p in holders:
            p.view[:] = [d.node.peer_id]  # each announces to C only
        d.view[:] = []
        author = Identity.generate()
        everything = _updates(author, 24, seed=31)

        async def hold_and_announce(updates: list[OuterUpdate]) -> None:  # on the loop: the stores belong to it
            for p in holders:
                for u in updates:
                    assert p.replica.offer(u)[0].value == "merged"
                    p.store.add(u)
            await asyncio.gather(*(p.gossip.publish(updates[-1]) for p in holders))

        for batch in range(4):
            loop.run(hold_and_announce(everything[batch * 6:(batch + 1) * 6]))
            wait_until(lambda n=(batch + 1) * 6: d.vv.total() == n, 15, f"C to pull batch {batch}")
        assert_replicas_match_reference([a, b, d], everything)
        assert d.gossip.stats["announces_received"] >= 2 * 4  # every holder did announce every batch
        assert d.gossip.stats["updates_received"] == len(everything), d.gossip.stats
        assert d.replica.stats["duplicate"] == 0
