"""Replica: merges commute, each update merges once, gaps wait, equivocators and poisoners are shut out."""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable, Iterable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.types import MergeOutcome
from p2p_diloco.sync.version_vector import VersionVector
from tests.helpers.fakes import FakeUpdate

DIM = 16
OUTER_LR = 0.7
MAX_WEIGHT = 2.0
SENDERS = ["a", "b", "c", "d"]


def make(sender: str, seq: int, weight: float = 1.0, seed: int = 0, variant: int = 0,
         payload: Iterable[float] | None = None) -> FakeUpdate:
    """A fake update; `variant` gives another message for the same (sender, seq): an equivocation."""
    if payload is None:
        payload = torch.randn(DIM, generator=torch.Generator().manual_seed(seed)).tolist()
    uid = hashlib.sha256(f"{sender}/{seq}/{variant}".encode()).digest()
    return FakeUpdate(sender, seq, uid, weight, tuple(payload), nbytes=4 * DIM)


class FnCodec:
    """A codec for the fake updates: `decompress` is `fn(payload)` (the replica passes the payload alone)."""

    def __init__(self, fn: Callable[[tuple[float, ...]], object]) -> None:
        self.fn = fn

    name = "fn"

    def decompress(self, data: tuple[float, ...], numel: int) -> object:
        return self.fn(data)

    def decompress_range(self, data: tuple[float, ...], numel: int, part: slice) -> object:
        """What a real codec's range decode is: the part of a fitting output (else the output, to be refused)."""
        out = self.fn(data)
        return out[part] if isinstance(out, torch.Tensor) and out.shape == (numel,) else out


def decode(payload: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(payload, dtype=torch.float32)


def theta0() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, DIM)


def replica(**kwargs: object) -> Replica:
    args: dict = dict(outer_lr=OUTER_LR, max_weight=MAX_WEIGHT, codec=FnCodec(decode))
    args.update(kwargs)
    return Replica(theta0(), **args)


def reference(updates: Iterable[FakeUpdate]) -> torch.Tensor:
    """The merge rule in float64, in a fixed order: what every replica must approximate."""
    theta = theta0().double()
    for u in sorted(updates, key=lambda u: (u.sender, u.seq)):
        theta -= OUTER_LR * min(max(u.weight, 0.0), MAX_WEIGHT) * torch.tensor(u.payload, dtype=torch.float64)
    return theta.float()


