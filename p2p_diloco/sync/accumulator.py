"""theta as the replica sums into it: the merge's axpy, guarded against float32 overflow (the last check of
rule 4 in sync/replica.py: the merge's result must be finite). Not thread-safe: the replica holds its lock."""

from __future__ import annotations

import torch
from torch import Tensor

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

    def subtract(self, step: Tensor, bound: float) -> bool:
        """theta -= step, unless the result would not be finite (False, theta unchanged); `bound` >= max|step|."""
        if self._peak_bound + bound > _F32_MAX:
            self._peak_bound = peak(self.theta)  # the cheap bound is too loose; measure
        if self._peak_bound + bound > _F32_MAX:
            trial = self.theta - step  # rare: the merge may overflow, so try it on a copy
            if not bool(torch.isfinite(trial).all()):
                return False
            self.theta.copy_(trial)
            self._peak_bound = peak(self.theta)
        else:
            self.theta.sub_(step)
            self._peak_bound += bound
        return True

    def add(self, step: Tensor) -> None:
        """theta += step (a merged step taken back)."""
        self.theta.add_(step)
        self._peak_bound = peak(self.theta)

    def load(self, theta: Tensor) -> None:
        """Copy `theta` in (a checked, same-shape tensor) in place, so references to the live tensor stay valid."""
        self.theta.copy_(theta)
        self._peak_bound = peak(self.theta)
