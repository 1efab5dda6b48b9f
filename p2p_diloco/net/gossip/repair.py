"""Replica repair on the real network (ARCHITECTURE.md "The network" (repair)).

The case: our replica merged an update `(sender, seq)` that other peers skipped (their gap waited out
`gap_timeout_s`: nobody served it), and we can no longer serve it ourselves: we restarted (our store is empty)
or it was evicted. Pulls can never make the replicas equal then: they will never get it, and we cannot take it
back without its payload. The repair: we adopt the state of a peer that skipped it and re-merge what we hold
beyond that state (`Replica.adopt`). The skipping side never yields for this reason, so the repair goes one way
and ends; a late copy that turns up afterwards is merged late by everyone, as a filled hole.

Gossip shows us the case: announces and pull requests carry the sender's holes, and gossip hands every
member's vector to `observe`, which picks the holes that name updates we merged and no longer hold
(`UpdateStore.unservable_for`), and the updates it merged that we skipped, and hands them to `consider`. Then:

1. Grace: an item must have stayed unservable for `grace_s` (a peer that still holds the update may fill
   the others' holes meanwhile, and then nobody needs to yield).
2. Quorum: at least as many of the member peers skipped it as merged it, counting our own merge and the
   members whose vectors we do not know as mergers (`skipped_by_quorum`). A lone peer that claims a hole
   cannot make a swarm whose other members merged the update adopt its state, and two sides that see
   different votes never both yield. Members are *proven* ("Who counts"): peers whose own updates merged here
   recently in good standing (sync/standing.py `Standing.proven`), never a bare DHT record, which any fresh
   identity can write; a claim from anyone else starts nothing. So a crowd can neither outvote the swarm
   nor widen `max_differ` (below), and every donor has contributed.
3. Fetch a verified snapshot (net/statesync/client.py: signed manifest, digests, finiteness) from the claiming peer,
   or another that skipped it; its vector must still skip one of the items (else it filled the hole since,
   and pulls do the rest).
4. Vet its vector (not now, if any fails; retried later): it names nothing that neither we nor the other
   peers we know hold, beyond its own latest `MAX_OWN_AHEAD` and our own holes (a donor cannot inflate the
   difference, nor make us take a sender's future seqs for duplicates); nothing of a sender we banned; at
   most `max_differ` updates differ from ours; every own update of ours it lacks is in our store, to merge
   again. Crossed holes (it merged one of ours as we merged one of its) would make both sides adopt each
   other's state forever: only the lower PeerID adopts.
5. Bound: every merge moves a coordinate by at most `Replica.max_step()`, so two replicas whose merged sets
   differ by d updates differ by at most d times that per coordinate. A snapshot further from ours is refused
   and its donor penalized. (Off with no bound in the RunSpec; under centered_clip receivers shape payloads
   differently, so the bound is not checked there.)
6. Load it under the replica's lock, then merge again the updates our store holds beyond its vector (decoding
   outside the lock, as every merge does; a learner finishing its phase meanwhile tolerates the moment its own
   seqs are not back yet).

The other side of the vote: when more peers merged an update than skipped it (our skip counted) and nobody
has served it to us within twice the grace, the skipper adopts a merger's state (`merged_by_quorum`, the
exact complement of the mergers' rule: over the same votes one side yields, never both), under the same
checks. This happens when the sender's last updates reached some peers only, and all of them restarted.

One repair at a time; after each attempt, none for `cooldown_s`, doubled after each attempt that did not
repair (each costs a snapshot), up to MAX_COOLDOWN_S. Counted in `stats`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence

import torch

from p2p_diloco.config.network import StateSyncConfig
from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.transport.node import SwarmNode
from p2p_diloco.sync.quorum import merged_by_quorum, skipped_by_quorum
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.sync.version_vector import VersionVector

logger = logging.getLogger(__name__)

MAX_TRACKED = 4096
"""Unservable items whose first sighting we remember; more are not tracked until some are repaired."""
MAX_ITEMS = 64
"""Unservable items looked at per remote vector (after a restart almost every old seq is unservable)."""
MAX_DONORS = 4
MAX_OWN_AHEAD = 2
"""Updates of the donor's own that no other peer we know holds yet, at most: its latest, in flight."""
MAX_COOLDOWN_S = 300.0
_RELATIVE_SLACK = 1e-3  # float32 sums in another order differ by rounding, far below one step
_ABSOLUTE_SLACK = 1e-5
_STATS = ("repairs", "repair_attempts", "repair_failures", "repairs_refused", "repairs_deferred",
          "repairs_outvoted", "repairs_moot", "repairs_unproven")


