"""Version vectors: the algebra (a join-semilattice under merge), staleness, catch-up ranges, encoding."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2p_diloco.sync.version_vector import MAX_SENDER_LEN, MAX_SEQ, VersionVector

SENDERS = ["alice", "bob", "carol", "dave", "eve"]

raw_vectors = st.dictionaries(st.sampled_from(SENDERS), st.integers(0, 30), max_size=len(SENDERS))
vectors = raw_vectors.map(VersionVector)


@given(vectors, vectors)
def test_merge_commutative(a: VersionVector, b: VersionVector) -> None:
    assert a.merge(b) == b.merge(a)


@given(vectors, vectors, vectors)
def test_merge_associative(a: VersionVector, b: VersionVector, c: VersionVector) -> None:
    assert a.merge(b).merge(c) == a.merge(b.merge(c))


@given(vectors)
def test_merge_idempotent(a: VersionVector) -> None:
    assert a.merge(a) == a


@given(raw_vectors, raw_vectors)
def test_merge_is_pointwise_max_and_least_upper_bound(ra: dict[str, int], rb: dict[str, int]) -> None:
    a, b = VersionVector(ra), VersionVector(rb)
    m = a.merge(b)
    for sender in SENDERS:
        assert m.get(sender) == max(ra.get(sender, 0), rb.get(sender, 0))
    assert m.dominates(a) and m.dominates(b)
    # dominance is exactly "merging changes nothing"
    assert a.dominates(b) == (a.merge(b) == a)


@given(raw_vectors, raw_vectors)
def test_staleness_matches_definition(rnow: dict[str, int], rbase: dict[str, int]) -> None:
    now, base = VersionVector(rnow), VersionVector(rbase)
    expected = sum(max(0, rnow.get(k, 0) - rbase.get(k, 0)) for k in SENDERS)
    assert now.staleness(base) == expected
    assert now.staleness(now) == 0
    # updates merged since base = growth of the merged vector's total
    assert base.merge(now).total() - base.total() == expected


@given(vectors, vectors)
def test_missing_from_names_exactly_the_gap(a: VersionVector, b: VersionVector) -> None:
    gaps = a.missing_from(b)
    filled = a
    for sender, (lo, hi) in gaps.items():
        assert lo == a.get(sender) + 1 and hi == b.get(sender) and lo <= hi
        filled = filled.advanced(sender, hi)
    assert filled == a.merge(b)
    assert sum(hi - lo + 1 for lo, hi in gaps.values()) == a.merge(b).total() - a.total()
    assert a.merge(b).missing_from(b) == {}


@given(vectors, st.sampled_from(SENDERS), st.integers(0, 10))
def test_advanced_returns_new_vector_and_only_grows(a: VersionVector, sender: str, step: int) -> None:
    before = a.to_dict()
    b = a.advanced(sender, a.get(sender) + step)
    assert a.to_dict() == before  # immutable
    assert b.get(sender) == a.get(sender) + step and b.dominates(a)
    assert b.total() == a.total() + step
    if a.get(sender) > 0:
        with pytest.raises(ValueError):
            a.advanced(sender, a.get(sender) - 1)


@given(vectors)
def test_dict_round_trip_and_canonical_form(a: VersionVector) -> None:
    d = a.to_dict()
    assert all(v > 0 for v in d.values()) and list(d) == sorted(d)
    b = VersionVector.from_dict(d)
    assert b == a and hash(b) == hash(a) and b.digest() == a.digest()
    # explicit zeros are the same vector as absent senders
    padded = VersionVector.from_dict({**d, **{s: 0 for s in SENDERS if s not in d}})
    assert padded == a and padded.digest() == a.digest()


@given(vectors, vectors)
def test_digest_tracks_equality(a: VersionVector, b: VersionVector) -> None:
    assert (a.digest() == b.digest()) == (a == b)
    assert len(a.digest()) == 32


def test_digest_is_unambiguous_about_sender_boundaries() -> None:
    # naive concatenation would encode both as "ab" + "c" ...; length prefixes keep them apart
    assert VersionVector({"ab": 1, "c": 1}).digest() != VersionVector({"a": 1, "bc": 1}).digest()


def test_get_len_iter_total() -> None:
    v = VersionVector({"a": 3, "b": 0, "c": 2})
    assert v.get("a") == 3 and v.get("b") == 0 and v.get("zzz") == 0
    assert sorted(v) == ["a", "c"] and len(v) == 2 and v.total() == 5
    assert v != {"a": 3, "c": 2}  # only equal to vectors
    assert VersionVector() == VersionVector({}) and VersionVector().total() == 0


@pytest.mark.parametrize("bad", [
    {1: 3},                      # non-str key
    {"": 1},                     # empty sender
    {"a" * (MAX_SENDER_LEN + 1): 1},
    {"a\ud800": 1},              # lone surrogate: no canonical encoding
    {"a": -1},
    {"a": 1.0},
    {"a": True},
    {"a": "3"},
    {"a": None},
    {"a": MAX_SEQ + 1},
    [("a", 1)],                  # not a mapping
    "a",
])
def test_from_dict_rejects_malformed(bad: object) -> None:
    with pytest.raises(ValueError):
        VersionVector.from_dict(bad)  # type: ignore[arg-type]


def test_from_dict_bounds_size() -> None:
    data = {f"s{i}": 1 for i in range(11)}
    with pytest.raises(ValueError, match="bound"):
        VersionVector.from_dict(data, max_senders=10)
    assert VersionVector.from_dict(data, max_senders=11).total() == 11


# --- holes: the vector of any merged set, built one update at a time in any order --------------------------

merged_sets = st.dictionaries(st.sampled_from(SENDERS), st.sets(st.integers(1, 12), min_size=1), max_size=4)


def build(merged: dict[str, set[int]], order: list[tuple[str, int]] | None = None) -> VersionVector:
    """The vector of `merged` via `with_merged`, in `order` (default: sorted)."""
    vv = VersionVector()
    for sender, seq in order if order is not None else sorted((s, q) for s, qs in merged.items() for q in qs):
        vv = vv.with_merged(sender, seq)
    return vv


def as_set(merged: dict[str, set[int]]) -> set[tuple[str, int]]:
    return {(s, q) for s, qs in merged.items() for q in qs}


@given(merged_sets, st.randoms(use_true_random=False))
def test_with_merged_names_exactly_the_set_whatever_the_order(merged: dict[str, set[int]], rnd) -> None:
    order = sorted(as_set(merged))
    rnd.shuffle(order)
    a, b = build(merged), build(merged, order)
    assert a == b and a.digest() == b.digest() and hash(a) == hash(b)
    for sender in SENDERS:
        seqs = merged.get(sender, set())
        assert a.get(sender) == max(seqs, default=0)
        assert a.holes(sender) == frozenset(range(1, a.get(sender))) - seqs
        for q in range(0, 14):
            assert a.has(sender, q) == (q in seqs)
    assert a.total() == len(as_set(merged))


@given(merged_sets)
def test_with_merged_refuses_a_second_merge(merged: dict[str, set[int]]) -> None:
    vv = build(merged)
    for sender, seq in as_set(merged):
        with pytest.raises(ValueError):
            vv.with_merged(sender, seq)


@given(merged_sets, merged_sets, merged_sets)
def test_set_algebra_with_holes(ma: dict[str, set[int]], mb: dict[str, set[int]], mc: dict[str, set[int]]) -> None:
    a, b, c = build(ma), build(mb), build(mc)
    sa, sb = as_set(ma), as_set(mb)
    union = {s: ma.get(s, set()) | mb.get(s, set()) for s in set(ma) | set(mb)}
    assert a.merge(b) == b.merge(a) == build(union)  # union of the merged sets, commutative
    assert a.merge(b).merge(c) == a.merge(b.merge(c)) and a.merge(a) == a
    assert a.dominates(b) == (sb <= sa) == (a.merge(b) == a)
    assert a.staleness(b) == len(sa - sb)
    assert (a == b) == (sa == sb) == (a.digest() == b.digest())
    assert a.merge(b).dominates(a) and a.merge(b).dominates(b)


@given(merged_sets)
def test_holes_round_trip_through_dicts(merged: dict[str, set[int]]) -> None:
    vv = build(merged)
    back = VersionVector.from_dict(vv.to_dict(), holes=vv.holes_dict())
    assert back == vv and back.digest() == vv.digest()
    assert VersionVector(vv.to_dict(), vv.holes_dict()) == vv
    if vv.n_holes:  # without its holes it is another set: the entries alone claim more
        assert VersionVector.from_dict(vv.to_dict()) != vv
        assert VersionVector.from_dict(vv.to_dict()).dominates(vv)


def test_hole_free_vectors_keep_their_digest() -> None:
    # peers that never skip must agree on digests with peers that predate holes
    assert VersionVector({"a": 2}).with_merged("a", 3).digest() == VersionVector({"a": 3}).digest()
    assert VersionVector({"a": 3}).digest().hex().startswith(VersionVector.from_dict({"a": 3}).digest().hex())


def test_skip_then_late_merge() -> None:
    vv = VersionVector({"a": 1}).with_merged("a", 4)  # 2 and 3 skipped
    assert vv.get("a") == 4 and vv.holes("a") == {2, 3} and vv.total() == 2
    assert vv.missing_from(VersionVector({"a": 6})) == {"a": (5, 6)}
    late = vv.with_merged("a", 3)
    assert late.holes("a") == {2} and late.total() == 3 and late.staleness(vv) == 1
    assert late.with_merged("a", 2) == VersionVector({"a": 4})


@pytest.mark.parametrize("holes", [
    {"a": [3]},        # not below the entry
    {"a": [0]},
    {"a": [True]},
    {"b": [1]},        # sender without an entry
    {"a": "1"},
    [("a", 1)],
])
def test_from_dict_rejects_malformed_holes(holes: object) -> None:
    with pytest.raises(ValueError):
        VersionVector.from_dict({"a": 3}, holes=holes)  # type: ignore[arg-type]


def test_holes_are_bounded() -> None:
    from p2p_diloco.sync.version_vector import MAX_HOLES
    with pytest.raises(ValueError, match="holes"):
        VersionVector().with_merged("a", MAX_HOLES + 2)
    with pytest.raises(ValueError, match="holes"):
        VersionVector.from_dict({"a": MAX_HOLES + 2}, holes={"a": list(range(1, MAX_HOLES + 2))})


def test_unservable_merges_names_what_only_we_merged_and_cannot_serve() -> None:
    from p2p_diloco.sync.quorum import unservable_merges
    local = VersionVector({"a": 5, "b": 2})
    remote = VersionVector({"a": 1}).with_merged("a", 5).with_merged("b", 3)  # skipped a2..a4, b1, b2
    assert remote.holes("a") == {2, 3, 4} and remote.holes("b") == {1, 2}
    held = {("a", 3), ("b", 1)}
    assert unservable_merges(local, remote, lambda s, q: (s, q) in held) == [("a", 2), ("a", 4), ("b", 2)]
    assert unservable_merges(remote, local, lambda s, q: False) == []  # the skipping side never yields


@given(merged_sets, st.data())
def test_without_is_the_inverse_of_with_merged(merged: dict[str, set[int]], data) -> None:  # noqa: ANN001
    vv = build(merged)
    if not merged:
        return
    sender, seq = data.draw(st.sampled_from(sorted(as_set(merged))))
    rest = {s: qs - {seq} if s == sender else qs for s, qs in merged.items()}
    assert vv.without(sender, seq) == build({s: qs for s, qs in rest.items() if qs})  # the unique form
    assert vv.without(sender, seq).with_merged(sender, seq) == vv
    with pytest.raises(ValueError, match="not merged"):
        vv.without(sender, seq).without(sender, seq)


def test_skipped_by_quorum_counts_our_merge_and_only_vectors_past_the_seq() -> None:
    from p2p_diloco.sync.quorum import skipped_by_quorum
    merged = VersionVector({"a": 3})
    skipped = VersionVector({"a": 1}).with_merged("a", 3)  # hole at a2
    behind = VersionVector({"a": 1})  # not past a2: no vote
    item = [("a", 2)]
    assert skipped_by_quorum(item, [skipped]) == item  # a swarm of two: the skip wins
    assert skipped_by_quorum(item, [skipped, merged]) == []  # a lone claim against us and another merger
    assert skipped_by_quorum(item, [skipped, skipped, merged]) == item
    assert skipped_by_quorum(item, [behind, behind]) == []
    assert skipped_by_quorum(item, []) == []


@given(st.lists(merged_sets, max_size=6), st.sampled_from(SENDERS), st.integers(1, 12))
def test_skipped_by_quorum_is_a_majority_of_the_voters(others: list[dict[str, set[int]]], sender: str,
                                                       seq: int) -> None:
    from p2p_diloco.sync.quorum import skipped_by_quorum
    vectors = [build(m) for m in others]
    skips = sum(1 for m in others if seq not in m.get(sender, set()) and max(m.get(sender, {0})) > seq)
    merges = 1 + sum(1 for m in others if seq in m.get(sender, set()))
    assert (skipped_by_quorum([(sender, seq)], vectors) == [(sender, seq)]) == (skips >= merges)


@given(st.integers(0, 5), st.integers(0, 5))
def test_one_side_of_an_item_yields_never_both(merged_elsewhere: int, skipped_elsewhere: int) -> None:
    """Peers that merged (s, 2) and peers that skipped it see the same votes: exactly one side adopts."""
    from p2p_diloco.sync.quorum import merged_by_quorum, skipped_by_quorum
    merger = VersionVector({"s": 3})
    skipper = VersionVector({"s": 1}).with_merged("s", 3)
    item = [("s", 2)]
    # A merger sees the other mergers and every skipper; a skipper sees every merger and the other skippers.
    merger_view = [merger] * merged_elsewhere + [skipper] * (skipped_elsewhere + 1)
    skipper_view = [merger] * (merged_elsewhere + 1) + [skipper] * skipped_elsewhere
    mergers_yield = skipped_by_quorum(item, merger_view) == item
    skippers_yield = merged_by_quorum(item, skipper_view) == item
    assert mergers_yield != skippers_yield


@given(st.integers(0, 4), st.integers(0, 4), st.integers(0, 4), st.integers(0, 4))
def test_with_votes_unknown_to_either_side_never_both_yield(merged_elsewhere: int, skipped_elsewhere: int,
                                                            hidden_from_merger: int, hidden_from_skipper: int) -> None:
    """Each side counts the peers whose vectors it has not seen against itself; whatever each saw, the two
    sides of an item never both adopt the other's state (they would swap forever)."""
    from p2p_diloco.sync.quorum import merged_by_quorum, skipped_by_quorum
    merger = VersionVector({"s": 3})
    skipper = VersionVector({"s": 1}).with_merged("s", 3)
    item = [("s", 2)]
    others_of_merger = [merger] * merged_elsewhere + [skipper] * (skipped_elsewhere + 1)
    others_of_skipper = [merger] * (merged_elsewhere + 1) + [skipper] * skipped_elsewhere
    h1 = min(hidden_from_merger, len(others_of_merger))
    h2 = min(hidden_from_skipper, len(others_of_skipper))
    mergers_yield = skipped_by_quorum(item, others_of_merger[h1:], unknown=h1) == item
    skippers_yield = merged_by_quorum(item, others_of_skipper[:len(others_of_skipper) - h2], unknown=h2) == item
    assert not (mergers_yield and skippers_yield)


@given(merged_sets, merged_sets)
def test_holes_merged_by_names_our_holes_the_other_merged(ma: dict[str, set[int]], mb: dict[str, set[int]]) -> None:
    a, b = build(ma), build(mb)
    expected = sorted((s, q) for s in SENDERS for q in a.holes(s) if q in mb.get(s, set()))
    assert sorted(a.holes_merged_by(b)) == expected
    assert all(s != SENDERS[0] for s, _ in a.holes_merged_by(b, skip={SENDERS[0]}))
