"""The round view (sync/round_view.py): which slots it leaves out, and that it is exactly the theta of a replica
that merged only the rest, whatever the order the updates arrived in."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.sync.round_view import SLACK, round_cut, round_view
from p2p_diloco.sync.version_vector import VersionVector
from tests.helpers.fakes import FakeUpdate
from tests.sync.test_replica import SENDERS, make, reference, replica


def test_a_complete_round_leaves_nothing_out() -> None:
    assert round_cut(VersionVector({"a": 10, "b": 10, "c": 10})) == []
    assert round_cut(VersionVector()) == []


def test_the_front_is_cut_back_to_its_fewest() -> None:
    cut = round_cut(VersionVector({"a": 9, "b": 10, "c": 10, "d": 11}))
    assert sorted(cut) == [("b", 10, 1.0), ("c", 10, 1.0), ("d", 10, 1.0), ("d", 11, 1.0)]


def test_averaging_rounds_takes_back_a_share_of_each_averaged_round() -> None:
    # the mean of the states at rounds 9, 8, 7: seq 9 is in one of the three, seq 8 in two
    cut = round_cut(VersionVector({"a": 9, "b": 10}), rounds=3)
    assert sorted(cut) == [("a", 8, 1 / 3), ("a", 9, 2 / 3), ("b", 8, 1 / 3), ("b", 9, 2 / 3), ("b", 10, 1.0)]
    with pytest.raises(ValueError, match="rounds"):
        round_cut(VersionVector({"a": 1}), rounds=0)


def test_a_unit_far_behind_is_kept_whole_and_not_waited_for() -> None:
    # a 4x slower unit, or one that joined late: beyond SLACK behind the front
    assert round_cut(VersionVector({"a": 40, "b": 41, "slow": 10})) == [("b", 41, 1.0)]
    assert round_cut(VersionVector({"a": 40, "b": 41, "slow": 10}), slack=0) == []
    with pytest.raises(ValueError, match="slack"):
        round_cut(VersionVector({"a": 1}), slack=-1)


def test_a_hole_in_the_cut_is_not_taken_back() -> None:
    vv = VersionVector({"a": 5, "b": 7}, holes={"b": [6]})
    assert round_cut(vv) == [("b", 7, 1.0)]


def by_slot(updates: list[FakeUpdate]):
    held = {(u.sender, u.seq): u for u in updates}
    return lambda sender, seq: held.get((sender, seq))


@st.composite
def rounds_under_way(draw: st.DrawFn) -> list[FakeUpdate]:
    """Senders whose counts differ by up to 3: some are in the round's front, some beyond its slack."""
    counts = draw(st.dictionaries(st.sampled_from(SENDERS), st.integers(1, 5), min_size=1))
    return [make(sender, seq, draw(st.floats(0.0, 2.0, allow_nan=False)), draw(st.integers(0, 2**31)))
            for sender, n in counts.items() for seq in range(1, n + 1)]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_view_is_the_replica_that_merged_only_the_rest_in_any_order(data: st.DataObject) -> None:
    updates = data.draw(rounds_under_way())
    views = []
    for _ in range(2):
        r = replica()
        for u in data.draw(st.permutations(updates)):
            r.offer(u)
        theta_before = r.snapshot()[0]
        view = round_view(r, by_slot(updates))
        assert view is not None
        assert torch.equal(r.snapshot()[0], theta_before)  # a view: theta is unchanged
        views.append(view)
    (t1, v1), (t2, v2) = views
    left_out = {(s, q) for s, q, _ in round_cut(replica_of(updates).version_vector)}
    kept = [u for u in updates if (u.sender, u.seq) not in left_out]
    assert v1 == v2 == replica_of(kept).version_vector
    assert torch.allclose(t1, t2, rtol=1e-5, atol=1e-5)
    assert torch.allclose(t1, reference(kept), rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.data(), st.integers(1, 4))
def test_the_averaged_view_is_the_mean_of_the_complete_rounds(data: st.DataObject, rounds: int) -> None:
    """rounds=R: the mean of the thetas of replicas holding each front unit's first k, k-1, ..., k-R+1 updates."""
    updates = data.draw(rounds_under_way())
    r = replica()
    for u in data.draw(st.permutations(updates)):
        r.offer(u)
    view = round_view(r, by_slot(updates), rounds=rounds)
    assert view is not None
    vv = r.version_vector
    top = max(vv.values())
    front = {s for s in vv if vv[s] >= top - SLACK}
    k = min(vv[s] for s in front)
    states = [reference([u for u in updates if u.sender not in front or u.seq <= j]) for j in range(k, k - rounds, -1)]
    assert torch.allclose(view[0], torch.stack(states).mean(0), rtol=1e-5, atol=1e-5)


def replica_of(updates: list[FakeUpdate]):
    r = replica()
    for u in sorted(updates, key=lambda u: (u.sender, u.seq)):
        r.offer(u)
    return r


def test_no_view_without_the_updates_it_leaves_out() -> None:
    updates = [make("a", 1, seed=1), make("a", 2, seed=2), make("b", 1, seed=3)]
    r = replica_of(updates)
    assert round_view(r, lambda sender, seq: None) is None
    theta, vv = r.snapshot()
    view = round_view(r, by_slot(updates))
    assert view is not None and view[1] == VersionVector({"a": 1, "b": 1})
    assert not torch.equal(view[0], theta)