class Repair:
    """Adopts a skipping peer's state when our replica holds an update nobody else can get (see module doc)."""

    def __init__(self, node: SwarmNode, run_id: str, spec_hash: str, replica: Replica, store: UpdateStore,
                 sync_config: StateSyncConfig, *, known: Callable[[], dict[str, VersionVector]],
                 members: Callable[[], Sequence[str]], guard: PeerGuard | None = None, grace_s: float = 15.0,
                 cooldown_s: float = 10.0, on_repaired: Callable[[dict], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`known()`: the last vector each remote sent us (Gossip.known_vectors); `members()`: the ids whose votes
        count: live members with proven contribution (PeerNetwork.proven_peer_ids); `on_repaired(summary)` runs
        on the loop after each adoption."""
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
        self._backoff_s = cooldown_s  # doubles after each attempt that did not repair, up to MAX_COOLDOWN_S

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def observe(self, peer: str, remote: VersionVector) -> None:
        """Gossip's hook (`on_vector`): member `peer` holds `remote`. On the loop; returns at once."""
        ours = self.replica.version_vector
        if remote.n_holes:
            items = self.store.unservable_for(ours, remote)
            if items:
                self.consider(peer, remote, items, False)
        if ours.n_holes:  # and the other way round: it merged what we skipped (a pull brings it, if anyone can)
            items = ours.holes_merged_by(remote, skip=self.replica.banned)
            if items:
                self.consider(peer, remote, items, True)

    def consider(self, peer: str, remote: VersionVector, items: list[tuple[str, int]],
                 skipped_here: bool = False) -> None:
        """`peer`'s vector `remote` skipped `items`, which we merged and cannot serve; or, with
        `skipped_here`, it merged `items`, which we skipped. On the loop; returns at once (the repair, if due,
        runs in a task)."""
        if peer not in set(self.members()):  # a bare DHT record votes nothing (members() are proven, see __init__)
            self.stats["repairs_unproven"] += 1
            return
        now = self.clock()
        items = items[:MAX_ITEMS]
        for item in items:
            if item not in self._since and len(self._since) < MAX_TRACKED:
                self._since[item] = now
        if (self._task is not None and not self._task.done()) or now < self._next_try:
            return
        # A skipper waits twice as long: any peer that still holds the update can fill its hole meanwhile.
        grace_s = 2 * self.grace_s if skipped_here else self.grace_s
        ripe = [item for item in items if now - self._since.get(item, now) >= grace_s]
        if not ripe:
            return
        # Crossed holes (it merged one of ours as we merged one of its): both would adopt, each the other's
        # state, and swap forever; only the lower PeerID adopts, and the higher then finds nothing left to do.
        if not skipped_here and peer < self.node.peer_id and self.replica.version_vector.holes_merged_by(remote):
            self.stats["repairs_deferred"] += 1
            self._next_try = now + self.cooldown_s
            return
        members = set(self.members())
        vectors = {pid: vv for pid, vv in self.known().items() if pid in members and pid != peer}
        vectors[peer] = remote
        unknown = len(members - set(vectors))  # members that never sent us a vector vote against us yielding
        chosen = (merged_by_quorum if skipped_here else skipped_by_quorum)(ripe, vectors.values(), unknown)
        if not chosen:
            self.stats["repairs_outvoted"] += 1
            self._next_try = now + self.cooldown_s
            logger.info("repair not due: fewer peers we know %s %s than did as we did (%s)",
                        "merged" if skipped_here else "skipped", _names(ripe), peer[-8:])
            return
        donors = [peer] + [pid for pid, vv in vectors.items() if pid != peer and any(
            vv.has(sender, seq) if skipped_here else seq in vv.holes(sender) for sender, seq in chosen)]
        self._next_try = now + self._backoff_s
        self._task = asyncio.create_task(
            self._repair(donors[:MAX_DONORS], chosen, vectors, len(members), skipped_here), name="replica-repair")

    def _refused(self, donor: str, why: str) -> None:
        """The check before adopting `donor`'s snapshot refused it; a bound exceeded is the donor's fault."""
        if why.startswith("bound"):
            if self.guard is not None and self.replica.policy.deterministic:
                self.guard.count(donor, "repair_bound")  # honest replicas never differ by more
                self.guard.penalize(donor, "repair_bound")
            self._not_repaired("repairs_refused", f"snapshot of {donor} refused: {why}")
        else:
            self._not_repaired("repairs_deferred", f"snapshot of {donor} not adopted now: {why}")

    async def _repair(self, donors: list[str], chosen: list[tuple[str, int]], vectors: dict[str, VersionVector],
                      n_members: int, skipped_here: bool) -> None:
        from p2p_diloco.net.statesync.client import StateSyncError, fetch_snapshot

        self.stats["repair_attempts"] += 1
        started = time.monotonic()
        if skipped_here:
            logger.warning("repair: our replica skipped %s, which most peers merged and nobody served us; adopting "
                           "the state of one of them (donors %s)", _names(chosen), [d[-8:] for d in donors])
        else:
            logger.warning("repair: our replica merged %s, which other peers skipped and we no longer hold; "
                           "adopting the state of one of them (donors %s)", _names(chosen), [d[-8:] for d in donors])
        try:
            theta, vv, donor = await fetch_snapshot(self.node, self.run_id, self.spec_hash, donors,
                                                    self.replica.theta.numel(), self.sync_config, guard=self.guard)
        except StateSyncError as e:
            self._not_repaired("repair_failures", f"no donor served a snapshot: {e}")
            return
        ours = self.replica.version_vector
        if not any(vv.has(sender, seq) if skipped_here else seq in vv.holes(sender) for sender, seq in chosen) \
                or (skipped_here and not any(seq in ours.holes(sender) for sender, seq in chosen)):
            self.stats["repairs_moot"] += 1  # the update turned up since, on its side or ours: pulls do the rest
            logger.info("repair: %s changed since; nothing to adopt from %s", _names(chosen), donor[-8:])
            return
        # What the donor's vector may name: what we or the other peers we know hold, plus its own latest.
        others = [v for pid, v in vectors.items() if pid != donor]
        cover = self.replica.version_vector.merge(*others) if others else self.replica.version_vector
        max_differ = len(chosen) + 4 * (n_members + 1)
        try:
            summary = await asyncio.to_thread(self._adopt, theta, vv, donor, cover, max_differ, skipped_here)
        except Exception:
            self._not_repaired("repair_failures", f"adopting the snapshot of {donor} failed")
            logger.exception("repair: adopting failed")
            return
        if isinstance(summary, str):  # not now: the check that refused it says why
            self._refused(donor, summary)
            return
        for item in chosen:
            self._since.pop(item, None)
        self.stats["repairs"] += 1
        self._backoff_s = self.cooldown_s
        summary.update(donor=donor, items=[list(item) for item in chosen], seconds=time.monotonic() - started)
        logger.warning("repair: adopted the state of %s (V total %d -> %d, %d held update(s) merged again) in %.1fs",
                       donor, summary["vv_total_before"], summary["vv_total"], summary["remerged"],
                       summary["seconds"])
        if self.on_repaired is not None:
            self.on_repaired(summary)

    def _not_repaired(self, stat: str, why: str) -> None:
        self.stats[stat] += 1
        self._backoff_s = min(2 * self._backoff_s, MAX_COOLDOWN_S)  # each retry costs a whole snapshot
        self._next_try = self.clock() + self._backoff_s
        logger.warning("repair: %s (next try in %.0fs at the earliest)", why, self._backoff_s)

    def _adopt(self, theta: torch.Tensor, vv: VersionVector, donor: str, cover: VersionVector,
               max_differ: int, skipped_here: bool = False) -> dict | str:
        """Check the snapshot against our replica and load it, under the replica's lock; then merge again what
        we hold beyond it (decoding: outside the lock, as every merge). A worker thread. A str says why not."""
        replica, me = self.replica, self.node.peer_id
        with replica.lock:
            local = replica.version_vector
            differ = vv.staleness(local) + local.staleness(vv)  # updates in one merged set and not the other
            why = self._vet(local, vv, donor, cover, differ, max_differ, skipped_here)
            if why:
                return why
            step = replica.max_step()
            if math.isfinite(step) and replica.policy.deterministic:  # centered_clip: receivers shape differently
                gap = float((theta - replica.theta).abs().max())
                allowed = differ * step * (1 + _RELATIVE_SLACK) + _ABSOLUTE_SLACK * (1 + float(theta.abs().max()))
                if not gap <= allowed:
                    return (f"bound: it is {gap:.3g} from our replica in a coordinate, more than the {differ} "
                            f"update(s) our vectors differ by can move it ({allowed:.3g})")
            held = self.store.missing_for(vv, 1 << 20)
            merged = replica.load(theta, vv)
        replica.bans.deliver()  # bans load() made while we held the lock: their listeners run now
        for update in held:  # offer re-checks under the lock: a concurrent merge of the same update is a duplicate
            merged.extend(replica.offer(update)[1])
        lost_own = [q for q in range(vv.get(me) + 1, local.get(me) + 1) if not replica.version_vector.has(me, q)]
        if lost_own:
            logger.warning("repair: own seqs %s not in the adopted state yet (gossip brings them back)", lost_own)
        return {"vv_total_before": local.total(), "vv_total": replica.version_vector.total(), "differ": differ,
                "remerged": len(merged)}

    def _vet(self, local: VersionVector, vv: VersionVector, donor: str, cover: VersionVector, differ: int,
             max_differ: int, skipped_here: bool = False) -> str | None:
        """Why the donor's vector must not replace ours now (None: it may). Cheap; under the replica's lock."""
        me = self.node.peer_id
        if not skipped_here and donor < me and local.holes_merged_by(vv):
            return "crossed holes: the peer with the lower PeerID adopts"
        ahead = vv.staleness(cover)
        own_ahead = max(0, vv.get(donor) - cover.get(donor))
        # Our holes it merged (crossed holes): we skipped them because nobody served them; it may hold them.
        filled = sum(1 for sender, seq in local.holes_merged_by(vv) if not cover.has(sender, seq))
        if ahead > own_ahead + filled or own_ahead > MAX_OWN_AHEAD:
            return (f"its vector names {ahead} update(s) neither we nor the other peers we know hold (or too many "
                    "of its own)")
        if any(vv.get(sender) > local.get(sender) for sender in self.replica.banned):
            return "it merged updates of a sender we banned"
        if differ > max_differ:
            return f"it differs from ours by {differ} updates (at most {max_differ}): wait until it has caught up"
        # Our own seqs above its entry must come back from our store. (Those it skipped are what we give up.)
        own_lacked = [q for q in range(vv.get(me) + 1, local.get(me) + 1) if local.has(me, q)]
        if any(self.store.get(me, q) is None for q in own_lacked):
            return "it lacks some of our own updates that our store no longer holds"
        return None


def _names(items: list[tuple[str, int]], limit: int = 4) -> str:
    shown = ", ".join(f"{sender[-8:]}#{seq}" for sender, seq in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
