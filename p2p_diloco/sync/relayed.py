"""What a sponsor's update carries of others' work (sync/sponsorship.py `Sponsorship.relay`, train/outer.py
`relay_payload`), and the buffer it is summed in."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from p2p_diloco.sync.decoded import Decoded


class Relayed(NamedTuple):
    """What a sponsor's next update carries of others' work (`Sponsorship.relay`, train/outer.py `relay_payload`)."""

    step: Tensor | None
    """Theta's units, times 1 + `share`: `1/S sum v(u) step(u)` of the proposals (displacing the sponsor's own
    work) plus `(1 + share)/S sum keep(u) step(u)` of the graduates' (which `relay_payload`'s 1 / (1 + share)
    leaves whole)."""
    vouches: bytes
    """Its verdicts, for its header (wire/vouches.py): graduates' first, then the most useful proposals'."""
    share: float
    """The share `t` (at most 1/S) the proposals take of its update."""
    carried: float
    """The graduates' relayed work in merge-weight units (`outer_lr * w`): the sponsor signs that much more."""


NOTHING = Relayed(None, b"", 0.0, 0.0)


def add_step(into: Tensor | None, step: Tensor | Decoded, factor: float) -> Tensor:
    """into += factor * step, a chunk at a time (a new zero buffer for None)."""
    decoded = step if isinstance(step, Decoded) else Decoded.of(step)
    if into is None:
        into = torch.zeros(decoded.numel, dtype=torch.float32)
    for part, values in decoded.chunks():
        into[part].add_(values, alpha=factor)
    return into
