"""A peer never trains alone while saying it is in a swarm: `IsolationDetector` notices a peer that
sees other members publish updates on the DHT but merges none of them, and `diagnose` says why from what the
network counted, with the fix.

Pure: no I/O, no clock of its own (the caller passes `now`), no torch. The round hook (peer/report.py) feeds it
once per round with the live member records (`PeerNetwork.peers`: peer_id -> record, whose `seq` is the
member's own published count), this peer's version vector (sender -> highest seq merged) and the network's
counters; it prints, logs and publishes what the detector decides.

The rule. A *window* starts at the first observation and again whenever the vector's entries for other
members change (something of theirs merged, or a repair/state sync replaced them). The peer is ALONE when,
in the current window:
  - at least one other live member published: its record's `seq` advanced since the window began (or since
    we first saw it), or it holds updates we lack (`seq` above our entry for it) and we hold none of its
    updates at all; members that left, sync, or are ignored (banned) never count;
  - and the window has lasted at least `min_rounds` rounds and `min_seconds` seconds.
It is CONNECTED again at the first observation whose vector shows a change of another member's entry.
Nobody publishing (a single-peer swarm, others lingering after their last round) is never ALONE.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

MIN_ROUNDS = 3
"""Rounds without a merge from anyone, while another member publishes, before a peer says it is alone."""
MIN_SECONDS = 20.0
"""...and at least this long: fast rounds (0.2 s on a small preset) must not flag a gossip round trip."""
REPEAT_EVERY = 10
"""While alone, the terminal line is printed again every this many rounds."""
MAX_UNREACHED = 16
"""Members listed by name in a verdict (the count is exact)."""
_NOT_PUBLISHING_STATES = ("left", "syncing")

# ---- diagnoses: what the counters say, and the fix (the one place these strings live) ---------------------

DIAL = "dial"
REFUSED = "refused"
THROTTLED = "throttled"
TIMEOUT = "timeout"
INVALID = "invalid"
STUCK = "stuck"
SILENT = "silent"
UNKNOWN = "unknown"

FIXES: dict[str, tuple[str, str]] = {
    DIAL: ("the other peers cannot be dialed (behind NAT?)",
           "run `p2p-diloco doctor --bootstrap ADDR`; behind NAT join with --reachability private; on a public "
           "host open the TCP port you listen on (--port) or pass --announce /ip4/PUBLIC_IP/tcp/PORT"),
    REFUSED: ("the other peers refuse our requests (allow list, run secret, or they are busy or rate-limit us)",
              "check that every peer uses the same --run-secret-file and that your PeerID (`p2p-diloco id`) is "
              "in the run's allow list; if their logs say busy or rate limited, ask them to raise "
              "--admission.rate.* or wait"),
    THROTTLED: ("this peer refuses or throttles the others (not a member, penalized or rate limited here)",
                "check this peer's --run-secret-file / allow list and its --admission.rate.* limits"),
    TIMEOUT: ("pulls from the other peers time out (a slow or relayed link, or an unreachable peer)",
              "run `p2p-diloco doctor --bootstrap ADDR`; on a slow link raise --gossip.rpc_timeout_s or use a "
              "smaller codec"),
    INVALID: ("updates arrive but are rejected here",
              "check that every peer runs the same p2p-diloco version and spec (`p2p-diloco status` shows the "
              "reasons); see the log's rejection lines"),
    STUCK: ("updates arrive but none can merge (a gap of missing updates, or only duplicates)",
            "wait for anti-entropy or restart this peer: it will state-sync from a live peer"),
    SILENT: ("no peer announced to us and we pulled from nobody",
             "the others may not reach this peer: run `p2p-diloco doctor --bootstrap ADDR`; behind NAT join with "
             "--reachability private, on a public host pass --announce"),
    UNKNOWN: ("nothing the network counted explains it", "run `p2p-diloco doctor --bootstrap ADDR`"),
}
"""kind -> (diagnosis, fix)."""

_DIAL_REASONS = ("disconnect",)  # RpcConnectionError: "could not open ...: all dials failed / routing: not found"
_TIMEOUT_REASONS = ("timeout", "slow_stream")
_REFUSED_REASONS = ("refused",)  # rpc.RpcRemoteError: the remote refused or failed our request
_THROTTLED_REASONS = ("not_allowed", "penalized", "rate_limited", "not_member")
_STUCK_REASONS = ("rejected_buffer_full", "duplicate", "buffered", "banned_sender", "empty")
_NETWORK_COUNTERS = ("pulls", "pull_failures", "announce_failures", "announces_received", "announces_sent",
                     "updates_received", "updates_new")


@dataclass(frozen=True)
class Diagnosis:
    kind: str
    reason: str
    fix: str
    evidence: dict[str, int] = field(default_factory=dict)  # the counts it was drawn from (this window)


def _int(value: object) -> int:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return int(value)
    return 0


def _delta(now: Mapping[str, object], before: Mapping[str, object]) -> dict[str, int]:
    out = {k: _int(v) - _int(before.get(k)) for k, v in now.items() if isinstance(k, str)}
    return {k: n for k, n in out.items() if n > 0}


def diagnose(counters: Mapping[str, object], rejected_by: Mapping[str, object]) -> Diagnosis:
    """Why nothing merges, from the network's counters (`PeerNetwork.counters`: pulls, pull_failures,
    announce_failures, announces_received...) and the refusals by reason (the record's `rejected_by`: the
    intake's outcomes and the guard's counts, which include each failed pull's kind), both counted over the
    window (deltas). The first rule that matches wins, so a dial failure is named before what follows from it."""
    c = {k: _int(counters.get(k)) for k in _NETWORK_COUNTERS}
    r = {k: _int(v) for k, v in rejected_by.items() if isinstance(k, str) and _int(v) > 0}

    def total(reasons: Iterable[str]) -> int:
        return sum(r.get(k, 0) for k in reasons)

    def pick(kind: str, *reasons: str, extra: Mapping[str, int] = {}) -> Diagnosis:  # noqa: B006 (read only)
        evidence = {k: r[k] for k in reasons if r.get(k)} | {k: n for k, n in extra.items() if n}
        return Diagnosis(kind, *FIXES[kind], evidence=evidence)

    dial, timeout = total(_DIAL_REASONS), total(_TIMEOUT_REASONS)
    refused, throttled = total(_REFUSED_REASONS), total(_THROTTLED_REASONS)
    invalid = sum(n for k, n in r.items() if k not in (*_DIAL_REASONS, *_TIMEOUT_REASONS, *_REFUSED_REASONS,
                                                        *_THROTTLED_REASONS, *_STUCK_REASONS))
    failures = {"pull_failures": c["pull_failures"], "announce_failures": c["announce_failures"]}
    if dial and dial >= max(timeout, refused):
        return pick(DIAL, *_DIAL_REASONS, extra=failures)
    if c["announce_failures"] and not (c["pulls"] or c["announces_received"] or refused or timeout):
        return pick(DIAL, extra=failures)  # every announce failed and nothing else happened: cannot reach them
    if refused and refused >= timeout:
        return pick(REFUSED, *_REFUSED_REASONS, extra=failures)
    if timeout:
        return pick(TIMEOUT, *_TIMEOUT_REASONS, extra=failures)
    if throttled:
        return pick(THROTTLED, *_THROTTLED_REASONS)
    if invalid:
        return pick(INVALID, *sorted(k for k in r if k not in _STUCK_REASONS))
    if c["updates_received"] or total(_STUCK_REASONS):
        return pick(STUCK, *_STUCK_REASONS, extra={"updates_received": c["updates_received"]})
    if not (c["pulls"] or c["announces_received"] or c["pull_failures"] or c["announce_failures"]):
        return pick(SILENT)
    return pick(UNKNOWN, extra={k: c[k] for k in ("pulls", "announces_received", "announces_sent")})


# ---- the detector ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """What one observation decided. `event`: "alone" (it just became alone), "still_alone" (a reminder, every
    REPEAT_EVERY rounds), "connected" (it merged again after being alone), "cleared" (alone no more because the
    members that published went quiet or away, with nothing merged) or None (nothing to say)."""

    alone: bool
    event: str | None
    rounds: int  # rounds without a merge (this window)
    seconds: float
    publishing: int  # other members that published in the window
    unreached: tuple[dict, ...] = ()  # {"peer", "seq", "held"} per publishing member, at most MAX_UNREACHED
    diagnosis: Diagnosis | None = None
    merging_from: int = 0  # on "connected": members whose entries changed

    def line(self) -> str:
        """The terminal line for an event ("" when there is none)."""
        if self.event == "connected":
            return (f"merging again from {self.merging_from} peer{'s' * (self.merging_from != 1)} "
                    f"(after {self.rounds} rounds alone)")
        if self.event == "cleared":
            return "no longer alone: the peers we could not merge from stopped publishing or left"
        if not self.alone or self.event is None or self.diagnosis is None:
            return ""
        names = ", ".join(f"{u['peer'][-8:]} seq {u['seq']} (merged {u['held']})" for u in self.unreached[:4])
        more = f" +{self.publishing - 4}" if self.publishing > 4 else ""
        verb = "peer publishes" if self.publishing == 1 else "peers publish"
        return (f"ALONE: {self.publishing} {verb} updates but none merged "
                f"here for {self.rounds} rounds ({self.seconds:.0f}s) [{names}{more}]: {self.diagnosis.reason}"
                f"{_evidence(self.diagnosis)}. Fix: {self.diagnosis.fix}")

    def status(self) -> str | None:
        """The record's/status page's `alone` field: None when connected."""
        if not self.alone or self.diagnosis is None:
            return None
        return (f"{self.publishing} publishing peer(s) unreached for {self.rounds} rounds: {self.diagnosis.reason}"
                f"{_evidence(self.diagnosis)}. Fix: {self.diagnosis.fix}")

    def to_dict(self) -> dict[str, object]:
        d = self.diagnosis
        return {"alone": self.alone, "change": self.event, "rounds": self.rounds, "seconds": round(self.seconds, 1),
                "publishing": self.publishing, "unreached": [dict(u) for u in self.unreached],
                "merging_from": self.merging_from, "diagnosis": d.kind if d else None,
                "reason": d.reason if d else None, "fix": d.fix if d else None,
                "evidence": dict(d.evidence) if d else {}}


def _evidence(diagnosis: Diagnosis) -> str:
    shown = ", ".join(f"{k} {n}" for k, n in list(diagnosis.evidence.items())[:4])
    return f" ({shown})" if shown else ""


class IsolationDetector:
    """Fed once per round (`observe`); see the module docstring for the rule. `self_id`: this peer's PeerID,
    left out of the members and of the vector's entries."""

    def __init__(self, self_id: str, *, min_rounds: int = MIN_ROUNDS, min_seconds: float = MIN_SECONDS,
                 repeat_every: int = REPEAT_EVERY) -> None:
        self.self_id, self.min_rounds, self.min_seconds = self_id, min_rounds, min_seconds
        self.repeat_every = max(1, repeat_every)
        self.alone = False
        self.verdict: Verdict | None = None  # the latest
        self._others: dict[str, int] | None = None  # our vector's entries for other members at the last observation
        self._start: tuple[int, float] = (0, 0.0)  # (round, time) the window began
        self._seqs: dict[str, int] = {}  # member -> its record's seq at the window's start (or first sight)
        self._counters: dict[str, int] = {}  # the network's counters at the window's start
        self._rejected: dict[str, int] = {}
        self._alone_since: int = 0  # round it became alone (for the reminders)

    def observe(self, at_round: int, now: float, peers: Mapping[str, Mapping[str, object]], vector: Mapping[str, int],
                counters: Mapping[str, object] | None = None, rejected_by: Mapping[str, object] | None = None, *,
                ignore: Iterable[str] = ()) -> Verdict:
        """One round: `peers` the live member records, `vector` our replica's version vector, `counters` the
        network's counters and `rejected_by` the refusals by reason (cumulative; the detector takes deltas),
        `ignore` senders never to wait for (banned)."""
        counts = {k: _int(v) for k, v in (counters or {}).items() if isinstance(k, str)}
        rejected = {k: _int(v) for k, v in (rejected_by or {}).items() if isinstance(k, str)}
        others = {s: _int(n) for s, n in vector.items() if s != self.self_id}
        merged_from = 0 if self._others is None else sum(
            1 for s in others.keys() | self._others.keys() if others.get(s, 0) != self._others.get(s, 0))
        first = self._others is None
        self._others = others
        if first or merged_from:
            was_alone, rounds, seconds = self.alone, at_round - self._start[0], now - self._start[1]
            self._reset(at_round, now, peers, counts, rejected)
            event = "connected" if was_alone else None
            self.verdict = Verdict(False, event, rounds if was_alone else 0, seconds if was_alone else 0.0, 0,
                                   merging_from=merged_from)
            return self.verdict
        skip = set(ignore)
        found: list[tuple[str, int, int]] = []  # (peer, seq, held)
        for pid, record in peers.items():
            if pid == self.self_id or pid in skip or not isinstance(pid, str):
                continue
            seq = _int(record.get("seq"))
            base = self._seqs.setdefault(pid, seq)
            state = record.get("state")
            if state in _NOT_PUBLISHING_STATES:
                continue
            held = others.get(pid, 0)
            # it published during the window (or ever, and we hold nothing of it) and we still lack some of it
            if seq > held and (seq > base or held == 0):
                found.append((pid, seq, held))
        rounds, seconds = at_round - self._start[0], now - self._start[1]
        alone = bool(found) and rounds >= self.min_rounds and seconds >= self.min_seconds
        event = None
        if alone and not self.alone:
            event, self._alone_since = "alone", at_round
        elif alone and (at_round - self._alone_since) % self.repeat_every == 0 and at_round != self._alone_since:
            event = "still_alone"
        elif not alone and self.alone:  # the publishers went quiet or away: no longer a reason to warn
            event = "cleared"
        self.alone = alone
        found.sort(key=lambda f: (-(f[1] - f[2]), f[0]))
        unreached = tuple({"peer": pid, "seq": seq, "held": held} for pid, seq, held in found[:MAX_UNREACHED])
        diagnosis = diagnose(_delta(counts, self._counters), _delta(rejected, self._rejected)) if alone else None
        self.verdict = Verdict(alone, event, rounds, seconds, len(found), unreached, diagnosis)
        return self.verdict

    def _reset(self, at_round: int, now: float, peers: Mapping[str, Mapping[str, object]], counters: dict[str, int],
               rejected: dict[str, int]) -> None:
        self.alone = False
        self._start = (at_round, now)
        self._seqs = {pid: _int(r.get("seq")) for pid, r in peers.items() if isinstance(pid, str)}
        self._counters, self._rejected = counters, rejected


def alone_lines(records: Mapping[str, Mapping[str, object]], limit: int = 400) -> list[str]:
    """`status` footer: one line per peer whose (untrusted) record says it is alone."""
    lines = []
    for pid, record in sorted(records.items()):
        why = record.get("alone") if isinstance(record, Mapping) else None
        if isinstance(pid, str) and isinstance(why, str) and why:
            shown = "".join(ch if ch.isprintable() else "?" for ch in why[:limit])
            lines.append(f"{pid[-8:]} ALONE: {shown}")
    return lines
