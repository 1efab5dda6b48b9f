"""A lying aggregator for the aggregation tree's benchmark and tests (sim/aggregation.py, sim/audits.py).

Every sum it sends names exactly the parts and children it should, each signed by its author, so nothing but the
payload can lie: it sends the negation of the true sum, twice over (the work of its whole subtree undone and then
some: the attack a run without audits would merge). `silent`: it also never answers an audit (no evidence can be
made of it; its sums only time out).
"""

from __future__ import annotations

from typing import Any

import torch

from p2p_diloco.sync.exact_sum import decode_grid
from p2p_diloco.wire.identity import Identity
from p2p_diloco.wire.sums import GroupSum, make_sum

AsyncSwarm = Any  # sim/swarm.py's (not imported: the swarm imports this module)


def lying_aggregator(swarm: AsyncSwarm, *, place: int = 1, silent: bool = False) -> None:
    """Make the peer at `place` of the first epoch's tree (1: the root's first child, an inner node from N =
    fan-in + 2) lie in every sum it sends, from then on whatever its place."""
    if swarm.tree is None:
        raise ValueError("the swarm does not aggregate (--sim.aggregate)")
    swarm.tree.liar_place = (place, silent)


def lie(s: GroupSum, identity: Identity, children: list[GroupSum]) -> GroupSum:
    """`s` with its payload negated twice over, signed again: the same parts and children."""
    values = -2 * decode_grid(s.payload, s.header.numel)
    h = s.header
    return make_sum(identity=identity, run_id=h.run_id, spec_hash=h.spec_hash, epoch=h.epoch,
                    heralds=[p.herald for p in h.parts], children=children,
                    payload=values.to(torch.int32).numpy().astype("<i4").tobytes(), numel=h.numel)
