"""Dissemination by an aggregation tree on the real network (ARCHITECTURE.md "Aggregation"; the simulator's
twin is sim/aggregation.py, and both build, audit and merge sums with the same sync/ code).

Every peer computes the epoch's tree itself (sync/groups.py: the live members whose record names the same
fan-in and a start at least `SETTLE_S` before the epoch's, ordered by a seeded hash of (run, epoch, PeerID);
epoch = wall-clock time // `aggregate_epoch_s`). Records spread in seconds, so peers that start the same epoch
draw the same tree; one that started later than that sends its update to the root. An
author that is a leaf sends its update to its parent; an inner node keeps its own. A node sends the exact signed
sum of what it holds (its own update, its leaves', its inner children's sums, each audited first:
net/gossip/tree_audits.py) to its parent once every child of its place has sent something, or a wait after
the first new item (`aggregate_wait_s`, by default a quarter of our round: the wait is staleness for all under
the node, which costs by its share of a round). The root's sum is the total: it goes back down the same edges,
its children audit it first, and every peer merges it at once (`Replica.offer_sum`: all its slots or none; a
part merged here already, our own above all, is taken out by its exact step); the root also sends it to the
authors of its parts outside the tree (late joiners). A total ahead of our vector merges, leaving holes (sync/
sum_merge.py); one too far ahead waits. Views of the tree may differ (a record missed): a node sums what it is
sent whatever its place, a total seen twice is dropped, and a sum holding a slot we passed up ourselves is a
loop and dropped, so a disagreement costs bytes and a fallback, not updates.

An author whose update is in no total it merged `aggregate_fallback_s` after publishing announces it as full
dissemination does (the gossip's announce): a dead, slow or lying aggregator costs that delay. Pulls and
anti-entropy run as before and fetch whatever the tree missed, but our update is held back from them
`aggregate_settle_s` first (`UpdateStore.hold_back`): a pull that races the tree fetches it whole a second time.

    tree    "p2p-diloco/<run_id>/tree"
        request  = msgpack {"k": "u" | "s" | "t", "e": epoch, "b": bytes}: our own update (encode_update) sent
                   to our parent, a sum sent up (wire/sums.py), a total sent down
        response = b""   (the work happens after the ack, in a bounded task)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

import msgpack

from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.gossip.sends import Sends
from p2p_diloco.net.gossip.tree_audits import TreeAudits
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import SwarmNode
from p2p_diloco.sync.aggregate import build_sum, sum_parts, sum_total
from p2p_diloco.sync.groups import Tree
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.wire.envelope import OuterUpdate, decode_update, encode_update
from p2p_diloco.wire.identity import Identity
from p2p_diloco.wire.sums import MAX_SUM_HEADER_BYTES, GroupSum, decode_sum

logger = logging.getLogger(__name__)

UPDATE, SUM, TOTAL = "u", "s", "t"
MAX_HELD = 256
"""Updates and child sums a node holds for its next sum, at most (more are dropped: their authors fall back)."""
MAX_WAITING = 16
"""Totals that do not fit our vector yet, kept for when they do."""
MAX_SEEN = 1024
MAX_SENDS = 64
MAX_TASKS = 32
TREES_KEPT = 4
MAX_PASSED = 4096
WAIT_SHARE, FIRST_WAIT_S = 0.25, 1.0
"""The default wait, as a share of our round (the time between our last two updates); before one is measured."""
SETTLE_S = 10.0
"""A peer is in an epoch's tree if its record says it started aggregating this long (at most half an epoch)
before the epoch began: two record refreshes (peer/announce.py), so every member has read its record by then."""


class TreeGossip:
    """One peer's place in the epochs' trees: what it sends up, sums, audits, passes down and merges."""

    def __init__(self, node: SwarmNode, run_id: str, spec_hash: str, intake: Intake, store: UpdateStore,
                 identity: Identity, *, fan_in: int, epoch_s: float, wait_s: float, fallback_s: float,
                 timeout_s: float, members: Callable[[], Mapping[str, float]], announce: Callable[[], None],
                 stats: dict[str, int], guard: PeerGuard | None = None, settle_s: float = 0.0,
                 clock: Callable[[], float] = time.time, since: float | None = None) -> None:
        """`members()`: the live peers whose record names our fan-in (not us), each with the wall-clock time it
        started aggregating (its record's); `since`, ours (our record's); `announce()` the gossip's."""
        self.node, self.run_id, self.spec_hash, self.intake, self.store = node, run_id, spec_hash, intake, store
        self.identity, self.fan_in, self.epoch_s, self.wait_s = identity, fan_in, epoch_s, wait_s
        self.fallback_s, self.timeout_s, self.members, self.announce = fallback_s, timeout_s, members, announce
        self.guard, self.clock, self.stats = guard, clock, stats
        self.settle_s = min(settle_s, fallback_s)  # pulls do not get our update sooner (UpdateStore.hold_back)
        self.since = clock() if since is None else since
        self.me, self.numel = node.peer_id, intake.numel
        self.name = f"p2p-diloco/{run_id}/tree"
        for key in ("tree_updates_sent", "tree_sums_sent", "tree_totals", "tree_totals_merged", "tree_totals_held",
                    "tree_totals_refused", "tree_timeouts", "tree_fallbacks", "tree_refused", "tree_dropped",
                    "tree_loops"):
            stats.setdefault(key, 0)
        self.audits = TreeAudits(node, run_id, spec_hash, intake.replica, identity, members=lambda: list(members()),
                                 numel=self.numel, max_update_bytes=intake.max_bytes, timeout_s=timeout_s,
                                 stats=stats, guard=guard)
        self._sends = Sends(node, self.name, limit=MAX_SENDS, timeout_s=timeout_s, stats=stats,
                            keys=("tree_sends", "tree_send_failures", "tree_sends_dropped"),
                            failed=lambda peer, e: logger.debug("tree send failed peer=%s error=%r", peer[-8:], e))
        self._trees: OrderedDict[int, Tree] = OrderedDict()
        self._direct: list[OuterUpdate] = []  # parts we hold for our next sum
        self._sums: list[GroupSum] = []  # audited child sums we hold for our next sum
        self._heard: set[str] = set()  # children that sent something since our last sum
        self._timer: asyncio.TimerHandle | None = None
        self._fallbacks: list[asyncio.TimerHandle] = []  # our updates' fallback checks, cancelled by `halt`
        self._waiting: list[GroupSum] = []  # totals that do not fit our vector yet
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # sums and totals we took in (each once)
        self._passed: OrderedDict[tuple[str, int], None] = OrderedDict()  # slots we sent up in a sum or update
        self._tasks: set[asyncio.Task] = set()
        self._sending = asyncio.Lock()
        self.delivered = 0  # our newest seq a total we merged holds: it reached the swarm
        self.round_s, self._published_at = 0.0, -1.0  # the time between our last two updates (loop clock)
        self.rpc_stats: rpc.RpcStats | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------------

    async def serve(self) -> None:
        self.rpc_stats = await rpc.serve(self.node.p2p, self.name, self.rpc_tree,
                                         max_request_bytes=4 * self.numel + MAX_SUM_HEADER_BYTES + 1024,
                                         timeout_s=self.timeout_s, max_concurrent=MAX_TASKS, guard=self.guard)
        await self.audits.serve()

    async def unserve(self) -> None:
        await rpc.unserve(self.node.p2p, self.name, timeout_s=self.timeout_s / 2)
        await self.audits.unserve()

    def halt(self) -> list[asyncio.Task]:
        for handle in [self._timer, *self._fallbacks]:
            if handle is not None:
                handle.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        return [*tasks, *self._sends.halt(), *self.audits.halt()]

    # ---- the epoch's tree --------------------------------------------------------------------------------

    def epoch(self) -> int:
        return int(self.clock() // self.epoch_s)

    def tree(self, epoch: int) -> Tree:
        """The epoch's tree over the members that started `SETTLE_S` before it (banned peers left out), as we
        saw them when we first needed it."""
        if epoch not in self._trees:
            banned, start = self.intake.replica.banned, epoch * self.epoch_s - min(SETTLE_S, self.epoch_s / 2)
            members = {p for p, since in self.members().items() if p not in banned and since <= start}
            if self.since <= start:
                members.add(self.me)
            self._trees[epoch] = Tree.of(members, seed=self.run_id.encode(), epoch=epoch, fan_in=self.fan_in)
            while len(self._trees) > TREES_KEPT:
                self._trees.popitem(last=False)
        return self._trees[epoch]

    # ---- our own update ----------------------------------------------------------------------------------

    def publish(self, update: OuterUpdate) -> bool:
        """Send our update up the epoch's tree; False when we are alone in it (the caller announces instead)."""
        epoch, loop = self.epoch(), asyncio.get_running_loop()
        tree = self.tree(epoch)
        if self._published_at >= 0:
            self.round_s = loop.time() - self._published_at
        self._published_at = loop.time()
        if not tree.order or list(tree.order) == [self.me]:
            return False  # nobody to send to yet (the tree's first members settle): the gossip announces it
        parent = tree.parent(self.me) if self.me in tree else tree.root  # a late joiner: to the root
        if parent is None or (self.me in tree and tree.is_inner(self.me)):
            self._hold(update=update)
            self._arm(epoch)
        else:
            request = msgpack.packb({"k": UPDATE, "e": epoch, "b": encode_update(update)}, use_bin_type=True)
            if self._sends.send(parent, request, "tree-update") is not None:
                self.stats["tree_updates_sent"] += 1
                self._pass([(update.sender, update.seq)])
        self.store.hold_back(update.sender, update.seq, self.settle_s)  # the tree's head start over pulls
        self._fallbacks = [h for h in self._fallbacks if h.when() > loop.time()]  # those still to come
        self._fallbacks.append(loop.call_later(self.fallback_s, self._fallback, update.seq))
        return True

    def _fallback(self, seq: int) -> None:
        if self.delivered < seq:
            self.stats["tree_fallbacks"] += 1
            logger.info("our update seq=%d is in no total after %gs: announcing it", seq, self.fallback_s)
            self.store.release(self.me, seq)
            self.announce()

    # ---- receiving ---------------------------------------------------------------------------------------

    async def rpc_tree(self, request: bytes, caller: str) -> bytes:
        self.stats["bytes_received"] += len(request)
        try:
            m = msgpack.unpackb(request, raw=False, max_map_len=3, max_bin_len=len(request))
            if not (isinstance(m, dict) and m.get("k") in (UPDATE, SUM, TOTAL) and type(m.get("e")) is int
                    and isinstance(m.get("b"), bytes)):
                raise ValueError("a tree message is {k, e, b}")
        except Exception as e:  # untrusted bytes: whatever msgpack raises
            self.stats["tree_refused"] += 1
            raise rpc.RpcError(f"bad tree message: {e}") from None
        if len(self._tasks) >= MAX_TASKS:
            self.stats["tree_dropped"] += 1
            raise rpc.RpcError("busy: too many tree messages in progress")
        task = asyncio.create_task(self._take(m["k"], m["e"], m["b"], caller), name=f"tree:{caller[-8:]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return b""

    async def _take(self, kind: str, epoch: int, data: bytes, caller: str) -> None:
        try:
            if kind == UPDATE:
                await self._on_update(epoch, data, caller)
            else:
                await self._on_sum(kind, data, caller)
        except Exception as e:  # a hostile message must not kill the task silently, nor anything else
            self.stats["tree_refused"] += 1
            logger.info("tree message refused kind=%s caller=%s: %r", kind, caller[-8:], e)

    async def _on_update(self, epoch: int, data: bytes, caller: str) -> None:
        update = await asyncio.to_thread(decode_update, data, max_bytes=self.intake.max_bytes, run_id=self.run_id,
                                         spec_hash=self.spec_hash)
        allowed = self.intake.spec.defence.allowed_senders
        if update.sender != caller or update.sender in self.intake.replica.banned \
                or (allowed and update.sender not in allowed):
            raise ValueError("an update in the tree comes from its own author, a member in good standing")
        if self._hold(update=update):
            self._heard_from(caller, epoch if abs(epoch - self.epoch()) <= 1 else self.epoch())

    async def _on_sum(self, kind: str, data: bytes, caller: str) -> None:
        s = await asyncio.to_thread(decode_sum, data, run_id=self.run_id, spec_hash=self.spec_hash,
                                    numel=self.numel)
        if s.aggregator in self.intake.replica.banned or s.sum_id in self._seen:
            return
        self._see(s)
        if kind == SUM:
            if any(slot in self._passed for slot in s.header.slots):
                self.stats["tree_loops"] += 1  # it holds what we sent up: our views of the tree differ
                return
            if await self.audits.check(s) and self._hold(child=s):
                self._heard_from(s.aggregator, s.header.epoch)
            return
        self.stats["tree_totals"] += 1
        tree = self.tree(s.header.epoch)
        # The root's children audit its total before anyone merges it; below them it is the same signed bytes.
        if self.me in tree and tree.parent(self.me) == s.aggregator and not await self.audits.check(s):
            return
        request = msgpack.packb({"k": TOTAL, "e": s.header.epoch, "b": data}, use_bin_type=True)
        for child in tree.children(self.me) if self.me in tree else ():
            if child != caller:
                self._sends.send(child, request, "tree-total")
        await self._merge(s)

    async def _merge(self, s: GroupSum) -> None:
        # A total (audited, or below the root's children) that names our update: it went out, whether or not we
        # can merge it ourselves (all its parts may have reached us by pulls already).
        self.delivered = max([self.delivered, *(seq for sender, seq in s.header.slots if sender == self.me)])
        outcome = await asyncio.to_thread(self.intake.replica.offer_sum, sum_parts(s), sum_total(s),
                                          held=self.store.get)
        if outcome.reason == "gap":
            self._waiting = [*self._waiting, s][-MAX_WAITING:]
            return
        if not outcome.merged:
            self.stats["tree_totals_held" if outcome.reason == "held" else "tree_totals_refused"] += 1
            logger.debug("total not merged aggregator=%s reason=%s", s.aggregator[-8:], outcome.reason)
            return
        self.stats["tree_totals_merged"] += 1
        waiting, self._waiting = self._waiting, []
        for later in waiting:
            await self._merge(later)

    # ---- when we send our sum ----------------------------------------------------------------------------

    def _hold(self, update: OuterUpdate | None = None, child: GroupSum | None = None) -> bool:
        if len(self._direct) + len(self._sums) >= MAX_HELD:
            self.stats["tree_dropped"] += 1
            return False
        if update is not None:
            self._direct.append(update)
        if child is not None:
            self._sums.append(child)
        return True

    def _heard_from(self, child: str, epoch: int) -> None:
        """`child` sent us something new: with every child of our place heard from, our sum goes now."""
        self._heard.add(child)
        tree = self.tree(epoch)
        if self.me in tree and set(tree.children(self.me)) <= self._heard:
            self._start_send(epoch)
        else:
            self._arm(epoch)

    def wait(self) -> float:
        """How long a node waits after its first new item: `aggregate_wait_s`, or a quarter of our round."""
        return self.wait_s or min(WAIT_SHARE * self.round_s if self.round_s else FIRST_WAIT_S, self.fallback_s / 2)

    def _arm(self, epoch: int) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.wait(), self._timed_out, epoch)

    def _timed_out(self, epoch: int) -> None:
        self.stats["tree_timeouts"] += 1
        self._start_send(epoch)

    def _start_send(self, epoch: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._heard.clear()
        direct, children, self._direct, self._sums = self._direct, self._sums, [], []
        if not direct and not children:
            return
        task = asyncio.create_task(self._send(epoch, direct, children), name="tree-sum")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, epoch: int, direct: list[OuterUpdate], children: list[GroupSum]) -> None:
        async with self._sending:
            replica = self.intake.replica
            s = await asyncio.to_thread(build_sum, identity=self.identity, run_id=self.run_id,
                                        spec_hash=self.spec_hash, epoch=epoch, numel=self.numel, direct=direct,
                                        children=children, step_of=replica.exact_step)
        if s is None:
            return
        used = [c for c in children if c.sum_id in {sid for sid, _ in s.header.children}]
        covered = {slot for c in used for slot in c.header.slots}
        self.audits.kept(s, [u for u in direct if (u.sender, u.seq) in set(s.header.slots) - covered], used)
        self._see(s)
        tree = self.tree(epoch)
        parent = tree.parent(self.me) if self.me in tree else tree.root if tree.order else None
        if parent is not None and parent != self.me:
            request = msgpack.packb({"k": SUM, "e": epoch, "b": s.encoded}, use_bin_type=True)
            if self._sends.send(parent, request, "tree-sum") is not None:
                self.stats["tree_sums_sent"] += 1
                self._pass(s.header.slots)
            return
        self.stats["tree_totals"] += 1  # we are the root: our sum is the total
        request = msgpack.packb({"k": TOTAL, "e": epoch, "b": s.encoded}, use_bin_type=True)
        outside = sorted({sender for sender, _ in s.header.slots if sender not in tree and sender != self.me})
        for peer in [*(tree.children(self.me) if self.me in tree else ()), *outside]:
            self._sends.send(peer, request, "tree-total")
        await self._merge(s)

    def _see(self, s: GroupSum) -> None:
        self._seen[s.sum_id] = None
        while len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)

    def _pass(self, slots: Iterable[tuple[str, int]]) -> None:
        for slot in slots:
            self._passed[slot] = None
        while len(self._passed) > MAX_PASSED:
            self._passed.popitem(last=False)
