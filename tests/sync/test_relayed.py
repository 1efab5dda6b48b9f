"""Crowding (sync/relayed.py `Carry`): a proposal's work is relayed at its value over how crowded its direction is
this round; alone or orthogonal to the rest it keeps its value, k copies of one direction weigh one in all."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.sync.relayed import Carry


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm()


def _carry(rows: list[torch.Tensor], values: list[float]) -> Carry:
    carry = Carry()
    for i, (row, value) in enumerate(zip(rows, values)):
        carry.propose(bytes([i]), row.clone(), 1.0, value, _unit(row))
    return carry


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(0, 2**31 - 1), st.floats(0.05, 1.0))
def test_crowded_weights_are_positive_at_most_the_values_and_k_copies_weigh_one(k: int, seed: int,
                                                                                value: float) -> None:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(64, generator=g) for _ in range(k)]
    values = [value * (1 + i % 3) / 3 for i in range(k)]
    weights = _carry(rows, values).weights()
    assert all(0 < w <= v + 1e-12 for w, v in zip(weights, values))
    copies = _carry([rows[0]] * k, [value] * k).weights()  # one direction signed k times
    assert abs(sum(copies) - value) < 1e-5
    negated = _carry([rows[0], -rows[0]], [value, value]).weights()  # opposed directions do not crowd
    assert max(abs(w - value) for w in negated) < 1e-6


def test_orthogonal_proposals_keep_their_values_and_the_relay_sums_them_at_their_weights() -> None:
    rows = list(torch.eye(4) * torch.tensor([1.0, 2.0, 3.0, 4.0])[:, None])
    carry = _carry(rows, [0.4, 0.3, 0.2, 0.1])
    relay, weights = carry.relay()
    assert max(abs(w - v) for w, v in zip(weights, [0.4, 0.3, 0.2, 0.1])) < 1e-6
    assert relay is not None
    torch.testing.assert_close(relay, torch.tensor([0.4, 0.6, 0.6, 0.4]), rtol=1e-5, atol=1e-6)


def test_a_graduates_relayed_work_crowds_the_proposals_along_it_and_is_not_crowded_itself() -> None:
    direction = torch.tensor([1.0, 0.0, 0.0])
    carry = Carry()
    carry.graduate(b"g", 0.5, direction.clone(), 1.0, 0.25, direction)
    carry.propose(b"p", direction.clone(), 1.0, 0.4, direction)
    carry.propose(b"q", torch.tensor([0.0, 1.0, 0.0]), 1.0, 0.4, torch.tensor([0.0, 1.0, 0.0]))
    # p: 1 + its cosine 1 with the graduate's work; q: alone
    assert max(abs(w - v) for w, v in zip(carry.weights(), [0.2, 0.4])) < 1e-6
    assert carry.carried == 0.25 and carry.full is not None and torch.equal(carry.full, 0.25 * direction)
