"""Resuming a restarted peer: where its checkpoints live, catching up with the swarm after loading one, and
`PeerCheckpoints`, the peer process's handle on all of it (restore, resume, save).

After `StateManager.restore` (train/state/manager.py) the replica holds the checkpoint's theta and V plus our
own journaled updates. What the others merged meanwhile comes by gossip: pulls of the updates newer than our
V (`Gossip.request_pull`), from the freshest live peers first, until our V holds every live peer's last
announced seq (the `seq` of its DHT record). If that stops making progress for `stall_s`, the gap is older
than what the peers retain (their stores are bounded) or they do not answer: then a state sync replaces theta
and V with a verified snapshot (net/statesync/client.py), exactly as a joiner's; m, e, the inner optimizer, the
data position and our own seq stay the checkpoint's, and our journaled updates the snapshot lacks are
offered again. Catching up is bounded by `max_s`: training then starts anyway, and anti-entropy goes on.

The compute thread waits (it has nothing to train on yet); nothing here touches the learner's compute state
except through `on_sync`, which runs while the compute thread waits.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable, Container
from pathlib import Path

from p2p_diloco.config import RunSpec
from p2p_diloco.net.discovery.status import number
from p2p_diloco.net.statesync.client import StateSyncError
from p2p_diloco.net.transport.netloop import NetLoop
from p2p_diloco.peer.network import PeerNetwork
from p2p_diloco.peer.output import JsonLog
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.train.learner import Learner
from p2p_diloco.train.state.manager import StateManager

logger = logging.getLogger(__name__)

PULL_AGAIN_S = 2.0
"""While catching up, ask the peers we still lag again this often (a pull that failed is not retried sooner)."""
POLL_S = 0.25
MAX_PULL_PEERS = 8
"""Peers asked at once while catching up (the freshest); anti-entropy reaches the others."""

Summary = dict[str, object]
"""What a catch-up did, as printed and logged."""
Restored = dict[str, object]
"""What a restore loaded: the checkpoint's name, round, step, V total, own seq (train/state/manager.py)."""


def default_checkpoint_dir(out_dir: str, run_id: str, spec_hash: str, peer_id: str) -> Path:
    """OUT_DIR/checkpoints with --out-dir; else the user's data folder keyed by run, spec and PeerID, so a
    restart with the same identity finds its checkpoints and another run never does."""
    if out_dir:
        return Path(out_dir).expanduser() / "checkpoints"
    run = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)  # a run id may hold any printable character, "/" and ".." too
    return Path("~/.local/share/p2p-diloco").expanduser() / f"{run}-{spec_hash[:12]}" / peer_id


def _lagging(vv: VersionVector, targets: dict[str, int], banned: Container[str] = frozenset()) -> dict[str, int]:
    # A banned sender's seqs are never served again: waiting for them would stall into a state sync.
    return {pid: seq - vv.get(pid) for pid, seq in targets.items() if vv.get(pid) < seq and pid not in banned}


async def catch_up(network: PeerNetwork, learner: Learner, *, stall_s: float, max_s: float,
                   on_sync: Callable[[], int]) -> Summary:
    """Pull until our V holds every live peer's last seq; state sync if that stalls. Returns a summary:
    `how` is "caught_up", "alone" (no live peer), "state_sync", "sync_failed" or "timeout"."""
    node = network.node
    assert node is not None  # catching up once serving: the node is up
    me = node.peer_id
    records = {pid: r for pid, r in network.peers.items() if pid != me}
    targets = {pid: int(number(r, "seq")) for pid, r in records.items() if number(r, "seq") > 0}
    donors = sorted((pid for pid, r in records.items() if number(r, "version_vector_total") > 0),
                    key=lambda pid: -number(records[pid], "version_vector_total"))
    started = time.monotonic()
    vv0 = learner.replica.version_vector
    banned = learner.replica.banned
    summary = {"targets": len(targets), "lag": sum(_lagging(vv0, targets, banned).values()),
               "vv_total_before": vv0.total()}
    if not donors:
        return {**summary, "how": "alone", "seconds": 0.0, "vv_total": vv0.total()}
    gossip = network.gossip
    assert gossip is not None  # serving: the services are attached
    for pid in donors[:MAX_PULL_PEERS]:
        await gossip.request_pull(pid)
    last_total, last_progress, last_ask = vv0.total(), started, started
    how = "caught_up"
    while True:
        vv = learner.replica.version_vector
        lagging = _lagging(vv, targets, banned)
        now = time.monotonic()
        if not lagging:
            break
        if vv.total() != last_total:
            last_total, last_progress = vv.total(), now
        if now - last_progress > stall_s:
            how = await _state_sync(network, donors, on_sync)
            break
        if now - started > max_s:
            how = "timeout"
            logger.warning("catch-up not done after %.0fs (lagging %s): training anyway; gossip goes on", max_s,
                           lagging)
            break
        if now - last_ask >= PULL_AGAIN_S:
            last_ask = now
            for pid in sorted(lagging, key=lambda p: -lagging[p])[:MAX_PULL_PEERS]:
                await gossip.request_pull(pid)
        await asyncio.sleep(POLL_S)
    vv = learner.replica.version_vector
    return {**summary, "how": how, "seconds": time.monotonic() - started, "vv_total": vv.total()}


