"""Decoupled learner units on an event queue: failures, inner phases, replicas with version vectors.

Each unit trains alone: an inner phase of H steps at its own speed, then it publishes an update (merging it
into its own replica first, as `Learner.finish_phase` does) and starts the next phase at once. A failure stops
only that unit: the work since its last checkpoint is lost, the chips are repaired, the unit restarts from its
checkpoint, catches up from a live donor (the missing updates, or a state sync if that is smaller) and resumes
its interrupted phase. A restarted unit then runs anti-entropy pulls until it holds what was published by then.

Replicas follow the real merge rule (sync/replica.py): V[sender] is the highest contiguous seq merged; later
seqs wait in a buffer; anything at or below V[sender] is a duplicate. tau (ARCHITECTURE.md "Vocabulary") is the number
of others' updates merged while a phase ran; because V only grows it is a difference of totals.

How updates spread is the job of the dissemination strategy (scale_gossip.py).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from p2p_diloco.sim.events import EventQueue
from p2p_diloco.sim.scale_gossip import FullDissemination, TreeAggregation
from p2p_diloco.sim.scale_links import Uplinks
from p2p_diloco.sim.scale_model import FailureClock, Ledger, MethodResult, Reservoir, progress, summarize, wall_s
from p2p_diloco.sim.scale_state import AUDIT_MAX_MERGES, REPAIR, RESTART, UP, Unit, Update

if TYPE_CHECKING:
    from p2p_diloco.sim.scale_config import ScaleConfig

class DecoupledSwarm:
    """Run p2p DiLoCo learner units through failures; `run()` returns the decoupled MethodResult."""

    def __init__(self, cfg: ScaleConfig, clocks: Sequence[FailureClock], speeds: Sequence[float]) -> None:
        self.cfg, self.clocks, self.n = cfg, list(clocks), cfg.units
        self.queue = EventQueue()
        self.rng = random.Random(f"{cfg.seed}:swarm")
        self.units = [Unit(i, self.n, s, cfg.round_s / s) for i, s in enumerate(speeds)]
        self.live: list[Unit] = list(self.units)
        self.log: list[list[Update]] = [[] for _ in range(self.n)]  # per sender, seq - 1 -> Update
        self.horizon = cfg.duration_s
        self.stopped = False
        self.ledger = Ledger()
        self.failures = self.published = 0
        self.taus: list[int] = []
        self.latency = Reservoir(20_000, f"{cfg.seed}:latency")
        self.samples: list[tuple[float, float, bool]] = []  # (mean, max missing in rounds, all equal)
        self.stats = dict.fromkeys(("pulls", "duplicates", "lost_transfers", "repairs", "stranded", "catchups",
                                    "state_syncs", "anti_entropy_pulls", "epochs", "epochs_lost"), 0)
        self.links = Uplinks(self)
        expected = self.n * self.n * cfg.duration_s / cfg.round_s
        self.audited = expected <= AUDIT_MAX_MERGES
        self.double_merges = 0
        self.events = 0
        if self.audited:
            for u in self.units:
                u.audit = set()
        self.gossip = FullDissemination(self) if cfg.gossip == "full" else TreeAggregation(self)

    def at(self, when: float, fn: Callable[..., Any], *args: Any) -> None:
        """Schedule `fn(*args)` at simulated time `when` (counted)."""
        self.events += 1
        self.queue.push(when, fn, *args)

    # ---- replicas ------------------------------------------------------------------------------------------

    @staticmethod
    def has(u: Unit, sender: int, seq: int) -> bool:
        return seq <= u.vv[sender] or seq in u.buffered.get(sender, ())

    def deliver(self, u: Unit, sender: int, seq: int, at: float) -> bool:
        """The replica rule: merge if contiguous (then drain the buffer), buffer if ahead, drop duplicates.
        True if the update is new to `u`."""
        vv = u.vv
        if seq <= vv[sender]:
            return False
        buf = u.buffered.get(sender)
        if seq == vv[sender] + 1:
            self._merge(u, sender, seq)
            while buf and vv[sender] + 1 in buf:
                buf.remove(vv[sender] + 1)
                u.n_buffered -= 1
                self._merge(u, sender, vv[sender] + 1)
            if buf is not None and not buf:
                del u.buffered[sender]
        else:
            if buf is None:
                buf = u.buffered[sender] = set()
            elif seq in buf:
                return False
            buf.add(seq)
            u.n_buffered += 1
        if sender != u.index:
            self.latency.add(at - self.log[sender][seq - 1].published_at)
        return True

    def _merge(self, u: Unit, sender: int, seq: int) -> None:
        u.vv[sender] = seq
        u.total += 1
        if u.audit is not None:
            if (sender, seq) in u.audit:
                self.double_merges += 1
            u.audit.add((sender, seq))

    def missing(self, u: Unit, donor: Unit) -> list[Update]:
        """What `donor` holds that `u` lacks (O(units + answer))."""
        out: list[Update] = []
        for s, (mine, theirs) in enumerate(zip(u.vv, donor.vv)):
            if theirs > mine:
                buf = u.buffered.get(s, ())
                out.extend(self.log[s][q - 1] for q in range(mine + 1, theirs + 1) if q not in buf)
        for s, seqs in donor.buffered.items():
            out.extend(self.log[s][q - 1] for q in sorted(seqs) if not self.has(u, s, q))
        return out

    # ---- network -------------------------------------------------------------------------------------------

    def count(self, src: Unit, dst: Unit, payload: int, meta: int) -> None:
        src.sent_payload += payload
        src.sent_meta += meta
        dst.recv_payload += payload
        dst.recv_meta += meta

    def vector_bytes(self) -> int:
        """An announce or pull request: header plus a version vector naming every sender."""
        return self.cfg.header_bytes + self.n * self.cfg.vector_entry_bytes

    def pick_live(self, k: int, exclude: tuple[int, ...]) -> list[Unit]:
        live, m = self.live, len(self.live)
        if m <= 2 * k + len(exclude):
            candidates = [u for u in live if u.index not in exclude]
            return self.rng.sample(candidates, min(k, len(candidates)))
        out: list[Unit] = []
        while len(out) < k:
            v = live[self.rng.randrange(m)]
            if v.index not in exclude and v not in out:
                out.append(v)
        return out

    def _set_live(self, u: Unit, alive: bool) -> None:
        if alive:
            u.live_pos = len(self.live)
            self.live.append(u)
        else:
            last = self.live.pop()
            if last is not u:
                self.live[u.live_pos] = last
                last.live_pos = u.live_pos

    # ---- phases --------------------------------------------------------------------------------------------

    def _start_segment(self, u: Unit) -> None:
        u.seg_start = self.queue.now
        at = u.seg_start + wall_s(u.seg_work, self.cfg.checkpoint_interval_s, self.cfg.checkpoint_cost_s)
        self.at(at, self._phase_end, u, u.life)

    def _phase_end(self, u: Unit, life: int) -> None:
        if life != u.life or self.stopped:
            return
        now = self.queue.now
        self.ledger.add("useful", u.work_s)
        self.ledger.add("checkpoint", now - u.seg_start - u.seg_work)
        self.taus.append(u.total - u.base_total)
        u.seq += 1
        update = Update(u.index, u.seq, now)
        self.log[u.index].append(update)
        self.published += 1
        self.deliver(u, u.index, u.seq, now)
        u.base_total = u.total
        u.seg_work = u.work_s
        self._start_segment(u)
        self.gossip.publish(u, update)

    # ---- failures and restarts -----------------------------------------------------------------------------

    def _fail(self, u: Unit) -> None:
        now, clock = self.queue.now, self.clocks[u.index]
        clock.pop()
        if clock.next_at < self.horizon:
            self.at(clock.next_at, self._fail, u)
        self.failures += 1
        if u.state == UP:
            done, saved, ckpt = progress(now - u.seg_start, u.seg_work, self.cfg.checkpoint_interval_s,
                                         self.cfg.checkpoint_cost_s)
            self.ledger.add("lost", done - saved)
            self.ledger.add("checkpoint", ckpt)
            u.seg_work -= saved
            u.down_since = now
            u.down_until = now + self.cfg.repair_s
            self._set_live(u, False)
            self.links.abort(u)
        elif u.state == REPAIR:  # spares are swapped in parallel
            u.down_until = max(u.down_until, now + self.cfg.repair_s)
        else:  # a failure during the restart starts the repair over
            u.down_until = now + self.cfg.repair_s
        u.state = REPAIR
        u.life += 1
        self.at(u.down_until, self._repaired, u, u.life)

    def _repaired(self, u: Unit, life: int) -> None:
        if life != u.life:
            return
        u.state = RESTART
        self.at(self.queue.now + self.cfg.restart_s, self._catch_up, u, life)

    def _catch_up(self, u: Unit, life: int) -> None:
        """Restored from the checkpoint: fetch what a live donor holds and we lack (updates, or a state sync)."""
        if life != u.life:
            return
        donors = self.pick_live(1, (u.index,))
        items = self.missing(u, donors[0]) if donors else []
        if not items:
            self._restarted(u, life)
            return
        donor = donors[0]
        nbytes = self.gossip.catch_up_bytes(items)
        if nbytes >= self.cfg.state_bytes:
            nbytes = self.cfg.state_bytes
            self.stats["state_syncs"] += 1
        self.stats["catchups"] += 1
        self.count(u, donor, 0, self.vector_bytes())
        self.links.send(donor, u, nbytes, 0, self.queue.now + self.cfg.latency_s, self._caught_up, u, life, items)

    def _caught_up(self, ok: bool, u: Unit, life: int, items: list[Update]) -> None:
        if life != u.life:
            return
        if not ok:  # the donor failed: ask another
            self._catch_up(u, life)
            return
        self.receive_many(u, items)
        self._restarted(u, life)

    def receive_many(self, u: Unit, items: list[Update]) -> None:
        now = self.queue.now
        for update in items:
            if self.deliver(u, update.sender, update.seq, now):
                self.gossip.on_held(u, update)

    def _restarted(self, u: Unit, life: int) -> None:
        now = self.queue.now
        u.state, u.up_since = UP, now
        self._set_live(u, True)
        if not self.stopped:
            self.ledger.add("down", now - u.down_since)
            self._start_segment(u)  # resume the interrupted phase from its checkpoint
        self.gossip.on_restarted(u)
        self.start_anti_entropy(u)

    def start_anti_entropy(self, u: Unit) -> None:
        """Pull from a random live peer every anti_entropy_s until `u` holds every update published by now. (The
        real anti-entropy never stops; past that point its pulls bring nothing the gossip would not.)"""
        target = [len(sent) for sent in self.log]
        self.at(self.queue.now + self.cfg.anti_entropy_s, self._anti_entropy, u, u.life, target)

    def _anti_entropy(self, u: Unit, life: int, target: list[int]) -> None:
        if life != u.life or u.state != UP or all(v >= t for v, t in zip(u.vv, target)):
            return
        peers = self.pick_live(1, (u.index,))
        items = self.missing(u, peers[0]) if peers else []
        if not items:
            self.at(self.queue.now + self.cfg.anti_entropy_s, self._anti_entropy, u, life, target)
            return
        self.stats["anti_entropy_pulls"] += 1
        nbytes = min(self.gossip.catch_up_bytes(items), self.cfg.state_bytes)
        self.count(u, peers[0], 0, self.vector_bytes())
        self.links.send(peers[0], u, nbytes, 0, self.queue.now + self.cfg.latency_s, self._anti_entropy_done, u,
                        life, items, target)

    def _anti_entropy_done(self, ok: bool, u: Unit, life: int, items: list[Update], target: list[int]) -> None:
        if life != u.life or u.state != UP:
            return
        if ok:
            self.receive_many(u, items)
        self.at(self.queue.now + self.cfg.anti_entropy_s, self._anti_entropy, u, life, target)

    # ---- measurement ---------------------------------------------------------------------------------------

    def _sample(self) -> None:
        live = self.live
        if not live:
            return
        missing = [self.published - u.total for u in live]
        first = live[0]
        equal = all(u.vv == first.vv and not u.n_buffered for u in live)
        self.samples.append((sum(missing) / len(missing) / self.n, max(missing) / self.n, equal))

    def _stop(self) -> None:
        """End of the allocation: close every unit's ledger; gossip and restarts go on until the queue drains."""
        self.stopped = True
        now = self.queue.now
        for u in self.units:
            self.ledger.add("unfinished", u.work_s - u.seg_work)  # saved earlier in the phase, not yet published
            if u.state == UP:
                done, _, ckpt = progress(now - u.seg_start, u.seg_work, self.cfg.checkpoint_interval_s,
                                         self.cfg.checkpoint_cost_s)
                self.ledger.add("unfinished", done)
                self.ledger.add("checkpoint", ckpt)
            else:
                self.ledger.add("down", now - u.down_since)

    def run(self) -> MethodResult:
        q = self.queue
        self.at(self.horizon, self._stop)
        for k in range(1, self.cfg.samples + 1):
            self.at(self.horizon * k / (self.cfg.samples + 1), self._sample)
        for u, clock in zip(self.units, self.clocks):
            if clock.next_at < self.horizon:
                self.at(clock.next_at, self._fail, u)
            self._start_segment(u)
        self.gossip.start()
        q.run(self.cfg.max_events)
        return self._result()

    def _result(self) -> MethodResult:
        allocated = self.n * self.horizon
        rounds_run = max(1.0, self.published / self.n)  # traffic per round of updates (the drain included)
        sent = [(u.sent_payload + u.sent_meta) / rounds_run for u in self.units]
        traffic = {"sent_mean": sum(sent) / self.n, "sent_max": max(sent),
                   "payload_sent_mean": sum(u.sent_payload for u in self.units) / self.n / rounds_run,
                   "metadata_sent_mean": sum(u.sent_meta for u in self.units) / self.n / rounds_run,
                   "received_mean": sum(u.recv_payload + u.recv_meta for u in self.units) / self.n / rounds_run}
        traffic["copies_sent_mean"] = traffic["payload_sent_mean"] / self.cfg.update_bytes
        first = self.units[0]
        converged = all(u.vv == first.vv and not u.n_buffered and u.total == self.published for u in self.units)
        div = {"missing_rounds_mean": 0.0, "missing_rounds_max": 0.0, "equal_fraction": 0.0}
        if self.samples:
            div = {"missing_rounds_mean": sum(s[0] for s in self.samples) / len(self.samples),
                   "missing_rounds_max": max(s[1] for s in self.samples),
                   "equal_fraction": sum(s[2] for s in self.samples) / len(self.samples)}
        gossip = {**self.stats, "published": self.published, "audited": int(self.audited),
                  "duplicate_fraction": self.stats["duplicates"] / max(1, self.stats["pulls"])}
        return MethodResult(
            method="decoupled", goodput=self.ledger.seconds["useful"] / allocated,
            breakdown=self.ledger.fractions(allocated), failures=self.failures, rounds=self.published / self.n,
            traffic=traffic, staleness=summarize(self.taus), tau_histogram=dict(sorted(Counter(self.taus).items())),
            delivery_latency_s=summarize(self.latency.items),
            divergence=div, gossip=gossip, converged=converged, double_merges=self.double_merges,
            events=self.events)
