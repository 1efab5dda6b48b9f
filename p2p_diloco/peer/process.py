"""One learner unit on the real network (`p2p-diloco join`): the compute thread's round loop and its lifecycle.

Process model (DESIGN.md section 5):

    compute thread (the caller's; the main thread under the CLI)
        begin_phase -> run_inner (step by step) -> finish_phase, then `SwarmExchange.publish(u)` hands the
        update to the network loop (`run_coroutine_threadsafe(gossip.publish(u))`) and goes on without
        waiting. It reads the swarm from snapshots the loop keeps fresh (`PeerNetwork.peers`, `.counters`):
        it never awaits the network during an inner phase (invariant 4).
    network loop (one asyncio loop in a daemon thread, see `peer_network`)
        SwarmNode, Gossip, SnapshotServer, announce and peer-list refresh; remote updates merge into the
        replica from there (Intake, in the loop's worker threads), under the replica's lock.

Lifecycle: start the node and check the run's spec (the first peer publishes it) -> restore the newest good
checkpoint if this peer has one, else state sync from the freshest live peers if any has merged updates ->
serve and announce -> after a restore, publish our journaled updates again and catch up (peer/resume.py) ->
rounds (a checkpoint every `checkpoint_every`) -> linger until the swarm is quiet -> leave (a last record says
"left"), write a checkpoint and the final state, shut the node down. A stop request
(Ctrl-C, SIGTERM) is checked before every inner step: the unfinished phase is dropped, or finished if it ends
within `finish_phase_within_s`, and the peer leaves as above within seconds. A finish request (SIGUSR1) makes
the current round the last one, as if `--rounds` had been reached: the peer lingers, then leaves.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2p_diloco.config import ConfigError, RunSpec
from p2p_diloco.net.discovery.status import (
    MAX_WEIGHTED_PEERS,
    JsonLog,
    fmt_bytes,
    is_quiet,
    round_line,
    save_state,
    shard_for,
    swarm_samples_per_round,
)

# Light at import time (the CLI builds `join --help` from PeerConfig): torch, hivemind and everything that
# imports them are imported where they are used.

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerConfig:
    """This peer: identity, addresses, data shard, how long it trains, where it reports (not shared)."""

    bootstrap: tuple[str, ...] = ()
    """Bootstrap multiaddrs, comma-separated, each ending in /p2p/<peer id> (empty: start a new swarm)."""
    identity: str = "~/.config/p2p-diloco/identity.key"
    """Ed25519 identity file, created if missing (mode 0600); peers on one machine need one each."""
    host: str = "127.0.0.1"
    """Address to listen on: an IP (0.0.0.0 for every interface) or a full multiaddr."""
    port: int = 0
    """TCP port to listen on (0: any free port)."""
    announce: tuple[str, ...] = ()
    """Addresses others should dial, comma-separated: public IPs or DNS names (with --port) or multiaddrs."""
    client_mode: bool = False
    """Serve no DHT requests (for a peer others cannot dial)."""
    use_auto_relay: bool = False
    """Reserve a slot on a relay (the bootstrap) to be reachable from behind NAT."""
    reachability: str = ""
    """Override NAT detection: public or private (empty: detect)."""
    start_timeout_s: float = 60.0
    """Upper bound on starting the node, retries on an unresponsive bootstrap included, in seconds."""
    shard: int = -1
    """Data shard to train on (-1: int(sha256(peer id)) mod num_shards)."""
    num_shards: int = 16
    """Number of disjoint data shards the training text is cut into."""
    rounds: int = 0
    """Outer rounds to train (0: until Ctrl-C)."""
    linger_s: float = 60.0
    """After the last round, keep serving until every live peer holds our replica (quiet) or this many seconds."""
    out_dir: str = ""
    """On exit, write the replica (theta.pt) and its version vector (version_vector.json) into this folder."""
    json_log: str = ""
    """Append one JSON object per round (and per start, sync, eval and final event) to this file."""
    eval_every: int = 5
    """Eval loss of the replica every this many rounds (0: only at the start and at the end)."""
    eval_batches: int = 4
    """Batches in the fixed eval set (the same windows on every peer)."""
    record_ttl_s: float = 60.0
    """Lifetime of this peer's DHT record, refreshed every third of it: a dead peer vanishes within it."""
    dht_timeout_s: float = 10.0
    """Timeout of one DHT read or write, in seconds."""
    finish_phase_within_s: float = 2.0
    """On Ctrl-C/SIGTERM, finish the inner phase if it ends within this many seconds, else drop it."""
    torch_threads: int = 0
    """CPU threads for torch (0: torch's default; 1 when several peers share a machine)."""
    device: str = "auto"
    """Where the model trains: auto (cuda, else mps, else cpu), cpu, cuda, cuda:N or mps. The replica and
    everything sent stay on the CPU in float32, so peers on different devices train one run together."""
    checkpoint_every: int = 10
    """Write a checkpoint (replica, version vector, outer momentum and error feedback, inner AdamW state, data
    position) every this many rounds and on a clean exit; a restart resumes from it (0: no checkpoints, no
    journal: a restart starts over with a state sync)."""
    checkpoint_dir: str = ""
    """Folder for checkpoints and the journal of our signed updates (empty: OUT_DIR/checkpoints with --out-dir,
    else ~/.local/share/p2p-diloco/RUN-SPEC/PEER_ID). Restart with the same --identity and folder to resume."""
    keep_checkpoints: int = 2
    """Checkpoints kept, newest first: an older one is the fallback when a crash tore the newest."""
    catch_up_stall_s: float = 20.0
    """After a restart, pull what peers merged since the checkpoint; if nothing new merges for this many
    seconds, the gap is older than peers retain: state sync instead (training starts after 10x this anyway)."""

    def validate(self) -> PeerConfig:
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        require(self.num_shards >= 1, f"num_shards must be >= 1, got {self.num_shards}")
        require(-1 <= self.shard < self.num_shards, f"shard must be in [0, {self.num_shards}) or -1, got {self.shard}")
        require(0 <= self.port < 65536, f"port must be in [0, 65535], got {self.port}")
        require(self.rounds >= 0 and self.eval_every >= 0, "rounds and eval_every must be >= 0")
        require(self.eval_batches >= 1, f"eval_batches must be >= 1, got {self.eval_batches}")
        require(self.linger_s >= 0 and self.finish_phase_within_s >= 0,
                "linger_s and finish_phase_within_s must be >= 0")
        require(3 <= self.record_ttl_s <= 3600, f"record_ttl_s must be in [3, 3600], got {self.record_ttl_s}")
        require(self.dht_timeout_s > 0 and self.start_timeout_s > 0, "dht_timeout_s and start_timeout_s must be > 0")
        require(self.reachability in ("", "public", "private"),
                f"reachability must be public, private or empty, got {self.reachability!r}")
        require(self.torch_threads >= 0, f"torch_threads must be >= 0, got {self.torch_threads}")
        require(self.checkpoint_every >= 0 and self.keep_checkpoints >= 1,
                f"checkpoint_every must be >= 0 and keep_checkpoints >= 1, got {self.checkpoint_every} and "
                f"{self.keep_checkpoints}")
        require(self.catch_up_stall_s > 0, f"catch_up_stall_s must be > 0, got {self.catch_up_stall_s}")
        from p2p_diloco.train.device import resolve_device  # imports torch: here, not at import time

        resolve_device(self.device)  # a missing GPU fails here, before the node starts
        return self

    def node_config(self):  # -> NodeConfig
        from p2p_diloco.net.transport.node import NodeConfig, parse_multiaddr

        return NodeConfig(host_maddrs=(listen_maddr(self.host, self.port),),
                          announce_maddrs=tuple(announce_maddr(a, self.port) for a in self.announce),
                          initial_peers=tuple(parse_multiaddr(b, require_peer_id=True) for b in self.bootstrap),
                          start_timeout_s=self.start_timeout_s, client_mode=self.client_mode,
                          use_auto_relay=self.use_auto_relay, force_reachability=self.reachability or None)


