"""When a running peer cannot catch up by pulls: the detector, pure (no I/O, no clock of its own).

Pulls bring a sender's updates in seq order: a replica merges `(sender, seq)` only as `V[sender] + 1` (or a hole).
So a replica that can catch up by pulls moves its entry for every sender that others hold more of. It cannot
when the updates it lacks next are held by nobody who serves them (they live only inside snapshots: the peers'
stores evicted them, or they came to everyone else in a state sync), and the gap is wider than the replica may
skip (`max_hole_span`, sync/replica.py rule 6); then every later update of that sender waits in the buffer until
it is full (`rejected_buffer_full`), is refused, pulled again, refused again, forever.

`LagWatch.observe(now, ours, others, ...)` is called every few seconds with our vector and the vectors other live
peers hold. Per sender (not us, not banned) it tracks since when we have been behind some peer on that sender
*without our entry moving*. A sender is stalled once that lasted:

- `window_s`, with hard evidence that pulls cannot help: our buffer refused updates meanwhile
  (`buffer_full` rose), or the peers hold more than `max_hole_span + 1` seqs of it beyond our entry (a gap
  the replica would never skip); or
- `2 * window_s`, behind by at least `min_behind` updates at every observation of that time.

A healthy peer that is just a bit behind moves its entry for each sender every round (pulls and announces
bring the next seq), so its timers restart; one that is behind by one update in flight (a slow transfer) is
below `min_behind`. `Stuck` says by how much, from whom, for how long; the caller re-syncs state from one of
`Stuck.donors` (peer/resync.py) and then calls `reset`.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass, field

from p2p_diloco.sync.version_vector import VersionVector


@dataclass(frozen=True)
class Stuck:
    """The verdict: we cannot catch up by pulls."""

    behind: int
    """Updates of the stalled senders that the most advanced peer holds and we lack (per sender, the max)."""
    senders: tuple[str, ...]
    """The stalled senders."""
    donors: tuple[str, ...]
    """Peers that hold more of the stalled senders than we do: most of them first, then the largest vector."""
    stalled_s: float
    """How long the longest stalled sender's entry has not moved while others held more."""
    why: str
    """"buffer full", "gap beyond max_hole_span" or "no progress"."""


@dataclass
class _Behind:
    since: float
    entry: int
    min_ahead: int
    buffer_full_at_start: int
    spans_at_start: bool = field(default=False)


class LagWatch:
    """Tracks, per sender, how long we stayed behind the others without moving; says when pulls cannot help."""

    def __init__(self, window_s: float, *, self_id: str = "", max_hole_span: int = 16, min_behind: int = 2) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s, self.self_id = float(window_s), self_id
        self.max_hole_span, self.min_behind = int(max_hole_span), max(1, int(min_behind))
        self._behind: dict[str, _Behind] = {}

    def reset(self) -> None:
        """Forget every timer (after a re-sync, or an attempt: the next verdict needs a whole window again)."""
        self._behind.clear()

    def behind_senders(self) -> dict[str, float]:
        """Sender -> since when we are behind on it without moving (for logs and tests)."""
        return {s: b.since for s, b in self._behind.items()}

    def observe(self, now: float, ours: VersionVector, others: Mapping[str, VersionVector], *,
                buffer_full: int = 0, banned: Container[str] = frozenset()) -> Stuck | None:
        """One observation: our vector, the other live peers' (peer -> vector) and our replica's cumulative
        count of `rejected_buffer_full`. Returns a `Stuck` when some sender is stalled (module doc), else None."""
        ahead: dict[str, int] = {}
        for vv in others.values():
            for sender in vv:
                if sender == self.self_id or sender in banned:
                    continue
                entry = ours.get(sender)
                n = vv.get(sender) - entry - sum(1 for q in vv.holes(sender) if q > entry)  # what they hold
                if n > ahead.get(sender, 0):
                    ahead[sender] = n
        for sender in [s for s in self._behind if s not in ahead]:
            del self._behind[sender]  # caught up (or the peers that held more are gone)
        stalled: dict[str, tuple[float, str]] = {}
        for sender, n in ahead.items():
            entry = ours.get(sender)
            b = self._behind.get(sender)
            if b is None or b.entry != entry:  # new, or our entry moved: pulls work for this sender
                self._behind[sender] = _Behind(now, entry, n, buffer_full)
                continue
            b.min_ahead = min(b.min_ahead, n)
            waited = now - b.since
            if waited >= self.window_s and buffer_full > b.buffer_full_at_start:
                stalled[sender] = (waited, "buffer full")
            elif waited >= self.window_s and b.min_ahead > self.max_hole_span + 1:
                stalled[sender] = (waited, "gap beyond max_hole_span")
            elif waited >= 2 * self.window_s and b.min_ahead >= self.min_behind:
                stalled[sender] = (waited, "no progress")
        if not stalled:
            return None
        senders = tuple(sorted(stalled, key=lambda s: -stalled[s][0]))
        stalled_s, why = stalled[senders[0]]

        def coverage(peer: str) -> tuple[int, int]:
            vv = others[peer]
            return sum(max(0, vv.get(s) - ours.get(s)) for s in senders), vv.total()

        holders = [p for p in others if coverage(p)[0] > 0]
        donors = tuple(sorted(holders, key=lambda p: tuple(-x for x in coverage(p))))
        return Stuck(behind=sum(ahead[s] for s in senders), senders=senders, donors=donors, stalled_s=stalled_s,
                     why=why)


def order_donors(donors: tuple[str, ...] | list[str], records: Mapping[str, Mapping], *,
                 proven: Container[str] = frozenset(), penalized: Container[str] = frozenset()) -> list[str]:
    """The detector's donors in the order to ask them: proven contributors first (sync/standing.py), then those
    whose record says they are reachable directly (`"reach": "public"`; absent: unknown), keeping the
    detector's order within each; penalized peers are dropped."""
    def key(indexed: tuple[int, str]) -> tuple[int, int, int]:
        index, peer = indexed
        record = records.get(peer) or {}
        return (0 if peer in proven else 1, 0 if record.get("reach") == "public" else 1, index)

    ranked = sorted(enumerate(donors), key=key)
    return [peer for _, peer in ranked if peer not in penalized]
