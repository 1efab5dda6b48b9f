"""Replica repair on real SwarmNodes (127.0.0.1, port 0): issue 4's second trap, ARCHITECTURE.md "The network".

Sender S published seqs 1-3. Peer A merged all three, but no longer holds S#2 (it restarted, or evicted it);
peers B and C never got S#2, waited out the gap and skipped it (a hole), then merged S#3. Vectors now differ
by S#2 and no pull can ever fix that. Each test builds that state by hand, starts Gossip + SnapshotServer +
Repair on every peer (as `PeerNetwork.serve` does) and asserts what the swarm does: A adopts a skipping peer's
state (and re-merges what it holds beyond it), unless most peers it knows merged S#2 as it did, or the
offered state is further from A's than the differing updates could move it. Holes travel in gossip requests,
so a peer that still holds a skipped update serves it, and the skippers merge it late.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest
import torch
from test_gossip import NUMEL, SPEC, _replica, _updates, wait_until

from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.admission.policy import RateLimitConfig
from p2p_diloco.net.gossip.repair import Repair
from p2p_diloco.net.gossip.service import Gossip, GossipConfig
from p2p_diloco.net.statesync.client import StateSyncConfig
from p2p_diloco.net.statesync.server import SnapshotServer
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.envelope import OuterUpdate
from p2p_diloco.wire.identity import Identity
from tests.helpers.net import LoopThread, Member

pytestmark = pytest.mark.timeout(120)

GOSSIP = GossipConfig(anti_entropy_s=3600.0, rpc_timeout_s=5)  # no anti-entropy: each test triggers its pulls
SYNC = StateSyncConfig(snapshot_reuse_s=0.0, timeout_s=10.0)


@dataclasses.dataclass
class Unit:
    """One learner unit's network side with repair: what PeerNetwork.serve starts."""

    member: Member
    replica: Replica
    intake: Intake
    store: UpdateStore
    guard: PeerGuard
    gossip: Gossip | None = None
    server: SnapshotServer | None = None
    repair: Repair | None = None

    @property
    def vv(self) -> VersionVector:
        return self.replica.version_vector

    @property
    def peer_id(self) -> str:
        return self.member.node.peer_id


def unit(member: Member) -> Unit:
    replica = _replica()
    intake = Intake(SPEC, NUMEL, replica)
    guard = PeerGuard(SPEC.run_id, self_id=member.node.peer_id, limits=RateLimitConfig())
    return Unit(member, replica, intake, UpdateStore(GOSSIP.retained_bytes), guard)


def merge_all(u: Unit, updates: list[OuterUpdate], *, keep: bool = True) -> None:
    """Merge (in order) as if pulled; `keep`: also into the store, to serve."""
    for update in updates:
        outcome, _ = u.replica.offer(update)
        assert outcome.value in ("merged", "buffered"), outcome
        if keep:
            u.store.add(update)


def skip_gap(u: Unit) -> None:
    """The gap timeout passes with nobody serving the missing seq: the replica skips it."""
    u.intake.expire_gaps(now_s=u.replica.clock() + SPEC.defence.gap_timeout_s + 1)


@contextlib.contextmanager
def serving(loop: LoopThread, units: list[Unit], grace_s: float = 0.0,
            proven_only: bool = False) -> Iterator[list[Unit]]:
    """`proven_only`: each unit's voters are what the real peer counts (PeerNetwork.proven_peer_ids): members
    whose own updates merged here in good standing; else every other unit votes."""
    everyone = [u.peer_id for u in units]
    try:
        for u in units:
            others = [pid for pid in everyone if pid != u.peer_id]

            def members(o: list[str] = others, u: Unit = u) -> list[str]:
                if not proven_only:
                    return o
                proven = u.replica.standing.proven(u.replica.clock(), 600.0)
                return [pid for pid in o if pid in proven]

            u.repair = Repair(u.member.node, SPEC.run_id, SPEC.spec_hash(), u.replica, u.store, SYNC,
                              known=lambda u=u: u.gossip.known_vectors(), members=members, guard=u.guard,
                              grace_s=grace_s, cooldown_s=0.0)
            u.gossip = Gossip(u.member.node, SPEC.run_id, u.intake, u.store, GOSSIP, peers=lambda o=others: o,
                              guard=u.guard, on_vector=u.repair.observe)
            u.server = SnapshotServer(u.member.node, SPEC.run_id, SPEC.spec_hash(), u.replica, u.member.identity,
                                      SYNC, guard=u.guard)
            loop.run(u.gossip.start())
            loop.run(u.server.start())
        yield units
    finally:
        for u in units:
            for service in (u.repair, u.gossip, u.server):
                if service is not None:
                    loop.run(service.stop(), timeout_s=30)