def _ip_protocol(host: str) -> str:
    if ":" in host:
        return "ip6"
    return "ip4" if host.replace(".", "").isdigit() else "dns"


def listen_maddr(host: str, port: int) -> str:
    """`/ip4/HOST/tcp/PORT` (or ip6), or `host` itself if it is already a multiaddr."""
    from p2p_diloco.net.transport.node import NodeError, parse_multiaddr

    if host.startswith("/"):
        return parse_multiaddr(host)
    if _ip_protocol(host) == "dns":
        raise NodeError(f"listen host must be an IP address (e.g. 0.0.0.0 or 127.0.0.1), got '{host}'")
    return parse_multiaddr(f"/{_ip_protocol(host)}/{host}/tcp/{port}")


def announce_maddr(address: str, port: int) -> str:
    """A multiaddr for an announced address: given as is, or built from an IP / DNS name and `port`."""
    from p2p_diloco.net.transport.node import NodeError, parse_multiaddr

    if address.startswith("/"):
        return parse_multiaddr(address)
    if port == 0:
        raise NodeError(f"--announce {address} needs the real port: give --port too (or a full multiaddr)")
    return parse_multiaddr(f"/{_ip_protocol(address)}/{address}/tcp/{port}")


def install_stop_handlers(stop: threading.Event, finish: threading.Event | None = None) -> None:
    """SIGINT and SIGTERM set `stop` (the peer then leaves cleanly); a second one interrupts at once.
    SIGUSR1 sets `finish`: the peer ends its current round as if it were its last (`--rounds`), lingers until
    the swarm is quiet, and exits (for a planned shutdown that should waste no work).

    Processes forked after this (hivemind's DHT process) inherit the handler: there it restores the default
    action and re-raises, so `kill` and hivemind's own terminate() still work on them (SIGUSR1 is ignored).
    """
    owner = os.getpid()
    usr1 = getattr(signal, "SIGUSR1", None)  # not on Windows

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_IGN if signum == usr1 else signal.SIG_DFL)
            if signum != usr1:
                os.kill(os.getpid(), signum)
            return
        if signum == usr1:
            if finish is not None:
                finish.set()
            return
        if stop.is_set():
            raise KeyboardInterrupt()
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    if usr1 is not None:
        signal.signal(usr1, handler)


