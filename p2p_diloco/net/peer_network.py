"""The network side of one peer: everything that runs on its asyncio loop (DESIGN.md section 5).

One loop in a daemon thread (`NetLoop`) runs the SwarmNode, Gossip, the SnapshotServer and two small tasks:
announcing this peer's signed record and refreshing the list of live peers. The compute thread talks to it
in two ways only, neither of which waits on the network:

- it hands over finished updates with `asyncio.run_coroutine_threadsafe(network.publish(u), loop)`;
- it reads `peers` and `counters`, plain dicts the loop replaces whole (never mutates) every tick, and
  writes `local` (its round summary) the same way. Replacing a reference is atomic under the GIL.

Remote updates merge into the replica here, through `Intake`; the replica's lock makes that safe while the
compute thread snapshots it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any

from p2p_diloco.config import ConfigError, RunSpec
from p2p_diloco.net.discovery import (
    DEFAULT_RECORD_TTL_S,
    PeerRecordValidator,
    announce_peer,
    fetch_run_spec,
    list_peers,
    publish_run_spec,
)
from p2p_diloco.net.node import NodeConfig, SwarmNode
from p2p_diloco.net.status import live, number, text
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.train.learner import Learner
from p2p_diloco.wire.envelope import OuterUpdate
from p2p_diloco.wire.identity import Identity

logger = logging.getLogger(__name__)

TICK_S = 0.5
"""How often the loop refreshes `counters` and checks whether to announce."""
MIN_ANNOUNCE_INTERVAL_S = 2.0
"""Announces asked for between the periodic ones (after a round, on a replica change while lingering) are at
most this frequent: a DHT store per peer every couple of seconds is cheap for tens of peers."""
LEAVE_TIMEOUT_S = 3.0
"""Bound on the farewell record and on stopping each service when leaving: Ctrl-C must be quick."""
MAX_ANNOUNCED_MADDRS = 8
SYNC_ATTEMPTS = 3
SYNC_RETRY_DELAY_S = 2.0


class Stopped(Exception):
    """The peer was asked to stop (Ctrl-C, SIGTERM) while the compute thread waited on the loop."""


class SpecMismatchError(ConfigError):
    """The run on the swarm has another RunSpec than ours; the message names the differing fields."""


async def _exit_with_parent(_dht: Any, dht_node: Any, parent_pid: int) -> None:
    """Runs inside hivemind's DHT process: if our process dies without shutting it down (SIGKILL, OOM), take
    p2pd down and exit, instead of lingering as an orphan that holds the identity and the port."""
    try:
        while os.getppid() == parent_pid:
            await asyncio.sleep(1.0)
    except asyncio.CancelledError:  # the DHT is shutting down normally
        return
    with contextlib.suppress(Exception):
        dht_node.p2p._terminate()  # hivemind's own teardown of its p2pd child
    os._exit(0)


def exit_with_parent(node: SwarmNode) -> None:
    """Make the node's DHT process (and its p2pd) exit when this process dies, even by SIGKILL."""
    try:
        node.dht.run_coroutine(functools.partial(_exit_with_parent, parent_pid=os.getpid()), return_future=True)
    except Exception as e:  # a convenience: never a reason to fail
        logger.debug("could not arm the DHT orphan watchdog error=%r", e)


