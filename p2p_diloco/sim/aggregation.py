"""Dissemination by the epoch's aggregation tree, in the in-process swarm (ARCHITECTURE.md "Aggregation").

Instead of a copy of every update to every peer, a leaf of the epoch's tree (sync/groups.py) sends its update to
its parent; an inner node keeps its own. A node sends the exact signed sum of what it holds (sync/aggregate.py:
its own update, its leaf children's, its inner children's sums) to its parent **as soon as every child has sent
it something new**, or `wait` after the first new item when one has not (a slow or dead child costs a timeout,
and its update goes in the next sum). The root's sum is the total, which goes back down the same edges; every
peer merges it with the real replica's merge of sums (`Replica.offer_sum`: its own update, and any it merged one
by one, taken out by their exact steps). The tree rotates every `epoch_s` (several phases: a rotation delays the
updates that straddle it by one sum). An author whose update some live peer still lacks after
`fallback_epochs` waits sends it to everyone itself (an aggregator that dies holding parts costs a timeout, not an
update); anti-entropy runs as before.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from p2p_diloco.sim.audits import Audits
from p2p_diloco.sim.liars import lie
from p2p_diloco.sync.aggregate import build_sum, sum_parts, sum_total
from p2p_diloco.sync.groups import Tree
from p2p_diloco.wire.envelope import OuterUpdate
from p2p_diloco.wire.sums import GroupSum, decode_sum

UP, DOWN = "sum", "total"

AsyncSwarm = Any  # sim/swarm.py's (not imported: the swarm imports this module)
SimPeer = Any  # sim/swarm.py's (not imported: the swarm imports this module)


class TreeDissemination:
    """The aggregation tree's traffic and state for every simulated peer of `swarm`."""

    def __init__(self, swarm: AsyncSwarm, *, fan_in: int, epoch_s: float, wait_s: float,
                 fallback_epochs: int, audit: bool = True) -> None:
        self.swarm, self.net, self.fan_in = swarm, swarm.net, fan_in
        self.epoch_s, self.wait_s, self.fallback_epochs = epoch_s, wait_s, fallback_epochs
        self.trees: dict[int, Tree] = {}
        self.direct: dict[str, list[OuterUpdate]] = defaultdict(list)  # parts a node holds for its next sum
        self.sums: dict[str, list[GroupSum]] = defaultdict(list)  # child sums a node holds for its next sum
        self.heard: dict[str, set[str]] = defaultdict(set)  # children a node holds something new from
        self.timer: dict[str, int] = {}  # a node's pending timeout (its id: a newer one replaces it)
        self.waiting: dict[str, list[GroupSum]] = defaultdict(list)  # totals that do not fit its vector yet
        self.sent_up: dict[str, dict[tuple[str, int], int]] = defaultdict(dict)  # parts a parent was sent, by epoch
        self.counts: Counter[str] = Counter()
        self.audits = Audits(self, timeout_s=wait_s) if audit else None
        self.liar_place: tuple[int, bool] | None = None  # (place in the first tree, silent): sim/liars.py
        self.liars: dict[str, bool] = {}  # peers that lie in their sums -> silent
        self.liars_silent: set[str] = set()

    @property
    def hop_s(self) -> float:
        """About how long one sum takes over one edge."""
        numel = self.swarm.peers[0].learner.numel if self.swarm.peers else 0
        return 4 * numel / self.net.bytes_per_s + 2 * self.swarm.sim.latency_s

    def epoch(self) -> int:
        return int(self.swarm.queue.now // self.epoch_s)

    def tree(self, epoch: int) -> Tree:
        """The epoch's tree over the peers alive when it was first asked for (the DHT's records, in a real swarm)."""
        if epoch not in self.trees:
            members = [p.learner.peer_id for p in self.swarm.peers if p.alive]
            convicted = self.audits.convicted if self.audits is not None else set()
            self.trees[epoch] = Tree.of(members, seed=self.swarm.spec.run_id.encode(), epoch=epoch,
                                        fan_in=self.fan_in, aggregators=[p for p in members if p not in convicted])
            self.trees.pop(epoch - 8, None)
            if self.liar_place is not None and self.trees[epoch].order[self.liar_place[0]:]:
                self.liars[self.trees[epoch].order[self.liar_place[0]]] = self.liar_place[1]
                self.liar_place = None
        return self.trees[epoch]

    # ---- publishing and receiving ----------------------------------------------------------------------

    def publish(self, src: str, data: bytes, update: OuterUpdate) -> None:
        """An author's update: a leaf of the epoch's tree sends it to its parent, an inner node (the root too)
        keeps it for its own sum, a peer that joined after the tree was drawn sends it to the root."""
        epoch = self.epoch()
        tree = self.tree(epoch)
        parent = tree.parent(src) if src in tree else tree.root
        if parent is None or (src in tree and tree.is_inner(src)):
            self.direct[src].append(update)
            self._arm(src, epoch)
        else:
            self.sent_up[parent][(update.sender, update.seq)] = epoch
            self.net.send(src, parent, data)
        due = self.swarm.queue.now + self.fallback_epochs * (self.wait_s + tree.depth() * 2 * self.hop_s)
        self.swarm.queue.push(due, self._fallback, src, data, update)

    def received(self, peer: SimPeer, update: OuterUpdate, src: str) -> None:
        """An update its author sent this peer up the tree (not a fallback's or anti-entropy's copy): a part of
        its next sum."""
        expected = self.sent_up.get(peer.learner.peer_id)
        if src == update.sender and expected is not None and (update.sender, update.seq) in expected:
            epoch = expected.pop((update.sender, update.seq))
            self.direct[peer.learner.peer_id].append(update)
            self._heard(peer.learner.peer_id, epoch, src)

    def convict(self, aggregator: str) -> None:
        """A proven liar: the trees from now on draw their inner places without it (every peer holds the proof)."""
        now = self.epoch()
        self.trees = {e: t for e, t in self.trees.items() if e < now}
        liar = self.swarm.peer_by_id(aggregator)
        if liar is not None and liar.alive:  # every peer refuses it now: in the simulator, it leaves the swarm
            self.swarm._crash(liar.index)

    def on_sum(self, peer: SimPeer, data: bytes, kind: str) -> None:
        if kind not in (UP, DOWN):
            if self.audits is not None:
                self.audits.on_message(peer, data, kind)
            return
        spec = self.swarm.spec
        try:
            s = decode_sum(data, run_id=spec.run_id, spec_hash=spec.spec_hash(), numel=peer.learner.numel)
        except ValueError:
            self.counts["sum_refused_wire"] += 1
            return
        me = peer.learner.peer_id
        if s.aggregator in peer.learner.replica.banned:
            self.counts["sum_refused_banned"] += 1
            return
        if kind == UP:
            def take() -> None:
                self.sums[me].append(s)
                self._heard(me, s.header.epoch, s.aggregator)
            self.audits.check(peer, s, take) if self.audits is not None else take()
            return
        tree = self.tree(s.header.epoch)

        def down() -> None:
            if me in tree:
                for child in tree.children(me):
                    self.net.send(me, child, data, kind=DOWN)
            self._merge_total(peer, s)
        # The root's children audit its total before anyone merges it; below them it is the same signed bytes.
        audited = self.audits is not None and me in tree and tree.parent(me) == s.aggregator
        self.audits.check(peer, s, down) if audited and self.audits is not None else down()

    def _merge_total(self, peer: SimPeer, s: GroupSum) -> None:
        if peer.busy and peer.waiting_until is None:
            self.swarm._advance(peer)  # the steps it would have done by now run before theta moves
        outcome = peer.learner.replica.offer_sum(sum_parts(s), sum_total(s), held=peer.store.get)
        self.counts[f"total_{outcome.reason or 'merged'}"] += 1
        if outcome.reason == "gap":
            self.waiting[peer.learner.peer_id].append(s)
            return
        if outcome.merged:
            for slot in s.header.slots:
                peer.held_since.setdefault(slot, self.swarm.queue.now)
            waiting, self.waiting[peer.learner.peer_id] = self.waiting[peer.learner.peer_id], []
            for later in waiting:
                self._merge_total(peer, later)
            if peer.waiting_until is not None:  # in the grace window: was this what it waited for?
                self.swarm._start_phase(peer)

    # ---- when a node sends ---------------------------------------------------------------------------

    def _heard(self, node: str, epoch: int, child: str) -> None:
        """`node` got something new from `child`: with every child of its place heard from, its sum goes now."""
        self.heard[node].add(child)
        tree = self.tree(epoch)
        if node in tree and set(tree.children(node)) <= self.heard[node]:
            self._send(node, epoch)
        else:
            self._arm(node, epoch)

    def _arm(self, node: str, epoch: int) -> None:
        """Send what `node` holds `wait_s` from now unless every child is heard from before (one timer a node)."""
        if node not in self.timer:
            self.timer[node] = ticket = self.counts["timers"] = self.counts["timers"] + 1
            self.swarm.queue.push(self.swarm.queue.now + self.wait_s, self._timeout, node, epoch, ticket)

    def _timeout(self, node: str, epoch: int, ticket: int) -> None:
        if self.timer.get(node) == ticket:
            self.counts["timeouts"] += 1
            self._send(node, epoch)

    def _send(self, node: str, epoch: int) -> None:
        self.timer.pop(node, None)
        self.heard.pop(node, None)
        peer = self.swarm.peer_by_id(node)
        direct, children = self.direct.pop(node, []), self.sums.pop(node, [])
        if peer is None or not peer.alive:
            return  # a dead aggregator's parts are lost with it: their authors fall back
        s = build_sum(identity=peer.learner.identity, run_id=self.swarm.spec.run_id,
                      spec_hash=self.swarm.spec.spec_hash(), epoch=epoch, numel=peer.learner.numel,
                      direct=direct, children=children, step_of=peer.learner.replica.exact_step)
        if s is None:
            return
        used = [c for c in children if c.sum_id in {sid for sid, _ in s.header.children}]
        covered = {slot for c in used for slot in c.header.slots}
        slots = set(s.header.slots) - covered
        kept = [u for u in direct if (u.sender, u.seq) in slots]
        if node in self.liars:
            if self.liars[node]:
                self.liars_silent.add(node)
            s = lie(s, peer.learner.identity, used)
        if self.audits is not None:
            self.audits.kept(node, s, kept, used)
        tree = self.tree(epoch)
        parent = tree.parent(node) if node in tree else None
        if parent is not None:
            self.net.send(node, parent, s.encoded, kind=UP)
            return
        self.counts["totals"] += 1
        for child in tree.children(node) if node in tree else ():
            self.net.send(node, child, s.encoded, kind=DOWN)
        self._merge_total(peer, s)

    def _fallback(self, src: str, data: bytes, update: OuterUpdate) -> None:
        """Some live peer still lacks it: the author sends it to everyone itself."""
        author = self.swarm.peer_by_id(src)
        if author is None or not author.alive:
            return
        if any(not p.learner.replica.version_vector.has(update.sender, update.seq)
               for p in self.swarm.peers if p.alive):
            self.counts["fallbacks"] += 1
            self.net.broadcast(src, data)
