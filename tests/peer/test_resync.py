"""A running peer that cannot catch up by pulls re-syncs state (issue 12): the detector (peer/lag.py) and the
load (peer/resync.py) with fakes; the real swarm in test_resync_swarm.py."""

from __future__ import annotations

import hashlib

import pytest
import torch

from p2p_diloco.peer.lag import LagWatch, Stuck, order_donors
from p2p_diloco.peer.resync import Resync, ResyncRefused, check, window_for
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.sync.types import MergeOutcome
from p2p_diloco.sync.version_vector import VersionVector
from tests.helpers.fakes import FakeUpdate

W = 30.0


def vv(**entries: int) -> VersionVector:
    return VersionVector(entries)


def run(watch: LagWatch, steps: list[tuple[float, VersionVector, dict[str, VersionVector], int]]) -> list:
    return [watch.observe(t, ours, others, buffer_full=full) for t, ours, others, full in steps]


# ---- the detector ---------------------------------------------------------------------------------------------


def test_a_healthy_peer_a_bit_behind_is_never_stuck() -> None:
    """Each round the others are 1-3 updates ahead of us, and our entries move every observation: pulls work."""
    watch = LagWatch(W, self_id="me")
    for i in range(200):  # 10 windows, an observation every 1.5 s
        ours = vv(me=i, a=i, b=max(0, i - 1))
        others = {"a": vv(a=i + 2, b=i + 1, me=i), "b": vv(a=i + 1, b=i + 2, me=i)}
        assert watch.observe(i * 1.5, ours, others, buffer_full=0) is None


def test_one_update_in_flight_for_long_is_not_stuck_without_proof() -> None:
    """Behind by one update whose transfer is slow (our entry does not move for minutes): no verdict."""
    watch = LagWatch(W, self_id="me")
    verdicts = run(watch, [(t, vv(a=5), {"a": vv(a=6)}, 0) for t in range(0, 300, 3)])
    assert verdicts == [None] * len(verdicts)