class NetLoop:
    """An asyncio loop in a daemon thread. `wait` runs a coroutine there and blocks the caller until it ends,
    the stop event is set (the coroutine is then cancelled and `Stopped` raised) or a timeout passes."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="p2p-diloco-net", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def wait(self, coro_or_future: Any, stop: threading.Event | None = None, timeout_s: float | None = None) -> Any:
        future = coro_or_future if isinstance(coro_or_future, concurrent.futures.Future) \
            else self.submit(coro_or_future)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                return future.result(timeout=0.2)
            except concurrent.futures.TimeoutError:
                pass
            if stop is not None and stop.is_set():
                future.cancel()
                raise Stopped()
            if deadline is not None and time.monotonic() > deadline:
                future.cancel()
                raise TimeoutError(f"network operation did not finish within {timeout_s:g}s")

    def close(self, timeout_s: float = 5.0) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout_s)

        if self.loop.is_closed():
            return
        try:
            self.submit(cancel_all()).result(timeout_s + 1)
        except Exception as e:  # leftovers must not keep the process alive; the thread is a daemon anyway
            logger.debug("net loop: cancelling leftover tasks failed error=%r", e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout_s)
        if not self.thread.is_alive():
            self.loop.close()


def check_spec(theirs: tuple[dict, str] | None, spec: RunSpec) -> None:
    """Raise SpecMismatchError unless the swarm's (spec_dict, spec_hash) is ours."""
    if theirs is None or theirs[1] == spec.spec_hash():
        return
    spec_dict, spec_hash = theirs
    try:
        diff = RunSpec.from_dict(spec_dict).differing_fields(spec)
    except (ConfigError, TypeError) as e:
        raise SpecMismatchError(
            f"run '{spec.run_id}' on this swarm has a RunSpec this version cannot read ({e}); upgrade p2p-diloco "
            "or use another --run-id") from None
    listed = "\n  ".join(diff) or "(no field differs: the spec hashes are computed differently; upgrade p2p-diloco)"
    raise SpecMismatchError(
        f"run '{spec.run_id}' on this swarm has a different RunSpec (spec hash {spec_hash[:12]} vs ours "
        f"{spec.spec_hash()[:12]}). Differing fields (swarm != ours):\n  {listed}\n"
        "Join with the swarm's values (the matching options, e.g. --inner-steps, or --config), or start a new "
        "run with another --run-id.")


