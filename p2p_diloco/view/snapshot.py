"""The swarm as people see it: one JSON-ready snapshot that the terminal view, the web page and the metrics all
render, so the three always show the same figures.

A snapshot is built from the peers' signed DHT records (net/discovery/status.py says what they carry), the
observer's own figures when the observer is a peer, and two bounded histories: `Curves` (each peer's loss as
its records said it, sampled over time) and the observer's own round history (`local`, from the round hook).

    run_id, spec_hash, now          the run, its spec hash (None when unpublished), DHT time of the snapshot
    observer                        who serves it: kind (peer | bootstrap | status), peer_id, reachability (its
                                    own probe's verdict, view/figures.py), addrs
    self                            the observer peer's own figures (None for a bootstrap or `status`); its
                                    `alone` says why it merges nothing while others publish, or is None
    peers                           one row per live record (`peer_row`), freshest replica first; a row's
                                    `alone` is that peer's own word that it is cut off (peer/isolation.py)
    agreement                       agree | in_flight | diverged, the live replicas grouped by version-vector
                                    digest, and the peers `behind` (view/figures.py says the rule)
    vv_matrix                       holders x senders: the seq of each sender each holder has merged (from the
                                    records' `vv` field, present while a vector names at most 16 senders)
    curves                          {peer_id: [[time, round, loss, eval_loss], ...]}
    local                           the observer's own rounds: time, round, loss, eval, bytes, utilization

Every record field is untrusted: it is read with `number`/`text`/`counts`, and strings stay strings (the views
escape them). The figures people compare across views (reachability, rejected, agreement) are read through
view/figures.py, the one place that defines them.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Any

from p2p_diloco.net.discovery.status import number, short_id, text
from p2p_diloco.view.figures import STUCK_S, ReplicaWatch, agreement, reachability, refused, rejected, rejected_by

MAX_CURVE_PEERS = 256
"""Peers whose loss curves we keep; the one updated longest ago is forgotten first (records are cheap to
forge, so a flood of identities must not grow the observer's memory)."""
MAX_CURVE_POINTS = 2048
"""Points per peer's curve; older points are thinned out (every other one dropped) rather than cut."""
MAX_LOCAL_ROUNDS = 4096
MAX_MATRIX_PEERS = 32
MAX_ALONE_CHARS = 400
"""The `alone` field (peer/isolation.py: why a peer merges nothing while others publish) is cut to this."""


def _optional(record: Mapping[str, Any], key: str) -> float | None:
    """A finite number from an untrusted record, or None (absent, null, not a number, inf or nan)."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def peer_row(peer_id: str, record: Mapping[str, Any], now: float) -> dict[str, Any]:
    """One peer's row, every field read defensively from its (untrusted) record."""
    last_update = _optional(record, "last_update_at")
    by_reason = rejected_by(record)
    return {
        "peer_id": peer_id, "short": short_id(peer_id), "state": text(record, "state") or "?",
        "round": int(number(record, "round")), "step": int(number(record, "step")),
        "loss": _optional(record, "loss"), "eval_loss": _optional(record, "eval_loss"),
        "samples_per_s": number(record, "samples_per_s"), "utilization": _optional(record, "utilization"),
        "tau": int(number(record, "tau")), "age_s": max(0.0, now - number(record, "updated_at", now)),
        "update_age_s": None if last_update is None else max(0.0, now - last_update),
        "bytes_sent": int(number(record, "bytes_sent")), "bytes_received": int(number(record, "bytes_received")),
        "reachability": reachability(record.get("reach")), "vv_total": int(number(record, "version_vector_total")),
        "vv_digest": text(record, "vv_digest", limit=16), "seq": int(number(record, "seq")),
        "rejected": rejected(record), "refused": refused(record), "rejected_by": by_reason,
        "banned": int(number(record, "banned")),
        "alone": text(record, "alone", limit=MAX_ALONE_CHARS) or None,
    }


def vv_matrix(records: Mapping[str, Mapping[str, Any]], limit: int = MAX_MATRIX_PEERS) -> dict[str, Any]:
    """Holders x senders of the records that carry their vector: which seq of each sender each holder merged."""
    vectors = {}
    for pid, record in list(records.items())[:limit]:
        vv = record.get("vv")
        if isinstance(vv, dict):
            vectors[pid] = {k: int(v) for k, v in vv.items()
                            if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0}
    senders = sorted({s for vv in vectors.values() for s in vv})[:limit]
    holders = sorted(vectors)
    return {"holders": holders, "senders": senders,
            "seq": [[vectors[h].get(s) for s in senders] for h in holders]}


class Curves:
    """Each peer's loss over time, as its records said it: one point per new round seen. A record carries the
    peer's last eval loss on every round after it; a point gets it only once, at the first round it appears.
    Bounded in peers and in points (see MAX_CURVE_PEERS, MAX_CURVE_POINTS)."""

    def __init__(self, max_peers: int = MAX_CURVE_PEERS, max_points: int = MAX_CURVE_POINTS) -> None:
        self.max_peers, self.max_points = max_peers, max_points
        self._curves: OrderedDict[str, list[list]] = OrderedDict()
        self._last_eval: dict[str, float] = {}  # per peer: the eval loss already drawn

    def observe(self, records: Mapping[str, Mapping[str, Any]], now: float) -> None:
        for pid, record in records.items():
            loss = _optional(record, "loss")
            at_round = int(number(record, "round"))
            if loss is None or at_round <= 0:
                continue
            eval_loss = _optional(record, "eval_loss")
            fresh_eval = eval_loss if eval_loss is not None and eval_loss != self._last_eval.get(pid) else None
            curve = self._curves.get(pid)
            if curve is not None and curve[-1][1] == at_round:
                if curve[-1][3] is None and fresh_eval is not None:  # the round's eval came in a later record
                    curve[-1][3] = self._last_eval[pid] = fresh_eval
                continue
            if curve is None:
                curve = self._curves[pid] = []
                while len(self._curves) > self.max_peers:
                    gone, _ = self._curves.popitem(last=False)
                    self._last_eval.pop(gone, None)
            self._curves.move_to_end(pid)
            curve.append([number(record, "updated_at", now), at_round, loss, fresh_eval])
            if fresh_eval is not None:
                self._last_eval[pid] = fresh_eval
            if len(curve) > self.max_points:
                curve[:] = curve[::2]

    def to_dict(self) -> dict[str, list[list]]:
        return {pid: [list(p) for p in curve] for pid, curve in self._curves.items()}


class LocalRounds:
    """The observer peer's own rounds (the round hook appends; the page draws bytes per round from them)."""

    KEYS = ("time", "round", "loss", "eval_loss", "bytes_sent", "bytes_received", "utilization")

    def __init__(self, max_rounds: int = MAX_LOCAL_ROUNDS) -> None:
        self._rounds: deque[dict] = deque(maxlen=max_rounds)

    def append(self, figures: Mapping[str, Any]) -> None:
        self._rounds.append({k: figures.get(k) for k in self.KEYS})

    def to_list(self) -> list[dict]:
        return list(self._rounds)


def build_snapshot(*, run_id: str, spec_hash: str | None, now: float, records: Mapping[str, Mapping[str, Any]],
                   observer: Mapping[str, Any], self_figures: Mapping[str, Any] | None = None,
                   curves: Curves | None = None, local: LocalRounds | None = None,
                   replicas: ReplicaWatch | None = None) -> dict[str, Any]:
    """The snapshot (module docstring) of `records` (peer_id -> record; the observer's own included if it is a
    peer) at DHT time `now`. Without `replicas` (no history of the records) agreement is never `diverged`."""
    rows = sorted((peer_row(pid, r, now) for pid, r in records.items()),
                  key=lambda row: (-row["vv_total"], row["peer_id"]))
    if curves is not None:
        curves.observe(records, now)
    behind = None
    if replicas is not None:
        replicas.observe(records, now)
        behind = replicas.behind(records, now)
    return {
        "run_id": run_id, "spec_hash": spec_hash, "now": now, "observer": dict(observer),
        "self": dict(self_figures) if self_figures is not None else None, "peers": rows,
        "agreement": agreement(rows, behind, replicas.stuck_s if replicas is not None else STUCK_S),
        "vv_matrix": vv_matrix(records),
        "curves": curves.to_dict() if curves is not None else {},
        "local": local.to_list() if local is not None else [],
    }
