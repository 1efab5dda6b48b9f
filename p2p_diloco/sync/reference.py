"""A replica's reference direction (sync/standing.py): an exponential average of the payloads of authors in good
standing, this peer's own included, and how a new payload compares with it.

Only promotion reads it by default (an update along it, at full weight, counts towards its author's good
standing); `min_agreement`, `max_norm_ratio` and `full_agreement` (config/defence.py) refuse by it opt-in. All three
misfired on honest work in real-process runs (a joiner's first update at cos -0.63 with two replicas' references
and not a third's; cosines down to -0.2 late in a run; norms 3.2-3.9x after a pause at H=2).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from p2p_diloco.sync.decoded import Decoded

REFERENCE_DECAY = 0.7
"""Weight of the old reference when a payload in good standing is folded in (about the last 3 updates)."""
REFERENCE_SAMPLE = 1 << 20
"""Coordinates the reference keeps (4 MB): all of a smaller model's; of a larger one, this many fixed random
coordinates, the same on every replica. A direction needs no full-size vector: the cosine over a million random
coordinates is within ~0.001 of the full one, and a full copy would cost every replica 4 bytes per parameter."""
NORM_DECAY = 0.9
"""The reference norm is a decaying maximum of the norms folded in: honest norms grow during warm-up and jump
after a restart, and an average lags behind them (an honest update measured 3.1x an average in a test)."""


class Reference:
    """The reference direction (None until the first payload in good standing) and its decaying peak norm."""

    def __init__(self) -> None:
        self.vector: Tensor | None = None  # over `at`'s coordinates (all of them for a small model)
        self.norm = 0.0  # decaying maximum of the (full) norms of the payloads folded into the reference
        self.at: Tensor | None = None

    def sample_at(self, numel: int) -> Tensor | None:
        """The fixed coordinates kept of a payload of `numel` values (None: all of them)."""
        if numel <= REFERENCE_SAMPLE:
            return None
        if self.at is None or int(self.at[-1]) >= numel:  # sorted: the last is the largest
            g = torch.Generator().manual_seed(0)  # fixed: every replica keeps the same coordinates
            # not randperm (8 B/param); sorted, so a pass over a payload takes them in order (sync/decoded.py)
            self.at = torch.randint(0, numel, (REFERENCE_SAMPLE,), generator=g).sort().values
        return self.at

    def _sample(self, delta: Decoded) -> Tensor:
        at = self.sample_at(delta.numel)
        return delta.whole() if at is None else delta.take(at)

    def compare(self, delta: Tensor | Decoded) -> tuple[float, float]:
        """(cosine of `delta` with the reference, its norm over the reference norm); 1.0 where a norm is 0."""
        if self.vector is None:
            raise ValueError("no reference yet: nothing to compare with")
        decoded = Decoded.of(delta)
        sample = self._sample(decoded)
        norm, sample_norm = decoded.norm(), float(sample.norm())
        ref_norm = float(self.vector.norm())
        agreement = float(torch.dot(sample, self.vector)) / (sample_norm * ref_norm) \
            if sample_norm > 0 and ref_norm > 0 else 1.0
        ratio = norm / self.norm if self.norm > 0 else 1.0
        return agreement, ratio

    def fold(self, delta: Tensor | Decoded) -> None:
        """Fold a payload in good standing into the reference (a zero or non-finite one is left out)."""
        decoded = Decoded.of(delta)
        norm = decoded.norm()
        if not (norm > 0 and math.isfinite(norm)):
            return
        sample = self._sample(decoded)
        if self.vector is None:
            self.vector, self.norm = sample.clone(), norm
            return
        self.vector.mul_(REFERENCE_DECAY).add_(sample, alpha=1.0 - REFERENCE_DECAY)
        self.norm = max(norm, NORM_DECAY * self.norm)