async def _state_sync(network: PeerNetwork, donors: list[str], on_sync: Callable[[], int]) -> str:
    logger.info("catch-up stalled: the gap is older than the peers retain; state sync from %d donor(s)",
                len(donors))
    try:
        donor, _, _ = await network.load_snapshot(donors)  # PeerNetwork's one state-sync path
    except StateSyncError as e:
        logger.warning("catch-up state sync failed (training anyway; gossip goes on) error=%s", e)
        return "sync_failed"
    on_sync()  # our own journaled updates the snapshot lacks; m, e, optimizer, data, seq stay ours
    gossip = network.gossip
    assert gossip is not None  # load_snapshot needs the services attached
    await gossip.request_pull(donor)
    return "state_sync"


class PeerCheckpoints:
    """One peer's checkpoints and restart, for `Peer` (peer/process.py): restore at start-up, publish the journal
    again and catch up once serving, checkpoint between rounds and on exit. Reports to `out` and `log`."""

    def __init__(self, state: StateManager, out: Callable[[str], None], log: JsonLog) -> None:
        self.state, self.out, self.log = state, out, log

    @classmethod
    def open(cls, folder: Path, spec: RunSpec, peer_id: str, *, keep: int, out: Callable[[str], None],
             log: JsonLog) -> PeerCheckpoints:
        """Open and lock the folder; CheckpointFolderError (a ConfigError) if it is another's or in use."""
        state = StateManager(folder, run_id=spec.run_id, spec_hash=spec.spec_hash(), peer_id=peer_id, keep=keep)
        state.open()
        return cls(state, out, log)

    def restore(self, learner: Learner) -> Restored | None:
        """Journal the learner's updates from now on, and load the newest good checkpoint into it."""
        self.state.attach(learner)
        restored = self.state.restore(learner)
        for name, reason in self.state.store.skipped:
            self.out(f"checkpoint {name} skipped: {reason}")
        if restored is None:
            self.out(f"checkpoints: none to resume from in {self.state.folder}")
            return None
        self.out(f"restored {restored['checkpoint']}: round {restored['round']}, step {restored['step']}, "
                 f"V total {restored['vv_total']}, own seq {restored['last_seq']} "
                 f"({restored['replayed']} journaled update(s) newer than the checkpoint taken back)")
        self.log.write("restore", **restored)
        return restored

    def adopt_journal(self, learner: Learner) -> int:
        return self.state.adopt_journal(learner)

    def resume(self, loop: NetLoop, network: PeerNetwork, learner: Learner, *, restored: bool, stop: threading.Event,
               stall_s: float, on_sync: Callable[[], int]) -> None:
        """Publish our journaled updates again (the same bytes: a duplicate to whoever has them, the missing
        update to whoever lacks it); after a restore, catch up with what the swarm merged meanwhile."""
        for update in self.state.journaled():
            loop.wait(network.publish(update), stop, timeout_s=30)
        if not restored:
            return
        network.local = {"state": "syncing"}
        network.request_announce()
        summary = loop.wait(catch_up(network, learner, stall_s=stall_s, max_s=10 * stall_s, on_sync=on_sync), stop)
        network.local = {"state": "training"}
        self.out(f"catch-up: {summary['how']} in {summary['seconds']:.1f}s, V total {summary['vv_total_before']} "
                 f"-> {summary['vv_total']}")
        self.log.write("catchup", **summary)

    def save(self, learner: Learner, *, round: int, why: str) -> None:
        t0 = time.monotonic()
        try:
            path = self.state.save(learner, round=round)
        except Exception as e:  # a full disk must not end training; the journal still keeps our seqs unique
            logger.exception("checkpoint failed")
            self.out(f"checkpoint failed: {e!r}")
            return
        vv = learner.replica.version_vector
        self.log.write("checkpoint", why=why, round=round, step=learner.step, path=str(path),
                       last_seq=learner.last_seq, vv_total=vv.total(), seconds=time.monotonic() - t0)

    def close(self) -> None:
        self.state.close()
