"""A running peer that cannot catch up by pulls re-syncs its state by itself.

The case (peer/lag.py): updates we lack next are held by nobody who serves them (only inside snapshots), the gap
is wider than the replica may skip, and every later update of that sender fills our buffer. Gossip cannot end
it; a state sync can, as it does for a joiner and for a restarted peer whose gap the peers no longer hold
(peer/resume.py). `Resync` is the running peer's side of that:

- `observe()`, from the compute thread at its ticks (at most every `period_s`; it reads only snapshots: our
  replica's vector, the vectors gossip last heard (`Gossip.known_vectors`, a copy) or, for a live peer gossip
  has not heard from, its record's `vv`), feeds `LagWatch`;
- `between_rounds(loop, stop)`, from the compute thread between two rounds (never inside an inner phase), re-syncs
  when the watch says so: fetch a verified snapshot (net/statesync/client.py) from the first donor that serves
  one (proven contributors first, then `"reach": "public"` records), check it (it must hold more of the stalled
  senders than we do, nothing of a sender we banned, and, under a deterministic merge rule with a bound, lie
  within what the updates our vectors differ by can move theta: repair's bound, net/gossip/repair.py), load it
  (our standing stays ours: unlike a joiner we have a reference to vet by; as in repair), then offer again
  our own updates it lacks (the journal's, with checkpoints, and our gossip store's) and the other updates our
  store holds beyond it. m, e, the inner optimizer, the data position and our own seq stay ours, as after a
  restart's catch-up state sync (peer/resume.py): no own update is lost or numbered again.

Bounded: at most one attempt per `cooldown_s`; after a failed one the cooldown doubles, up to MAX_COOLDOWN_S.
Each attempt prints one line, writes a `resync` JSON event (with the running counts) and, when it loaded a state,
a summary with `kind: "resync"` in `PeerNetwork.repairs` (the final record's `repairs`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable

import torch

from p2p_diloco.net.statesync.client import fetch_snapshot
from p2p_diloco.net.transport.netloop import NetLoop, Stopped
from p2p_diloco.peer.announce import Record
from p2p_diloco.peer.lag import LagWatch, Stuck, order_donors
from p2p_diloco.peer.network import PeerNetwork
from p2p_diloco.peer.output import JsonLog
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.train.learner import Learner
from p2p_diloco.wire.envelope import OuterUpdate

logger = logging.getLogger(__name__)

MIN_WINDOW_S = 30.0
WINDOW_ANTI_ENTROPIES = 6
"""The watch's window: this many anti-entropy periods, at least MIN_WINDOW_S."""
ROUNDS_IN_WINDOW = 3
COOLDOWN_S = 300.0
MAX_COOLDOWN_S = 3600.0
RESYNC_TIMEOUT_S = 900.0
"""Bound on one re-sync (the state sync's own per-donor timeouts end it sooner)."""
MAX_DONORS = 4
_RELATIVE_SLACK = 1e-3
_ABSOLUTE_SLACK = 1e-5
_STATS = ("resyncs", "resync_attempts", "resync_failures", "resyncs_refused")


class ResyncRefused(Exception):
    """The snapshot fetched must not replace our state (the message says why)."""


