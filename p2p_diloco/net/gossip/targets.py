"""Whom gossip talks to first: the peers an announce or an anti-entropy pull goes to.

Peers we trade with come first (ARCHITECTURE.md "Where each protocol rule lives", announce and anti-entropy
targets): records cost nothing, and a crowd of them in the view would otherwise take almost every announce and
anti-entropy pull. One pick in NEWCOMER_PICK_EVERY still goes to anyone, so a new honest peer is reached too.
Penalized peers are never picked.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Sequence

from p2p_diloco.net.admission.guard import PeerGuard

logger = logging.getLogger(__name__)

NEWCOMER_PICK_EVERY = 4
"""With contributors enough to fill an announce or anti-entropy pick, one pick in this many includes a peer we
have no record of (a new honest peer is reached; a crowd of records gets a quarter of one pick)."""


class PeerPicker:
    """Random live peers of the run, contributors first (see the module docstring)."""

    def __init__(self, self_id: str, run_id: str, peers: Callable[[], Sequence[str]], guard: PeerGuard | None,
                 rng: random.Random) -> None:
        """`peers` returns the live peer ids of the run (e.g. from the DHT records); `self_id` is filtered out."""
        self.self_id, self.run_id = self_id, run_id
        self._peers, self._guard, self._rng = peers, guard, rng

    def pick(self, k: int, exclude: Iterable[str]) -> list[str]:
        """Up to `k` peers, none of `exclude`; [] when the peers callback fails (logged)."""
        try:
            peers = list(dict.fromkeys(self._peers()))
        except Exception:
            logger.exception("the peers callback failed run_id=%s", self.run_id)
            return []
        guard = self._guard
        skip = {self.self_id, *exclude}
        candidates = [p for p in peers if isinstance(p, str) and p not in skip
                      and (guard is None or not guard.is_penalized(p))]
        if guard is None:
            return self._rng.sample(candidates, min(k, len(candidates)))
        contributors = [p for p in candidates if guard.is_contributor(p)]
        others = [p for p in candidates if not guard.is_contributor(p)]
        picked = self._rng.sample(contributors, min(k, len(contributors)))
        if others and (len(picked) < k or self._rng.random() < 1 / NEWCOMER_PICK_EVERY):
            extra = self._rng.sample(others, min(max(1, k - len(picked)), len(others)))
            picked = (picked + extra)[-k:] if len(picked) >= k else picked + extra
        return picked[:k]
