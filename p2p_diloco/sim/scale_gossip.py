"""How updates spread in the scale simulator: full dissemination (the real gossip) or tree aggregation.

Full dissemination follows net/gossip/service.py. A publisher announces its version vector to `fanout` random live
peers; a peer that lacks the update pulls it (request: its own vector; response: the payload) and, if it was
new, re-announces to `fanout` others. A peer does not pull an update from a second announcer while a pull
bringing it is in flight (the real code's claims; `dedup_inflight=False` pulls again: duplicate payloads). Push
gossip alone
leaves about e^-fanout of the peers unreached; when a wave ends, each live peer still lacking the update pulls
it from a holder after about `anti_entropy_s` (anti-entropy, or a later announce naming it). Every peer
receives about one copy of every update: O(N) bytes per peer per round, plus O(N) vector bytes per announce.

Tree aggregation (ARCHITECTURE.md "The network"; in the spirit of Moshpit SGD and NoLoCo, but exact): every
period, the live units form a random k-ary tree; each sends up the sum of its own unconfirmed updates and its
children's sums, and the root's sum travels back down. The sender's outer step is linear, so a replica
merges the sum as it would merge the parts; a part it already holds (its own update, say) it subtracts, which
is how an update is never merged twice. Each unit sends one sum up and k down: O(1) bytes per unit per round,
for 2 x depth hops of latency. A dead node drops its subtree's parts from that epoch (their senders offer them
again in the next one); a live unit the sum missed pulls it from one that got it. What it gives up: a sum
cannot be checked against the senders' signatures, so aggregators must be trusted (or the sums verified).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2p_diloco.sim.scale_state import UP

HERALD_BYTES = 250
"""A part's signed header, as a sum names it under the real rules (wire/herald.py: sender, seq, digests, signature)."""

if TYPE_CHECKING:
    from p2p_diloco.sim.scale_state import SwarmHost, Unit, Update


class FullDissemination:
    """Announce, pull, re-announce; anti-entropy after each wave; stranded updates wait for a holder."""

    def __init__(self, swarm: SwarmHost) -> None:
        self.sw = swarm
        self.stranded: list[Update] = []

    def start(self) -> None:
        pass

    def catch_up_bytes(self, items: list[Update]) -> int:
        return len(items) * self.sw.cfg.update_bytes

    def publish(self, u: Unit, update: Update) -> None:
        update.holders = [u.index]
        self._announce(u, update, exclude=-1)

    def on_held(self, u: Unit, update: Update) -> None:
        if update.holders is not None:
            update.holders.append(u.index)

    def on_restarted(self, u: Unit) -> None:
        """A holder of a stranded update is back: it starts a new wave."""
        still = []
        for update in self.stranded:
            if self.sw.has(u, update.sender, update.seq):
                update.stranded = False
                self._announce(u, update, exclude=-1)
            else:
                still.append(update)
        self.stranded = still

    def _announce(self, src: Unit, update: Update, exclude: int) -> None:
        sw = self.sw
        now, announce_bytes = sw.queue.now, sw.vector_bytes()
        update.inflight += 1  # the wave cannot end while we are still announcing
        for target in sw.pick_live(sw.cfg.fanout, (src.index, exclude)):
            sw.count(src, target, 0, announce_bytes)
            if sw.has(target, update.sender, update.seq):
                continue
            if sw.cfg.dedup_inflight and update.pending.get(target.index):
                continue
            # announce (one way), then the pull request (one way), then the payload
            self._pull(target, src, update, now + 2 * sw.cfg.latency_s)
        update.inflight -= 1
        self._settle(update)

    def _pull(self, dst: Unit, src: Unit, update: Update, request_at: float) -> None:
        sw = self.sw
        sw.stats["pulls"] += 1
        sw.count(dst, src, 0, sw.vector_bytes())
        update.inflight += 1
        update.pending[dst.index] = update.pending.get(dst.index, 0) + 1
        sw.links.send(src, dst, sw.cfg.update_bytes, 0, request_at, self._arrive, dst, dst.life, src, update)

    def _arrive(self, ok: bool, dst: Unit, dst_life: int, src: Unit, update: Update) -> None:
        sw = self.sw
        update.inflight -= 1
        left = update.pending.get(dst.index, 1) - 1
        if left:
            update.pending[dst.index] = left
        else:
            update.pending.pop(dst.index, None)
        if not ok or dst_life != dst.life or dst.state != UP:
            sw.stats["lost_transfers"] += 1  # one end failed before or during the transfer
        elif sw.deliver(dst, update.sender, update.seq, sw.queue.now):
            self.on_held(dst, update)
            self._announce(dst, update, exclude=src.index)
        else:
            sw.stats["duplicates"] += 1
        self._settle(update)

    def _settle(self, update: Update) -> None:
        """When nothing about `update` is in flight, the live units still lacking it schedule a pull."""
        if update.inflight or update.stranded or update.holders is None:
            return
        sw = self.sw
        lacking = [v for v in sw.live if not sw.has(v, update.sender, update.seq)]
        if not lacking:
            update.holders = None  # everyone live holds it; restarted units catch up from donors
            update.pending = {}
            return
        for v in lacking:
            update.inflight += 1
            delay = sw.cfg.anti_entropy_s * sw.rng.uniform(0.5, 1.5)
            sw.at(sw.queue.now + delay, self._repair, v, v.life, update)

    def _repair(self, v: Unit, life: int, update: Update) -> None:
        sw = self.sw
        update.inflight -= 1
        if life == v.life and v.state == UP and update.holders is not None \
                and not sw.has(v, update.sender, update.seq):
            holder = self._live_holder(update.holders)
            if holder is None:
                if not update.stranded:
                    update.stranded = True
                    self.stranded.append(update)
                    sw.stats["stranded"] += 1
            else:
                sw.stats["repairs"] += 1
                self._pull(v, holder, update, sw.queue.now + sw.cfg.latency_s)
        self._settle(update)

    def _live_holder(self, holders: list[int]) -> Unit | None:
        units, rng = self.sw.units, self.sw.rng
        for _ in range(8):
            u = units[holders[rng.randrange(len(holders))]]
            if u.state == UP:
                return u
        live = [units[h] for h in holders if units[h].state == UP]
        return rng.choice(live) if live else None


