"""Directions built against a judge of directions (sync/sponsorship.py, sync/worth.py): work turned so that its
cosine with the swarm's recent direction is what the attacker chose (sim/adversary.py `tilted`). Pure."""

from __future__ import annotations

import math

import torch


def tilt(honest: torch.Tensor, direction: torch.Tensor, cosine: float) -> torch.Tensor:
    """`honest` negated, plus just enough of `direction` that the result's cosine with it is `cosine`, at the
    honest length (`tilted`'s attack against a judge that rewards pointing along `direction`)."""
    length = float(honest.norm())
    if not (float(direction.norm()) > 0 and length > 0):
        return -honest
    s, p = direction / direction.norm(), honest / length
    c0 = float(torch.dot(p, s))
    low, high = 0.0, 100.0  # cos(-p + x s, s) = (x - c0) / |-p + x s| grows with x: bisect for `cosine`
    for _ in range(60):
        x = (low + high) / 2
        if (x - c0) / math.sqrt(max(1e-12, 1 - 2 * x * c0 + x * x)) < cosine:
            low = x
        else:
            high = x
    out = -p + high * s
    return out * (length / float(out.norm()))


def undercut(honest: torch.Tensor, direction: torch.Tensor, cosine: float) -> torch.Tensor:
    """`honest` minus as much of `direction` as brings its cosine with it down to `cosine`, at the honest length
    (unchanged where it is already at or under it)."""
    length = float(honest.norm())
    if not (float(direction.norm()) > 0 and length > 0):
        return honest
    s, p = direction / direction.norm(), honest / length
    c0 = float(torch.dot(p, s))
    if c0 <= cosine:
        return honest
    low, high = 0.0, 100.0  # cos(p - x s, s) = (c0 - x) / |p - x s| falls with x: bisect for `cosine`
    for _ in range(60):
        x = (low + high) / 2
        if (c0 - x) / math.sqrt(max(1e-12, 1 - 2 * x * c0 + x * x)) > cosine:
            low = x
        else:
            high = x
    out = p - high * s
    return out * (length / float(out.norm()))
