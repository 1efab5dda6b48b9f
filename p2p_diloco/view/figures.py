"""The figures people compare across views, each defined once: the terminal view, the web page, `/metrics`,
`p2p-diloco status` and the peer's own round line all read them through these functions, under these names.

    reachability    whether others can dial a peer, as its own dial-back probe found (peer/reach.py): the
                    `reach` field of its record, `node.reachability` of the observer. Never guessed from the
                    addresses a peer announces: a peer on 10.x behind a port forward is public, and one on a
                    public IP behind a firewall is not.
    rejected        updates a peer refused: they failed the intake's checks. The peer counts it
                    (peer/network_counters.py) for its own round line and carries it in its record; every view
                    reads that number. Honest duplicates are not refusals: gossip delivers each update along
                    several paths, so a healthy swarm counts one for most of them.
    refused         requests the peer's network turned away (busy, rate limits, fair share, access), carried the
                    same way. `rejected_by` lists both kinds and vetting's verdicts (`vetting_*`) by reason,
                    duplicates left out.
    agreement       whether the live replicas hold the same updates: `agree` (one version vector), `in_flight`
                    (several, while updates travel: a peer merges its own update a moment before the others
                    do), or `diverged` (some peer still lacks an update that another live peer has held for
                    over `STUCK_S`). Peers that lack such an update are `behind`.

Why the time rule for `diverged`: version vectors of a training swarm differ almost always (each peer is a round
ahead on its own updates), so "several vectors" says nothing. What is wrong is an update that does not arrive:
gossip and pulls deliver one within seconds, so a live replica that still lacks it a minute after another peer
held it is cut off or stuck. Equal vectors mean equal replicas (the merge is deterministic), so peers in one
group never disagree. `ReplicaWatch` remembers, from the records it was shown, since when each update was held;
a single read (no history) can tell `agree` from `in_flight` only.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from p2p_diloco.net.discovery.status import counts, number, text

REACHABILITY = ("public", "private", "unknown")
"""What the probe says: others dialled us back (public), could not (private: reached through a relay), or no
bootstrap answered (unknown)."""
HONEST_REASONS = ("duplicate",)
"""Reasons in `rejected_by` that are not refusals of anything wrong (an update we already hold)."""
AGREEMENT_STATES = ("agree", "in_flight", "diverged")
STUCK_S = 60.0
"""A live replica lacking an update another live peer has held this long is `behind` (`diverged`)."""
NOT_REPLICAS = ("syncing", "left")
"""States whose replica is not compared: a joiner's is being replaced, a peer that left holds none any more."""
CLOCK_SLACK_S = 30.0
"""A record's time is taken as at most this much older than when we read it, and never newer: it is a peer's
claim (a wrong clock, or a forged one, must not make an update look held for long the moment it is read)."""
MAX_WATCHED_SENDERS = 256
"""Senders whose seqs `ReplicaWatch` remembers (records are cheap to forge: memory must stay bounded)."""
MAX_MARKS = 1024
"""Per sender, the levels remembered (the oldest go first; a replica behind by more is behind anyway)."""


def reachability(reach: Any) -> str:
    """A probe's verdict (a record's `reach`, a node's `reachability`) as shown: public, private or unknown."""
    return reach if isinstance(reach, str) and reach in REACHABILITY else "unknown"


def rejected_by(record: Mapping[str, Any]) -> dict[str, int] | None:
    """A record's refusals by reason, honest duplicates left out; None when the record carries none (an old
    peer, or a record that dropped the field to fit the DHT's size limit)."""
    if not isinstance(record.get("rejected_by"), dict):
        return None
    return {k: n for k, n in counts(record, "rejected_by").items() if k not in HONEST_REASONS}


def rejected(record: Mapping[str, Any]) -> int | None:
    """The `rejected` figure a peer carries in its record (None when the record has none, e.g. an old peer)."""
    return _count(record, "rejected")


def refused(record: Mapping[str, Any]) -> int | None:
    """The `refused` figure a peer carries in its record (None when the record has none)."""
    return _count(record, "refused")


def _count(record: Mapping[str, Any], key: str) -> int | None:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _vector(record: Mapping[str, Any]) -> dict[str, int] | None:
    vv = record.get("vv")
    if not isinstance(vv, dict):
        return None
    return {k: v for k, v in vv.items() if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
            and v >= 0}


def _is_replica(record: Mapping[str, Any]) -> bool:
    return text(record, "state") not in NOT_REPLICAS


