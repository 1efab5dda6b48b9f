"""The grace window: after publishing a round, a unit may wait a little for the round's other updates.

Why: in an async swarm a unit that finishes its phase first starts the next one on a base that lacks the other
units' updates of the round just done; they land a network latency later, mid-phase, and the next update it
trains is built partly on the old base. Measured in the simulator (BENCHMARKS "Async at parity"), what async pays
against synchronous DiLoCo at equal tokens follows that latency as a share of a phase: +0.3% when updates land
within 3% of a phase, +2.7% at 19%. Decoupled DiLoCo's syncer has the answer: it waits for a quorum and then a
short grace window for stragglers. Here there is no syncer, so each unit waits on its own replica.

Whom a unit waits for (`awaited`): the authors at the round's front, those whose count is exactly one short of
ours: they are inside the round we just finished. After our first round those are the live units (as the swarm
view counts them) with no update yet, so they are not in the vector: the window awaits them by number. That first
window matters most: without it every unit's second phase starts on its own first update alone, the others land
mid-phase, and in the simulator that one round cost about 1.5% at equal tokens even with every later round in
step (BENCHMARKS "Async at parity": the grace window). (A real peer's swarm view counts the units whose updates
it merged lately, never the DHT's records, which a crowd could inflate; after its first round that is often
itself alone, so a real swarm's first window mostly awaits nobody yet.) A unit further behind (4x slower, or
joined late) is not waited for (that would hold the swarm to its pace), and one level with us or ahead has
nothing of this round to come.
How long: until the replica holds every awaited author's next update, or `grace` times the phase just done,
whichever comes first; a dead author costs that once (its count then falls two short and it is no longer
awaited). The wait is a choice of each unit's timing, not of the merge: replicas stay equal whatever it is.

A unit that leads waits, which pulls it back towards the others: units whose start was spread settle into step
after a few rounds, and then only the latency and the phase jitter are waited for.

**In a run with founders** (sync/sponsorship.py) only the sponsors wait, and only for one another. Everyone
else's update is a proposal that merges at weight 0 on every replica, so no replica's next base is better for
awaiting it, and a crowd of proposers cannot hold the sponsors' rounds. Sponsors are named, so their first window
awaits the ones not yet heard from by name. A proposer's timing against the sponsors' rounds still matters to
their judge, which compares a proposal with their latest work (BENCHMARKS "The outer step's ramp": with no timing
noise the window's fixed offset has a volunteer's proposals judged against the round before their own; under
noise, copy races decide whether a crowd-copied volunteer graduates).
"""

from __future__ import annotations

from collections.abc import Collection

from p2p_diloco.sync.version_vector import VersionVector


def awaited(vv: VersionVector, me: str, live: int = 0, sponsors: Collection[str] = ()) -> list[str]:
    """Authors whose next update the grace window waits for: those exactly one update short of `me`. After our
    first round, the units short of it hold no update yet and are not in `vv`: of `live` units (ourselves
    included, as the swarm view counts them), those missing from it are awaited too, as "?". In a run with
    `sponsors`, a sponsor awaits only the other sponsors and anyone else awaits nobody."""
    mine = vv.get(me)
    if sponsors:
        if me not in sponsors:
            return []
        return sorted(s for s in sponsors if s != me and vv.get(s) == mine - 1)
    short = sorted(sender for sender in vv if sender != me and vv[sender] == mine - 1)
    if mine == 1:
        short += ["?"] * max(0, live - 1 - sum(1 for sender in vv if sender != me))
    return short
