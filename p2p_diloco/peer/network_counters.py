"""The counters a peer shows (its round line, its final summary, its DHT record's `rejected_by`), read from
its intake and its network services' `stats`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.sync.intake import Intake

_NOT_REJECTIONS = ("merged", "buffered")


def rejection_totals(intake: Intake | None, guard: PeerGuard | None) -> dict[str, int]:
    """Everything refused, by reason: the intake's update outcomes and the guard's network refusals."""
    counts = dict(intake.counts) if intake is not None else {}
    totals = Counter({k: n for k, n in counts.items() if k not in _NOT_REJECTIONS})
    if guard is not None:
        totals.update(guard.rejections.totals)
    standing = getattr(getattr(intake, "replica", None), "standing", None)
    if standing is not None:  # merged at weight 0 by vetting (sync/standing.py): refused in all but the slot
        totals.update({f"vetting_{k}": n for k, n in standing.stats.items() if k != "probation" and n})
    return dict(totals)


def updates_rejected(intake: Intake | None) -> int:
    """The `rejected` figure (view/figures.py): updates that failed the intake's checks. Honest duplicates are
    not refusals; vetting's verdicts (an update merged at weight 0) are listed by reason in `rejected_by` and the
    final record's `vetting`; what the network turned away is `refused`."""
    counts = dict(intake.counts) if intake is not None else {}
    return sum(n for k, n in counts.items() if k not in (*_NOT_REJECTIONS, "duplicate"))


def collect_counters(intake: Intake | None, services: Iterable[object], server: object,
                     guard: PeerGuard | None) -> dict[str, int]:
    """Intake outcomes, every service's `stats` (gossip, relay, repair), the snapshot bytes the `server` sent
    (counted in `bytes_sent` too: everything we uploaded) and the guard's refusals."""
    counts = dict(intake.counts) if intake is not None else {}
    out = {"merged": counts.get("merged", 0), "duplicate": counts.get("duplicate", 0),
           "rejected": updates_rejected(intake)}
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
        out.update(uplink_counters(guard))
    return out


def uplink_counters(guard: PeerGuard) -> dict[str, int]:
    """Bandwidth awareness (net/admission/meter.py): the measured upload rate (`uplink_bps`, bytes/s; 0 before
    the first measurement), the budget the uplink's shares split (`uplink_budget_bps`), what the meter timed
    (`uplink_metered_bytes`, `uplink_samples`) and the fair-share refusals (`uplink_fair_share`)."""
    uplink = getattr(guard, "uplink", None)
    meter = getattr(uplink, "meter", None)
    if uplink is None or meter is None:  # no uplink: no meter either
        return {}
    return {"uplink_bps": int(uplink.rate_bps() or 0), "uplink_budget_bps": int(uplink.budget_bps()),
            "uplink_metered_bytes": int(meter.total_bytes), "uplink_samples": int(meter.samples),
            "uplink_fair_share": int(guard.rejections.totals.get("uplink_fair_share", 0))}
