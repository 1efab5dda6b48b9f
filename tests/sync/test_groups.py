"""The epoch's aggregation tree: one answer on every peer, every member covered once, proven members inside."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.sync.groups import Tree

members = st.lists(st.text("abcdefghijklmnop", min_size=1, max_size=6), min_size=1, max_size=300, unique=True)


@settings(max_examples=60, deadline=None)
@given(members, st.integers(0, 10**6), st.integers(2, 9))
def test_every_member_reaches_the_root_once(peers, epoch, k):
    tree = Tree.of(reversed(peers), seed=b"run", epoch=epoch, fan_in=k)
    assert tree == Tree.of(peers, seed=b"run", epoch=epoch, fan_in=k)  # the member list's order does not matter
    assert sorted(tree.order) == sorted(peers)
    children = [c for p in peers for c in tree.children(p)]
    assert sorted(children) == sorted(p for p in peers if p != tree.root)  # each non-root is one node's child
    for p in peers:
        assert all(tree.parent(c) == p for c in tree.children(p)) and len(tree.children(p)) <= k
        hops, at = 0, p
        while (up := tree.parent(at)) is not None:
            hops, at = hops + 1, up
        assert at == tree.root and hops <= tree.depth()
    assert tree.depth() <= max(0, math.ceil(math.log(len(peers) * (k - 1) + 1, k)) - 1) + 1


@settings(max_examples=30, deadline=None)
@given(members, st.integers(0, 1000))
def test_proven_members_take_the_inner_places(peers, epoch):
    proven = set(peers[: max(1, len(peers) // 4)])
    tree = Tree.of(peers, seed=b"run", epoch=epoch, aggregators=proven)
    inner = [p for p in peers if tree.is_inner(p)]
    assert all(p in proven for p in inner) or len(inner) > len(proven)


def test_the_tree_rotates_with_the_epoch():
    peers = [f"peer{i}" for i in range(64)]
    roots = {Tree.of(peers, seed=b"run", epoch=e).root for e in range(40)}
    assert len(roots) >= 20  # a new root most epochs: no peer aggregates the total for good