class TreeAggregation:
    """Every period: reduce the live units' new updates up a random k-ary tree, broadcast the sum down."""

    def __init__(self, swarm: SwarmHost) -> None:
        self.sw = swarm
        cfg = swarm.cfg
        self.period_s = cfg.aggregation_period_s or cfg.round_s
        self.confirmed = [0] * swarm.n  # per sender: highest seq known to be in a delivered sum
        self.epoch = 0
        bytes_per_hop = cfg.tree_fanin * cfg.sum_bytes  # a node receives k sums, or sends k copies
        self.real = cfg.tree_rules == "real"
        self.hop_s = cfg.latency_s + bytes_per_hop / swarm.links.bytes_per_s

    def start(self) -> None:
        self.sw.at(self.sw.rng.uniform(0.0, self.period_s), self._epoch_start)

    def catch_up_bytes(self, items: list[Update]) -> int:
        """A donor serves the epochs' sums (and single updates not yet in any)."""
        epochs = {u.epoch for u in items if u.epoch is not None}
        return len(epochs) * self.sw.cfg.sum_bytes + sum(1 for u in items if u.epoch is None) * self.sw.cfg.update_bytes

    def publish(self, u: Unit, update: Update) -> None:
        pass  # merged locally already; offered in the next epoch

    def on_held(self, u: Unit, update: Update) -> None:
        pass

    def on_restarted(self, u: Unit) -> None:
        pass

    def _pending(self) -> bool:
        return any(u.seq > c for u, c in zip(self.sw.units, self.confirmed))

    def _epoch_start(self) -> None:
        sw = self.sw
        if sw.stopped and not self._pending() and len(sw.live) == sw.n:
            return  # drained: nothing left to aggregate
        order = list(sw.live)
        sw.rng.shuffle(order)
        k, depth = sw.cfg.tree_fanin, 0
        levels: list[int] = []
        for i in range(len(order)):
            level = levels[(i - 1) // k] + 1 if i else 0
            levels.append(level)
            depth = max(depth, level)
        offers = {u.index: (self.confirmed[u.index] + 1, u.seq) for u in order if u.seq > self.confirmed[u.index]}
        self.epoch += 1
        sw.stats["epochs"] += 1
        now = sw.queue.now
        if order:
            sw.at(now + 2 * depth * self.hop_s, self._epoch_end, self.epoch, now, order, levels, depth, offers)
        sw.at(now + self.period_s, self._epoch_start)

    @staticmethod
    def _up_through(u: Unit, since: float, until: float) -> bool:
        """Was `u` up for the whole of [since, until]? (A unit that failed and came back counts as not.)"""
        if u.up_since > since:
            return False
        return u.state == UP or u.down_since >= until

    def _reduce(self, order: list[Unit], levels: list[int], depth: int, t0: float,
                offers: dict[int, tuple[int, int]]) -> tuple[list[list[int] | None], list[int]]:
        """Bottom-up: each node's subtree senders, or None if the node died before sending its sum; and the
        updates each node added itself (what the real rules' audits re-send)."""
        sw, k, cfg = self.sw, self.sw.cfg.tree_fanin, self.sw.cfg
        meta = HERALD_BYTES if self.real else cfg.vector_entry_bytes
        sub: list[list[int] | None] = [None] * len(order)
        directs = [0] * len(order)
        for i in range(len(order) - 1, -1, -1):
            u = order[i]
            if not self._up_through(u, t0, t0 + (depth - levels[i]) * self.hop_s):
                continue
            senders = [u.index] if u.index in offers else []
            direct = self._seqs(offers, senders)  # the updates it adds itself (the real rules audit them)
            for c in range(k * i + 1, min(k * i + k + 1, len(order))):
                child = sub[c]
                if child is not None:  # an empty subtree sends a header only
                    senders.extend(child)
                    leaf = k * c + 1 >= len(order)
                    if not self.real:
                        payload = cfg.update_bytes if child else 0
                    elif leaf:  # a leaf sends its updates themselves, each once
                        payload = self._seqs(offers, child) * cfg.update_bytes
                        direct += self._seqs(offers, child)
                    else:  # an inner child's sum, and its answer to our audit (the updates it added itself)
                        payload = (cfg.sum_bytes + directs[c] * cfg.update_bytes) if child else 0
                    sw.count(order[c], u, payload, cfg.header_bytes + meta * len(child))
            directs[i] = direct
            sub[i] = senders
        return sub, directs

    @staticmethod
    def _seqs(offers: dict[int, tuple[int, int]], senders: list[int]) -> int:
        return sum(offers[s][1] - offers[s][0] + 1 for s in senders if s in offers)

    def _epoch_end(self, epoch: int, t0: float, order: list[Unit], levels: list[int], depth: int,
                   offers: dict[int, tuple[int, int]]) -> None:
        sw, k = self.sw, self.sw.cfg.tree_fanin
        subtrees, directs = self._reduce(order, levels, depth, t0, offers)
        root = subtrees[0]
        if root is None:
            sw.stats["epochs_lost"] += 1
            return
        if not root:
            return  # nothing to send down
        parts = [sw.log[s][q - 1] for s in root for q in range(offers[s][0], offers[s][1] + 1)]
        for update in parts:
            if update.epoch is None:
                update.epoch = epoch
        for s in root:
            self.confirmed[s] = max(self.confirmed[s], offers[s][1])
        t_root = t0 + depth * self.hop_s
        meta = sw.cfg.header_bytes + (HERALD_BYTES if self.real else sw.cfg.vector_entry_bytes) * len(root)
        audit = directs[0] * sw.cfg.update_bytes if self.real else 0  # the root's children audit the total
        reached = [False] * len(order)
        reached[0] = True
        for i, u in enumerate(order):
            if i:
                p = (i - 1) // k
                forwarded = reached[p] and self._up_through(order[p], t0, t_root + (levels[p] + 1) * self.hop_s)
                if forwarded:
                    sw.count(order[p], u, sw.cfg.sum_bytes + (audit if p == 0 else 0), meta)
                reached[i] = forwarded and self._up_through(u, t0, t_root + levels[i] * self.hop_s)
            if reached[i]:
                at = t_root + levels[i] * self.hop_s
                for update in parts:
                    sw.deliver(u, update.sender, update.seq, at)
        if not parts:
            return
        got = [u for u, r in zip(order, reached) if r and u.state == UP]
        reached_ids = {u.index for u, r in zip(order, reached) if r}
        for u in sw.live:
            if u.index not in reached_ids:
                delay = sw.cfg.anti_entropy_s * sw.rng.uniform(0.5, 1.5)
                sw.at(sw.queue.now + delay, self._repair, u, u.life, parts, got, meta)

    def _repair(self, u: Unit, life: int, parts: list[Update], got: list[Unit], meta: int) -> None:
        """A live unit the epoch's sum missed pulls it from one that got it."""
        sw = self.sw
        if life != u.life or u.state != UP:
            return
        donors = [d for d in got if d.state == UP and d is not u]
        if not donors:  # fall back on anti-entropy pulls from random live peers
            sw.start_anti_entropy(u)
            return
        donor = sw.rng.choice(donors)
        sw.stats["repairs"] += 1
        sw.links.send(donor, u, sw.cfg.sum_bytes, meta, sw.queue.now + sw.cfg.latency_s, self._repaired, u, life,
                      parts)

    def _repaired(self, ok: bool, u: Unit, life: int, parts: list[Update]) -> None:
        if life == u.life and u.state == UP:
            if ok:
                self.sw.receive_many(u, parts)
            else:  # the donor failed while sending
                self.sw.start_anti_entropy(u)
