"""Exact sums of merge steps: what a group's aggregator adds up (ARCHITECTURE.md "Aggregation").

Float addition does not associate, so two aggregators that add the same steps in different groupings (a tree per
epoch, rotating) would produce different bits, and a holder of the inputs could only check a sum "to a tolerance"
that a liar could hide inside. Here every step is first put on one fixed grid of `2**-GRID_BITS` (the same on
every peer, fixed by the protocol) as an int64, and steps are summed as integers: integer addition associates,
so **a sum over a named set of steps has the same bits whatever the grouping or order** (replicas that merge the
same sums are exactly equal; two sums over one set compare by digest; any holder of the inputs recomputes a sum
bit for bit). The grid's step, 6e-8, is far below an int4 payload's quantisation error (a block's max / 7).

On the wire a sum is int32 little-endian (4 bytes a parameter: the range is +-128, far above the norm bound), named
by the Merkle root of its chunks (wire/merkle.py), so an auditor can check a sum on a few chunks it draws
(sync/sum_audit.py).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

GRID_BITS = 24
"""A step's value v is stored as round(v * 2**GRID_BITS): resolution 6e-8, range of the wire's int32 +-128."""
_LIMIT = 2**31 - 1


class SumRangeError(ValueError):
    """A sum outside what the wire's int32 carries (a step beyond any norm bound: refuse the part)."""


def to_grid(step: Tensor) -> Tensor:
    """One merge step (float, the theta change an update makes) on the exact grid, as int64."""
    values = step.detach().to(torch.float64) * float(2**GRID_BITS)
    if not bool(torch.isfinite(values).all()) or (values.numel() and float(values.abs().max()) > _LIMIT):
        raise SumRangeError("a step outside the exact grid's range (|v| >= 128 or not finite)")
    return torch.round(values).to(torch.int64)


def from_grid(total: Tensor) -> Tensor:
    """A grid sum as float32 (what theta is moved by)."""
    return (total.to(torch.float64) / float(2**GRID_BITS)).to(torch.float32)


class ExactSum:
    """A running integer sum of steps on the grid."""

    def __init__(self, numel: int) -> None:
        self.total = torch.zeros(numel, dtype=torch.int64)

    def add(self, step: Tensor) -> None:
        """Add one float step (put on the grid first)."""
        self.total += to_grid(step)

    def add_grid(self, values: Tensor) -> None:
        """Add a sum already on the grid (a child's)."""
        self.total += values

    def encode(self) -> bytes:
        """int32 little-endian bytes; SumRangeError if a value left the range."""
        if self.total.numel() and int(self.total.abs().max()) > _LIMIT:
            raise SumRangeError("a sum outside the wire's int32 range")
        return self.total.to(torch.int32).numpy().astype("<i4").tobytes()


def decode_grid(payload: bytes | memoryview, numel: int) -> Tensor:
    """A sum payload back to int64 grid values; ValueError if its length is not `numel` int32 values."""
    if len(payload) != 4 * numel:
        raise ValueError(f"sum payload is {len(payload)} bytes, expected {4 * numel}")
    return torch.from_numpy(np.frombuffer(payload, dtype="<i4").astype(np.int64))