def the_trap(members: list[Member], *, c_merged: bool) -> tuple[list[Unit], list[OuterUpdate], list[OuterUpdate]]:
    """A merged S#1-3 but holds only S#1 and S#3; B skipped S#2; C like A (`c_merged`) or like B. Everyone
    merged H#1-2 of an honest sender. Returns the units, S's updates and H's."""
    s_updates = _updates(Identity.generate(), 3, seed=80)
    h_updates = _updates(Identity.generate(), 2, seed=81)
    a, b, c = (unit(m) for m in members)
    merge_all(a, s_updates[:1] + h_updates)
    merge_all(a, s_updates[1:2], keep=False)  # merged, then lost with a restart or an eviction
    merge_all(a, s_updates[2:])
    for u in (b, c):
        if u is c and c_merged:
            merge_all(c, s_updates[:1] + h_updates)
            merge_all(c, s_updates[1:2], keep=False)
            merge_all(c, s_updates[2:])
            continue
        merge_all(u, s_updates[:1] + [s_updates[2]] + h_updates)  # S#3 waits for S#2...
        skip_gap(u)  # ...which never comes
        assert s_updates[1].seq in u.vv.holes(s_updates[1].sender)
    return [a, b, c], s_updates, h_updates


def test_a_replica_that_merged_what_nobody_can_serve_adopts_a_skipping_peers_state(loop, members) -> None:
    (a, b, c), s_updates, _ = the_trap(members, c_merged=False)
    a_only = _updates(Identity.generate(), 1, seed=82)  # A also holds an update nobody else has yet
    merge_all(a, a_only)
    assert a.vv != b.vv and b.vv == c.vv
    with serving(loop, [a, b, c]):
        for u in (b, c):  # what anti-entropy does every few seconds: A sees their holes
            loop.run(u.gossip.request_pull(a.peer_id))
        wait_until(lambda: a.repair.stats["repairs"] == 1, 30, "A to adopt a skipping peer's state")
        # A re-merged its own extra update on top, and gossip spreads it: every replica ends equal, without S#2.
        loop.run(b.gossip.request_pull(a.peer_id))
        loop.run(c.gossip.request_pull(a.peer_id))
        wait_until(lambda: a.vv == b.vv == c.vv, 30, "the three vectors to meet")
        sender, seq = s_updates[1].sender, s_updates[1].seq
        assert seq in a.vv.holes(sender) and a.vv.has(a_only[0].sender, 1)
        for u in (b, c):
            torch.testing.assert_close(u.replica.theta, a.replica.theta, rtol=0, atol=1e-6)
        assert a.repair.stats["repairs_refused"] == 0  # (outvoted first, maybe: until it knew both vectors)
        assert b.repair.stats["repair_attempts"] == c.repair.stats["repair_attempts"] == 0  # the skippers never yield


def test_a_restarted_peer_never_adopts_a_state_offered_only_by_identities_without_contribution(loop, members):
    """Issue 16: B and C claim the skip (their vectors have the hole) and serve snapshots, but no update of
    theirs ever merged at A: in an open run they are what a crowd of fresh identities would be. Their claims
    start nothing, whatever their number; the same trap with B and C counted as members is repaired (the first
    test of this module)."""
    (a, b, c), s_updates, _ = the_trap(members, c_merged=False)
    before, vv_before = a.replica.theta.clone(), a.vv
    with serving(loop, [a, b, c], proven_only=True):
        for u in (b, c):
            loop.run(u.gossip.request_pull(a.peer_id))
        wait_until(lambda: a.repair.stats["repairs_unproven"] >= 2, 15, "A to hear both claims")
        loop.run(b.gossip.request_pull(a.peer_id))  # and again: a repeated claim changes nothing either
        wait_until(lambda: a.repair.stats["repairs_unproven"] >= 3, 15, "A to hear the claim again")
        assert a.repair.stats["repair_attempts"] == 0 and a.repair.stats["repairs"] == 0
        assert a.vv == vv_before and a.vv.has(s_updates[1].sender, s_updates[1].seq)
        torch.testing.assert_close(a.replica.theta, before, rtol=0, atol=0)


def test_a_lone_claim_of_a_skip_does_not_make_two_mergers_adopt(loop, members) -> None:
    (a, b, c), s_updates, _ = the_trap(members, c_merged=True)
    before = a.replica.theta.clone()
    with serving(loop, [a, b, c]):
        loop.run(c.gossip.request_pull(a.peer_id))  # A learns that C merged S#2 too
        wait_until(lambda: c.peer_id in a.gossip.known_vectors(), 15, "A to see C's vector")
        loop.run(b.gossip.request_pull(a.peer_id))  # B claims the skip
        wait_until(lambda: a.repair.stats["repairs_outvoted"] >= 1, 15, "A to count the votes")
        assert a.repair.stats["repair_attempts"] == 0
        assert a.vv.has(s_updates[1].sender, s_updates[1].seq)
        torch.testing.assert_close(a.replica.theta, before, rtol=0, atol=0)