class PeerNetwork:
    """SwarmNode + spec handshake + state sync + Gossip + SnapshotServer + announce/refresh, on one loop."""

    def __init__(self, spec: RunSpec, identity: Identity, identity_path: str, node_config: NodeConfig, *,
                 gossip_config: Any, sync_config: Any, record_ttl_s: float = DEFAULT_RECORD_TTL_S,
                 dht_timeout_s: float = 10.0, static_record: dict | None = None) -> None:
        self.spec = spec
        self.spec_hash = spec.spec_hash()
        self.run_id = spec.run_id
        self.identity = identity
        self.identity_path = identity_path
        self.node_config = node_config
        self.gossip_config = gossip_config
        self.sync_config = sync_config
        self.record_ttl_s = record_ttl_s
        self.dht_timeout_s = dht_timeout_s
        self.static_record = dict(static_record or {})
        # Shared with the compute thread: each is replaced whole, never mutated in place.
        self.peers: dict[str, dict] = {}
        self.counters: dict[str, int] = {}
        self.local: dict[str, Any] = {"state": "training"}
        self.sync_donor: str | None = None
        self.node: SwarmNode | None = None
        self.learner: Learner | None = None
        self.gossip: Any = None
        self.server: Any = None
        self._tasks: list[asyncio.Task] = []
        self._announce_wanted = False
        self._announced_digest: str | None = None
        self._warned_corpus: set[str] = set()

    # ---- start-up ---------------------------------------------------------------------------------------

    async def start(self) -> str:
        """Start the node and check the run's spec; returns "published" (we are the first) or "matched"."""
        started = time.monotonic()
        self.node = await SwarmNode.start(self.identity_path, self.node_config,
                                          record_validators=[PeerRecordValidator([self.run_id])])
        exit_with_parent(self.node)
        logger.info("node up took_s=%.2f", time.monotonic() - started)
        theirs = await fetch_run_spec(self.node, self.run_id, timeout_s=self.dht_timeout_s)
        logger.info("run spec read found=%s took_s=%.2f", theirs is not None, time.monotonic() - started)
        check_spec(theirs, self.spec)
        how = "matched" if theirs else "published"
        await publish_run_spec(self.node, self.run_id, self.spec.to_dict(), self.spec_hash,
                               timeout_s=self.dht_timeout_s)  # first peer: publish; later ones: refresh expiry
        if theirs is None:  # two first peers may race with different specs: the DHT keeps one; check again
            check_spec(await fetch_run_spec(self.node, self.run_id, timeout_s=self.dht_timeout_s), self.spec)
        logger.info("run spec %s took_s=%.2f", how, time.monotonic() - started)
        return how

    async def sync_state(self, learner: Learner, attempts: int = SYNC_ATTEMPTS) -> dict | None:
        """Load the replica from the freshest live peers (highest V total first), if any has merged updates.

        None if nobody has (we start from the run's seed). Donors that fail are skipped; when all fail, the
        peer list is read again and the sync retried, `attempts` times in all, before StateSyncError.
        """
        from p2p_diloco.net.statesync import StateSyncError, fetch_snapshot

        # Say we are here at once: peers lingering after their last round keep serving while one is "syncing".
        self.learner, self.local = learner, {"state": "syncing"}
        await self._announce()
        for attempt in range(1, attempts + 1):
            started = time.monotonic()
            records = live(await list_peers(self.node, self.run_id, timeout_s=self.dht_timeout_s))
            logger.info("state sync: %d live peer record(s) took_s=%.2f", len(records), time.monotonic() - started)
            own = records.pop(self.node.peer_id, None)
            if own is not None and attempt == 1:
                logger.warning("this identity already has a live record (updated %.0fs ago): if another process "
                               "runs with it, give each peer its own --identity",
                               time.time() - number(own, "updated_at"))
            donors = sorted((pid for pid, r in records.items() if number(r, "version_vector_total") > 0),
                            key=lambda pid: -number(records[pid], "version_vector_total"))
            if not donors:
                return None
            started = time.monotonic()
            try:
                theta, vv, donor = await fetch_snapshot(self.node, self.run_id, self.spec_hash, donors,
                                                        learner.numel, self.sync_config)
            except StateSyncError as e:
                if attempt == attempts:
                    raise StateSyncError(f"state sync failed {attempts} times; last: {e}") from None
                logger.warning("state sync failed, retrying attempt=%d/%d error=%s", attempt, attempts, e)
                await asyncio.sleep(SYNC_RETRY_DELAY_S * attempt)
                continue
            learner.replica.load(theta, vv)
            self.sync_donor = donor  # serve() pulls from it at once: catch-up need not wait for anti-entropy
            return {"donor": donor, "vv_total": vv.total(), "bytes": theta.numel() * 4,
                    "seconds": time.monotonic() - started, "candidates": len(donors)}
        return None

    async def serve(self, learner: Learner) -> None:
        """Start gossip, the snapshot server and the announce/refresh tasks; announce at once."""
        from p2p_diloco.net.gossip import Gossip
        from p2p_diloco.net.statesync import SnapshotServer

        self.learner, self.local = learner, {"state": "training"}
        store = UpdateStore(self.gossip_config.retained_bytes)
        self.gossip = Gossip(self.node, self.run_id, learner.intake, store, self.gossip_config,
                             peers=self._other_peer_ids)
        await self.gossip.start()
        if self.sync_donor:
            await self.gossip.request_pull(self.sync_donor)
        self.server = SnapshotServer(self.node, self.run_id, self.spec_hash, learner.replica, self.identity,
                                     self.sync_config)
        await self.server.start()
        await self._refresh_peers()
        await self._announce()
        self._tasks = [asyncio.create_task(self._announce_loop(), name="announce"),
                       asyncio.create_task(self._refresh_loop(), name="refresh-peers")]

    def _other_peer_ids(self) -> list[str]:
        me = self.node.peer_id if self.node else ""
        return [pid for pid in self.peers if pid != me]

    # ---- called from the compute thread (through the loop) ----------------------------------------------

    async def publish(self, update: OuterUpdate) -> None:
        try:
            await self.gossip.publish(update)
        except Exception:  # a publish failure must not be lost silently; anti-entropy still spreads the update
            logger.exception("gossip publish failed seq=%d", update.seq)

    def request_announce(self) -> None:
        """Thread-safe: announce soon (rate-limited), e.g. after a round or a change of state."""
        self._announce_wanted = True

    # ---- the loop's own tasks -----------------------------------------------------------------------------

    def _record(self, state: str | None = None) -> dict:
        vv = self.learner.replica.version_vector
        record = {**self.static_record, **self.local}
        record.update(maddrs=self.node.visible_maddrs()[:MAX_ANNOUNCED_MADDRS], version_vector_total=vv.total(),
                      vv_digest=vv.digest().hex()[:16], seq=vv.get(self.node.peer_id))
        if state is not None:
            record["state"] = state
        return record

    async def _announce(self, state: str | None = None, timeout_s: float | None = None) -> bool:
        record = self._record(state)
        try:
            ok = await announce_peer(self.node, self.run_id, record, self.identity, ttl_s=self.record_ttl_s,
                                     timeout_s=timeout_s or self.dht_timeout_s)
        except Exception as e:  # the DHT being slow or down must not stop training
            logger.warning("announce failed error=%r", e)
            return False
        if not ok:
            logger.warning("announce: no DHT node stored our record")
        self._announced_digest = record["vv_digest"]
        return ok

    async def _announce_loop(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            try:  # one bad tick must not end the task: without announces the swarm forgets us
                self.counters = self._collect_counters()
                now = time.monotonic()
                lingering = self.local.get("state") == "done"
                digest = self.learner.replica.version_vector.digest().hex()[:16]
                if now - last >= self.record_ttl_s / 3 or ((self._announce_wanted or (
                        lingering and digest != self._announced_digest)) and now - last >= MIN_ANNOUNCE_INTERVAL_S):
                    self._announce_wanted = False
                    last = now
                    await self._announce()
            except Exception:
                logger.exception("announce tick failed")

    async def _refresh_peers(self) -> None:
        try:
            records = await list_peers(self.node, self.run_id, timeout_s=self.dht_timeout_s)
        except Exception as e:
            logger.warning("listing peers failed error=%r", e)
            return
        fingerprint = self.static_record.get("corpus")
        for pid, record in records.items():
            if fingerprint and text(record, "corpus") not in ("", fingerprint) and pid not in self._warned_corpus:
                self._warned_corpus.add(pid)
                logger.warning("peer %s trains on another corpus (fingerprint %s, ours %s): a different Python "
                               "version's stdlib or another file", pid, text(record, "corpus"), fingerprint)
        self.peers = live(records)

    async def _refresh_loop(self) -> None:
        started = time.monotonic()
        while True:
            lingering = self.local.get("state") == "done"
            # Every second at first: peers that start together must see each other before they sign their
            # first weights (a peer that sees nobody signs w=1, an N-fold overshoot).
            starting = time.monotonic() - started < 15.0
            await asyncio.sleep(1.0 if lingering or starting else min(5.0, self.record_ttl_s / 6))
            try:
                await self._refresh_peers()
            except Exception:
                logger.exception("peer list refresh failed")

    def _collect_counters(self) -> dict[str, int]:
        counts = dict(self.learner.intake.counts)
        out = {"merged": counts.get("merged", 0), "duplicate": counts.get("duplicate", 0),
               "rejected": sum(n for k, n in counts.items() if k not in ("merged", "buffered", "duplicate"))}
        stats = getattr(self.gossip, "stats", None) or {}
        out.update({k: int(v) for k, v in dict(stats).items() if isinstance(v, (int, float))})
        out.setdefault("bytes_sent", 0)
        out.setdefault("bytes_received", 0)
        served = getattr(self.server, "stats", None) or {}
        out["snapshot_bytes_sent"] = int(served.get("bytes_sent", 0))
        out["bytes_sent"] += out["snapshot_bytes_sent"]  # everything we uploaded: updates and snapshots
        return out

    # ---- leaving ------------------------------------------------------------------------------------------

    async def leave(self) -> None:
        """Stop announcing (a last record says "left", so others drop us at once), stop gossip and serving."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.learner is not None and self.node is not None and self.node.is_alive:
            await self._announce(state="left", timeout_s=LEAVE_TIMEOUT_S)
        for service in (self.gossip, self.server):
            if service is None:
                continue
            try:
                await asyncio.wait_for(service.stop(), LEAVE_TIMEOUT_S)
            except Exception as e:
                logger.warning("stopping %s failed error=%r", type(service).__name__, e)
        if self.learner is not None:
            self.counters = self._collect_counters()

    async def shutdown(self) -> None:
        if self.node is not None:
            await self.node.shutdown()
