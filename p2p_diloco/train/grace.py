"""The grace window: after publishing a round, a unit may wait a little for the round's other updates.

Why: in an async swarm a unit that finishes its phase first starts the next one on a base that lacks the other
units' updates of the round just done; they land a network latency later, mid-phase, and the next update it
trains is built partly on the old base. Measured in the simulator (BENCHMARKS "Async at parity"), what async pays
against synchronous DiLoCo at equal tokens follows that latency as a share of a phase: +0.3% when updates land
within 3% of a phase, +2.7% at 19%. Decoupled DiLoCo's syncer has the answer: it waits for a quorum and then a
short grace window for stragglers. Here there is no syncer, so each unit waits on its own replica.

Whom a unit waits for (`awaited`): the authors at the round's front, those whose count is exactly one short of
ours: they are inside the round we just finished. A unit further behind (4x slower, or joined late) is not waited
for (that would hold the swarm to its pace), and one level with us or ahead has nothing of this round to come.
How long: until the replica holds every awaited author's next update, or `grace` times the phase just done,
whichever comes first; a dead author costs that once (its count then falls two short and it is no longer
awaited). The wait is a choice of each unit's timing, not of the merge: replicas stay equal whatever it is.

A unit that leads waits, which pulls it back towards the others: units whose start was spread settle into step
after a few rounds, and then only the latency and the phase jitter are waited for.
"""

from __future__ import annotations

from p2p_diloco.sync.version_vector import VersionVector


def awaited(vv: VersionVector, me: str) -> list[str]:
    """Authors whose next update the grace window waits for: those exactly one update short of `me`."""
    mine = vv.get(me)
    return sorted(sender for sender in vv if sender != me and vv[sender] == mine - 1)