@st.composite
def update_sets(draw: st.DrawFn) -> list[FakeUpdate]:
    counts = draw(st.dictionaries(st.sampled_from(SENDERS), st.integers(1, 4), min_size=1))
    return [make(sender, seq, draw(st.floats(-0.5, 3.0, allow_nan=False)), draw(st.integers(0, 2**31)))
            for sender, n in counts.items() for seq in range(1, n + 1)]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_merge_order_does_not_matter(data: st.DataObject) -> None:
    updates = data.draw(update_sets())
    results = []
    for _ in range(2):
        r = replica()
        for u in data.draw(st.permutations(updates)):
            r.offer(u)
        results.append(r.snapshot())
    (t1, v1), (t2, v2) = results
    expected_vv = VersionVector({s: max(u.seq for u in updates if u.sender == s) for s in {u.sender for u in updates}})
    assert v1 == v2 == expected_vv
    assert torch.allclose(t1, t2, rtol=1e-6, atol=1e-6)
    assert torch.allclose(t1, reference(updates), rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_offers_only_grow_the_vector_and_merge_each_update_once(data: st.DataObject) -> None:
    pool = data.draw(update_sets())
    offers = data.draw(st.lists(st.sampled_from(pool), max_size=3 * len(pool)))  # repeats, gaps, any order
    r = replica()
    merged_all: list[FakeUpdate] = []
    for u in offers:
        before = r.version_vector
        outcome, merged = r.offer(u)
        after = r.version_vector
        assert after.dominates(before)
        assert after.staleness(before) == len(merged) == after.total() - before.total()
        assert (outcome is MergeOutcome.MERGED) == bool(merged)
        if merged:
            assert merged[0] is u
            assert [m.seq for m in merged] == list(range(u.seq, u.seq + len(merged)))
        merged_all.extend(merged)
    assert len(merged_all) == len(set(merged_all))  # no update merged twice
    assert r.stats["merged"] == len(merged_all)
    assert r.n_buffered == len({(u.sender, u.seq) for u in offers}) - len(merged_all)
    assert torch.allclose(r.theta, reference(merged_all), rtol=1e-5, atol=1e-5)


def test_duplicate_is_ignored() -> None:
    r = replica()
    u = make("a", 1, seed=1)
    assert r.offer(u) == (MergeOutcome.MERGED, [u])
    theta, vv = r.snapshot()
    assert r.offer(u) == (MergeOutcome.DUPLICATE, [])
    assert torch.equal(r.theta, theta) and r.version_vector == vv
    assert r.stats["duplicate"] == 1 and r.stats["merged"] == 1


def test_gap_is_buffered_then_released_in_order() -> None:
    r = replica()
    u1, u2, u3, u5 = (make("a", s, seed=s) for s in (1, 2, 3, 5))
    start = r.theta.clone()
    assert r.offer(u3) == (MergeOutcome.BUFFERED, [])
    assert r.offer(u2) == (MergeOutcome.BUFFERED, [])
    assert r.offer(u5) == (MergeOutcome.BUFFERED, [])
    assert r.offer(u3) == (MergeOutcome.DUPLICATE, [])  # same message while buffered
    assert torch.equal(r.theta, start) and r.version_vector.get("a") == 0 and r.n_buffered == 3
    assert r.offer(u1) == (MergeOutcome.MERGED, [u1, u2, u3])
    assert r.version_vector.get("a") == 3 and r.n_buffered == 1  # 5 still waits for 4
    assert torch.allclose(r.theta, reference([u1, u2, u3]), atol=1e-6)


def test_buffer_bound_is_enforced_across_senders() -> None:
    r = replica(max_buffered=2, max_sender_share=1.0)  # the total bound only; per sender: see below
    assert r.offer(make("a", 3))[0] is MergeOutcome.BUFFERED
    assert r.offer(make("b", 2))[0] is MergeOutcome.BUFFERED
    assert r.offer(make("a", 4))[0] is MergeOutcome.REJECTED_BUFFER_FULL
    assert r.offer(make("c", 9))[0] is MergeOutcome.REJECTED_BUFFER_FULL
    assert r.n_buffered == 2 and r.stats["rejected_buffer_full"] == 2
    # a ready update never needs the buffer
    assert r.offer(make("c", 1))[0] is MergeOutcome.MERGED
    # releasing frees room
    assert r.offer(make("b", 1))[1] == [make("b", 1), make("b", 2)]
    assert r.n_buffered == 1
    assert r.offer(make("a", 4))[0] is MergeOutcome.BUFFERED


def test_equivocation_against_merged_update() -> None:
    r = replica()
    good, evil = make("a", 1, seed=1), make("a", 1, seed=2, variant=1)
    r.offer(good)
    r.offer(make("a", 3))  # buffered, dropped by the ban
    theta, vv = r.snapshot()
    assert r.offer(evil) == (MergeOutcome.EQUIVOCATION, [])
    assert r.bans.evidence["a"] == (good.update_id, evil.update_id)
    assert "a" in r.banned and r.n_buffered == 0
    assert r.offer(make("a", 2)) == (MergeOutcome.REJECTED_BANNED, [])
    assert torch.equal(r.theta, theta) and r.version_vector == vv
    assert r.offer(make("b", 1))[0] is MergeOutcome.MERGED  # others unaffected


def test_equivocation_against_buffered_update() -> None:
    r = replica()
    first, second = make("a", 3, seed=1), make("a", 3, seed=2, variant=1)
    assert r.offer(first)[0] is MergeOutcome.BUFFERED
    assert r.offer(second)[0] is MergeOutcome.EQUIVOCATION
    assert r.bans.evidence["a"] == (first.update_id, second.update_id)
    assert r.n_buffered == 0
    assert r.offer(make("a", 1))[0] is MergeOutcome.REJECTED_BANNED
    assert r.version_vector.get("a") == 0 and torch.equal(r.theta, theta0())


def test_equivocation_memory_is_bounded_per_sender() -> None:
    r = replica(max_ids_per_sender=2)
    for seq in range(1, 5):
        r.offer(make("a", seq))
    assert r.offer(make("a", 2, variant=1))[0] is MergeOutcome.DUPLICATE  # id forgotten: cannot prove
    assert r.offer(make("a", 3, variant=1))[0] is MergeOutcome.EQUIVOCATION


@pytest.mark.parametrize("poison", [
    [float("nan")] + [0.0] * (DIM - 1),
    [float("inf")] * DIM,
    [3e38] * DIM,  # finite, but lr * w * delta overflows float32
])
@pytest.mark.parametrize("weight", [1.0, 0.0])
def test_nonfinite_delta_is_refused_and_blocks_the_sender(poison: list[float], weight: float) -> None:
    r = replica(outer_lr=10.0)
    r.offer(make("b", 1))
    theta, vv = r.snapshot()
    r.offer(make("a", 2))  # buffered behind the poison
    bad = make("a", 1, weight=weight, payload=poison)
    if weight == 0.0 and poison[0] == 3e38:
        # 0 * finite is a harmless zero update
        assert r.offer(bad)[0] is MergeOutcome.MERGED
        return
    assert r.offer(bad) == (MergeOutcome.REJECTED_NONFINITE, [])
    assert torch.equal(r.theta, theta) and r.version_vector == vv
    assert r.stats["rejected_nonfinite"] == 1 and "a" in r.banned and "a" not in r.bans.evidence
    assert r.n_buffered == 0
    assert r.offer(make("a", 2))[0] is MergeOutcome.REJECTED_BANNED


def test_nonfinite_weight_is_refused() -> None:
    r = replica()
    assert r.offer(make("a", 1, weight=float("nan")))[0] is MergeOutcome.REJECTED_NONFINITE
    assert r.offer(make("b", 1, weight=10**400))[0] is MergeOutcome.REJECTED_NONFINITE  # type: ignore[arg-type]
    assert torch.equal(r.theta, theta0()) and r.version_vector.total() == 0


def test_merge_that_would_overflow_theta_is_refused() -> None:
    r = Replica(torch.full((DIM,), 3e38), outer_lr=1.0, max_weight=1.0, codec=FnCodec(decode))
    assert r.offer(make("a", 1, payload=[-3e38] * DIM))[0] is MergeOutcome.REJECTED_NONFINITE
    assert torch.equal(r.theta, torch.full((DIM,), 3e38)) and r.version_vector.total() == 0
    assert r.offer(make("b", 1, payload=[3e38] * DIM))[0] is MergeOutcome.MERGED  # back towards 0 is fine
    assert torch.isfinite(r.theta).all()


def test_poisoned_update_is_refused_before_it_is_buffered() -> None:
    # Whatever a replica keeps (and its peer serves to others) passed every check of the update alone.
    r = replica()
    bad2 = make("a", 2, payload=[float("nan")] * DIM)
    assert r.offer(bad2) == (MergeOutcome.REJECTED_NONFINITE, [])
    assert "a" in r.banned and r.n_buffered == 0
    assert r.offer(make("a", 1))[0] is MergeOutcome.REJECTED_BANNED


def test_successor_failing_at_merge_stops_the_release_chain() -> None:
    # Finite on its own, overflowing on this theta: found only at merge time.
    r = Replica(torch.full((DIM,), 3e38), outer_lr=1.0, max_weight=1.0, codec=FnCodec(decode))
    u1, u3 = make("a", 1, payload=[1.0] * DIM), make("a", 3, payload=[1.0] * DIM)
    assert r.offer(make("a", 2, payload=[-3e38] * DIM))[0] is MergeOutcome.BUFFERED
    r.offer(u3)
    assert r.offer(u1) == (MergeOutcome.MERGED, [u1])
    assert r.version_vector.get("a") == 1 and "a" in r.banned and r.n_buffered == 0
    assert r.stats["rejected_nonfinite"] == 1


def test_weight_is_clamped() -> None:
    r1, r2, r3 = replica(), replica(), replica()
    r1.offer(make("a", 1, weight=50.0, seed=4))
    r2.offer(make("a", 1, weight=MAX_WEIGHT, seed=4))
    assert torch.equal(r1.theta, r2.theta) and not torch.equal(r1.theta, theta0())
    assert r3.offer(make("a", 1, weight=-3.0, seed=4))[0] is MergeOutcome.MERGED  # counted, moves nothing
    assert torch.equal(r3.theta, theta0()) and r3.version_vector.get("a") == 1


def raises(_: tuple[float, ...]) -> torch.Tensor:
    raise ValueError("corrupt payload")


@pytest.mark.parametrize("bad_decode", [raises, lambda u: torch.zeros(DIM + 1), lambda u: "not a tensor"])
def test_undecodable_update_is_refused(bad_decode) -> None:  # noqa: ANN001
    r = Replica(theta0(), outer_lr=OUTER_LR, max_weight=MAX_WEIGHT, codec=FnCodec(bad_decode))
    assert r.offer(make("a", 1)) == (MergeOutcome.REJECTED_INVALID, [])
    assert torch.equal(r.theta, theta0()) and "a" in r.banned


@pytest.mark.parametrize("bad", [
    FakeUpdate("a", 0, b"x", 1.0, ()),
    FakeUpdate("a", True, b"x", 1.0, ()),  # type: ignore[arg-type]
    FakeUpdate("", 1, b"x", 1.0, ()),
    FakeUpdate("a", 1, "x", 1.0, ()),  # type: ignore[arg-type]
    FakeUpdate("a", 1, b"x", "1", ()),  # type: ignore[arg-type]
    object(),
])
def test_malformed_header_is_refused_without_banning(bad: object) -> None:
    r = replica()
    assert r.offer(bad) == (MergeOutcome.REJECTED_INVALID, [])  # type: ignore[arg-type]
    assert not r.banned and r.stats["rejected_invalid"] == 1


def test_snapshot_is_a_copy() -> None:
    r = replica()
    r.offer(make("a", 1))
    theta, vv = r.snapshot()
    theta += 100.0
    assert torch.allclose(r.theta, reference([make("a", 1)]), atol=1e-6) and vv == r.version_vector


def test_load_replaces_state_and_releases_ready_buffered_updates() -> None:
    donor = replica()
    ups = {s: make("a", s, seed=s) for s in range(1, 5)}
    for s in (1, 2):
        donor.offer(ups[s])
    r = replica()
    live = r.theta
    r.offer(ups[2])  # buffered; the donor state already includes it
    r.offer(ups[3])  # buffered; ready once the state says a=2
    r.offer(make("b", 3))  # still waiting after the load
    merged = r.load(*donor.snapshot())
    assert merged == [ups[3]]
    assert r.theta is live  # loaded in place
    assert r.version_vector == VersionVector({"a": 3}) and r.n_buffered == 1
    assert torch.allclose(r.theta, reference([ups[1], ups[2], ups[3]]), atol=1e-6)
    with pytest.raises(ValueError):
        r.load(torch.zeros(DIM + 1), VersionVector())
    with pytest.raises(ValueError):
        r.load(torch.full((DIM,), float("nan")), VersionVector())


def slow_decode(payload: tuple[float, ...]) -> torch.Tensor:
    time.sleep(0.0002)  # widen the window between decode and merge so threads interleave
    return decode(payload)


def test_concurrent_offers_on_disjoint_senders_equal_sequential_merge() -> None:
    updates = [make(s, q, weight=0.5 + q / 4, seed=100 * i + q) for i, s in enumerate(SENDERS) for q in range(1, 31)]
    sequential = replica()
    for u in updates:
        sequential.offer(u)
    r = replica(codec=FnCodec(slow_decode))
    halves = [[u for u in updates if u.sender in ("a", "b")], [u for u in updates if u.sender in ("c", "d")]]
    snapshots: list[tuple[torch.Tensor, VersionVector]] = []
    done = threading.Event()
    start = threading.Barrier(3)

    def offer_all(batch: list[FakeUpdate], seed: int) -> None:
        random.Random(seed).shuffle(batch)
        start.wait()
        for u in batch:
            r.offer(u)

    def watch() -> None:
        start.wait()
        while not done.is_set():
            snapshots.append(r.snapshot())
            time.sleep(0.001)

    threads = [threading.Thread(target=offer_all, args=(h, i)) for i, h in enumerate(halves)]
    watcher = threading.Thread(target=watch)
    for t in [*threads, watcher]:
        t.start()
    for t in threads:
        t.join(timeout=10)
    done.set()
    watcher.join(timeout=10)
    assert r.version_vector == sequential.version_vector == VersionVector({s: 30 for s in SENDERS})
    assert torch.allclose(r.theta, sequential.theta, rtol=1e-5, atol=1e-5)
    # every snapshot is consistent: its theta is exactly the sum of the updates its vector names
    for theta, vv in snapshots[:: max(1, len(snapshots) // 10)]:
        named = [u for u in updates if u.seq <= vv.get(u.sender)]
        assert torch.allclose(theta, reference(named), rtol=1e-5, atol=1e-5)


def test_concurrent_offers_of_the_same_updates_merge_each_once() -> None:
    updates = [make(s, q, seed=10 * q + i) for i, s in enumerate(SENDERS[:2]) for q in range(1, 21)]
    r = replica(codec=FnCodec(slow_decode))
    merged: list[list[FakeUpdate]] = [[], []]
    start = threading.Barrier(2)

    def offer_all(k: int) -> None:
        batch = list(updates)
        random.Random(k).shuffle(batch)
        start.wait()
        for u in batch:
            merged[k].extend(r.offer(u)[1])

    threads = [threading.Thread(target=offer_all, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(merged[0] + merged[1], key=lambda u: (u.sender, u.seq)) == updates  # each exactly once
    assert r.stats["merged"] == len(updates)
    assert torch.allclose(r.theta, reference(updates), rtol=1e-5, atol=1e-5)


# --- bounded buffer, per sender -------------------------------------------------------------------------------

def test_buffer_is_bounded_per_sender_by_count_and_bytes() -> None:
    r = replica(max_buffered=8, max_buffered_bytes=10 * 4 * DIM, max_sender_share=0.25)  # 2 updates per sender
    assert [r.offer(make("a", q))[0] for q in (3, 4, 5)] == [MergeOutcome.BUFFERED] * 2 + \
        [MergeOutcome.REJECTED_BUFFER_FULL]
    assert r.offer(make("b", 3))[0] is MergeOutcome.BUFFERED  # another sender still has room
    assert r.n_buffered == 3 and r.buffered_bytes == 3 * 4 * DIM
    big = FakeUpdate("c", 3, b"big", 1.0, tuple([0.0] * DIM), nbytes=3 * 4 * DIM)  # over c's byte share
    assert r.offer(big)[0] is MergeOutcome.REJECTED_BUFFER_FULL
    assert r.offer(make("a", 1))[1] == [make("a", 1)]  # 2 waits for its own gap; 3, 4 wait behind it
    assert r.n_buffered == 3


def test_buffer_is_bounded_in_total_bytes() -> None:
    r = replica(max_buffered=100, max_buffered_bytes=3 * 4 * DIM, max_sender_share=1.0)
    outcomes = [r.offer(make(s, 2))[0] for s in SENDERS]
    assert outcomes.count(MergeOutcome.BUFFERED) == 3 and r.buffered_bytes <= 3 * 4 * DIM


# --- gaps that can never fill: skip, late merge, repair (the lost-update trap) ----------------------------------

def gapped(**kwargs: object) -> Replica:
    r = replica(**kwargs)
    r.bind_rules(r.policy, gap_timeout_s=10.0, max_hole_span=3)
    return r


def test_a_gap_is_skipped_after_the_timeout_and_filled_late() -> None:
    r = gapped()
    ups = {q: make("a", q, seed=q) for q in range(1, 6)}
    r.offer(ups[1], now_s=0.0)
    assert r.offer(ups[3], now_s=1.0)[0] is MergeOutcome.BUFFERED
    r.offer(ups[4], now_s=2.0)
    assert r.expire_gaps(10.5) == ([], 0)  # the gap is dated from its first buffered update: 9.5 s old
    merged, skipped = r.expire_gaps(11.0)
    assert merged == [ups[3], ups[4]] and skipped == 1
    assert r.version_vector.get("a") == 4 and r.version_vector.holes("a") == {2}
    assert r.offer(ups[5])[1] == [ups[5]]
    assert r.offer(ups[2]) == (MergeOutcome.MERGED, [ups[2]])  # late, exactly once
    assert r.offer(ups[2])[0] is MergeOutcome.DUPLICATE
    assert r.offer(make("a", 2, variant=1))[0] is MergeOutcome.EQUIVOCATION  # its id is known now
    assert r.version_vector == VersionVector({"a": 5}) and r.stats["late_merged"] == 1
    assert torch.allclose(r.theta, reference(ups.values()), atol=1e-6)


def test_a_gap_wider_than_max_hole_span_waits() -> None:
    r = gapped()
    r.offer(make("a", 6), now_s=0.0)  # 1..5 missing: 5 > max_hole_span = 3
    assert r.expire_gaps(100.0) == ([], 0) and r.n_buffered == 1 and r.version_vector.get("a") == 0


def test_each_new_gap_waits_its_own_timeout() -> None:
    r = gapped()
    r.offer(make("a", 2), now_s=0.0)
    r.offer(make("a", 4), now_s=0.0)
    assert r.expire_gaps(20.0)[1] == 1 and r.version_vector.get("a") == 2  # 1 skipped; 3 now missing
    assert r.expire_gaps(25.0)[1] == 0
    assert r.expire_gaps(30.0)[1] == 1 and r.version_vector.holes("a") == {1, 3}


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_replicas_that_skipped_converge_with_those_that_did_not(data: st.DataObject) -> None:
    """A replica that lost some updates skips them; once they turn up (anti-entropy) it equals one that never
    lost any. Two replicas that lost the same updates for good are equal to each other."""
    updates = [u for u in data.draw(update_sets())]
    lost = set(data.draw(st.sets(st.sampled_from([(u.sender, u.seq) for u in updates]))))
    full = replica()
    for u in data.draw(st.permutations(updates)):
        full.offer(u)
    partial = [gapped(), gapped()]
    for r in partial:
        for u in data.draw(st.permutations(updates)):
            if (u.sender, u.seq) not in lost:
                r.offer(u, now_s=0.0)
        for k in range(1, 4):  # a sender of <= 4 seqs has at most 2 gaps; each waits its own timeout
            r.expire_gaps(1000.0 * k)
    kept = [u for u in updates if (u.sender, u.seq) not in lost]
    (ta, va), (tb, vb) = (r.snapshot() for r in partial)
    # without the lost ones: every kept update merged (gaps of <= 3 seqs are skipped), equal to each other
    assert all(va.has(u.sender, u.seq) for u in kept) and va.total() == len(kept)
    assert va == vb and torch.allclose(ta, tb, atol=1e-5)
    assert torch.allclose(ta, reference(kept), atol=1e-5)
    # the lost ones turn up late, in any order: equal to the replica that never lost any
    for u in data.draw(st.permutations(updates)):
        partial[0].offer(u)
    assert partial[0].version_vector == full.version_vector
    assert torch.allclose(partial[0].theta, full.theta, atol=1e-5)


def test_a_replica_that_merged_what_others_skipped_adopts_their_state() -> None:
    """Seq 2 reached only `lucky`, whose store lost it; `others` skipped it. Pulls can never make them equal."""
    from p2p_diloco.sync.store import UpdateStore

    ups = {q: make("a", q, seed=q) for q in range(1, 5)}
    lucky, other = gapped(), gapped()
    lucky_store = UpdateStore(10**6)
    for q in (1, 2, 3, 4):
        lucky.offer(ups[q])
        if q != 2:
            lucky_store.add(ups[q])
    lucky.offer(make("b", 1, seed=9))  # something only lucky has, still held: survives the repair
    lucky_store.add(make("b", 1, seed=9))
    for q in (1, 3, 4):
        other.offer(ups[q], now_s=0.0)
    other.expire_gaps(100.0)
    assert other.version_vector.holes("a") == {2}
    assert lucky_store.unservable_for(lucky.version_vector, other.version_vector) == [("a", 2)]
    assert lucky_store.unservable_for(other.version_vector, lucky.version_vector) == []
    theta, vv = other.snapshot()
    merged = lucky.adopt(theta, vv, lucky_store.missing_for(vv, limit=100))
    assert merged == [make("b", 1, seed=9)]
    other.offer(make("b", 1, seed=9))
    assert lucky.version_vector == other.version_vector
    assert torch.allclose(lucky.theta, other.theta, atol=1e-6)
    assert torch.allclose(lucky.theta, reference([ups[1], ups[3], ups[4], make("b", 1, seed=9)]), atol=1e-6)


# --- bans, the check hook, the merge policy ---------------------------------------------------------------------

def test_public_ban_drops_buffered_and_tells_listeners() -> None:
    r = replica()
    told: list[str] = []
    r.add_ban_listener(told.append)
    r.add_ban_listener(lambda s: 1 / 0)  # a broken listener changes nothing
    r.offer(make("a", 3))
    assert r.ban("a", "evidence from a peer") and told == ["a"] and r.n_buffered == 0
    assert not r.ban("a", "again") and told == ["a"]
    assert r.offer(make("a", 1))[0] is MergeOutcome.REJECTED_BANNED


def test_the_check_hook_runs_after_the_seq_checks_and_bans() -> None:
    r = replica()
    u1 = make("a", 1)
    r.offer(u1)
    bad = lambda u: "bad_layout"  # noqa: E731
    assert r.offer(u1, check=bad)[0] is MergeOutcome.DUPLICATE  # the earlier check wins
    assert r.offer(make("a", 1, variant=1), check=bad)[0] is MergeOutcome.EQUIVOCATION
    assert r.offer(make("b", 5), check=bad)[0] is MergeOutcome.REJECTED_LAYOUT  # before buffering
    assert "b" in r.banned and r.n_buffered == 0
    assert r.offer(make("b", 1), check=bad)[0] is MergeOutcome.REJECTED_BANNED


def test_conflicts_keep_the_buffered_earlier_update() -> None:
    r = replica()
    first, second = make("a", 4, seed=1), make("a", 4, seed=2, variant=1)
    r.offer(first)
    r.offer(second)
    conflict = r.bans.conflicts["a"]
    assert (conflict.seq, conflict.first, conflict.second, conflict.first_id) == (4, first, second, first.update_id)


def test_norm_bound_rejects_and_bans_after_the_finiteness_check() -> None:
    from p2p_diloco.config import DefenceConfig
    from p2p_diloco.sync.robust import MergePolicy

    r = replica()
    r.bind_rules(MergePolicy(DefenceConfig(norm_bound=2.0), coord_bound=1.0), gap_timeout_s=60.0, max_hole_span=4)
    assert r.offer(make("a", 1, payload=[1.9] * DIM))[0] is MergeOutcome.MERGED
    assert r.offer(make("b", 1, payload=[float("nan"), 5.0] + [0.0] * (DIM - 2)))[0] is \
        MergeOutcome.REJECTED_NONFINITE  # fails both: the earlier check names it
    theta, vv = r.snapshot()
    assert r.offer(make("c", 3, payload=[0.0] * (DIM - 1) + [-2.5]))[0] is MergeOutcome.REJECTED_NORM  # buffered? no
    assert r.offer(make("a", 2, payload=[2.5] * DIM))[0] is MergeOutcome.REJECTED_NORM
    assert {"a", "b", "c"} <= r.banned and torch.equal(r.theta, theta) and r.version_vector == vv
    assert r.stats["norm_bound"] == 2


def test_centered_clip_merges_unclipped_updates_exactly() -> None:
    from p2p_diloco.config import DefenceConfig
    from p2p_diloco.sync.robust import MergePolicy

    plain, clipped = replica(), replica()
    clipped.bind_rules(MergePolicy(DefenceConfig(norm_bound=0.0, aggregation="centered_clip", clip_window=4,
                                                 clip_radius=100.0), 1.0), gap_timeout_s=60.0, max_hole_span=4)
    ups = [make(s, q, seed=10 * q + i) for q in range(1, 4) for i, s in enumerate(SENDERS)]
    for u in ups:
        plain.offer(u)
        clipped.offer(u)
    assert torch.equal(plain.theta, clipped.theta)  # a huge radius clips nothing: bit-identical
    outlier = make("a", 4, payload=[1e4] * DIM)
    clipped.offer(outlier)
    plain.offer(outlier)
    assert float(clipped.theta.abs().max()) < float(plain.theta.abs().max()) / 10


def test_a_remote_payload_is_read_from_its_bytes_and_never_kept_decoded() -> None:
    """A remote payload is decoded a chunk at a time on each read (sync/decoded.py): a buffered update keeps no
    decoded delta (it is read again when it merges: once per screening for a one-chunk payload); a sender's own
    update brings its tensor and is not decoded at all."""
    calls: list[tuple[float, ...]] = []
    r = replica(codec=FnCodec(lambda p: (calls.append(p), decode(p))[1]))
    later, first = make("a", 2), make("a", 1)
    assert r.offer(later)[0] is MergeOutcome.BUFFERED
    assert r._slots.buffer.decoded_bytes == 0 and len(calls) == 1
    assert r.offer(first)[0] is MergeOutcome.MERGED
    assert len(calls) == 3 and r.version_vector.get("a") == 2
    own = make("b", 1)
    assert r.offer(own, decoded=decode(own.payload))[0] is MergeOutcome.MERGED and len(calls) == 3
    assert torch.allclose(r.theta, reference([later, first, own]))


def test_a_banning_call_returns_only_after_its_ban_listeners_ran() -> None:
    """Thread B is running the listener of its own ban when thread A bans another sender: A's call must not
    return while B's loop still runs A's listener (A's caller would find no proof kept, no take-back done)."""
    import logging
    import threading

    r = Replica(theta0(), outer_lr=OUTER_LR, max_weight=MAX_WEIGHT, codec=FnCodec(lambda u: torch.zeros(DIM)))
    a_queued, a_returned = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def listener(sender: str) -> None:
        if sender == "x":
            a_queued.wait(5)  # B is busy with x while A bans y
        if sender == "y":
            seen["a_returned_before_y_listener_ended"] = a_returned.wait(1)

    class WhenAQueues(logging.Handler):  # the replica logs the ban under its lock: y is queued then
        def emit(self, record: logging.LogRecord) -> None:
            if "sender=y" in record.getMessage() and threading.current_thread().name == "A":
                a_queued.set()
                threading.Event().wait(0.3)  # let B's delivery loop reach y first

    r.add_ban_listener(listener)
    hook = WhenAQueues()
    logging.getLogger("p2p_diloco.sync.slots").addHandler(hook)
    try:
        b = threading.Thread(target=lambda: r.ban("x", "test"), name="B")
        b.start()
        a = threading.Thread(target=lambda: (r.ban("y", "test"), a_returned.set()), name="A")
        a.start()
        a.join(10)
        b.join(10)
    finally:
        logging.getLogger("p2p_diloco.sync.slots").removeHandler(hook)
    assert seen == {"a_returned_before_y_listener_ended": False}
