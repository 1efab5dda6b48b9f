"""The counters a peer shows (its round line, its final summary, its DHT record's `rejected_by`), read from
its intake and its network services' `stats`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

_NOT_REJECTIONS = ("merged", "buffered")


def rejection_totals(intake: Any, guard: Any) -> dict[str, int]:
    """Everything refused, by reason: the intake's update outcomes and the guard's network refusals."""
    counts = dict(intake.counts) if intake is not None else {}
    totals = Counter({k: n for k, n in counts.items() if k not in _NOT_REJECTIONS})
    if guard is not None:
        totals.update(guard.rejections.totals)
    standing = getattr(getattr(intake, "replica", None), "standing", None)
    if standing is not None:  # merged at weight 0 by vetting (sync/standing.py): refused in all but the slot
        totals.update({f"vetting_{k}": n for k, n in standing.stats.items() if k != "probation" and n})
    return dict(totals)


def collect_counters(intake: Any, services: Iterable[Any], server: Any, guard: Any) -> dict[str, int]:
    """Intake outcomes, every service's `stats` (gossip, relay, repair), the snapshot bytes the `server` sent
    (counted in `bytes_sent` too: everything we uploaded) and the guard's refusals."""
    counts = dict(intake.counts) if intake is not None else {}
    out = {"merged": counts.get("merged", 0), "duplicate": counts.get("duplicate", 0),
           "rejected": sum(n for k, n in counts.items() if k not in ("merged", "buffered", "duplicate"))}
    for service in services:
        stats = getattr(service, "stats", None) or {}
        out.update({k: int(v) for k, v in dict(stats).items() if isinstance(v, (int, float))})
    out.setdefault("bytes_sent", 0)
    out.setdefault("bytes_received", 0)
    served = getattr(server, "stats", None) or {}
    out["snapshot_bytes_sent"] = int(served.get("bytes_sent", 0))
    out["bytes_sent"] += out["snapshot_bytes_sent"]  # everything we uploaded: updates and snapshots
    if guard is not None:
        out["refused"] = sum(guard.rejections.totals.values())
    return out
