"""What a proposal is worth to a sponsor (sync/sponsorship.py): FLTrust's rule (Cao et al. 2021) on the
sponsor's own secret sample of the coordinates (sync/sponsorship.py `sample_at`). Pure: no state, no I/O.

`v = max(0, cos) * min(1, length / |u|)`, `cos` the larger of the proposal's cosines with the directions it is
judged by, `length` what one sponsor's update measures (a longer proposal is scaled down: work scaled up within
the norm bound gains nothing); `keep = share * min(1, length / |u|)` for a proposal that points along them at
all (a graduate's step relayed as a member's), else 0. No direction, or a non-finite cosine: (0, 0).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from p2p_diloco.sync.echoes import new_parts

Along = tuple[Tensor, float]
"""A direction to judge by, with its length (computed once, then used for every proposal of a phase)."""


def along(direction: Tensor) -> Along | None:
    """`direction` with its length; None for a zero or non-finite one (nothing to judge by)."""
    length = float(direction.norm())
    return (direction, length) if length > 0 and math.isfinite(length) else None


def cosine(sample: Tensor, norm: float, direction: Along | None) -> float:
    """The cosine of `sample` (length `norm`) with `direction`; -inf with none."""
    if direction is None or not norm > 0:  # nothing new in it (all along theta's recent moves): no direction
        return -math.inf
    return float(torch.dot(sample, direction[0])) / (norm * direction[1])


def worth(sample: Tensor, directions: tuple[Along | None, ...], length: float, share: float,
          floor: float = 0.0) -> tuple[float, float]:
    """(v, keep) of a proposal's `sample` (see the module docstring); `v` is 0 for a cosine under `floor` (many
    proposals each judged a little sum to a full share), `keep` is not (a graduate's work is judged one at a time)."""
    norm = float(sample.norm())
    return worth_of(max((cosine(sample, norm, d) for d in directions), default=-math.inf), norm, length, share,
                    floor)


def worth_of(cos: float, norm: float, length: float, share: float, floor: float = 0.0) -> tuple[float, float]:
    """`worth` from a proposal's best cosine `cos` and its sample's `norm` (a sponsor that judges a phase's
    proposals at once computes those for all of them in one product)."""
    if not math.isfinite(cos):
        return 0.0, 0.0
    capped = min(1.0, length / norm)
    return (min(1.0, cos) * capped if cos >= max(floor, 0.0) else 0.0), (share * capped if cos > 0 else 0.0)


def worths(samples: Tensor, fresh: list[Tensor], directions: tuple[Along | None, ...], length: float, share: float,
           floor: float = 0.0, echoes: list[bool] | None = None) -> list[tuple[float, float]]:
    """`worth` of each row of `samples` without its components along the orthonormal `fresh` (what is no longer
    new, sync/echoes.py), in a few matrix products for the whole batch: a sponsor judges a phase's proposals at
    once, and one Python-level call per proposal and direction was most of what judging cost on small models.
    A row marked in `echoes` (an echo of published work: sync/echoes.py `echoing`), or with nothing outside `fresh`,
    is worth (0, 0)."""
    whole = samples.norm(dim=1)
    samples = new_parts(samples, fresh)
    new = samples.norm(dim=1)
    # Nothing new: a proposal along theta's recent moves only (theta's own move, sent back) keeps a part of float
    # rounding, whose direction is noise: worth nothing, not a cosine read off that noise.
    echoes = [e or bool(n) for e, n in zip(echoes or [False] * len(new), (new <= 1e-4 * whole).tolist())]
    norms = new.tolist()
    best = [-math.inf] * len(norms)
    for d in directions:
        if d is not None:
            dots = (samples @ d[0]).tolist()
            best = [max(b, dot / (norm * d[1])) if norm > 0 else b for b, dot, norm in zip(best, dots, norms)]
    return [(0.0, 0.0) if e else worth_of(cos, norm, length, share, floor) for cos, norm, e in zip(best, norms, echoes)]
