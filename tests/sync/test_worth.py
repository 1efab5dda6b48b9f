"""What a proposal is worth to a sponsor (sync/worth.py): bounded, no gain from scaling work up or from pointing
against the sponsors, and judged by whichever direction it follows best."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.sync.echoes import echoing, orthonormal, without
from p2p_diloco.sync.worth import along, cosine, worth, worths

DIM = 64
SHARE = 0.25


def _vec(seed: int) -> torch.Tensor:
    return torch.randn(DIM, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6),
       st.floats(0.01, 100.0), st.floats(1.0, 1e4))
def test_worth_is_bounded_and_scaling_work_up_never_raises_it(s: int, a: int, b: int, length: float,
                                                               scale: float) -> None:
    sample, d1, d2 = _vec(s), along(_vec(a)), along(_vec(b))
    v, keep = worth(sample, (d1, d2), length, SHARE)
    assert 0.0 <= v <= 1.0 and 0.0 <= keep <= SHARE
    assert worth(sample * scale, (d1, d2), length, SHARE)[0] <= v + 1e-6
    best = max(worth(sample, (d1,), length, SHARE)[0], worth(sample, (d2,), length, SHARE)[0])
    assert math.isclose(v, best, abs_tol=1e-9)  # the better of the two directions decides
    norm = float(sample.norm())
    assert v <= max(0.0, cosine(sample, norm, d1), cosine(sample, norm, d2)) + 1e-6


def test_work_against_every_direction_and_work_with_none_to_judge_by_are_worth_nothing() -> None:
    d = _vec(1)
    assert worth(-d, (along(d), along(d * 3)), 10.0, SHARE) == (0.0, 0.0)
    assert worth(d, (None, along(torch.zeros(DIM))), 10.0, SHARE) == (0.0, 0.0)
    assert worth(d, (along(torch.full((DIM,), math.nan)),), 10.0, SHARE) == (0.0, 0.0)
    v, keep = worth(d, (along(d),), float(d.norm()), SHARE)
    assert math.isclose(v, 1.0, rel_tol=1e-6) and math.isclose(keep, SHARE, rel_tol=1e-6)
    assert math.isclose(worth(d * 4, (along(d),), float(d.norm()), SHARE)[0], 0.25, rel_tol=1e-6)  # 4x long


def test_under_the_floor_work_earns_no_share_but_a_graduates_is_still_carried() -> None:
    """Many proposals each judged a little (noise: |cos| ~ 1/sqrt(n)) would sum to a full newcomers' share: under
    `floor` v is 0; a graduate's keep follows the sign alone (its work is judged one update at a time)."""
    d = _vec(2)
    side = _vec(3)
    side -= torch.dot(side, d) / torch.dot(d, d) * d  # orthogonal to d
    slight = d * 0.05 / float(d.norm()) + side / float(side.norm())  # cosine ~0.05 with d
    v, keep = worth(slight, (along(d),), 10.0, SHARE, floor=0.1)
    assert v == 0.0 and keep > 0
    assert worth(slight, (along(d),), 10.0, SHARE)[0] > 0  # no floor: a little


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 3), st.integers(1, 9), st.floats(0.0, 0.3))
def test_a_batch_is_judged_as_each_proposal_would_be_alone(seed: int, moves: int, rows: int, floor: float) -> None:
    """`worths` (a phase's proposals in a few products) against `worth` of each without the recent moves, one at a
    time: the same values. Some rows lie along the moves (an echo: its new part is small)."""
    g = torch.Generator().manual_seed(seed)
    fresh = orthonormal([torch.randn(DIM, generator=g) for _ in range(moves)])
    d, sponsors = along(torch.randn(DIM, generator=g)), along(torch.randn(DIM, generator=g))
    samples = torch.randn(rows, DIM, generator=g)
    if fresh:
        samples[0] = fresh[0] * 3 + 0.1 * samples[0]
    for directions in ((d,), (sponsors, d), (None,)):
        batch = worths(samples, fresh, directions, 2.0, SHARE, floor)
        for row, got in zip(samples, batch):
            want = worth(without(row.clone(), fresh), directions, 2.0, SHARE, floor)
            assert got == pytest.approx(want, abs=1e-5)


def test_a_row_whose_new_part_is_near_a_published_ones_is_an_echo_worth_nothing() -> None:
    """`echoing`: a proposal whose part outside the recent moves is near (|cos| >= 0.5) the same part of a published
    update is an echo, negated or not, a recent move added or not; one that is not near is not; `worths` gives an
    echo (0, 0)."""
    g = torch.Generator().manual_seed(5)
    fresh = orthonormal([torch.randn(DIM, generator=g)])
    d = along(torch.randn(DIM, generator=g))
    update = torch.randn(DIM, generator=g)
    echo = 0.9 * update / update.norm() + 0.3 * torch.randn(DIM, generator=g) / DIM ** 0.5
    other = torch.randn(DIM, generator=g)
    rows = torch.stack([echo, -echo, other, fresh[0] * 5 + echo])
    marks = echoing(rows, fresh, update[None], 0.5)
    assert marks == [True, True, False, True]
    got = worths(rows, fresh, (d,), 2.0, SHARE, 0.0, marks)
    assert got[0] == got[1] == got[3] == (0.0, 0.0)
    # Alone or in a batch: the same to float noise (a batch's matrix product may sum in another order).
    assert got[2] == pytest.approx(worths(rows[2:3], fresh, (d,), 2.0, SHARE)[0], rel=1e-5)


def test_a_proposal_with_nothing_new_in_it_is_worth_nothing_and_raises_nothing() -> None:
    """A proposal lying exactly in the span of theta's recent moves (a hostile peer can send theta's own move) has a
    zero new part: worth (0, 0), one at a time or in a batch, never a division by zero."""
    g = torch.Generator().manual_seed(9)
    move = torch.randn(DIM, generator=g)
    fresh = orthonormal([move.clone()])
    d = along(torch.randn(DIM, generator=g))
    exact = fresh[0] * 3.0  # exactly along the move: its new part is 0.0 in every coordinate
    assert worth(torch.zeros(DIM), (d,), 2.0, SHARE) == (0.0, 0.0)
    assert worths(torch.stack([exact, torch.zeros(DIM)]), fresh, (d,), 2.0, SHARE) == [(0.0, 0.0), (0.0, 0.0)]
    assert worths(exact[None], [], (along(exact),), 2.0, SHARE)[0][0] > 0.5  # with nothing known as old, it is new
    assert len(echoing(torch.stack([exact]), fresh, move[None], 0.5)) == 1  # float noise either way: no error
