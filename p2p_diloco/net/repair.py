"""Replica repair on the real network (DESIGN.md section 4, "Repair"; issue 4's second trap).

The case: our replica merged an update `(sender, seq)` that other peers skipped (their gap waited out
`gap_timeout_s`: nobody served it), and we can no longer serve it ourselves: we restarted (our store is empty)
or it was evicted. Pulls can never make the replicas equal then: they will never get it, and we cannot take it
back without its payload. The repair: we adopt the state of a peer that skipped it and re-merge what we hold
beyond that state (`Replica.adopt`). The skipping side never yields for this reason, so the repair goes one way
and ends; a late copy that turns up afterwards is merged late by everyone, as a filled hole.

Gossip finds the case: announces and pull requests carry the sender's holes, and `Gossip._consider` hands
the ones that name updates we merged and no longer hold (`UpdateStore.unservable_for`) to `consider`. Then:

1. Grace: an item must have stayed unservable for `grace_s` (a peer that still holds the update may fill
   the others' holes meanwhile, and then nobody needs to yield).
2. Quorum: at least as many of the peers whose vectors we know (members only) skipped it as merged it,
   counting our own merge (`skipped_by_quorum`). A lone peer that claims a hole cannot make a swarm whose
   other members merged the update adopt its state.
3. Fetch a verified snapshot (net/statesync.py: signed manifest, digests, finiteness) from the claiming peer,
   or another that skipped it; its vector must still skip one of the items (else it filled the hole since,
   and pulls do the rest).
4. Bound: every merge moves a coordinate by at most `Replica.max_step()`, so two replicas whose merged sets
   differ by d updates differ by at most d times that per coordinate. A snapshot further from ours is refused
   and its donor penalized (with no bound in the RunSpec this check is off).
5. Adopt, under the replica's lock, with the updates our store holds beyond the snapshot's vector (our own
   included: a learner finishing its phase meanwhile sees its own seqs back in place).

One repair at a time; after each attempt, none for `cooldown_s`. Counted in `stats`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.sync.version_vector import VersionVector, skipped_by_quorum

logger = logging.getLogger(__name__)

MAX_TRACKED = 4096
"""Unservable items whose first sighting we remember (a hostile vector can name many holes)."""
MAX_DONORS = 4
MAX_READOPTED = 1 << 20
"""Updates of our store re-merged after adopting, at most (the store is bounded in bytes anyway)."""
_RELATIVE_SLACK = 1e-3  # float32 sums in another order differ by rounding, far below one step
_ABSOLUTE_SLACK = 1e-5
_STATS = ("repairs", "repair_attempts", "repair_failures", "repairs_refused", "repairs_outvoted", "repairs_moot")


class Repair:
    """Adopts a skipping peer's state when our replica holds an update nobody else can get (see module doc)."""

    def __init__(self, node: Any, run_id: str, spec_hash: str, replica: Replica, store: UpdateStore,
                 sync_config: Any, *, known: Callable[[], dict[str, VersionVector]],
                 members: Callable[[], Sequence[str]], guard: Any = None, grace_s: float = 15.0,
                 cooldown_s: float = 10.0, on_repaired: Callable[[dict], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`known()`: the last vector each remote sent us (Gossip.known_vectors); `members()`: the live member
        ids (votes of others are not counted); `on_repaired(summary)` runs on the loop after each adoption."""
        self.node, self.run_id, self.spec_hash = node, run_id, spec_hash
        self.replica, self.store, self.sync_config, self.guard = replica, store, sync_config, guard
        self.known, self.members = known, members
        self.grace_s, self.cooldown_s = grace_s, cooldown_s
        self.on_repaired = on_repaired
        self.clock = clock
        self.stats: dict[str, int] = dict.fromkeys(_STATS, 0)
        self._since: dict[tuple[str, int], float] = {}  # item -> when we first saw it unservable
        self._task: asyncio.Task | None = None
        self._next_try = -math.inf

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def consider(self, peer: str, remote: VersionVector, items: list[tuple[str, int]]) -> None:
        """Gossip's hook: `peer`'s vector `remote` skipped `items`, which we merged and cannot serve. On the
        loop; returns at once (the repair, if due, runs in a task)."""
        now = self.clock()
        for item in items:
            self._since.setdefault(item, now)
        while len(self._since) > MAX_TRACKED:
            del self._since[next(iter(self._since))]
        if (self._task is not None and not self._task.done()) or now < self._next_try:
            return
        ripe = [item for item in items if now - self._since.get(item, now) >= self.grace_s]
        if not ripe:
            return
        members = set(self.members())
        vectors = {pid: vv for pid, vv in self.known().items() if pid in members and pid != peer}
        vectors[peer] = remote
        chosen = skipped_by_quorum(ripe, vectors.values())
        if not chosen:
            self.stats["repairs_outvoted"] += 1
            self._next_try = now + self.cooldown_s
            logger.info("repair not due: most peers we know merged %s as we did (claimed skipped by %s)",
                        _names(ripe), peer[-8:])
            return
        donors = [peer] + [pid for pid, vv in vectors.items()
                           if pid != peer and any(seq in vv.holes(sender) for sender, seq in chosen)]
        self._next_try = now + self.cooldown_s
        self._task = asyncio.create_task(self._repair(donors[:MAX_DONORS], chosen), name="replica-repair")

    async def _repair(self, donors: list[str], chosen: list[tuple[str, int]]) -> None:
        from p2p_diloco.net.statesync import StateSyncError, fetch_snapshot

        self.stats["repair_attempts"] += 1
        started = time.monotonic()
        logger.warning("repair: our replica merged %s, which other peers skipped and we no longer hold; adopting "
                       "the state of one of them (donors %s)", _names(chosen), [d[-8:] for d in donors])
        try:
            theta, vv, donor = await fetch_snapshot(self.node, self.run_id, self.spec_hash, donors,
                                                    self.replica.theta.numel(), self.sync_config, guard=self.guard)
        except StateSyncError as e:
            self.stats["repair_failures"] += 1
            logger.warning("repair: no donor served a snapshot error=%s", e)
            return
        if not any(seq in vv.holes(sender) for sender, seq in chosen):
            self.stats["repairs_moot"] += 1  # it merged the update since (someone still held it): pulls do the rest
            logger.info("repair: donor %s merged %s since; nothing to adopt", donor[-8:], _names(chosen))
            return
        try:
            summary = await asyncio.to_thread(self._adopt, theta, vv)
        except Exception:
            self.stats["repair_failures"] += 1
            logger.exception("repair: adopting the snapshot of %s failed", donor)
            return
        if summary is None:
            self.stats["repairs_refused"] += 1
            if self.guard is not None:
                self.guard.count(donor, "repair_bound")
                self.guard.penalize(donor, "repair_bound")
            return
        for item in chosen:
            self._since.pop(item, None)
        self.stats["repairs"] += 1
        summary.update(donor=donor, items=[list(item) for item in chosen], seconds=time.monotonic() - started)
        logger.warning("repair: adopted the state of %s (V total %d -> %d, %d held update(s) merged again) in %.1fs",
                       donor, summary["vv_total_before"], summary["vv_total"], summary["remerged"],
                       summary["seconds"])
        if self.on_repaired is not None:
            self.on_repaired(summary)

    def _adopt(self, theta: torch.Tensor, vv: VersionVector) -> dict | None:
        """Check the snapshot against our replica and adopt it (a worker thread: re-merging decodes)."""
        replica = self.replica
        with replica.lock:
            local = replica.version_vector
            differ = vv.staleness(local) + local.staleness(vv)  # updates in one merged set and not the other
            step = replica.max_step()
            if math.isfinite(step):
                gap = float((theta - replica.theta).abs().max())
                allowed = differ * step * (1 + _RELATIVE_SLACK) + _ABSOLUTE_SLACK * (1 + float(theta.abs().max()))
                if not gap <= allowed:
                    logger.warning("repair: snapshot refused: it is %.3g from our replica in a coordinate, more than "
                                   "the %d update(s) our vectors differ by can move it (%.3g)", gap, differ, allowed)
                    return None
            held = self.store.missing_for(vv, MAX_READOPTED)
            merged = replica.adopt(theta, vv, held)
            return {"vv_total_before": local.total(), "vv_total": replica.version_vector.total(),
                    "differ": differ, "remerged": len(merged)}


def _names(items: list[tuple[str, int]], limit: int = 4) -> str:
    shown = ", ".join(f"{sender[-8:]}#{seq}" for sender, seq in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
