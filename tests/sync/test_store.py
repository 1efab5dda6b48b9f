"""UpdateStore: bounded bytes with oldest-first eviction, and exact answers to "what does a peer lack"."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.sync.version_vector import VersionVector
from tests.helpers.fakes import FakeUpdate

SENDERS = ["a", "b", "c"]


adds = st.lists(st.builds(FakeUpdate, st.sampled_from(SENDERS), st.integers(1, 12), nbytes=st.integers(0, 40)),
                max_size=40)


def model_store(updates: list[FakeUpdate], max_bytes: int) -> list[FakeUpdate]:
    """Reference: a plain list, oldest first, same rules as the docstring of `UpdateStore.add`."""
    held: list[FakeUpdate] = []
    for u in updates:
        if any((h.sender, h.seq) == (u.sender, u.seq) for h in held) or u.nbytes > max_bytes:
            continue
        while sum(h.nbytes for h in held) + u.nbytes > max_bytes:
            held.pop(0)
        held.append(u)
    return held


@settings(max_examples=150)
@given(adds, st.integers(0, 120))
def test_eviction_respects_max_bytes_oldest_first(updates: list[FakeUpdate], max_bytes: int) -> None:
    store = UpdateStore(max_bytes)
    for u in updates:
        store.add(u)
        assert store.nbytes <= max_bytes
    held = model_store(updates, max_bytes)
    assert len(store) == len(held) and store.nbytes == sum(h.nbytes for h in held)
    for h in held:
        assert store.get(h.sender, h.seq) is h and store.has(h.sender, h.seq)
    for s in SENDERS:
        seqs = [h.seq for h in held if h.sender == s]
        assert store.oldest_seq(s) == (min(seqs) if seqs else None)


@settings(max_examples=150)
@given(adds, st.dictionaries(st.sampled_from(SENDERS), st.integers(0, 12)), st.integers(0, 50))
def test_missing_for_returns_exactly_the_missing_in_order(updates: list[FakeUpdate], remote_raw: dict[str, int],
                                                          limit: int) -> None:
    store = UpdateStore(10**9)
    for u in updates:
        store.add(u)
    remote = VersionVector(remote_raw)
    missing = {(s, q) for s in SENDERS for q in range(1, 13)
               if store.has(s, q) and q > remote.get(s)}
    out = store.missing_for(remote, limit)
    keys = [(u.sender, u.seq) for u in out]
    assert len(keys) == min(limit, len(missing)) and len(set(keys)) == len(keys)
    assert set(keys) <= missing
    for s in SENDERS:
        got = [q for sender, q in keys if sender == s]
        wanted = sorted(q for sender, q in missing if sender == s)
        # per sender: ascending and a prefix of what it lacks (the lowest seqs are the mergeable ones)
        assert got == wanted[: len(got)]
    if limit >= len(missing):
        assert set(keys) == missing


def test_missing_for_shares_a_tight_limit_across_senders() -> None:
    store = UpdateStore(10**6)
    for s in SENDERS:
        for q in range(1, 6):
            store.add(FakeUpdate(s, q, nbytes=10))
    out = store.missing_for(VersionVector({"a": 1}), limit=4)
    assert [(u.sender, u.seq) for u in out] == [("a", 2), ("b", 1), ("c", 1), ("a", 3)]
    assert store.missing_for(VersionVector({s: 5 for s in SENDERS}), limit=10) == []
    assert store.missing_for(VersionVector(), limit=0) == []


def test_add_refuses_held_and_oversized() -> None:
    store = UpdateStore(100)
    first = FakeUpdate("a", 1, b"x", nbytes=30)
    assert store.add(first)
    assert not store.add(FakeUpdate("a", 1, b"y", nbytes=30))  # same (sender, seq): the first message stays
    assert store.get("a", 1) is first
    assert not store.add(FakeUpdate("b", 1, nbytes=101))  # could never fit: evicts nothing
    assert len(store) == 1 and store.nbytes == 30
    assert store.get("b", 1) is None and not store.has("b", 1) and store.oldest_seq("b") is None
    with pytest.raises(ValueError):
        store.add(FakeUpdate("c", 1, nbytes=-1))


def test_eviction_reveals_unfillable_gap() -> None:
    store = UpdateStore(30)
    for q in range(1, 6):
        store.add(FakeUpdate("a", q, nbytes=10))
    assert store.oldest_seq("a") == 3 and len(store) == 3
    # a peer at a=1 needs seq 2, which we no longer hold: it must look elsewhere or state-sync
    assert store.oldest_seq("a") > VersionVector({"a": 1}).get("a") + 1


def test_drop_sender() -> None:
    store = UpdateStore(1000)
    for s in ("a", "b"):
        for q in (1, 2, 3):
            store.add(FakeUpdate(s, q, nbytes=7))
    assert store.drop_sender("a") == 3 and store.drop_sender("zzz") == 0
    assert store.senders() == ["b"] and len(store) == 3 and store.nbytes == 21
    assert store.missing_for(VersionVector(), 10) == [store.get("b", q) for q in (1, 2, 3)]


@settings(max_examples=150)
@given(adds, st.dictionaries(st.sampled_from(SENDERS), st.sets(st.integers(1, 12), min_size=1)), st.integers(0, 50))
def test_missing_for_serves_the_remotes_holes_too(updates: list[FakeUpdate], remote_sets: dict[str, set[int]],
                                                  limit: int) -> None:
    store = UpdateStore(10**9)
    for u in updates:
        store.add(u)
    remote = VersionVector()
    for sender, seqs in sorted(remote_sets.items()):
        for seq in sorted(seqs):
            remote = remote.with_merged(sender, seq)  # gaps in the set are holes of the vector
    missing = {(s, q) for s in SENDERS for q in range(1, 13) if store.has(s, q) and not remote.has(s, q)}
    keys = [(u.sender, u.seq) for u in store.missing_for(remote, limit)]
    assert len(keys) == min(limit, len(missing)) and set(keys) <= missing and len(set(keys)) == len(keys)
    for s in SENDERS:
        got = [q for sender, q in keys if sender == s]
        assert got == sorted(q for sender, q in missing if sender == s)[: len(got)]  # lowest first


def test_ban_purges_and_refuses() -> None:
    store = UpdateStore(1000)
    for q in (1, 2):
        store.add(FakeUpdate("a", q, nbytes=7))
    store.add(FakeUpdate("b", 1, nbytes=7))
    assert store.ban("a") == 2 and store.is_banned("a") and not store.is_banned("b")
    assert not store.add(FakeUpdate("a", 3, nbytes=7)) and store.senders() == ["b"] and store.nbytes == 7
    assert store.missing_for(VersionVector(), 10) == [store.get("b", 1)]


def test_unservable_for_names_merged_updates_only_we_could_have_served() -> None:
    store = UpdateStore(1000)
    store.add(FakeUpdate("a", 3, nbytes=7))
    local = VersionVector({"a": 4})
    remote = VersionVector({"a": 1}).with_merged("a", 4)  # skipped 2 and 3
    assert store.unservable_for(local, remote) == [("a", 2)]  # 3 we still hold: a pull fixes it
    assert store.unservable_for(remote, local) == []



def test_an_update_held_back_is_not_served_until_its_time_is_up_or_it_is_released() -> None:
    """An author whose update goes up an aggregation tree holds it back from pulls a while (the tree's head
    start): left out of what it serves as a seq and as a hole, served again when the time is up or on `release`
    (a fallback announce); nothing else is held back, and an evicted update leaves no hold behind."""
    now = [100.0]
    store = UpdateStore(3, clock=lambda: now[0])
    for update in (FakeUpdate("a", 1, nbytes=1), FakeUpdate("a", 2, nbytes=1), FakeUpdate("b", 1, nbytes=1)):
        store.add(update)
    store.hold_back("a", 2, 10.0)
    store.hold_back("z", 9, 10.0)  # not held: nothing to hold back

    def served(vv: VersionVector) -> list[tuple[str, int]]:
        return [(u.sender, u.seq) for u in store.missing_for(vv, 10, to_serve=True)]

    assert served(VersionVector()) == [("a", 1), ("b", 1)]
    assert len(store.missing_for(VersionVector(), 10)) == 3  # a repair re-merging what we hold still sees it
    assert served(VersionVector({"a": 3, "b": 1}, holes={"a": [2]})) == []  # a hole waits like any seq
    now[0] = 110.0
    assert served(VersionVector()) == [("a", 1), ("b", 1), ("a", 2)]
    store.hold_back("a", 1, 5.0)
    store.release("a", 1)
    assert served(VersionVector()) == [("a", 1), ("b", 1), ("a", 2)]
    store.hold_back("a", 1, 5.0)
    store.add(FakeUpdate("c", 1, nbytes=1))  # evicts a/1, the oldest, with its hold
    assert ("a", 1) not in store._held_back and served(VersionVector()) == [("a", 2), ("b", 1), ("c", 1)]