class Resync:
    """The watch and the re-sync of one running peer (see module doc)."""

    def __init__(self, network: PeerNetwork, learner: Learner, *, window_s: float, fixed: bool = False,
                 cooldown_s: float = COOLDOWN_S, period_s: float = 1.0,
                 journal: Callable[[], Iterable[OuterUpdate]] | None = None,
                 out: Callable[[str], None] = print, log: JsonLog | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`window_s`: the watch's window; unless `fixed`, at least ROUNDS_IN_WINDOW of our rounds (a peer whose
        rounds are long moves its entries once a round). `journal()`: our journaled updates
        (PeerCheckpoints.state.journaled), or None without checkpoints."""
        self.network, self.learner, self.journal, self.out, self.log = network, learner, journal, out, log
        self.clock, self.period_s, self.window_s, self.fixed = clock, period_s, window_s, fixed
        replica = learner.replica
        self.watch = LagWatch(window_s, self_id=learner.peer_id, max_hole_span=replica.max_hole_span)
        self.cooldown_s = self._backoff_s = cooldown_s
        self.due: Stuck | None = None
        self.stats: dict[str, int] = dict.fromkeys(_STATS, 0)
        self._next_try = -math.inf
        self._last_observed = -math.inf

    # ---- the compute thread's ticks ------------------------------------------------------------------------

    def observe(self) -> Stuck | None:
        """Feed the watch (at most every `period_s`); returns the current verdict. Never waits on the network."""
        now = self.clock()
        if now - self._last_observed < self.period_s:
            return self.due
        self._last_observed = now
        replica = self.learner.replica
        self.due = self.watch.observe(now, replica.version_vector, self.others(),
                                      buffer_full=replica.stats.get("rejected_buffer_full", 0),
                                      banned=replica.banned)
        return self.due

    def others(self) -> dict[str, VersionVector]:
        """Live peers -> the vector they hold: gossip's last from each, else its record's `vv` (untrusted: a bad
        one is left out). Penalized peers are left out."""
        network = self.network
        me = self.learner.peer_id
        guard = getattr(network, "guard", None)
        gossip = getattr(network, "gossip", None)
        known = gossip.known_vectors() if gossip is not None else {}
        out: dict[str, VersionVector] = {}
        for peer, record in network.peers.items():
            if peer == me or (guard is not None and guard.is_penalized(peer)):
                continue
            vv = known.get(peer)
            raw = record.get("vv")
            if vv is None and isinstance(raw, dict):
                try:
                    vv = VersionVector.from_dict(raw)
                except (TypeError, ValueError):
                    vv = None
            if vv is not None:
                out[peer] = vv
        return out

    # ---- between rounds ---------------------------------------------------------------------------------------

    def between_rounds(self, loop: NetLoop, stop: threading.Event, round_s: float = 0.0) -> Record | None:
        """After a round that took `round_s`: re-sync now if the watch says we cannot catch up by pulls and no
        cooldown holds; the summary, or None when nothing was tried. Only between rounds: the compute thread waits
        here, nothing uses phi."""
        if not self.fixed:
            self.watch.window_s = max(self.window_s, ROUNDS_IN_WINDOW * round_s)
        stuck = self.observe()
        now = self.clock()
        if stuck is None or now < self._next_try:
            return None
        records = self.network.peers
        guard = getattr(self.network, "guard", None)
        proven = set(self.network.proven_peer_ids()) if hasattr(self.network, "proven_peer_ids") else set()
        penalized = {p for p in stuck.donors if guard is not None and guard.is_penalized(p)}
        donors = order_donors(stuck.donors, records, proven=proven, penalized=penalized)[:MAX_DONORS]
        if not donors:
            return None
        self.stats["resync_attempts"] += 1
        line = (f"cannot catch up by pulls (behind by {stuck.behind} updates from {len(stuck.donors)} peers for "
                f"{stuck.stalled_s:.0f} s: {stuck.why}): re-syncing state from {donors[0]}")
        logger.warning(line)
        self.out(line)
        previous = self.network.local
        self.network.local = {**previous, "state": "syncing"}
        self.network.request_announce()
        started = time.monotonic()
        try:
            summary = loop.wait(self._resync(donors, stuck), stop, timeout_s=RESYNC_TIMEOUT_S)
            ok = True
        except Stopped:  # the peer is leaving (the round loop sees the stop next): not a failure
            self.out("re-sync interrupted: stopping")
            return None
        except Exception as e:  # a failed re-sync must not end training: gossip goes on, we try again later
            refused = isinstance(e, ResyncRefused)
            self.stats["resyncs_refused" if refused else "resync_failures"] += 1
            summary, ok = {"error": str(e) or type(e).__name__}, False
        finally:
            self.network.local = previous
            self.network.request_announce()
        self.watch.reset()
        self.due = None
        summary.update(kind="resync", ok=ok, behind=stuck.behind, peers=len(stuck.donors),
                       stalled_s=round(stuck.stalled_s, 1), why=stuck.why, senders=list(stuck.senders),
                       seconds=round(time.monotonic() - started, 2))
        if ok:
            self.stats["resyncs"] += 1
            self._backoff_s = self.cooldown_s
            self.out(f"re-synced state from {summary['donor']}: V total {summary['vv_total_before']} -> "
                     f"{summary['vv_total']} ({summary['remerged']} held update(s) merged again) in "
                     f"{summary['seconds']:.1f}s")
        else:
            self._backoff_s = min(2 * self._backoff_s, MAX_COOLDOWN_S)
            self.out(f"re-sync failed ({summary['error']}); next try in {self._backoff_s:.0f}s at the earliest")
        self._next_try = self.clock() + (self.cooldown_s if ok else self._backoff_s)
        if self.log is not None:
            self.log.write("resync", **summary, **self.stats)
        return summary

    async def _resync(self, donors: list[str], stuck: Stuck) -> Record:
        """On the loop: fetch, check, load, offer again what we hold beyond it."""
        network, node = self.network, self.network.node
        assert node is not None  # a running peer: its node started before training
        theta, vv, donor = await fetch_snapshot(node, network.run_id, network.spec_hash, donors,
                                                self.learner.numel, network.config.statesync, guard=network.guard)
        summary = await asyncio.to_thread(self._load, theta, vv, donor, stuck)
        summary["donor"] = donor
        network.resynced(donor, dict(summary, kind="resync"))
        if network.gossip is not None:
            await network.gossip.request_pull(donor)
        return summary

    def _load(self, theta: torch.Tensor, vv: VersionVector, donor: str, stuck: Stuck) -> Record:
        """A worker thread: check the snapshot against our replica, load it, offer again what we hold beyond it."""
        replica, learner, me = self.learner.replica, self.learner, self.learner.peer_id
        store = getattr(self.network.gossip, "store", None)
        with replica.lock:
            local = replica.version_vector
            check(local, vv, theta, replica, stuck)
            held = store.missing_for(vv, 1 << 20) if store is not None else []
            replica.load(theta, vv)  # our standing (whom we vet, and how) stays ours, as after a repair
        replica.bans.deliver()
        own = [u for u in held if u.sender == me]
        if self.journal is not None:
            own += [u for u in self.journal() if u.seq > vv.get(me)]
        before = replica.version_vector.total()
        learner.adopt_own_updates(own)  # seqs at or below our last: no round counted, nothing signed again
        for update in held:
            if update.sender != me:
                replica.offer(update)
        lost_own = [q for q in range(vv.get(me) + 1, learner.last_seq + 1) if not replica.version_vector.has(me, q)]
        if lost_own:
            logger.warning("resync: own seqs %s not in the loaded state yet (gossip brings them back)", lost_own)
        return {"vv_total_before": local.total(), "vv_total": replica.version_vector.total(),
                "remerged": replica.version_vector.total() - before, "lost_own": len(lost_own),
                "differ": vv.staleness(local) + local.staleness(vv)}


def check(local: VersionVector, vv: VersionVector, theta: torch.Tensor, replica: Replica, stuck: Stuck) -> None:
    """ResyncRefused unless the snapshot (`theta`, `vv`) may replace our replica (`local`): it holds more of a
    stalled sender than we do, nothing more of a sender we banned, and (deterministic merge rule with a bound)
    it is no further from our theta than the updates the vectors differ by can move it."""
    if not any(vv.get(s) > local.get(s) for s in stuck.senders):
        raise ResyncRefused("its state holds no more of the senders we are stuck on")
    if any(vv.get(s) > local.get(s) for s in replica.banned):
        raise ResyncRefused("it merged updates of a sender we banned")
    step = replica.max_step()
    if math.isfinite(step) and replica.policy.deterministic:
        differ = vv.staleness(local) + local.staleness(vv)
        gap = float((theta - replica.theta).abs().max())
        allowed = differ * step * (1 + _RELATIVE_SLACK) + _ABSOLUTE_SLACK * (1 + float(theta.abs().max()))
        if not gap <= allowed:
            raise ResyncRefused(f"it is {gap:.3g} from our replica in a coordinate, more than the {differ} "
                                f"update(s) our vectors differ by can move it ({allowed:.3g})")


def window_for(anti_entropy_s: float) -> float:
    """The watch's window for a peer whose anti-entropy runs every `anti_entropy_s`."""
    return max(MIN_WINDOW_S, WINDOW_ANTI_ENTROPIES * anti_entropy_s)