def test_a_snapshot_further_than_the_differing_updates_allow_is_refused(loop, members) -> None:
    (a, b, c), _, _ = the_trap(members, c_merged=False)
    assert 0 < a.replica.max_step() < 1.0
    with b.replica.lock:
        b.replica.theta[7] += 100 * a.replica.max_step()  # B's state is not what its vector says
    before, vv_before = a.replica.theta.clone(), a.vv
    with serving(loop, [a, b]):
        loop.run(b.gossip.request_pull(a.peer_id))
        wait_until(lambda: a.repair.stats["repairs_refused"] == 1, 30, "A to refuse B's snapshot")
        assert a.vv == vv_before and a.repair.stats["repairs"] == 0
        torch.testing.assert_close(a.replica.theta, before, rtol=0, atol=0)
        assert a.guard.is_penalized(b.peer_id)


def test_a_peer_that_still_holds_a_skipped_update_serves_it_and_the_holes_fill(loop, members) -> None:
    (a, b, c), s_updates, h_updates = the_trap(members, c_merged=False)
    a.store.add(s_updates[1])  # this time A kept S#2
    with serving(loop, [a, b, c], grace_s=3600.0):
        for u in (b, c):
            loop.run(u.gossip.request_pull(a.peer_id))  # the request names the hole; A serves it
        wait_until(lambda: a.vv == b.vv == c.vv, 30, "B and C to merge S#2 late")
        assert a.vv.n_holes == 0 and b.replica.stats["late_merged"] == 1
        for u in (b, c):
            torch.testing.assert_close(u.replica.theta, a.replica.theta, rtol=0, atol=1e-6)
        assert a.repair.stats["repair_attempts"] == 0


def test_a_donor_vector_that_names_updates_nobody_holds_is_not_adopted(loop, members) -> None:
    """A hostile skipper serves a snapshot whose signed vector also names a million updates nobody has: that
    would loosen the bound a millionfold and make A take a sender's next seqs for duplicates."""
    (a, b, c), _, _ = the_trap(members, c_merged=False)
    theta, vv = b.replica.snapshot()
    inflated = VersionVector({**vv.to_dict(), "made-up-sender": 10**6}, holes=vv.holes_dict())
    b.replica.load(theta + 1000 * a.replica.max_step(), inflated)
    before, vv_before = a.replica.theta.clone(), a.vv
    with serving(loop, [a, b]):
        loop.run(b.gossip.request_pull(a.peer_id))
        wait_until(lambda: a.repair.stats["repairs_deferred"] >= 1, 30, "A to turn B's snapshot down")
        assert a.vv == vv_before and a.repair.stats["repairs"] == 0
        torch.testing.assert_close(a.replica.theta, before, rtol=0, atol=0)


def test_crossed_holes_are_repaired_once_by_the_lower_peer_id(loop, members) -> None:
    """A merged S#2 and skipped T#2; B merged T#2 and skipped S#2; neither holds what it merged. Both would
    adopt each other's state and swap forever: the lower PeerID adopts, and the two replicas meet."""
    s_updates = _updates(Identity.generate(), 3, seed=90)
    t_updates = _updates(Identity.generate(), 3, seed=91)
    a, b = unit(members[0]), unit(members[1])
    for u, merged, skipped in ((a, s_updates, t_updates), (b, t_updates, s_updates)):
        merge_all(u, merged[:1])
        merge_all(u, merged[1:2], keep=False)
        merge_all(u, merged[2:] + skipped[:1] + skipped[2:])
        skip_gap(u)
    assert a.vv != b.vv and a.vv.n_holes == b.vv.n_holes == 1
    lower, higher = sorted((a, b), key=lambda u: u.peer_id)
    with serving(loop, [a, b]):
        loop.run(a.gossip.request_pull(b.peer_id))
        loop.run(b.gossip.request_pull(a.peer_id))
        wait_until(lambda: a.vv == b.vv, 30, "the two vectors to meet")
        # The repair counts itself once its worker thread has returned, a moment after the replica changed.
        wait_until(lambda: lower.repair.stats["repairs"] == 1, 10, "the lower PeerID's repair to be counted")
        assert lower.repair.stats["repairs"] == 1 and higher.repair.stats["repairs"] == 0
        torch.testing.assert_close(a.replica.theta, b.replica.theta, rtol=0, atol=1e-6)


def test_an_outvoted_skipper_adopts_a_mergers_state(loop, members) -> None:
    """A and C merged S#2 and both lost it; B skipped it. The mergers are the majority, so they keep it, and
    B (after waiting for anyone to serve it) adopts a merger's state: all three meet, with S#2 merged."""
    (a, b, c), s_updates, _ = the_trap(members, c_merged=True)
    with serving(loop, [a, b, c]):
        for u in (a, c):
            loop.run(u.gossip.request_pull(b.peer_id))  # B sees both mergers' vectors in their requests
        wait_until(lambda: a.vv == b.vv == c.vv, 30, "B to adopt a merger's state")
        wait_until(lambda: b.repair.stats["repairs"] == 1, 10, "B's repair to be counted")  # after its thread returns
        assert b.repair.stats["repairs"] == 1 and a.repair.stats["repairs"] == c.repair.stats["repairs"] == 0
        assert b.vv.has(s_updates[1].sender, s_updates[1].seq) and b.vv.n_holes == 0
        torch.testing.assert_close(b.replica.theta, a.replica.theta, rtol=0, atol=1e-6)
