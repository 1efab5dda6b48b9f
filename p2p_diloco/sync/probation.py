"""Probation: the deterministic part of the weight an update merges with (sync/standing.py), and how a weight
multiplier applies to a merged step.

An author's k-th update (its signed seq) merges at `probation * 2**(k-1)` of its weight, capped at 1: with the
default 0.25, at 1/4, 1/2, then in full from the 3rd update on. The seq is signed and the same on every replica
(the author's own included), so probation keeps the merge rule exact: replicas that merged the same set are
still equal. An honest volunteer that joins late reaches full weight after two updates; a fresh identity's first
updates are worth a fraction while it is vetted.
"""

from __future__ import annotations


def probation_multiplier(seq: int, probation: float) -> float:
    """The deterministic part: `probation * 2**(seq-1)`, capped at 1 (1 with probation >= 1)."""
    if probation >= 1.0 or seq >= 64:
        return 1.0
    return min(1.0, probation * 2.0 ** (max(1, seq) - 1))

