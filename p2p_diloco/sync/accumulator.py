"""theta as the replica sums into it: the merge's axpy, guarded against float32 overflow (the last check of
rule 4 in sync/replica.py: the merge's result must be finite). Not thread-safe: the replica holds its lock."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

from p2p_diloco.sync.decoded import Decoded
from p2p_diloco.sync.robust import peak
from p2p_diloco.sync.screening import check_theta

_F32_MAX = float(torch.finfo(torch.float32).max)


class Accumulator:
    """A flat float32 theta, summed into in place, and an upper bound on max|theta_i|."""

    def __init__(self, theta: Tensor) -> None:
        check_theta(theta)
        self.theta = theta.detach()
        # Upper bound on max|theta_i|, grown by max|step_i| per merge (triangle inequality): lets the overflow
        # guard skip a full pass over theta until the bound gets near the float32 range.
        self._peak_bound = peak(self.theta)

    def subtract(self, step: Tensor | Decoded, bound: float, *, factor: float = 1.0, multiplier: float = 1.0) -> bool:
        """theta -= (step * factor) * multiplier, unless the result would not be finite (False, theta unchanged);
        `bound` >= max|step * factor|, multiplier <= 1. The product is made a chunk at a time, bit for bit the
        whole one, so a merge needs no full-size temporary (ARCHITECTURE.md "Memory")."""
        if self._peak_bound + bound > _F32_MAX:
            self._peak_bound = peak(self.theta)  # the cheap bound is too loose; measure
        if self._peak_bound + bound > _F32_MAX:
            trial = self.theta.clone()  # rare: the merge may overflow, so try it on a copy
            for part, value in _chunks(step, factor, multiplier):
                trial[part].sub_(value)
            if not math.isfinite(peak(trial)):
                return False
            self.theta.copy_(trial)
            self._peak_bound = peak(self.theta)
        else:
            for part, value in _chunks(step, factor, multiplier):
                self.theta[part].sub_(value)
            self._peak_bound += bound
        return True

    def add(self, step: Tensor | Decoded, *, factor: float = 1.0, multiplier: float = 1.0) -> None:
        """theta += (step * factor) * multiplier (a merged step taken back)."""
        for part, value in _chunks(step, factor, multiplier):
            self.theta[part].add_(value)
        self._peak_bound = peak(self.theta)

    def load(self, theta: Tensor) -> None:
        """Copy `theta` in (a checked, same-shape tensor) in place, so references to the live tensor stay valid."""
        self.theta.copy_(theta)
        self._peak_bound = peak(self.theta)


def _chunks(step: Tensor | Decoded, factor: float, multiplier: float) -> Iterator[tuple[slice, Tensor]]:
    """(slice, (step * factor) * multiplier on it): the same rounding as the whole product, a chunk at a time
    (sync/decoded.py's chunks: a payload is decoded one chunk at a time)."""
    for part, value in Decoded.of(step).chunks():
        if factor != 1.0:
            value = value * factor
        if multiplier != 1.0:
            value = value * multiplier
        yield part, value