def _print(line: str) -> None:
    try:
        print(line, flush=True)
    except BrokenPipeError:  # e.g. `p2p-diloco join | head`: keep training, stop printing
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the rest of the process)


class SwarmExchange:
    """The `Exchange` (train/exchange.py) of one peer on the real swarm, used from the compute thread.

    `publish` hands the update to the network loop (`Gossip.publish` runs there) and returns at once;
    `swarm_view` reads the live peer list the loop keeps fresh. Neither waits on the network.
    """

    def __init__(self, network: Any, loop: Any, samples_per_update: float) -> None:
        self.network, self.loop, self.samples_per_update = network, loop, samples_per_update
        self.last_publish: Any = None  # concurrent.futures.Future of the last hand-over
        self._seen: dict[str, int] = {}  # sender -> highest seq we have merged from it
        self._active_at: dict[str, float] = {}  # sender -> when its seq last advanced in our replica
        self._last_view_at: float | None = None

    def publish(self, update: Any) -> None:
        import asyncio

        self.last_publish = asyncio.run_coroutine_threadsafe(self.network.publish(update), self.loop)

    def swarm_view(self) -> Any:  # -> SwarmView
        from p2p_diloco.train.learner import SwarmView

        node = self.network.node
        me = node.peer_id if node else ""
        num_peers, _ = swarm_samples_per_round(self.network.peers, me, self.samples_per_update)
        # DHT records lag (a peer that started a few seconds later is not listed yet, and then every update
        # would be signed with too large a weight): also count the senders whose updates advanced our replica
        # within the last few of our rounds. Both are cheap local reads; neither waits on the network.
        num_peers = min(MAX_WEIGHTED_PEERS + 1, max(num_peers, self._recent_senders(me) + 1))
        return SwarmView(num_peers=num_peers, samples_per_round=self.samples_per_update * num_peers)

    def _recent_senders(self, me: str) -> int:
        now = time.monotonic()
        window_s = max(30.0, 3 * (now - self._last_view_at)) if self._last_view_at else 30.0
        self._last_view_at = now
        learner = getattr(self.network, "learner", None)
        if learner is not None:
            for sender, seq in learner.replica.version_vector.items():
                if sender != me and seq > self._seen.get(sender, 0):
                    self._seen[sender], self._active_at[sender] = seq, now
        for sender in [s for s, t in self._active_at.items() if now - t > window_s]:
            del self._active_at[sender]  # bounded: only senders active within the window stay
        return len(self._active_at)