def test_buffer_full_and_a_frozen_entry_is_stuck_after_one_window() -> None:
    watch = LagWatch(W, self_id="me")
    steps = [(float(t), vv(a=3, b=t), {"a": vv(a=3 + 5 + t // 5, b=t)}, t) for t in range(0, 40)]
    verdicts = run(watch, steps)
    assert all(v is None for v in verdicts[:30])
    stuck = verdicts[30]
    assert isinstance(stuck, Stuck) and stuck.why == "buffer full" and stuck.senders == ("a",)
    assert stuck.donors == ("a",) and stuck.behind == 5 + 30 // 5 and stuck.stalled_s == 30


def test_a_gap_wider_than_max_hole_span_is_stuck_after_one_window() -> None:
    watch = LagWatch(W, self_id="me", max_hole_span=16)
    steps = [(float(t), vv(a=1), {"p": vv(a=40), "q": vv(a=20)}, 0) for t in range(0, 31, 5)]
    stuck = run(watch, steps)[-1]
    assert stuck is not None and stuck.why == "gap beyond max_hole_span" and stuck.behind == 39
    assert stuck.donors == ("p", "q")  # who holds most of what we lack first


def test_no_progress_without_proof_needs_two_windows() -> None:
    watch = LagWatch(W, self_id="me")
    steps = [(float(t), vv(a=4), {"p": vv(a=7)}, 0) for t in range(0, 61, 5)]
    verdicts = run(watch, steps)
    assert all(v is None for v in verdicts[:-1])
    assert verdicts[-1].why == "no progress" and verdicts[-1].stalled_s == 60


def test_a_moving_entry_restarts_the_timer() -> None:
    """Catching up by pulls (the lag shrinks, our entry moves) never triggers, however long it takes."""
    watch = LagWatch(W, self_id="me")
    for t in range(0, 600, 5):
        assert watch.observe(float(t), vv(a=t // 20), {"p": vv(a=100)}, buffer_full=t) is None


def test_own_and_banned_senders_and_vanished_peers_do_not_count() -> None:
    watch = LagWatch(W, self_id="me", max_hole_span=2)
    for t in range(0, 100, 5):
        # our own sender (a restarted peer may claim more of us) and a banned sender are never waited on
        assert watch.observe(float(t), vv(me=1, x=1), {"p": vv(me=50, x=50)}, buffer_full=t, banned={"x"}) is None
    watch.observe(100.0, vv(a=1), {"p": vv(a=50)})
    assert "a" in watch.behind_senders()
    watch.observe(105.0, vv(a=1), {})  # the only peer that held more is gone
    assert watch.behind_senders() == {}


def test_reset_needs_a_whole_window_again() -> None:
    watch = LagWatch(W, self_id="me")
    ahead = {"p": vv(a=50)}
    assert watch.observe(0.0, vv(a=1), ahead) is None
    assert watch.observe(31.0, vv(a=1), ahead) is not None
    watch.reset()
    assert watch.observe(32.0, vv(a=1), ahead) is None
    assert watch.observe(50.0, vv(a=1), ahead) is None


def test_order_donors_prefers_proven_then_public_and_drops_penalized() -> None:
    records = {"a": {}, "b": {"reach": "public"}, "c": {"reach": "nat"}, "d": {"reach": "public"}, "e": {}}
    ranked = order_donors(("a", "b", "c", "d", "e"), records, proven={"c", "e"}, penalized={"d"})
    assert ranked == ["c", "e", "b", "a"]


def test_window_for() -> None:
    assert window_for(1.0) == 30.0 and window_for(10.0) == 60.0
    with pytest.raises(ValueError):
        LagWatch(0.0)


# ---- the load: own seqs kept, held updates merged again, bad snapshots refused ---------------------------------

DIM = 8


def make(sender: str, seq: int) -> FakeUpdate:
    payload = tuple(torch.randn(DIM, generator=torch.Generator().manual_seed(hash((sender, seq)) % 1000)).tolist())
    return FakeUpdate(sender, seq, hashlib.sha256(f"{sender}/{seq}".encode()).digest(), 1.0, payload, nbytes=4 * DIM)


class Codec:
    name = "fake"

    def decompress(self, data: tuple[float, ...], numel: int) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.float32)

    def decompress_range(self, data: tuple[float, ...], numel: int, part: slice) -> torch.Tensor:
        return self.decompress(data, numel)[part]


def replica(*updates: FakeUpdate) -> Replica:
    r = Replica(torch.zeros(DIM), outer_lr=0.5, max_weight=1.0, codec=Codec())
    for u in updates:
        assert r.offer(u)[0] is MergeOutcome.MERGED, u
    return r


class FakeLearner:
    def __init__(self, rep: Replica, last_seq: int) -> None:
        self.replica, self.peer_id, self.last_seq, self.numel = rep, "me", last_seq, DIM

    def adopt_own_updates(self, updates: list) -> int:
        for u in sorted(updates, key=lambda u: u.seq):
            assert self.replica.offer(u)[0] in (MergeOutcome.MERGED, MergeOutcome.DUPLICATE)
        return 0


class FakeGossip:
    def __init__(self, store: UpdateStore) -> None:
        self.store = store


class FakeNetwork:
    def __init__(self, store: UpdateStore) -> None:
        self.gossip, self.peers, self.repairs = FakeGossip(store), {}, []


def test_load_keeps_our_own_seqs_and_merges_held_updates_again() -> None:
    """We are stuck on sender a (we lack a#1..); the donor holds a#1..3 and our me#1 only. Our me#2 (in the journal
    only) and me#3, b#1 (in our store) come back on top of its state: the result equals the replica that merged
    the union, and no own seq is lost or signed again."""
    ours = [make("me", 1), make("me", 2), make("me", 3), make("b", 1)]
    donor_updates = [make("a", 1), make("a", 2), make("a", 3), make("me", 1)]
    local = replica(*ours)
    donor = replica(*donor_updates)
    store = UpdateStore(1 << 20)
    for u in (ours[0], ours[2], ours[3]):  # me#2 was evicted from the store: the journal has it
        store.add(u)
    learner = FakeLearner(local, last_seq=3)
    resync = Resync(FakeNetwork(store), learner, window_s=W, journal=lambda: iter(ours[:3]), out=lambda _: None)
    stuck = Stuck(behind=3, senders=("a",), donors=("d",), stalled_s=40.0, why="buffer full")
    summary = resync._load(donor.theta.clone(), donor.version_vector, "d", stuck)
    union = replica(*donor_updates, *ours[1:])
    assert local.version_vector == union.version_vector == vv(a=3, me=3, b=1)
    assert torch.allclose(local.theta, union.theta, atol=1e-6)
    assert summary["lost_own"] == 0 and summary["remerged"] == 3 and summary["vv_total"] == 7


def test_check_refuses_a_snapshot_that_does_not_help_or_holds_a_banned_sender() -> None:
    local = replica(make("b", 1))
    stuck = Stuck(behind=3, senders=("a",), donors=("d",), stalled_s=40.0, why="buffer full")
    same = replica(make("b", 1), make("c", 1))
    with pytest.raises(ResyncRefused, match="no more of the senders"):
        check(local.version_vector, same.version_vector, same.theta, local, stuck)
    local.ban("c", "test")
    helps = replica(make("a", 1), make("c", 1))
    with pytest.raises(ResyncRefused, match="banned"):
        check(local.version_vector, helps.version_vector, helps.theta, local, stuck)
    check(local.version_vector, replica(make("a", 1)).version_vector, replica(make("a", 1)).theta, local, stuck)


def test_seqs_the_others_skipped_are_not_counted_as_held() -> None:
    """Others skipped a#2..a#30 as holes (nobody served them) and hold a#31 only: that is one update ahead, not 30."""
    watch = LagWatch(W, self_id="me")
    theirs = VersionVector({"a": 31}, holes={"a": list(range(2, 31))})
    assert all(watch.observe(float(t), vv(a=1), {"p": theirs}) is None for t in range(0, 120, 5))
