"""The verdict of vetting on one update (sync/standing.py): the fraction of its signed weight it merges with here,
and the reason, named the same in every view (`Standing.stats`, the peer's report)."""

from __future__ import annotations

import math
from dataclasses import dataclass

REFUSALS = ("disagrees", "too_long", "copy", "negated_copy")
"""Verdicts that refuse an update and count a strike against its author."""
TIED = "tied_copy"
"""Two authors not in good standing sent one payload (up to a scale): both merge at 0, with no strike."""
REFUSED = "refused"
"""The state of a copy-window entry found to copy an author in good standing (its author struck)."""
PROMOTE_AGREEMENT = 0.0
"""Cosine with the reference above which a full-weight update puts its author in good standing (its payloads win
a copy pair; they are folded into the reference). Only promotion: an update below it still merges (refusing
needs `min_agreement`), so an honest author whose update points away for a round loses only that edge until its
next one; a sign-flipped copy, which points away early in a run, never earns standing."""


@dataclass(frozen=True)
class Verdict:
    """How much of its signed weight one update merges with here, and why."""

    multiplier: float
    reason: str = ""  # "" (full weight), "probation", "copy", "negated_copy", TIED, "unvetted", "distrusted",
    #                   and the opt-in "disagrees", "too_long", "low_agreement"
    agreement: float = math.nan  # cosine with the reference (nan: not compared)
    norm_ratio: float = math.nan
    average: float = math.nan  # the author's average agreement, this update included (nan: not compared)

    @property
    def vetted(self) -> bool:
        """Compared with a reference and found in line (agreement above PROMOTE_AGREEMENT): only such an update,
        at full weight, puts its author in good standing (an unvetted full weight earns none)."""
        return not math.isnan(self.agreement) and self.agreement > PROMOTE_AGREEMENT and self.multiplier > 0
