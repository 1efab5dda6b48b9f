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
import time
from collections.abc import Callable
from pathlib import Path

import torch

from p2p_diloco.config import JoinConfig
from p2p_diloco.net.admission.policy import NetPolicy
from p2p_diloco.net.discovery.status import shard_for
from p2p_diloco.net.transport import addresses
from p2p_diloco.net.transport.netloop import NetLoop, Stopped
from p2p_diloco.peer.exchange import SwarmExchange
from p2p_diloco.peer.linger import linger
from p2p_diloco.peer.network import PeerNetwork
from p2p_diloco.peer.output import JsonLog
from p2p_diloco.peer.progress import JoinProgress
from p2p_diloco.peer.report import PeerReport, print_line
from p2p_diloco.peer.resume import PeerCheckpoints, Restored, default_checkpoint_dir
from p2p_diloco.peer.resync import Resync, window_for
from p2p_diloco.peer.sinks import check_available, open_sinks
from p2p_diloco.peer.status import PeerStatus
from p2p_diloco.train.data.corpus import eval_batches
from p2p_diloco.train.data.resolve import load_training_data, resolve_spec
from p2p_diloco.train.hardware.compute import Compute
from p2p_diloco.train.hardware.unit import unit_device
from p2p_diloco.train.hardware.units import unit_from_env
from p2p_diloco.train.learner import Learner
from p2p_diloco.train.loop import GRACE_POLL_S, GraceWait, PhaseBegun, RoundDone, Schedule, StepDone, rounds
from p2p_diloco.train.pace import Pace
from p2p_diloco.wire.identity import Identity

# Heavy at import time (torch, hivemind): only `join` imports this module, once its options are known to be good.

logger = logging.getLogger(__name__)


