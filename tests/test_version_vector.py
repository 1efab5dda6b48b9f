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
