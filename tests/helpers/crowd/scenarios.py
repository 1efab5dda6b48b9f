"""Crowd scenarios: engage the crowd with the honest peers, measure their lag under a behaviour, disengage."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from tests.helpers.crowd.crowd import Crowd
from tests.helpers.crowd.honest import Honest, LagMeter, honest_payload, publish_loop


async def engage(honest: Sequence[Honest], crowd: Crowd | None, *, spec: Any, numel: int, publish_s: float,
                 records: bool = False, timeout_s: float = 60.0) -> list[asyncio.Task]:
    """Dial the crowd to the honest peers (with `records`, also put it in their views, as its DHT records would
    in an open run: then their announces and anti-entropy pick crowd members too), start every honest peer's
    publishing, and wait until each merged an update of each other (each is then a contributor to the others).
    Returns the publishing tasks: cancel them (`disengage`) when done."""
    if crowd is not None:
        dialled = await crowd.connect({h.peer_id: h.node.visible_maddrs() for h in honest})
        assert dialled == crowd.size * len(honest), f"only {dialled} of {crowd.size * len(honest)} dials worked"
        if records:
            for peer in honest:
                peer.view.extend(crowd.peer_ids)
    # One payload per honest peer, from its own seed: two peers sending the very same payload would be a copy
    # of each other's work, and vetting (sync/standing.py) gives a copy no weight and its relay no credit.
    tasks = [asyncio.ensure_future(publish_loop(h, spec, numel, honest_payload(spec, numel, seed=i), publish_s))
             for i, h in enumerate(honest)]
    deadline = time.monotonic() + timeout_s
    while not all(a.replica.version_vector.get(b.peer_id) > 0 for a in honest for b in honest if a is not b):
        if time.monotonic() > deadline:
            await disengage(tasks)
            raise TimeoutError(f"the honest peers did not merge each other's updates within {timeout_s:g}s")
        await asyncio.sleep(0.05)
    return tasks


async def disengage(tasks: Sequence[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def measure(honest: Sequence[Honest], crowd: Crowd | None, behaviour: str, *, base_s: float,
                  attack_s: float) -> dict[str, Any]:
    """A baseline window (the crowd idle), then `behaviour` ("stall": at every honest peer; "flood": at the
    first, the victim; "none") for `attack_s`, then quiet. Lags of both windows (`LagMeter.summary`), the bytes
    the crowd read from the victim and all the victim served meanwhile, the crowd's counters."""
    victim, meter = honest[0], LagMeter(honest)
    base = await meter.run(base_s)
    counted_before = await _counted(crowd, victim.peer_id)
    served_before = victim.gossip.stats["bytes_sent"]
    started = time.monotonic()
    if crowd is not None and behaviour == "stall":
        await crowd.stall([h.peer_id for h in honest])
    elif crowd is not None and behaviour == "flood":
        await crowd.flood([victim.peer_id])
    try:
        attacked = await meter.run(attack_s)
    finally:
        if crowd is not None:
            await crowd.quiet()
    seconds = time.monotonic() - started
    counted = await _counted(crowd, victim.peer_id)
    counted.subtract(counted_before)
    crowd_bytes = counted.pop("bytes_from_victim", 0)
    return {"base": base, "attack": attacked, "seconds": seconds, "crowd_bytes": crowd_bytes,
            "served_bytes": victim.gossip.stats["bytes_sent"] - served_before, "crowd": dict(+counted)}


async def _counted(crowd: Crowd | None, victim: str) -> Counter:
    """The crowd's counters summed over its identities, and the bytes it read from `victim`."""
    out: Counter = Counter()
    for part in (await crowd.stats()).values() if crowd is not None else ():
        out.update({k: v for k, v in part.items() if k != "bytes_from"})
        out["bytes_from_victim"] += part["bytes_from"].get(victim, 0)
    return out