class _Held:
    """One counter (a sender's seq, or the version-vector total): levels seen held, each with the time a level at
    or above it was first seen. Levels rise, and so do their times. At most `max_marks`, the lowest go first."""

    def __init__(self, max_marks: int) -> None:
        self.max_marks = max_marks
        self.levels: list[int] = []
        self.since: list[float] = []

    def mark(self, level: int, at: float) -> None:
        """Every level up to `level` was held at `at` (records arrive in any order: an earlier sighting lowers
        the times it covers)."""
        if level <= 0:
            return
        i = bisect.bisect_right(self.levels, level)
        while i > 0 and self.since[i - 1] > at:
            i -= 1
            self.since[i] = at
        if not self.levels or level > self.levels[-1]:
            self.levels.append(level)
            self.since.append(at)
            if len(self.levels) > self.max_marks:
                del self.levels[0], self.since[0]

    def held_since(self, level: int) -> float | None:
        """When some live peer first held `level` (or more), or None if none did."""
        i = bisect.bisect_left(self.levels, level)
        return self.since[i] if i < len(self.levels) else None


class ReplicaWatch:
    """Since when each update has been held by a live peer, as the records showed it: per sender, the record time
    (`updated_at`, clamped: CLOCK_SLACK_S) at which each new highest seq was first seen; for records without `vv`
    (a vector of more than 16 senders), the same for the version-vector total. Bounded in senders and levels."""

    def __init__(self, stuck_s: float = STUCK_S, max_senders: int = MAX_WATCHED_SENDERS,
                 max_marks: int = MAX_MARKS) -> None:
        self.stuck_s, self.max_senders, self.max_marks = stuck_s, max_senders, max_marks
        self._seqs: OrderedDict[str, _Held] = OrderedDict()
        self._totals = _Held(max_marks)

    def observe(self, records: Mapping[str, Mapping[str, Any]], now: float) -> None:
        for record in records.values():
            if not _is_replica(record):
                continue
            at = min(max(number(record, "updated_at", now), now - CLOCK_SLACK_S), now)
            for sender, seq in (_vector(record) or {}).items():
                held = self._seqs.get(sender)
                if held is None:
                    held = self._seqs[sender] = _Held(self.max_marks)
                    while len(self._seqs) > self.max_senders:
                        self._seqs.popitem(last=False)
                self._seqs.move_to_end(sender)
                held.mark(seq, at)
            self._totals.mark(int(number(record, "version_vector_total")), at)

    def behind(self, records: Mapping[str, Mapping[str, Any]], now: float) -> dict[str, float]:
        """Live peers whose record lacks an update some live peer holds now and had held for over `stuck_s`
        when that record was written: peer_id -> for how long (s)."""
        replicas = {pid: r for pid, r in records.items() if _is_replica(r)}
        vectors = {pid: _vector(r) for pid, r in replicas.items()}
        top: dict[str, int] = {}
        for vv in vectors.values():
            for sender, seq in (vv or {}).items():
                top[sender] = max(top.get(sender, 0), seq)
        top_total = max((int(number(r, "version_vector_total")) for r in replicas.values()), default=0)
        out = {}
        for pid, record in replicas.items():
            at, vv = min(number(record, "updated_at", now), now), vectors[pid]
            if vv is not None:
                lacks = [held.held_since(vv.get(s, 0) + 1) for s, seq in top.items()
                         if vv.get(s, 0) < seq and (held := self._seqs.get(s)) is not None]
            else:
                total = int(number(record, "version_vector_total"))
                lacks = [self._totals.held_since(total + 1)] if total < top_total else []
            lag = max((at - since for since in lacks if since is not None), default=0.0)
            if lag > self.stuck_s:
                out[pid] = round(lag, 1)
        return out


def agreement(rows: Sequence[Mapping[str, Any]], behind: Mapping[str, float] | None = None,
              stuck_s: float = STUCK_S) -> dict[str, Any]:
    """The `agreement` figure of the snapshot's rows (`behind`: from `ReplicaWatch.behind`; None: no history).

    `groups`: live replicas grouped by version-vector digest, the biggest first (equal digests, equal replicas).
    """
    groups: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["state"] in NOT_REPLICAS:
            continue
        group = groups.setdefault(row["vv_digest"], {"digest": row["vv_digest"], "vv_total": row["vv_total"],
                                                      "peers": []})
        group["peers"].append(row["peer_id"])
    ordered = sorted(groups.values(), key=lambda g: (-len(g["peers"]), -g["vv_total"], g["digest"]))
    members = {pid for g in ordered for pid in g["peers"]}
    lagging = {pid: s for pid, s in (behind or {}).items() if pid in members} if len(ordered) > 1 else {}
    state = "agree" if len(ordered) <= 1 else "diverged" if lagging else "in_flight"
    return {"state": state, "agree": state == "agree", "groups": ordered, "behind": lagging, "stuck_s": stuck_s}
