"""The round view: theta at the last complete rounds a replica holds, what an async run is measured at beside theta.

Why: when every unit trains on data of its own, one unit's outer update pulls theta towards that data. Merged alone,
as an async replica merges, it moves the eval loss by up to 10% even at the end of a 100-round run, and the next
unit's update pulls it back (BENCHMARKS "Async at parity": the round view). Synchronous DiLoCo never shows such a
state: it steps once per complete round. A replica at any moment holds a round still under way.

The round view leaves that round out: of the units at the front (those within `SLACK` updates of the one with the
most), every update past the fewest any of them has (k). With `rounds` = R > 1 it is the mean of the states at the
last R complete rounds, k, k-1, ..., k-R+1 (tail averaging, as synchronous DiLoCo's last R round states would be
averaged): an update of seq q, k-R+1 < q <= k, is missing from the q-k+R-1 averaged rounds before it, so
(q-k+R-1)/R of its step is taken back. Merges are sums, so the view is exactly the mean of the thetas of replicas
that merged only those sets, whatever the order: two replicas that hold the same updates have the same view. Units
far behind (slower, or joined late) are kept whole: waiting for them would hold the view back by their pace. The
view never has more tokens than theta. theta itself, what trains and what is served, is unchanged.

A measurement (the simulator's `SimResult.round_loss` / `tail_loss`), not the model a peer exports: when the counts
at the front differ, the cut is not causally consistent (an update trained on a base that held another unit's
newest updates stays, while those are taken back), and on one timing seed of three it was worse than theta.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import Tensor

from p2p_diloco.sync.types import UpdateLike
from p2p_diloco.sync.version_vector import VersionVector

if TYPE_CHECKING:
    from p2p_diloco.sync.replica import Replica

SLACK = 2
"""A unit this many updates behind the one with the most still belongs to the round (async timing noise leaves the
counts up to 2 apart); one further behind is not waited for."""


def round_cut(vv: VersionVector, rounds: int = 1, slack: int = SLACK) -> list[tuple[str, int, float]]:
    """(sender, seq, share) of the merged slots the round view takes back, and the share of each one's step it
    takes back: 1 past the last complete round k, (seq - k + rounds - 1) / rounds within the rounds averaged."""
    if slack < 0 or rounds < 1:
        raise ValueError(f"need slack >= 0 and rounds >= 1, got slack={slack}, rounds={rounds}")
    counts = {sender: vv[sender] for sender in vv if vv[sender] > 0}
    if not counts:
        return []
    top = max(counts.values())
    front = sorted(sender for sender, n in counts.items() if n >= top - slack)
    floor = min(counts[sender] for sender in front)
    cut = []
    for sender in front:
        for seq in range(max(1, floor - rounds + 2), counts[sender] + 1):
            if vv.has(sender, seq):
                cut.append((sender, seq, 1.0 if seq > floor else (seq - floor + rounds - 1) / rounds))
    return cut


def round_view(replica: Replica, held: Callable[[str, int], UpdateLike | None],
               rounds: int = 1) -> tuple[Tensor, VersionVector] | None:
    """The round view's theta and the version vector of its last complete round; None if an update it takes back
    is not `held` (the store evicted it) or cannot be (a receiver-dependent aggregation): then there is none."""
    with replica.lock:  # V and theta must name the same merged set
        vv = replica.version_vector
        cut = round_cut(vv, rounds)
        updates = [held(sender, seq) for sender, seq, _ in cut]
        if any(update is None for update in updates):
            return None
        theta = replica.theta_without([(u, share) for u, (_, _, share) in zip(updates, cut) if u is not None])
    if theta is None:
        return None
    for sender, seq, share in reversed(cut):
        if share == 1.0:
            vv = vv.without(sender, seq)
    return theta, vv
