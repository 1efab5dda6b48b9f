"""`p2p-diloco status` as text: one row per peer record and, under it, every peer's refusals by reason.

It reads the same figures, under the same names, as the live views (view/figures.py): `reach` from the peer's
own probe, `rejected` without honest duplicates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from p2p_diloco.net.discovery.status import counts, number, short_id, text
from p2p_diloco.view.figures import reachability, rejected, rejected_by


def rejection_summary(record: Mapping[str, Any], top: int = 3) -> str:
    """'rejected (reason n, ...)': a record's `rejected` figure, then its refusals of both kinds by reason."""
    total = rejected(record)
    by_reason = rejected_by(record) or {}
    shown = "-" if total is None else str(total)
    if not by_reason:
        return shown
    head = ", ".join(f"{reason} {n}" for reason, n in list(by_reason.items())[:top])
    return f"{shown} ({head})"


def _fmt(value: float | None, spec: str, empty: str = "-") -> str:
    return empty if value is None else format(value, spec)


def status_table(records: Mapping[str, dict], now: float | None = None) -> str:
    """The `p2p-diloco status` table: one row per peer, freshest replica first."""
    if now is None:
        from hivemind.utils import get_dht_time  # hivemind is heavy; this module is imported by the CLI

        now = get_dht_time()
    header = ("peer", "state", "V", "seq", "round", "step", "samples/s", "loss", "eval", "tau", "age", "reach",
              "rejected", "addrs")
    rows = [header]
    ordered = sorted(records.items(), key=lambda kv: -number(kv[1], "version_vector_total"))
    for pid, r in ordered:
        maddrs = r.get("maddrs")
        maddrs = maddrs if isinstance(maddrs, list) else []
        addrs = ", ".join(str(m).split("/p2p/")[0] for m in maddrs[:2] if isinstance(m, str))
        eval_loss = r.get("eval_loss")
        rows.append((
            pid, text(r, "state") or "?", str(int(number(r, "version_vector_total"))), str(int(number(r, "seq"))),
            str(int(number(r, "round"))), str(int(number(r, "step"))), f"{number(r, 'samples_per_s'):.1f}",
            _fmt(number(r, "loss", math.nan), ".3f") if r.get("loss") is not None else "-",
            f"{number(r, 'eval_loss'):.3f}" if isinstance(eval_loss, (int, float)) else "-",
            str(int(number(r, "tau"))), f"{max(0.0, now - number(r, 'updated_at', now)):.0f}s",
            reachability(r.get("reach")), rejection_summary(r), addrs or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def rejection_details(records: Mapping[str, dict]) -> str:
    """Per peer: every rejection reason with its count, and its worst offenders (the `status` footer)."""
    lines = []
    for pid, r in sorted(records.items()):
        by_reason = rejected_by(r) or {}
        dht = counts(r, "dht_rejected")
        if not (by_reason or dht):
            continue
        lines.append(f"{short_id(pid)}: " + (", ".join(f"{k} {n}" for k, n in by_reason.items()) or "-")
                     + (f"; dht records refused: {', '.join(f'{k} {n}' for k, n in dht.items())}" if dht else ""))
        offenders = r.get("offenders")
        offenders = offenders if isinstance(offenders, dict) else {}
        for offender, reasons in list(offenders.items())[:4]:
            if isinstance(offender, str):
                detail = ", ".join(f"{k} {n}" for k, n in counts({"x": reasons}, "x", limit=16).items())
                lines.append(f"    from {short_id(offender)}: {detail}")
    return "\n".join(lines)
