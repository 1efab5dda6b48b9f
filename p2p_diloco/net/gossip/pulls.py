"""The pulling half of gossip (the protocol: net/gossip/service.py): which remotes to pull from, one pull at a
time per remote, and every update a pull brings through the intake.

`Puller` keeps the wishes and backoffs in `PullSlots` (net/gossip/slots.py: who gets a slot, by track record),
runs at most `max_concurrent_pulls` pulls, asks each remote only beyond what the pulls started before it will
bring (`claims`), remembers remotes whose last pull brought nothing (`dry`), pulls from no peer it banned as
an author, and ends a pull at the first update no honest peer sends. `Gossip` owns it and starts it; the
gossip's parts share one `stats` dict and one `FailureLog`.

Track record (ARCHITECTURE.md "The network", open runs), in the guard's ledger (net/admission/ledger.py; a
Puller without a guard keeps its own): a pull that brought updates records `gave` against its remote for each
one kept (merged or buffered) that vetting did not refuse (`_earned`); a failure records its kind (timeout,
for a slow stream too; refused; error, for a broken stream; invalid, with the penalty; empty, for a pull that
brought nothing of what the remote claimed: a forced pull, anti-entropy's, claims nothing). Every failure but
invalid data (which the guard's penalty covers) and every empty pull makes the remote back off; a remote whose
bytes-in bucket is in debt keeps its wish and is asked again after the shortest backoff. A pull from a
remote that never gave us anything (probation) must bring each part of its answer within
`probation_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Collection

from p2p_diloco.config.admission import RateLimitConfig
from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.admission.ledger import Ledger
from p2p_diloco.net.gossip.digests import request_digests
from p2p_diloco.net.gossip.messages import (
    HOSTILE_OUTCOMES,
    LEDGER_FAILURES,
    PULL_FAILURES,
    GossipConfig,
    InvalidPull,
    encode_request,
)
from p2p_diloco.net.gossip.slots import MAX_WANTED_PEERS, PullSlots
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import SwarmNode
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.sync.types import MergeOutcome
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.envelope import OuterUpdate

logger = logging.getLogger(__name__)

MAX_PULL_ROUNDS = 64
"""Pulls from one remote in a row, at most (each of up to pull_max_updates updates)."""
# Outcomes after which we hold the update (merged, or waiting for its gap), so we keep it to serve others.
_KEPT = (MergeOutcome.MERGED.value, MergeOutcome.BUFFERED.value)


def lacks(ours: VersionVector, remote: VersionVector, banned: Collection[str]) -> bool:
    """`remote` holds updates `ours` lacks (above our entries, or in our holes: merged late), of senders we
    have not banned: a banned sender's seqs are never served, and a replica that took back an equivocation
    holds fewer of them than one that could not."""
    if any(sender not in banned for sender in ours.missing_from(remote)):
        return True
    return bool(ours.n_holes and ours.holes_merged_by(remote, skip=banned))


class FailureLog:
    """Counts a remote's failures against it (with the guard) and logs them at most once per peer per
    `interval_s`."""

    def __init__(self, guard: PeerGuard | None, interval_s: float) -> None:
        self.guard, self.interval_s = guard, interval_s
        self._logged_at: dict[str, float] = {}

    def count(self, peer: str, reason: str, *, in_totals: bool = True) -> None:
        if self.guard is not None:
            self.guard.count(peer, reason, in_totals=in_totals)

    def log(self, peer: str, what: str, error: BaseException) -> None:
        now = time.monotonic()
        if len(self._logged_at) > MAX_WANTED_PEERS:
            self._logged_at.clear()
        if now - self._logged_at.get(peer, -1e18) >= self.interval_s:
            self._logged_at[peer] = now
            logger.warning("gossip %s failed peer=%s error=%s (further failures of this peer counted, logged "
                           "again after %gs)", what, peer, error, self.interval_s)


class Puller:
    """Pull scheduling and the pulls themselves, on the gossip's loop, between `start()` and `halt()`."""

    def __init__(self, node: SwarmNode, pull_name: str, intake: Intake, store: UpdateStore, config: GossipConfig, *,
                 guard: PeerGuard | None, stats: dict[str, int], failures: FailureLog, rng: random.Random,
                 on_evidence: Callable[[bytes, bytes], None] | None, on_brought: Callable[[str], None]) -> None:
        """`on_brought(peer)` runs after a pull from `peer` that brought anything new (Gossip re-announces)."""
        self.node, self.pull_name, self.intake, self.store, self.config = node, pull_name, intake, store, config
        self.guard, self.stats, self.failures, self.rng = guard, stats, failures, rng
        self.on_evidence, self.on_brought = on_evidence, on_brought
        self.limits = guard.limits if guard is not None else RateLimitConfig()
        self.ledger: Ledger = guard.ledger if guard is not None else Ledger()
        self.slots = PullSlots(config.max_concurrent_pulls, self.limits.probation_pulls)
        self._running = False
        self.tasks: dict[str, asyncio.Task] = {}  # remote -> its pull task
        self._wake: asyncio.TimerHandle | None = None  # start_pulls when the first backoff of a wish ends
        # remote -> the vector its running pull is expected to bring us up to. Concurrent pulls from other
        # peers ask only for what lies beyond these claims, so one update is not fetched twice at once (the scale
        # simulator measured 36-50% duplicate pulls, 1.6-2x the bytes, without this).
        self._claims: dict[str, VersionVector] = {}
        # remote -> its vector when a pull from it brought nothing we could use (e.g. it merged one of our holes
        # and cannot serve it): not asked again until its vector changes, or by anti-entropy
        self._dry: OrderedDict[str, VersionVector] = OrderedDict()

    @property
    def running(self) -> bool:
        return self._running

    def start(self) -> None:
        """Pulls may start (`Gossip.start` calls it once it serves its RPCs)."""
        self._running = True

    def halt(self) -> list[asyncio.Task]:
        """No pull starts any more, and the running ones are cancelled; returns their tasks, for the caller to
        wait on before `clear()`."""
        self._running = False
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        return tasks

    def clear(self) -> None:
        self.slots.clear()
        self._dry.clear()
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None

    def is_dry(self, peer: str, remote: VersionVector) -> bool:
        return self._dry.get(peer) == remote

    def pending_peers(self) -> list[str]:
        """Remotes with a pull running or wanted (copies: a poll from another thread is safe enough)."""
        return [*list(self.tasks), *list(self.slots.wanted)]

    def want(self, peer: str, remote: VersionVector, *, force: bool) -> None:
        """`peer` holds `remote` (a hint: see net/gossip/slots.py for when it gets a slot)."""
        self.stats["pulls_dropped"] += self.slots.want(peer, remote, force, self.ledger.is_contributor)
        now = time.monotonic()
        until = self.slots.backoff_until(peer, now)
        if until is not None:
            self._wake_at(until, now)
        elif self.slots.may_start(peer, self.tasks, now, self.ledger.is_contributor):
            self.start_pulls()

    def start_pulls(self) -> None:
        if not self.running:
            return
        now = time.monotonic()
        picked, wake = self.slots.pick(self.tasks, now, self.ledger.is_contributor, self.ledger.score)
        for peer in picked:
            self.tasks[peer] = asyncio.create_task(self._pull_from(peer), name=f"pull:{peer[-8:]}")
        if wake is not None:
            self._wake_at(wake, now)

    def _wake_at(self, at: float, now: float) -> None:
        """Run start_pulls at monotonic time `at` (or earlier, if already due to)."""
        if self._wake is not None and self._wake.when() <= asyncio.get_running_loop().time() + (at - now) + 0.01:
            return
        if self._wake is not None:
            self._wake.cancel()
        self._wake = asyncio.get_running_loop().call_later(max(0.0, at - now) + 0.01, self._woken)

    def _woken(self) -> None:
        self._wake = None
        self.start_pulls()

    def _lacks(self, ours: VersionVector, remote: VersionVector) -> bool:
        return lacks(ours, remote, self.intake.replica.banned)

    async def _pull_from(self, peer: str) -> None:
        """Pull from `peer` while it has something for us (pending wishes folded in), then re-announce."""
        brought = 0
        try:
            while self.running and peer in self.slots.wanted \
                    and self.slots.backoff_until(peer, time.monotonic()) is None:
                remote, force = self.slots.wanted.pop(peer)
                self._claims[peer] = remote
                for _ in range(MAX_PULL_ROUNDS):
                    claimed = self._lacks(self._wanted_vector(peer), remote)
                    why = self._refusal(peer) if force or claimed else "nothing"
                    if why == "rate_limited":  # its bytes-in bucket refills: keep the wish, ask again soon
                        self.slots.want(peer, remote, force, self.ledger.is_contributor)
                        self.slots.failed(peer, time.monotonic(), grow=False)
                    if why:
                        break
                    received, new = await self._pull_once(peer)
                    brought += new
                    if new == 0:  # nothing usable (e.g. it lacks the seq that fills our gap): stop asking
                        self._dry.pop(peer, None)
                        self._dry[peer] = remote
                        while len(self._dry) > MAX_WANTED_PEERS:
                            self._dry.popitem(last=False)
                        # it said it held what we lack, and brought none of it (with a tree its author holds
                        # it back a while, or the remote merged it in a total: not a failure then)
                        if claimed and not self.config.aggregate:
                            self._record_failure(peer, "empty")
                        break
                    self.slots.succeeded(peer)
                    force = received >= self.config.pull_max_updates  # a full batch: more may remain
        except asyncio.CancelledError:
            raise
        except Exception as e:  # RpcError, or anything else a remote could provoke: count it, never crash
            self.slots.pop(peer)
            self.stats["pull_failures"] += 1
            self._pull_failed(peer, e)
        finally:
            self.tasks.pop(peer, None)
            self._claims.pop(peer, None)
            if brought and self.running:
                self.on_brought(peer)
            self.start_pulls()

    async def _pull_once(self, peer: str) -> tuple[int, int]:
        """One pull request; returns (updates received, updates new to us)."""
        limit = self.config.pull_max_updates
        timeout_s = self.config.rpc_timeout_s
        if not self.ledger.is_contributor(peer):  # probation: a staller holds its slot briefly
            timeout_s = min(timeout_s, self.limits.probation_timeout_s)
        wanted = self._wanted_vector(peer)
        replica = self.intake.replica
        request = encode_request(wanted, limit, ids=request_digests(wanted, replica.version_vector,
                                                                    replica.recent_ids, self.rng))
        self.stats["pulls"] += 1
        self.stats["bytes_sent"] += len(request)
        max_bytes = self.intake.max_bytes
        stream = rpc.call_stream(self.node.p2p, peer, self.pull_name, request, max_chunk_bytes=max_bytes,
                                 max_total_bytes=limit * max_bytes, timeout_s=timeout_s,
                                 min_bytes_per_s=min_bytes_per_s(self.guard))
        received = new = 0
        async with contextlib.aclosing(stream):
            async for data in stream:
                received += 1
                self.stats["updates_received"] += 1
                self.stats["bytes_received"] += len(data)
                if self.guard is not None:
                    self.guard.charge_in(peer, len(data))
                if received > limit:
                    raise InvalidPull("too_many_updates", f"peer {peer} sent more than the {limit} updates asked for")
                # Decompression and the merge are CPU work: off the loop. The store stays on the loop.
                outcome, update = await asyncio.to_thread(self.intake.receive, data, source=peer)
                if update is not None and outcome in _KEPT:
                    self.store.add(update)
                    new += 1
                    self.stats["updates_new"] += 1  # counted as merged, not when the stream ends: readers race
                    if self._earned(update.sender):
                        self.ledger.gave(peer, 1, len(data))
                else:
                    self._rejected(peer, outcome, update)
        return received, new

    def _earned(self, sender: str) -> bool:
        """A kept update counts as a gift unless vetting refused it (sync/standing.py): a signed update under a
        fresh key is free to make, and one the merge gave no weight must not buy its relay pull slots."""
        standing = self.intake.replica.standing
        if standing is None:
            return True
        authors = standing.authors  # what the replica remembers of each author (sync/authors.py)
        return sender not in authors.distrusted and sender not in authors.strikes

    def _rejected(self, peer: str, outcome: str, update: OuterUpdate | None) -> None:
        """Count an update we did not keep against the remote that sent it; stop listening to a hostile one."""
        self.failures.count(peer, outcome, in_totals=False)  # the intake totals its own outcomes
        if outcome == MergeOutcome.EQUIVOCATION.value and update is not None and self.on_evidence is not None:
            proof = self.intake.evidence.get(update.sender)  # kept by the intake when it banned the sender
            if proof is not None:
                self.stats["evidence_found"] += 1
                self.on_evidence(*proof)
        if outcome in HOSTILE_OUTCOMES:
            # An honest peer never relays this (it checks what it keeps): spend nothing more on this stream.
            raise InvalidPull(outcome, f"peer {peer} sent an invalid update ({outcome})")

    def _wanted_vector(self, peer: str) -> VersionVector:
        """What we hold plus what the pulls started before this one will bring: a pull from `peer` asks only
        beyond it. Only earlier pulls count (`_claims` keeps start order), so two pulls never both leave an
        update to the other. If an earlier pull fails, what it claimed comes back with the next pull."""
        vector = self.intake.replica.version_vector
        for other, claim in self._claims.items():
            if other == peer:
                break
            vector = vector.merge(claim)
        return vector

    def _refusal(self, peer: str) -> str | None:
        """Why not to pull from `peer` now (counted), or None."""
        # A peer we banned as an author would serve us its own refused updates first (it keeps them) at every
        # anti-entropy tick: no pull slot; what else it could relay reaches us from others.
        if peer in self.intake.replica.banned:
            why: str | None = "banned_author"
        else:
            why = self.guard.may_pull_from(peer) if self.guard is not None else None
        if why:
            self.stats["pulls_skipped"] += 1
            self.failures.count(peer, why)
        return why

    def _pull_failed(self, peer: str, error: BaseException) -> None:
        if isinstance(error, InvalidPull):
            reason = error.reason
            if reason not in HOSTILE_OUTCOMES:  # intake outcomes are counted already
                self.failures.count(peer, reason)
            if self.guard is not None:
                self.guard.penalize(peer, reason)
            self._record_failure(peer, "invalid")
        else:
            reason = next((r for kind, r in PULL_FAILURES if isinstance(error, kind)), "pull_error")
            self.failures.count(peer, reason)
            if reason == "oversize" and self.guard is not None:  # honest peers never exceed the spec's bound
                self.guard.penalize(peer, reason)
            self._record_failure(peer, LEDGER_FAILURES.get(reason, "error"))
        self.failures.log(peer, "pull", error)

    def _record_failure(self, peer: str, kind: str) -> None:
        """Into the ledger; and back off, unless the data was invalid (the guard's penalty covers that)."""
        self.ledger.failed(peer, kind)
        if kind != "invalid":  # a contributor that was busy (a crowd may keep it so) is asked again soon
            self.slots.failed(peer, time.monotonic(), grow=not (kind == "refused" and self.ledger.is_contributor(peer)))


def min_bytes_per_s(guard: PeerGuard | None) -> float:
    """The pace every pull stream must keep, in both directions (0: none without a guard)."""
    return guard.limits.min_stream_bytes_per_s if guard is not None else 0.0
