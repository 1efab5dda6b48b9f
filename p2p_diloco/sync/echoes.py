"""Echoes: what a sponsor relays, without what theta has just done (sync/sponsorship.py).

A judge of directions values a proposal for pointing along the sponsors' work; but the sponsors' recent work is
merged already, so a proposal that echoes theta's recent move (an attacker's, or the part of an honest one that
redoes what the swarm just did) would be relayed for it and move theta along it a second time. Before it signs,
a sponsor removes from what it relays every component along theta's moves over its last ECHO phases: only what is
new is relayed. Measured (BENCHMARKS "Echoes", `test`, against 3 honest peers in the attackers' place): 3 peers
that echo theta's move cost +9.0% before, +5.0% after (less than 3 peers whose work is never relayed, +6.0%);
negated work tilted toward the swarm's direction +11.8% before, +6.2% after; and an honest run's loss fell 3% (its
graduates' relayed work had carried the same echo).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

ECHO = 2
"""Phases of theta's recent moves a sponsor removes from what it relays."""


def without_echoes(relay: Tensor | None, theta: Tensor, snapshots: list[Tensor]) -> tuple[Tensor | None, list[Tensor]]:
    """(The relayed work without its components along each of theta's moves over the last ECHO phases, the
    snapshots to pass next time). `snapshots`: theta at the last ECHO relays, newest first (consumed: the oldest
    is reused in place). The span of the moves, not only their sum: an echo of a window offset from ours is in the
    span. Costs a sponsor ECHO theta-sized snapshots (and two more vectors while it relays)."""
    kept = [theta.clone(), *snapshots[:ECHO - 1]]
    if relay is None:
        return relay, kept
    moves = []
    for i, older in enumerate(snapshots):  # move i: snapshot i - the point after it, newest first
        newer = theta if i == 0 else snapshots[i - 1]
        moves.append(older.sub_(newer) if i == ECHO - 1 else older - newer)  # the oldest is not kept: in place
    return without(relay, orthonormal(moves)), kept


def moves_at(theta: Tensor, snapshots: list[Tensor], at: Tensor) -> list[Tensor]:
    """Theta's moves over the last ECHO phases (as `without_echoes` takes them), at the coordinates `at` only."""
    points = [theta[at], *(snapshot[at] for snapshot in snapshots)]
    return [older - newer for newer, older in zip(points, points[1:])]


def orthonormal(moves: list[Tensor]) -> list[Tensor]:
    """An orthonormal basis of the span of `moves` (Gram-Schmidt, in place; zero or non-finite ones skipped)."""
    basis: list[Tensor] = []
    for move in moves:
        for b in basis:
            move.sub_(b, alpha=float(torch.dot(move, b)))
        norm = float(move.norm())
        if norm > 0 and math.isfinite(norm):
            basis.append(move.div_(norm))
    return basis


def without(x: Tensor, basis: list[Tensor]) -> Tensor:
    """`x` without its components along the orthonormal `basis` (in place)."""
    for b in basis:
        x.sub_(b, alpha=float(torch.dot(x, b)))
    return x


def new_parts(rows: Tensor, fresh: list[Tensor]) -> Tensor:
    """Each row of `rows` without its components along the orthonormal `fresh` (`without`, for a batch at once)."""
    if not fresh:
        return rows
    basis = torch.stack(fresh)
    return rows - (rows @ basis.T) @ basis


def unit_new_parts(rows: Tensor, fresh: list[Tensor]) -> list[Tensor | None]:
    """Each row's part outside the span of the orthonormal `fresh`, unit length (None if nothing): what a sponsor's
    crowding compares (sync/relayed.py)."""
    parts = new_parts(rows, fresh)
    norms = parts.norm(dim=1).tolist()
    return [part / n if n > 0 and math.isfinite(n) else None for part, n in zip(parts, norms)]


def echoing(samples: Tensor, fresh: list[Tensor], published: Tensor, near: float) -> list[bool]:
    """Which rows of `samples` echo a row of `published`: the |cosine| of their parts outside the span of the
    orthonormal `fresh` (what is no longer new) is at least `near`. A crowd with no compute signs a published update
    plus its own noise; what is new in it is what was new in that update (sync/sponsorship.py ECHO_OF)."""
    if not len(published) or not len(samples):
        return [False] * len(samples)
    samples, published = new_parts(samples, fresh), new_parts(published, fresh)
    published = published / published.norm(dim=1, keepdim=True).clamp_min(1e-30)
    cos = (samples @ published.T).abs() / samples.norm(dim=1, keepdim=True).clamp_min(1e-30)
    hits: list[bool] = (cos >= near).any(1).tolist()
    return hits