class Peer:
    """Runs one learner unit until its rounds are done (and the swarm is quiet) or `stop` is set."""

    def __init__(self, config: JoinConfig, *, stop: threading.Event | None = None,
                 finish: threading.Event | None = None, out: Callable[[str], None] | None = None) -> None:
        # --model PATH and a token dataset's facts go into the spec before it is hashed, published or compared.
        self.config = dataclasses.replace(config, spec=resolve_spec(config.spec)).validate()
        self.spec = self.config.spec
        self.device = unit_device(config.training.device)  # a missing GPU fails here, before the node starts
        check_available(config.logging)  # so does a TensorBoard or wandb sink whose package is missing
        # access (allow list, run secret) and rate limits
        self.policy = NetPolicy(config.admission.access, config.admission.rate)
        self.stop = stop or threading.Event()  # leave now (Ctrl-C, SIGTERM)
        self.finish = finish or threading.Event()  # end after this round, then linger (SIGUSR1)
        self.out = out or print_line
        self.log = JsonLog(config.logging.json_log)
        # bars on a terminal (peer/progress.py): the state sync's bytes, then each inner phase's steps
        self.progress = JoinProgress(config.logging.progress, self.spec.inner.inner_steps, out=self.out)
        self.learner: Learner | None = None
        self.network: PeerNetwork | None = None
        self.report: PeerReport | None = None  # prints and logs what happens, and is the round loop's hooks
        self.exchange: SwarmExchange | None = None  # once training begins
        self.round = 0
        self.checkpoints: PeerCheckpoints | None = None  # None with --checkpoint-every 0
        self.status: PeerStatus | None = None  # the snapshot, and the status page if asked for
        self._ready = False  # the replica is set up (restored or synced) and served: worth a checkpoint on exit

    # ---- lifecycle ----------------------------------------------------------------------------------------

    def run(self) -> int:
        identity_path = str(Path(self.config.network.identity).expanduser())
        identity = Identity.load_or_create(identity_path)
        self.checkpoints = self._open_checkpoints(identity.peer_id)  # before the node: a second process stops here
        loop = NetLoop()
        try:
            network = self.network = PeerNetwork(
                self.spec, identity, identity_path, addresses.node_config(self.config.network),
                network=self.config.network, gossip=self.config.gossip, statesync=self.config.statesync,
                policy=self.policy, on_sync_progress=self.progress.sync)
            started = loop.submit(network.start())
            learner, static_record = self._build_learner(identity)  # while the node starts
            report = self.report = self._open_views(identity.peer_id, network, learner)
            restored = self._restore(learner)
            up = loop.wait(started, self.stop)
            report.start(up)
            network.attach(learner, static_record)
            if restored is None:
                synced = loop.wait(network.sync_state(), self.stop)
                report.sync(synced)
                self._adopt_journal()  # no checkpoint, but maybe a journal: never reuse a seq
            loop.wait(network.serve(), self.stop)
            self._ready = True
            if self.checkpoints is not None:
                self.checkpoints.resume(loop, network, learner, restored=restored is not None,
                                        stop=self.stop, stall_s=self.config.checkpoint.catch_up_stall_s,
                                        on_sync=self._adopt_journal)
            resync = self._train(loop, network, learner, report)
            self.progress.close()  # the bars go; the linger's lines follow the last round line
            catch_up = None if resync is None else (lambda: resync.between_rounds(loop, self.stop))
            self._linger(network, learner, catch_up)
        except Stopped:
            self.out("stopping (interrupted during start-up)")
        finally:
            self._finish(loop)
        return 0

    def _build_learner(self, identity: Identity) -> tuple[Learner, dict[str, object]]:
        """The learner, and the record fields that never change (shard, corpus fingerprint, samples per update)."""
        if self.config.training.torch_threads:
            torch.set_num_threads(self.config.training.torch_threads)
        cfg = self.config.training
        shard = cfg.shard if cfg.shard >= 0 else shard_for(identity.peer_id, cfg.num_shards)
        corpus = load_training_data(self.spec.data, block_size=self.spec.model.block_size)
        compute = Compute.for_training(cfg, self.device)
        unit = unit_from_env(self.device, cfg.parallel)  # one process, or DDP/FSDP over torchrun's ranks
        learner = self.learner = Learner(self.spec, identity, corpus, shard=shard, num_shards=cfg.num_shards,
                                         device=self.device, compute=compute, unit=unit,
                                         stream=identity.peer_id,  # peers that drew one shard: other batches
                                         outer_state_dir=cfg.outer_state_dir, fit_share=cfg.fit_share)
        self.eval_set = eval_batches(corpus, block_size=self.spec.model.block_size,
                                     batch_size=self.spec.data.batch_size, num_batches=cfg.eval_batches)
        self.samples_per_update = self.spec.inner.inner_steps * self.spec.data.batch_size
        self.out(f"peer {identity.peer_id}")
        n_windows = getattr(learner.sampler, "n_windows", None)
        if n_windows is not None:  # a token dataset: every window once per epoch, shuffled by PeerID and epoch
            self.out(f"data: {n_windows} windows of a sequence, read in this unit's own shuffled order (keyed by "
                     f"the PeerID); {corpus.describe()}")
        elif cfg.num_shards == 1:
            self.out(f"data: the whole training split, in this unit's own stream (keyed by the PeerID); "
                     f"{corpus.describe()}")
        else:
            how = "chosen with --shard" if cfg.shard >= 0 else "from the PeerID; --shard to choose"
            self.out(f"data shard {shard} of {cfg.num_shards} ({how}); {corpus.describe()}")
        self.log.write("start", peer_id=identity.peer_id, shard=shard, num_shards=cfg.num_shards,
                       spec_hash=self.spec.spec_hash(), numel=learner.numel, device=learner.device,
                       precision=compute.precision, processes=learner.unit.world)
        self.out(f"model {self.spec.model.arch}: {learner.numel / 1e6:.2f}M parameters on {self.device} "
                 f"({compute.precision}" + (f", a unit of {learner.unit.world} processes" if
                                            learner.unit.world > 1 else "") + ")")
        return learner, {"shard": shard, "corpus": corpus.fingerprint, "samples_per_update": self.samples_per_update}

    def _open_views(self, peer_id: str, network: PeerNetwork, learner: Learner) -> PeerReport:
        """The report (with the optional TensorBoard / wandb sinks) and the status page (with --status-port)."""
        cfg = self.config.logging
        report = PeerReport(self.spec, learner, network, eval_set=self.eval_set, log=self.log, out=self.out,
                            checkpoints=self.checkpoints, sinks=open_sinks(cfg, peer_id, self.spec))
        self.status = PeerStatus(network, report)
        if cfg.status_port >= 0:
            url = self.status.serve(cfg.status_host, cfg.status_port)
            self.out(f"status page: {url} (metrics: {url}metrics)")
            self.log.write("status_page", url=url)
        return report

    # ---- checkpoints and restart (peer/resume.py, train/state/) ----------------------------------------------

    def _open_checkpoints(self, peer_id: str) -> PeerCheckpoints | None:
        """The checkpoint folder, opened and locked (None with --checkpoint-every 0)."""
        cfg = self.config.checkpoint
        if cfg.every == 0:
            return None
        folder = Path(cfg.dir).expanduser() if cfg.dir else \
            default_checkpoint_dir(self.config.logging.out_dir, self.spec.run_id, self.spec.spec_hash(), peer_id)
        return PeerCheckpoints.open(folder, self.spec, peer_id, keep=cfg.keep, out=self.out, log=self.log)

    def _restore(self, learner: Learner) -> Restored | None:
        """Load the newest good checkpoint (CPU work, while the node starts); None if there is none."""
        restored = self.checkpoints.restore(learner) if self.checkpoints else None
        if restored is not None:
            at = restored["round"]
            assert isinstance(at, int)  # StateManager.restore: the manifest's round (checked) plus the replayed
            self.round = int(at)
        return restored

    def _adopt_journal(self) -> int:
        """Our journaled updates into a replica that came from a state sync (seqs stay unique)."""
        rounds_adopted = self.checkpoints.adopt_journal(self.learner) if self.checkpoints and self.learner else 0
        self.round += rounds_adopted
        return rounds_adopted

    # ---- the round loop -------------------------------------------------------------------------------

    def _train(self, loop: NetLoop, network: PeerNetwork, learner: Learner, report: PeerReport) -> Resync | None:
        """The round loop; returns its re-sync watch (the linger keeps using it)."""
        cfg = self.config.training
        self.exchange = SwarmExchange(network, loop.loop, self.samples_per_update)
        schedule = Schedule(rounds=cfg.rounds, eval_every=cfg.eval_every,
                            checkpoint_every=self.config.checkpoint.every if self.checkpoints else 0,
                            finish_phase_within_s=cfg.finish_phase_within_s, max_stretch=cfg.max_stretch,
                            stretch_backlog=cfg.stretch_backlog, grace=cfg.grace)
        report.training_begins(self.round)
        resync = self._open_resync(network, learner)
        ticks = rounds(learner, self.exchange, schedule, report, start_round=self.round, stop=self.stop,
                       finish=self.finish)
        pace = Pace(cfg.duty_cycle)
        try:
            while True:  # `drive`, with each tick shown on the progress bars
                try:
                    tick = next(ticks)
                except StopIteration as end:
                    ended = end.value
                    break
                if isinstance(tick, GraceWait):  # the round's other updates are due: a moment, then look again
                    self.stop.wait(GRACE_POLL_S)
                    continue
                self.progress.tick(tick)
                if isinstance(tick, PhaseBegun):
                    pace.begin(time.monotonic())
                elif isinstance(tick, StepDone):
                    self.stop.wait(pace.rest_s(time.monotonic()))  # a machine shared with its owner
                if isinstance(tick, RoundDone) and self.status is not None:
                    self.status.round_done(report.last)  # the page's history of our rounds
                if resync is not None and isinstance(tick, RoundDone):  # between rounds: the next phase begins
                    resync.between_rounds(loop, self.stop, tick.round_s)  # at the next `next(ticks)`
                elif resync is not None:
                    resync.observe()  # never waits on the network: inside an inner phase
        finally:
            self.round = report.round  # also after an error: the exit checkpoint names the rounds done
        if ended == "finish":
            self.out(f"finishing after round {self.round} (SIGUSR1)")
        return resync

    def _open_resync(self, network: PeerNetwork, learner: Learner) -> Resync | None:
        """The watch that re-syncs state when pulls cannot catch us up (peer/resync.py); None if turned off."""
        window_s = self.config.checkpoint.resync_window_s
        if window_s < 0:
            return None
        journal = self.checkpoints.state.journaled if self.checkpoints is not None else None
        return Resync(network, learner, window_s=window_s or window_for(self.config.gossip.anti_entropy_s),
                      fixed=window_s > 0, journal=journal, out=self.out, log=self.log)

    def _linger(self, network: PeerNetwork, learner: Learner, catch_up: Callable[[], object] | None) -> None:
        """After the last round (not after a stop): keep serving until every live peer holds our replica."""
        cfg = self.config.training
        if self.stop.is_set() or not (cfg.rounds or self.finish.is_set()) or cfg.linger_s <= 0:
            return
        linger(network, learner, stop=self.stop, linger_s=cfg.linger_s, at_round=self.round, out=self.out,
               log=self.log, catch_up=catch_up)

    # ---- leaving ----------------------------------------------------------------------------------------

    def _close_views(self) -> None:
        closers = [self.progress.close, *([self.status.close] if self.status else []),
                   *(sink.close for sink in (self.report.sinks if self.report else []))]
        for closer in closers:
            try:
                closer()
            except Exception as e:  # a view failing to close must not hide how the run ended
                logger.warning("closing a view failed error=%r", e)

    def _finish(self, loop: NetLoop) -> None:
        """Leave the swarm, write the final state, shut the node down: each step bounded, each step tried."""
        network, learner = self.network, self.learner
        try:
            attached = network is not None and network.learner is not None
            if self.stop.is_set() and self.exchange is not None and attached:
                self.exchange.see_last_update_out(self.config.training.finish_phase_within_s)
            if network is not None and network.node is not None:
                try:
                    loop.wait(network.leave(), timeout_s=15)
                except Exception as e:
                    logger.warning("leaving the swarm failed error=%r", e)
            if self.checkpoints is not None and self._ready and learner is not None:
                self.checkpoints.save(learner, round=self.round, why="exit")  # after leaving: no more merges
            if attached and self.report is not None:
                self.report.final(self.round, self.config.logging.out_dir)
        finally:
            try:
                if network is not None:
                    loop.wait(network.shutdown(), timeout_s=network.node_config.shutdown_timeout_s + 5)
            except Exception as e:
                logger.warning("node shutdown failed error=%r", e)
            loop.close()
            if learner is not None:
                learner.unit.stop()  # the unit's other processes (torchrun) end with rank 0
            self._close_views()
            self.log.close()
            if self.checkpoints is not None:
                self.checkpoints.close()
