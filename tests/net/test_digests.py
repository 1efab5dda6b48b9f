"""Equivocation digests (net/gossip/digests.py): pure functions, no network."""

from __future__ import annotations

import random

from p2p_diloco.net.gossip.digests import (
    ID_WINDOW,
    MAX_ID_DIGESTS,
    differing_windows,
    id_window,
    ids_digest,
    request_digests,
    summarize_ids,
)
from p2p_diloco.sync.version_vector import VersionVector


def ids_from(table: dict[tuple[str, int], bytes]):
    def ids_of(sender: str, seqs: list[int]) -> list[bytes] | None:
        out = [table.get((sender, seq)) for seq in seqs]
        return None if any(i is None for i in out) else out
    return ids_of


def test_window_is_the_newest_merged_seqs() -> None:
    assert id_window(VersionVector({"a": 3}), "a") == [1, 2, 3]
    assert id_window(VersionVector({"a": 20}), "a") == list(range(20 - ID_WINDOW + 1, 21))
    assert id_window(VersionVector({"a": 5}, holes={"a": [4]}), "a") == [1, 2, 3, 5]
    assert id_window(VersionVector(), "a") == []


def test_digest_names_the_updates() -> None:
    assert ids_digest([1, 2], [b"x", b"y"]) == ids_digest([1, 2], [b"x", b"y"])
    assert ids_digest([1, 2], [b"x", b"y"]) != ids_digest([1, 2], [b"x", b"z"])
    assert ids_digest([1, 2], [b"x", b"y"]) != ids_digest([2, 3], [b"x", b"y"])
    assert len(ids_digest([1], [b"x"])) == 16


def test_summarize_leaves_out_unknown_ids() -> None:
    vv = VersionVector({"a": 2, "b": 1})
    table = {("a", 1): b"a1", ("a", 2): b"a2"}
    assert summarize_ids(vv, ids_from(table), ["a", "b"]) == {"a": ids_digest([1, 2], [b"a1", b"a2"])}


def test_request_digests_only_compare_hole_free_equal_windows() -> None:
    ours = VersionVector({"a": 2, "b": 3, "c": 2}, holes={"b": [2]})
    wanted = ours.merge(VersionVector({"c": 4}))  # a pull's claims reach beyond what we merged for c
    table = {(s, q): f"{s}{q}".encode() for s in "abc" for q in range(1, 5)}
    digests = request_digests(wanted, ours, ids_from(table), random.Random(0))
    assert set(digests) == {"a"}


def test_request_digests_are_bounded() -> None:
    senders = {f"s{i}": 1 for i in range(MAX_ID_DIGESTS + 10)}
    vv = VersionVector(senders)
    table = {(s, 1): s.encode() for s in senders}
    assert len(request_digests(vv, vv, ids_from(table), random.Random(1))) == MAX_ID_DIGESTS


def test_differing_windows_find_the_other_versions() -> None:
    remote = VersionVector({"a": 2, "b": 2, "c": 2})
    ours = {(s, q): f"{s}{q}".encode() for s in "ab" for q in (1, 2)}  # we never merged c's
    theirs = {**ours, ("b", 2): b"other", ("c", 1): b"c1", ("c", 2): b"c2"}
    digests = summarize_ids(remote, ids_from(theirs), ["a", "b", "c"])
    assert list(differing_windows(digests, remote, ids_from(ours))) == [("b", [1, 2])]
