"""What the guard refused, counted: by reason in all (what `status` shows) and by remote (the worst offenders)."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

MAX_REJECTION_PEERS = 256
"""Remotes whose rejection counts are kept (least recently counted forgotten first)."""


class Rejections:
    """Rejections by reason in all, and by remote for the last `max_peers` remotes counted."""

    def __init__(self, max_peers: int = MAX_REJECTION_PEERS) -> None:
        self.max_peers = max_peers
        self.totals: Counter[str] = Counter()
        self._by_peer: OrderedDict[str, Counter[str]] = OrderedDict()

    def count(self, peer: str, reason: str, n: int = 1, *, in_totals: bool = True) -> None:
        """Count `n` rejections of `reason` against `peer`; `in_totals=False` for reasons already totalled
        elsewhere (the intake counts its own)."""
        if in_totals:
            self.totals[reason] += n
        counts = self._by_peer.pop(peer, None) or Counter()
        counts[reason] += n
        self._by_peer[peer] = counts
        while len(self._by_peer) > self.max_peers:
            self._by_peer.popitem(last=False)

    def of(self, peer: str) -> dict[str, int]:
        return dict(self._by_peer.get(peer, {}))

    def offenders(self, k: int, *, max_reasons: int = 8,
                  ignore: Iterable[str] = ("duplicate",)) -> dict[str, dict[str, int]]:
        """The `k` remotes with the most rejections (reasons in `ignore` do not rank, e.g. honest duplicates),
        each with its `max_reasons` most frequent reasons."""
        skip = set(ignore)
        ranked = sorted(((sum(n for r, n in c.items() if r not in skip), pid) for pid, c in self._by_peer.items()),
                        reverse=True)
        return {pid: dict(self._by_peer[pid].most_common(max_reasons)) for score, pid in ranked[:k] if score > 0}