class Peer:
    """Runs one learner unit until its rounds are done (and the swarm is quiet) or `stop` is set."""

    def __init__(self, spec: RunSpec, config: PeerConfig, *, gossip_config: Any, sync_config: Any,
                 stop: threading.Event | None = None, finish: threading.Event | None = None,
                 out: Callable[[str], None] | None = None, policy: Any = None) -> None:
        self.spec = spec.validate()
        self.config = config.validate()
        self.gossip_config = gossip_config
        self.sync_config = sync_config
        self.policy = policy  # net/policy.NetPolicy: access (allow list, run secret) and rate limits; None: defaults
        self.stop = stop or threading.Event()  # leave now (Ctrl-C, SIGTERM)
        self.finish = finish or threading.Event()  # end after this round, then linger (SIGUSR1)
        self.out = out or _print
        self.log = JsonLog(config.json_log)
        self.learner: Any = None
        self.network: Any = None  # PeerNetwork
        self.round = 0
        self.eval_loss: float | None = None
        self.last: dict[str, Any] = {}
        self._publish: Any = None  # the last update's hand-over to the loop (a concurrent Future)
        self._sent_at_publish = self._last_nbytes = 0
        self.checkpoints: Any = None  # PeerCheckpoints (peer/resume.py), None with --checkpoint-every 0
        self._ready = False  # the replica is set up (restored or synced) and served: worth a checkpoint on exit

    # ---- lifecycle ----------------------------------------------------------------------------------------

    def run(self) -> int:
        from p2p_diloco.peer.network import NetLoop, PeerNetwork, Stopped
        from p2p_diloco.wire.identity import Identity

        identity_path = str(Path(self.config.identity).expanduser())
        identity = Identity.load_or_create(identity_path)
        self.checkpoints = self._open_checkpoints(identity.peer_id)  # before the node: a second process stops here
        node_config = self.config.node_config()
        loop = NetLoop()
        try:
            self.network = PeerNetwork(
                self.spec, identity, identity_path, node_config, gossip_config=self.gossip_config,
                sync_config=self.sync_config, record_ttl_s=self.config.record_ttl_s,
                dht_timeout_s=self.config.dht_timeout_s, policy=self.policy)
            started = loop.submit(self.network.start())
            self._build_learner(identity)  # while the node starts
            restored = self._restore()
            how = loop.wait(started, self.stop)
            self._report_start(how)
            if restored is None:
                synced = loop.wait(self.network.sync_state(self.learner), self.stop)
                self._report_sync(synced)
                self._adopt_journal()  # no checkpoint, but maybe a journal: never reuse a seq
            loop.wait(self.network.serve(self.learner), self.stop)
            self._ready = True
            if self.checkpoints is not None:
                self.checkpoints.resume(loop, self.network, self.learner, restored=restored is not None,
                                        stop=self.stop, stall_s=self.config.catch_up_stall_s,
                                        on_sync=self._adopt_journal)
            self._train(loop)
            self._linger()
        except Stopped:
            self.out("stopping (interrupted during start-up)")
        finally:
            self._finish(loop)
        return 0

    def _build_learner(self, identity: Any) -> None:
        import torch

        from p2p_diloco.train.data import eval_batches, load_corpus
        from p2p_diloco.train.learner import Learner

        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        cfg = self.config
        shard = cfg.shard if cfg.shard >= 0 else shard_for(identity.peer_id, cfg.num_shards)
        corpus = load_corpus(self.spec.data, block_size=self.spec.model.block_size)
        self.learner = Learner(self.spec, identity, corpus, shard=shard, num_shards=cfg.num_shards,
                               device=cfg.device)
        self.eval_set = eval_batches(corpus, block_size=self.spec.model.block_size,
                                     batch_size=self.spec.data.batch_size, num_batches=cfg.eval_batches)
        self.samples_per_update = self.spec.inner.inner_steps * self.spec.data.batch_size
        self.network.static_record = {"shard": shard, "corpus": corpus.fingerprint,
                                      "samples_per_update": self.samples_per_update}
        self.out(f"peer {identity.peer_id}")
        how = "chosen with --shard" if cfg.shard >= 0 else "from the PeerID; --shard to choose"
        self.out(f"data shard {shard} of {cfg.num_shards} ({how}); {corpus.describe()}")
        self.log.write("start", peer_id=identity.peer_id, shard=shard, num_shards=cfg.num_shards,
                       spec_hash=self.spec.spec_hash(), numel=self.learner.numel, device=self.learner.device)

    # ---- checkpoints and restart (peer/resume.py, train/checkpoint.py) ----------------------------------

    def _open_checkpoints(self, peer_id: str) -> Any:
        """The checkpoint folder, opened and locked (None with --checkpoint-every 0)."""
        cfg = self.config
        if cfg.checkpoint_every == 0:
            return None
        from p2p_diloco.peer.resume import PeerCheckpoints, default_checkpoint_dir

        folder = Path(cfg.checkpoint_dir).expanduser() if cfg.checkpoint_dir else \
            default_checkpoint_dir(cfg.out_dir, self.spec.run_id, self.spec.spec_hash(), peer_id)
        return PeerCheckpoints.open(folder, self.spec, peer_id, keep=cfg.keep_checkpoints, out=self.out,
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

    def _report_start(self, how: str) -> None:
        node = self.network.node
        for maddr in node.visible_maddrs():
            self.out(f"listening on {maddr}")
        verb = "published (first peer of the run)" if how == "published" else "matches the swarm's"
        self.out(f"run '{self.spec.run_id}' spec {self.spec.spec_hash()[:12]} {verb}; "
                 f"{self.learner.numel:,} parameters, H={self.spec.inner.inner_steps}, codec={self.spec.outer.codec}, "
                 f"device={self.learner.device}")

    def _report_sync(self, synced: dict | None) -> None:
        if synced is None:
            self.out("state sync: not needed (no live peer has merged updates yet); starting from the run's seed")
            return
        self.out(f"state sync: loaded replica with V total {synced['vv_total']} from donor {synced['donor']} "
                 f"({fmt_bytes(synced['bytes'])} in {synced['seconds']:.1f}s)")
        self.log.write("sync", **synced)

    # ---- the round loop -------------------------------------------------------------------------------

    def _train(self, loop: Any) -> None:
        learner, network, cfg = self.learner, self.network, self.config
        exchange = SwarmExchange(network, loop.loop, self.samples_per_update)
        self.t_start = time.monotonic()
        self.compute_s = 0.0
        self._evaluate(0)
        samples_per_s = 0.0
        while not self.stop.is_set() and (cfg.rounds == 0 or self.round < cfg.rounds):
            if self.finish.is_set():
                self.out(f"finishing after round {self.round} (SIGUSR1)")
                return
            phase = learner.begin_phase()
            t0 = time.monotonic()
            result = self._inner_phase(phase)
            if result is None:
                return
            view = exchange.swarm_view()
            update = learner.finish_phase(phase, result, view)
            exchange.publish(update)  # returns at once: the loop announces it, peers pull it
            self._publish = exchange.last_publish
            self._sent_at_publish, self._last_nbytes = network.counters.get("bytes_sent", 0), update.nbytes
            self.round += 1
            self.compute_s += result.compute_s
            round_s = time.monotonic() - t0
            samples_per_s = result.samples / max(round_s, 1e-9)
            if cfg.eval_every and self.round % cfg.eval_every == 0:
                self._evaluate(self.round)
            counters = network.counters
            vv = learner.replica.version_vector
            self.last = {
                "round": self.round, "step": learner.step, "loss": result.mean_loss,
                "eval_loss": self.eval_loss if cfg.eval_every and self.round % cfg.eval_every == 0 else None,
                "peers": view.num_peers, "tau": update.header.tau, "weight": update.header.weight, "seq": update.seq,
                "vv_total": vv.total(), "bytes_sent": counters.get("bytes_sent", 0),
                "bytes_received": counters.get("bytes_received", 0), "merged": counters.get("merged", 0),
                "rejected": counters.get("rejected", 0), "samples_per_s": samples_per_s, "round_s": round_s,
                "utilization": self.compute_s / (time.monotonic() - self.t_start), "compute_s": self.compute_s}
            network.local = {"state": "training", "round": self.round, "step": learner.step,
                             "loss": result.mean_loss, "eval_loss": self.eval_loss, "samples_per_s": samples_per_s,
                             "tau": update.header.tau}
            network.request_announce()
            self.out(round_line(self.last))
            self.log.write("round", peer_id=learner.peer_id, **self.last)
            if self.checkpoints is not None and self.round % cfg.checkpoint_every == 0:
                self.checkpoints.save(learner, round=self.round, why="periodic")

    def _inner_phase(self, phase: Any) -> Any:
        """The inner steps, one at a time so that a stop request is seen within a step. On a stop, the phase
        is dropped (None) unless it would end within finish_phase_within_s; then it is finished."""
        steps = self.spec.inner.inner_steps
        finish_anyway: bool | None = None
        while phase.steps_done < steps:
            if self.stop.is_set() and finish_anyway is None:
                done = phase.steps_done
                remaining_s = phase.compute_s / max(done, 1) * (steps - done)
                finish_anyway = done > 0 and remaining_s <= self.config.finish_phase_within_s
                if not finish_anyway:
                    self.out(f"stopping: dropped the unfinished inner phase at step {done}/{steps}")
                    return None
                self.out(f"stopping: finishing the inner phase first ({remaining_s:.1f}s left)")
            self.learner.run_inner(phase, 1)
        return phase.result()

    def _evaluate(self, at_round: int) -> None:
        self.eval_loss = self.learner.evaluate(self.eval_set)
        self.log.write("eval", round=at_round, eval_loss=self.eval_loss)

    def _linger(self) -> None:
        """After the last round: keep serving and merging until every live peer holds our replica."""
        cfg, network = self.config, self.network
        if self.stop.is_set() or not (cfg.rounds or self.finish.is_set()) or cfg.linger_s <= 0:
            return
        network.local = {**network.local, "state": "done"}
        network.request_announce()
        self.out(f"finished {self.round} rounds; serving until the swarm is quiet (at most {cfg.linger_s:g}s)")
        self.log.write("linger", round=self.round)
        deadline = time.monotonic() + cfg.linger_s
        quiet_checks = 0
        while not self.stop.wait(0.5):
            digest = self.learner.replica.version_vector.digest().hex()[:16]
            # Twice in a row: our own record must also have been refreshed since our replica last changed.
            quiet = is_quiet(network.peers, self.learner.peer_id, digest) and not network.settling()
            quiet_checks = quiet_checks + 1 if quiet else 0
            if quiet_checks >= 2:
                self.out(f"swarm quiet: every live peer holds version vector {digest}")
                return
            if time.monotonic() > deadline:
                self.out(f"linger time over ({cfg.linger_s:g}s) before the swarm went quiet")
                return

    # ---- leaving ----------------------------------------------------------------------------------------

    def _finish(self, loop: Any) -> None:
        """Leave the swarm, write the final state, shut the node down: each step bounded, each step tried."""
        network = self.network
        try:
            if self.stop.is_set() and self.network is not None and self.network.learner is not None:
                self._see_last_update_out()
            if network is not None and network.node is not None:
                try:
                    loop.wait(network.leave(), timeout_s=15)
                except Exception as e:
                    logger.warning("leaving the swarm failed error=%r", e)
            if self.checkpoints is not None and self._ready:
                self.checkpoints.save(self.learner, round=self.round, why="exit")  # after leaving: no more merges
            if self.learner is not None and self.network is not None and self.network.learner is not None:
                self._final_report()
        finally:
            try:
                if network is not None:
                    loop.wait(network.shutdown(), timeout_s=network.node_config.shutdown_timeout_s + 5)
            except Exception as e:
                logger.warning("node shutdown failed error=%r", e)
            loop.close()
            self.log.close()
            if self.checkpoints is not None:
                self.checkpoints.close()

    def _see_last_update_out(self) -> None:
        """After a stop request: give peers a moment (finish_phase_within_s) to pull our last update, which is
        why we finished the phase at all. Others then have it; if they don't, nobody does, and replicas agree."""
        publish = self._publish
        if publish is None or self._last_nbytes == 0:
            return
        deadline = time.monotonic() + self.config.finish_phase_within_s
        try:
            publish.result(timeout=self.config.finish_phase_within_s)
        except Exception as e:
            logger.debug("last publish did not finish error=%r", e)
        while time.monotonic() < deadline and \
                self.network.counters.get("bytes_sent", 0) - self._sent_at_publish < self._last_nbytes:
            time.sleep(0.1)

    def _final_report(self) -> None:
        theta, vv = self.learner.replica.snapshot()
        eval_loss = self.learner.evaluate(self.eval_set)
        counters = self.network.counters
        final = {"peer_id": self.learner.peer_id, "round": self.round, "step": self.learner.step,
                 "eval_loss": eval_loss, "vv_total": vv.total(), "vv_digest": vv.digest().hex()[:16],
                 "bytes_sent": counters.get("bytes_sent", 0), "bytes_received": counters.get("bytes_received", 0),
                 "merged": counters.get("merged", 0), "rejected": counters.get("rejected", 0),
                 "duplicates": counters.get("duplicate", 0), "seq": self.learner.last_seq,
                 "equivocations": self.learner.replica.stats.get("equivocation", 0),
                 "banned": sorted(self.learner.replica.banned),
                 "holes": vv.n_holes, "repairs": list(self.network.repairs),
                 "utilization": self.last.get("utilization", 0.0)}  # while training (lingering is not idling)
        if self.config.out_dir:
            theta_path, vv_path = save_state(self.config.out_dir, theta, vv,
                                             {"peer_id": self.learner.peer_id, "spec_hash": self.spec.spec_hash(),
                                              "round": self.round, "step": self.learner.step})
            final.update(theta_path=str(theta_path), vv_path=str(vv_path))
            self.out(f"wrote {theta_path} and {vv_path}")
        self.out(f"final: rounds {self.round}  eval {eval_loss:.3f}  V {vv.total()}  "
                 f"sent {fmt_bytes(final['bytes_sent'])}  merged {final['merged']}  rejected {final['rejected']}")
        self.log.write("final", **final)
