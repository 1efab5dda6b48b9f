"""Fit checks in sponsorship (sync/fitness.py): which proposals a sponsor checks, and what a check that fits
does to a record. The check itself is train/fit.py's (tests/train/test_fit.py, on a real model); here it is
given, so that the rule around it is tested alone."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.sync.fitness import FIT_CHECKS, echoes, to_check
from p2p_diloco.sync.relayed import Pending
from p2p_diloco.sync.sponsorship import PROVEN, RECORD, Sponsorship

SPONSORS = ("s1", "s2")
WHERE = (0, 20, 0, 1, 1)


def _pending(author: str, data: tuple[int, ...] = WHERE) -> Pending:
    t = torch.zeros(1)
    return Pending(author, 1, t, t, t, 1.0, 0.0, None, data)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d", "e"]), st.floats(0, 1), st.floats(0, 0.5),
                          st.booleans()), max_size=12),
       st.sets(st.sampled_from(["a", "b", "c", "d", "e"])), st.integers(0, 3), st.integers(0, 99))
def test_only_weak_declared_work_along_ours_is_checked_members_first(rows, useful, limit, seed) -> None:
    judged = [(_pending(a, WHERE if declared else ()), value, keep) for a, value, keep, declared in rows]
    picked = to_check(judged, useful.__contains__, PROVEN, random.Random(seed), limit)
    eligible = [p for p, value, keep in judged if keep > 0 and value < PROVEN and p.data]
    assert len(picked) == min(limit, len(eligible)) and all(any(p is q for q in eligible) for p in picked)
    members = sum(p.author in useful for p in eligible)
    # Authors with a useful mark first: a stranger is picked only once every member is.
    assert all(p.author in useful for p in picked[:members]) or members >= len(picked)
    assert [p.author in useful for p in picked] == sorted((p.author in useful for p in picked), reverse=True)


def test_strangers_share_the_checks_by_a_draw_nobody_else_can_make() -> None:
    crowd = [(_pending(f"x{i}"), 0.05, 0.2) for i in range(100)]
    picks = [to_check(crowd, lambda a: False, PROVEN, random.Random(seed))[0].author for seed in range(200)]
    assert len(set(picks)) > 50  # spread over the crowd, not the first in merge order
    other = [to_check(crowd, lambda a: False, PROVEN, random.Random(seed + 1000))[0].author for seed in range(200)]
    assert picks != other  # another sponsor's secret draws other turns


def _round(s: Sponsorship, seq: int, own: torch.Tensor, work: torch.Tensor, fit, data=WHERE) -> None:  # noqa: ANN001
    s.merged("s1", seq, own, own)
    s.merged("v", seq, work, work, data=data)
    s.relay(torch.zeros_like(own), fit=fit)


def test_work_too_weak_for_its_direction_graduates_when_it_fits_its_batches_and_not_otherwise() -> None:
    """A volunteer on a file shard of its own points little along the sponsors' work (judged under PROVEN): with
    the fit check it earns its record from what it trained, without it never; the value it is relayed with is
    still its direction's (0 under PROVEN), and each check is of the proposal's own step."""
    g = torch.Generator().manual_seed(5)
    own = torch.randn(512, generator=g)
    works = [0.05 * own + torch.randn(512, generator=g) for _ in range(RECORD + 2)]
    calls: list[tuple[str, tuple[int, ...], torch.Tensor]] = []

    def fits(answer):  # noqa: ANN001, ANN202
        def fit(author, data, step, theta):  # noqa: ANN001, ANN202
            calls.append((author, data, step))
            return answer
        return fit

    for answer, graduates in ((True, True), (False, False), (None, False)):
        s = Sponsorship(SPONSORS, self_id="s1")
        calls.clear()
        for seq, work in enumerate(works, 1):
            _round(s, seq, own, work, fits(answer))
            value, keep = s.judged[("v", seq)]
            assert 0 <= value < PROVEN  # the direction alone: too little to count
            if seq > RECORD:
                assert (keep > 0) is graduates  # relayed as a member's from its (RECORD + 1)th
        assert s.graduated("v") is graduates
        assert [(a, d) for a, d, _ in calls] == [("v", WHERE)] * len(works) and len(calls) <= FIT_CHECKS * len(works)
        torch.testing.assert_close(calls[0][2], works[0])
    s = Sponsorship(SPONSORS, self_id="s1")
    for seq, work in enumerate(works, 1):  # no position declared: nothing to redraw, nothing checked
        _round(s, seq, own, work, fits(True), data=())
    assert not s.graduated("v")


def test_copies_and_work_against_ours_are_never_checked() -> None:
    g = torch.Generator().manual_seed(6)
    own = torch.randn(512, generator=g)
    checked: list[str] = []
    s = Sponsorship(SPONSORS, self_id="s1")
    s.merged("s1", 1, own, own)
    against = -0.08 * own + torch.randn(512, generator=g)
    s.merged("neg", 1, against, against, data=WHERE)
    s.merged("copy", 1, own.clone(), own.clone(), data=WHERE)  # a near copy of the sponsor's own update
    s.relay(torch.zeros_like(own), fit=lambda author, *_: checked.append(author) or True)
    assert checked == [] and not s.graduated("neg") and not s.graduated("copy")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 10)), min_size=1, max_size=10))
def test_of_proposals_that_near_each_other_only_the_earliest_dated_is_checked(rows) -> None:
    """An echo of a proposal (near it, |cos| >= ECHO_BAR) dated after it is not checked, negated or not, whether or
    not the first of its cluster is a candidate; the first is; proposals far from every other are all eligible.
    Directions: 4 orthogonal axes, so a cluster is exactly the proposals on one axis (some negated)."""
    axes = torch.eye(4)
    judged = []
    for i, (axis, date) in enumerate(rows):
        unit = axes[axis] * (-1 if i % 3 == 0 else 1)
        judged.append((Pending(f"a{i}", 1, unit, unit, unit, 1.0, date, None, WHERE), 0.05, 0.2))
    marks = echoes([p for p, _, _ in judged])
    for axis in range(4):
        on_axis = [(p.date, i) for i, (p, _, _) in enumerate(judged) if rows[i][0] == axis]
        if on_axis:  # the earliest (by date, then merge order) is no echo, every other one is
            first = min(on_axis)[1]
            assert [marks[i] for _, i in on_axis] == [i != first for _, i in on_axis]
    picked = to_check(judged, lambda a: False, PROVEN, random.Random(0), limit=10)
    assert sorted(p.author for p in picked) == sorted(judged[i][0].author for i, m in enumerate(marks) if not m)
    # The earliest of each cluster valued in full (not a candidate itself): its echoes are still not checked.
    strong = [(p, 2 * PROVEN if not marks[i] else value, keep) for i, (p, value, keep) in enumerate(judged)]
    assert to_check(strong, lambda a: False, PROVEN, random.Random(0), limit=10) == []
