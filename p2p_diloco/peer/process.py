"""One learner unit on the real network (`p2p-diloco join`): the process's lifecycle around the round loop.

Process model (ARCHITECTURE.md "Threads"):

    compute thread (the caller's; the main thread under the CLI)
        runs the round loop (train/loop.py `rounds`): begin_phase -> inner steps -> finish_phase, then
        `SwarmExchange.publish(u)` (peer/exchange.py) hands the update to the network loop
        (`run_coroutine_threadsafe(gossip.publish(u))`) and goes on without waiting. It reads the swarm from
        snapshots the loop keeps fresh (`PeerNetwork.peers`, `.counters`): it never awaits the network during
        an inner phase (invariant 4).
    network loop (one asyncio loop in a daemon thread, see peer/network.py)
        SwarmNode, Gossip, SnapshotServer, announce and peer-list refresh; remote updates merge into the
        replica from there (Intake, in the loop's worker threads), under the replica's lock.

Lifecycle: start the node and check the run's spec (the first peer publishes it) -> restore the newest good
checkpoint if this peer has one, else state sync from the freshest live peers if any has merged updates ->
serve and announce -> after a restore, publish our journaled updates again and catch up (peer/resume.py) ->
rounds (a checkpoint every `checkpoint.every`; printed and logged by peer/report.py; between two rounds, a
re-sync of state when pulls can no longer catch the replica up: peer/resync.py) -> linger until the swarm
is quiet (peer/linger.py) -> leave (a last record says "left"), write a checkpoint and the final state, shut the
node down. A stop request (Ctrl-C, SIGTERM; peer/signals.py) is checked before every inner step: the unfinished
phase is dropped, or finished if it ends within `finish_phase_within_s`, and the peer leaves as above within
seconds. A finish request (SIGUSR1) makes the current round the last one, as if `--rounds` had been reached:
the peer lingers, then leaves.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from p2p_diloco.config import JoinConfig
from p2p_diloco.net.discovery.status import shard_for
from p2p_diloco.peer.output import JsonLog
from p2p_diloco.peer.report import PeerReport, print_line

# Light at import time: torch, hivemind and everything that imports them are imported where they are used.

logger = logging.getLogger(__name__)


class Peer:
    """Runs one learner unit until its rounds are done (and the swarm is quiet) or `stop` is set."""

    def __init__(self, config: JoinConfig, *, stop: threading.Event | None = None,
                 finish: threading.Event | None = None, out: Callable[[str], None] | None = None) -> None:
        from p2p_diloco.net.admission.policy import NetPolicy
        from p2p_diloco.train.resolve import resolve_spec  # imports torch: here, not at import time
        from p2p_diloco.train.unit import unit_device

        # --model PATH and a token dataset's facts go into the spec before it is hashed, published or compared.
        self.config = dataclasses.replace(config, spec=resolve_spec(config.spec)).validate()
        self.spec = self.config.spec
        from p2p_diloco.peer.sinks import check_available

        self.device = unit_device(config.training.device)  # a missing GPU fails here, before the node starts
        check_available(config.logging)  # so does a TensorBoard or wandb sink whose package is missing
        # access (allow list, run secret) and rate limits
        self.policy = NetPolicy(config.admission.access, config.admission.rate)
        self.stop = stop or threading.Event()  # leave now (Ctrl-C, SIGTERM)
        self.finish = finish or threading.Event()  # end after this round, then linger (SIGUSR1)
        self.out = out or print_line
        self.log = JsonLog(config.logging.json_log)
        self.learner: Any = None
        self.network: Any = None  # PeerNetwork
        self.report: Any = None  # PeerReport: prints and logs what happens, and is the round loop's hooks
        self.exchange: Any = None  # SwarmExchange, once training begins
        self.round = 0
        self.checkpoints: Any = None  # PeerCheckpoints (peer/resume.py), None with --checkpoint-every 0
        self.progress: Any = None  # JoinProgress (peer/progress.py): bars on a terminal
        self.status: Any = None  # PeerStatus (peer/status.py): the snapshot, and the status page if asked for
        self._ready = False  # the replica is set up (restored or synced) and served: worth a checkpoint on exit

    # ---- lifecycle ----------------------------------------------------------------------------------------

    def run(self) -> int:
        from p2p_diloco.net.transport import addresses
        from p2p_diloco.peer.network import NetLoop, PeerNetwork, Stopped
        from p2p_diloco.wire.identity import Identity

        identity_path = str(Path(self.config.network.identity).expanduser())
        identity = Identity.load_or_create(identity_path)
        self.checkpoints = self._open_checkpoints(identity.peer_id)  # before the node: a second process stops here
        node_config = addresses.node_config(self.config.network)
        loop = NetLoop()
        try:
            self.network = PeerNetwork(
                self.spec, identity, identity_path, node_config, gossip_config=self.config.gossip,
                sync_config=self.config.statesync, record_ttl_s=self.config.network.record_ttl_s,
                dht_timeout_s=self.config.network.dht_timeout_s, policy=self.policy)
            started = loop.submit(self.network.start())
            self._build_learner(identity)  # while the node starts
            self._open_views(identity.peer_id)
            restored = self._restore()
            how = loop.wait(started, self.stop)
            self.report.start(how)
            if restored is None:
                synced = loop.wait(self.network.sync_state(self.learner), self.stop)
                self.report.sync(synced)
                self._adopt_journal()  # no checkpoint, but maybe a journal: never reuse a seq
            loop.wait(self.network.serve(self.learner), self.stop)
            self._ready = True
            if self.checkpoints is not None:
                self.checkpoints.resume(loop, self.network, self.learner, restored=restored is not None,
                                        stop=self.stop, stall_s=self.config.checkpoint.catch_up_stall_s,
                                        on_sync=self._adopt_journal)
            self._train(loop)
            self.progress.close()  # the bars go; the linger's lines follow the last round line
            self._linger()
        except Stopped:
            self.out("stopping (interrupted during start-up)")
        finally:
            self._finish(loop)
        return 0

    def _build_learner(self, identity: Any) -> None:
        import torch

        from p2p_diloco.train.compute import Compute
        from p2p_diloco.train.data import eval_batches
        from p2p_diloco.train.learner import Learner
        from p2p_diloco.train.resolve import load_training_data
        from p2p_diloco.train.unit import RankGroup

        if self.config.training.torch_threads:
            torch.set_num_threads(self.config.training.torch_threads)
        cfg = self.config.training
        shard = cfg.shard if cfg.shard >= 0 else shard_for(identity.peer_id, cfg.num_shards)
        corpus = load_training_data(self.spec.data, block_size=self.spec.model.block_size)
        compute = Compute.for_training(cfg, self.device)
        self.learner = Learner(self.spec, identity, corpus, shard=shard, num_shards=cfg.num_shards,
                               device=self.device, compute=compute, unit=RankGroup.from_env(self.device))
        self.eval_set = eval_batches(corpus, block_size=self.spec.model.block_size,
                                     batch_size=self.spec.data.batch_size, num_batches=cfg.eval_batches)
        self.samples_per_update = self.spec.inner.inner_steps * self.spec.data.batch_size
        self.network.static_record = {"shard": shard, "corpus": corpus.fingerprint,
                                      "samples_per_update": self.samples_per_update}
        self.out(f"peer {identity.peer_id}")
        n_windows = getattr(self.learner.sampler, "n_windows", None)
        if n_windows is not None:  # a token dataset: every window once per epoch, shuffled by PeerID and epoch
            self.out(f"data: {n_windows} windows of a sequence, read in this unit's own shuffled order (keyed by "
                     f"the PeerID); {corpus.describe()}")
        else:
            how = "chosen with --shard" if cfg.shard >= 0 else "from the PeerID; --shard to choose"
            self.out(f"data shard {shard} of {cfg.num_shards} ({how}); {corpus.describe()}")
        self.log.write("start", peer_id=identity.peer_id, shard=shard, num_shards=cfg.num_shards,
                       spec_hash=self.spec.spec_hash(), numel=self.learner.numel, device=self.learner.device,
                       precision=compute.precision, processes=self.learner.unit.world)
        self.out(f"model {self.spec.model.arch}: {self.learner.numel / 1e6:.2f}M parameters on {self.device} "
                 f"({compute.precision}" + (f", a unit of {self.learner.unit.world} processes" if
                                            self.learner.unit.world > 1 else "") + ")")
        self.report = PeerReport(self.spec, self.learner, self.network, eval_set=self.eval_set, log=self.log,
                                 out=self.out, checkpoints=self.checkpoints)

    def _open_views(self, peer_id: str) -> None:
        """Progress bars, the status page (with --status-port) and the optional TensorBoard / wandb sinks."""
        from p2p_diloco.peer.progress import JoinProgress
        from p2p_diloco.peer.sinks import open_sinks
        from p2p_diloco.peer.status import PeerStatus

        cfg = self.config.logging
        self.progress = JoinProgress(cfg.progress, self.spec.inner.inner_steps, out=self.out)
        self.network.sync_progress = self.progress.sync
        self.status = self.report.status = PeerStatus(self.network, self.report)
        if cfg.status_port >= 0:
            url = self.status.serve(cfg.status_host, cfg.status_port)
            self.out(f"status page: {url} (metrics: {url}metrics)")
            self.log.write("status_page", url=url)
        self.report.sinks = open_sinks(cfg, peer_id, self.spec)

    # ---- checkpoints and restart (peer/resume.py, train/checkpoint.py) ----------------------------------

    def _open_checkpoints(self, peer_id: str) -> Any:
        """The checkpoint folder, opened and locked (None with --checkpoint-every 0)."""
        cfg = self.config.checkpoint
        if cfg.every == 0:
            return None
        from p2p_diloco.peer.resume import PeerCheckpoints, default_checkpoint_dir

        folder = Path(cfg.dir).expanduser() if cfg.dir else \
            default_checkpoint_dir(self.config.logging.out_dir, self.spec.run_id, self.spec.spec_hash(), peer_id)
        return PeerCheckpoints.open(folder, self.spec, peer_id, keep=cfg.keep, out=self.out,
                                    log=self.log)

    def _restore(self) -> dict | None:
        """Load the newest good checkpoint (CPU work, while the node starts); None if there is none."""
        restored = self.checkpoints.restore(self.learner) if self.checkpoints else None
        if restored is not None:
            self.round = restored["round"]
        return restored

    def _adopt_journal(self) -> int:
        """Our journaled updates into a replica that came from a state sync (seqs stay unique)."""
        rounds = self.checkpoints.adopt_journal(self.learner) if self.checkpoints else 0
        self.round += rounds
        return rounds

    # ---- the round loop -------------------------------------------------------------------------------

    def _train(self, loop: Any) -> None:
        from p2p_diloco.peer.exchange import SwarmExchange
        from p2p_diloco.train.loop import RoundDone, Schedule, rounds

        cfg = self.config.training
        self.exchange = SwarmExchange(self.network, loop.loop, self.samples_per_update)
        schedule = Schedule(rounds=cfg.rounds, eval_every=cfg.eval_every,
                            checkpoint_every=self.config.checkpoint.every if self.checkpoints else 0,
                            finish_phase_within_s=cfg.finish_phase_within_s, max_stretch=cfg.max_stretch,
                            stretch_backlog=cfg.stretch_backlog)
        self.report.training_begins(self.round)
        resync = self._open_resync()
        ticks = rounds(self.learner, self.exchange, schedule, self.report, start_round=self.round, stop=self.stop,
                       finish=self.finish)
        try:
            while True:  # `drive`, with each tick shown on the progress bars
                try:
                    tick = next(ticks)
                except StopIteration as end:
                    ended = end.value
                    break
                self.progress.tick(tick)
                if resync is not None and isinstance(tick, RoundDone):  # between rounds: the next phase begins
                    resync.between_rounds(loop, self.stop, tick.round_s)  # at the next `next(ticks)`
                elif resync is not None:
                    resync.observe()  # never waits on the network: inside an inner phase
        finally:
            self.round = self.report.round  # also after an error: the exit checkpoint names the rounds done
        if ended == "finish":
            self.out(f"finishing after round {self.round} (SIGUSR1)")

    def _open_resync(self) -> Any:
        """The watch that re-syncs state when pulls cannot catch us up (peer/resync.py); None if turned off."""
        from p2p_diloco.peer.resync import Resync, window_for

        window_s = self.config.checkpoint.resync_window_s
        if window_s < 0:
            return None
        journal = self.checkpoints.state.journaled if self.checkpoints is not None else None
        return Resync(self.network, self.learner, window_s=window_s or window_for(self.config.gossip.anti_entropy_s),
                      fixed=window_s > 0, journal=journal, out=self.out, log=self.log)

    def _linger(self) -> None:
        """After the last round (not after a stop): keep serving until every live peer holds our replica."""
        from p2p_diloco.peer.linger import linger

        cfg = self.config.training
        if self.stop.is_set() or not (cfg.rounds or self.finish.is_set()) or cfg.linger_s <= 0:
            return
        linger(self.network, self.learner, stop=self.stop, linger_s=cfg.linger_s, at_round=self.round,
               out=self.out, log=self.log)

    # ---- leaving ----------------------------------------------------------------------------------------

    def _close_views(self) -> None:
        for closer in [getattr(self.progress, "close", None), getattr(self.status, "close", None),
                       *(sink.close for sink in (self.report.sinks if self.report else []))]:
            if closer is None:
                continue
            try:
                closer()
            except Exception as e:  # a view failing to close must not hide how the run ended
                logger.warning("closing a view failed error=%r", e)

    def _finish(self, loop: Any) -> None:
        """Leave the swarm, write the final state, shut the node down: each step bounded, each step tried."""
        network = self.network
        try:
            if self.stop.is_set() and self.exchange is not None and self.network.learner is not None:
                self.exchange.see_last_update_out(self.config.training.finish_phase_within_s)
            if network is not None and network.node is not None:
                try:
                    loop.wait(network.leave(), timeout_s=15)
                except Exception as e:
                    logger.warning("leaving the swarm failed error=%r", e)
            if self.checkpoints is not None and self._ready:
                self.checkpoints.save(self.learner, round=self.round, why="exit")  # after leaving: no more merges
            if self.learner is not None and self.network is not None and self.network.learner is not None:
                self.report.final(self.round, self.config.logging.out_dir)
        finally:
            try:
                if network is not None:
                    loop.wait(network.shutdown(), timeout_s=network.node_config.shutdown_timeout_s + 5)
            except Exception as e:
                logger.warning("node shutdown failed error=%r", e)
            loop.close()
            if self.learner is not None:
                self.learner.unit.stop()  # the unit's other processes (torchrun) end with rank 0
            self._close_views()
            self.log.close()
            if self.checkpoints is not None:
                self.checkpoints.close()
