"""`p2p-diloco join`: one nested config for a peer of the real swarm, one section per concern.

Each section is a TOML table of the same name (`[network]`, `[training]`, `[spec.outer]`, `[admission.rate]`...)
and a family of `--SECTION.FIELD` options (cli/args.py). Only `spec` is shared by the peers of a run (and
hashed); every other section is this peer's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2p_diloco.config.admission import AdmissionConfig
from p2p_diloco.config.errors import require
from p2p_diloco.config.multiaddrs import check_multiaddr
from p2p_diloco.config.network import GossipConfig, NetworkConfig, StateSyncConfig, check_status_port
from p2p_diloco.config.spec import RunSpec


@dataclass(frozen=True)
class TrainingConfig:
    """How long this peer trains, on what device and which data shard, and how often it evaluates."""

    rounds: int = 0
    """Outer rounds to train (0: until Ctrl-C)."""
    device: str = "auto"
    """Where the model trains: auto (cuda, else mps, else cpu), cpu, cuda, cuda:N or mps. The replica and
    everything sent stay on the CPU in float32, so peers on different devices train one run together."""
    precision: str = "auto"
    """auto (bf16 on GPUs that have it, fp16 with a loss scaler on older GPUs, fp32 on the CPU), bf16, fp16 or
    fp32: the forward and backward only; weights, AdamW state, the replica and what is sent stay float32."""
    micro_batch: int = 0
    """Sequences per forward/backward, gradients accumulated to the run's batch (0: the whole batch): lower it
    when a card runs out of memory; the run's batch and the update stay the same."""
    activation_checkpointing: bool = False
    """Recompute activations in backward instead of keeping them: less memory, ~30% more compute."""
    compile: bool = False
    """torch.compile the model for the inner steps: faster steps on GPUs after a minute of compiling."""
    memory_check: bool = True
    """Refuse to start when the memory plan (`p2p-diloco plan`) says the unit will not fit this machine's free
    device and host memory; false starts anyway."""
    gpus: int = 0
    """Run this unit as N processes (one per GPU; on a CPU, N gloo processes): this one becomes rank 0 and speaks
    to the swarm, all N train (0 or 1: one process; torchrun --nproc-per-node N -m p2p_diloco join ... works too)."""
    outer_state_dir: str = ""
    """Keep the outer momentum and error feedback in files in this folder instead of memory: they are used once a
    round, and between uses their pages leave the process (8 bytes per parameter less on the host during the inner
    steps, for a model near the host's limit; a round then reads and writes them, 8 bytes per parameter). Empty:
    in memory."""
    parallel: str = "ddp"
    """How a unit of several processes (--gpus N / torchrun) splits the model: ddp (a full copy of the model, its
    gradients and AdamW state on every rank) or fsdp (each rank holds 1/N of them: for a model that does not fit
    one device; the inner AdamW state is then not checkpointed)."""
    torch_threads: int = 0
    """CPU threads for torch (0: torch's default; 1 when several peers share a machine)."""
    duty_cycle: float = 1.0
    """Share of the wall time the unit computes, for a machine it shares (0.5: after each inner step it rests as
    long as the step took; train/pace.py). The network side never rests: the peer keeps serving and merging.
    1: flat out."""
    fit_share: float = 0.05
    """At a sponsor of a run with founders: the share of its compute it may spend checking whether proposals too
    weak for their direction teach the stream they declare more than its own step did (train/fit.py `FIT_SHARE`;
    one that does counts for its author's graduation). 0: no checks. At 0.05 a late volunteer on a file shard of
    its own was carried by every sponsor from its 3rd update in 2 of 4 seeds, by 2 of 3 in the others, for 3-3.6%
    of the sponsors' compute (BENCHMARKS.md "The lift")."""
    shard: int = -1
    """Data shard to train on (-1: int(sha256(peer id)) mod num_shards)."""
    num_shards: int = 1
    """Number of disjoint data shards the training text is cut into. 1 (the default): every unit samples the whole
    training split in a stream of its own (batches salted by its PeerID), as units reading a token dataset do;
    with N > 1, two units whose PeerIDs hash to one shard read the same bytes all run, and each unit's updates
    pull theta towards its own slice of the text (BENCHMARKS.md "The end of a long run")."""
    eval_every: int = 5
    """Eval loss of the replica every this many rounds (0: only at the start and at the end)."""
    eval_batches: int = 4
    """Batches in the fixed eval set (the same windows on every peer)."""
    linger_s: float = 60.0
    """After the last round, keep serving until every live peer holds our replica (quiet) or this many seconds."""
    finish_phase_within_s: float = 2.0
    """On Ctrl-C/SIGTERM, finish the inner phase if it ends within this many seconds, else drop it."""
    max_stretch: int = 4
    """While this peer's own updates queue (a slow uplink: at least stretch_backlog of them held by no live peer
    yet), go on training the inner phase for H more steps instead of publishing, up to this many times H in one
    phase; the one update then covers them all and what is sent stays fresh (1: never stretch)."""
    stretch_backlog: int = 3
    """Own updates held by no live peer yet at which a phase is stretched (see max_stretch). Not 1 or 2: the
    remotes' vectors we judge by can be a phase old, so a healthy link can read 1-2 (a slow one reads dozens)."""

    grace: float = 0.5
    """After each round, wait at most this share of the phase just done for the other units' updates of the round
    (those one update short of ours, and after the first round the live units with none yet; train/grace.py): what
    async pays for its timing shrinks, for that idle time (BENCHMARKS.md "The grace window": at 10 rounds in the
    simulator +0.15% against sync instead of +2.8%; real local swarms -2.4% loss for 10-12 points of
    utilization). In a run with sponsors only they wait, for one another. 0: never wait."""

    def validate(self) -> TrainingConfig:
        require(self.num_shards >= 1, f"num_shards must be >= 1, got {self.num_shards}")
        require(-1 <= self.shard < self.num_shards, f"shard must be in [0, {self.num_shards}) or -1, got {self.shard}")
        require(self.rounds >= 0 and self.eval_every >= 0, "rounds and eval_every must be >= 0")
        require(self.eval_batches >= 1, f"eval_batches must be >= 1, got {self.eval_batches}")
        require(self.linger_s >= 0 and self.finish_phase_within_s >= 0,
                "linger_s and finish_phase_within_s must be >= 0")
        require(self.torch_threads >= 0, f"torch_threads must be >= 0, got {self.torch_threads}")
        require(0 < self.duty_cycle <= 1, f"duty_cycle must be in (0, 1], got {self.duty_cycle}")
        require(0 <= self.fit_share <= 1, f"fit_share must be in [0, 1], got {self.fit_share}")
        require(self.precision in ("auto", "bf16", "fp16", "fp32"),
                f"precision must be auto, bf16, fp16 or fp32, got {self.precision!r}")
        require(self.micro_batch >= 0, f"micro_batch must be >= 0, got {self.micro_batch}")
        require(self.gpus >= 0, f"gpus must be >= 0, got {self.gpus}")
        require(self.parallel in ("ddp", "fsdp"), f"parallel must be ddp or fsdp, got {self.parallel!r}")
        require(1 <= self.max_stretch <= 64, f"max_stretch must be in [1, 64], got {self.max_stretch}")
        require(self.stretch_backlog >= 1, f"stretch_backlog must be >= 1, got {self.stretch_backlog}")
        require(0 <= self.grace <= 4, f"grace must be in [0, 4], got {self.grace}")
        return self


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints and the journal of our signed updates: what a restart resumes from."""

    every: int = 10
    """Write a checkpoint (replica, version vector, outer momentum and error feedback, inner AdamW state, data
    position) every this many rounds and on a clean exit; a restart resumes from it (0: no checkpoints, no
    journal: a restart starts over with a state sync)."""
    dir: str = ""
    """Folder for checkpoints and the journal of our signed updates (empty: OUT_DIR/checkpoints with --out-dir,
    else ~/.local/share/p2p-diloco/RUN-SPEC/PEER_ID). Restart with the same --identity and folder to resume."""
    keep: int = 2
    """Checkpoints kept, newest first: an older one is the fallback when a crash tore the newest."""
    catch_up_stall_s: float = 20.0
    """After a restart, pull what peers merged since the checkpoint; if nothing new merges for this many
    seconds, the gap is older than peers retain: state sync instead (training starts after 10x this anyway)."""
    resync_window_s: float = 0.0
    """While training, a peer behind the others on a sender whose updates pulls do not bring for this long
    (twice as long without proof that pulls cannot help: a full buffer, a gap wider than max_hole_span)
    re-syncs its state from a peer (peer/resync.py). 0: 6 anti-entropy periods or 3 rounds, at least 30 s;
    -1: never."""

    def validate(self) -> CheckpointConfig:
        require(self.every >= 0 and self.keep >= 1,
                f"checkpoint.every must be >= 0 and checkpoint.keep >= 1, got {self.every} and {self.keep}")
        require(self.catch_up_stall_s > 0, f"catch_up_stall_s must be > 0, got {self.catch_up_stall_s}")
        require(self.resync_window_s >= 0 or self.resync_window_s == -1,
                f"resync_window_s must be >= 0 or -1, got {self.resync_window_s}")
        return self


@dataclass(frozen=True)
class LoggingConfig:
    """Where this peer reports: the final replica, the per-round JSON log, the status page and metrics."""

    out_dir: str = ""
    """On exit, write the replica (theta.pt) and its version vector (version_vector.json) into this folder."""
    json_log: str = ""
    """Append one JSON object per round (and per start, sync, eval and final event) to this file."""
    status_port: int = -1
    """Serve a web status page of the swarm, /api/status and Prometheus /metrics on this port (-1: off, 0: any
    free port; the address is printed). Read-only."""
    status_host: str = "127.0.0.1"
    """Address the status page binds to: 127.0.0.1 keeps it on this host; 0.0.0.0 shows it to everyone."""
    progress: str = "auto"
    """Progress bars for state sync and each inner phase: auto (on a terminal), on, off (plain lines)."""
    tensorboard_dir: str = ""
    """Also log each round's figures for TensorBoard into this folder (needs the tensorboard package)."""
    wandb_project: str = ""
    """Also log each round's figures to this Weights & Biases project (needs wandb, logged in)."""

    def validate(self) -> LoggingConfig:
        check_status_port(self.status_port, self.status_host)
        require(self.progress in ("auto", "on", "off"), f"progress must be auto, on or off, got {self.progress!r}")
        return self


@dataclass(frozen=True)
class JoinConfig:
    """A peer of the real swarm: the run it trains (`spec`, shared) and everything that is its own."""

    spec: RunSpec = field(default_factory=RunSpec)
    """The run: every peer of it holds the same spec (content-hashed)."""
    network: NetworkConfig = field(default_factory=NetworkConfig)
    """This peer's identity, addresses and DHT options."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Rounds, device, data shard, evaluation."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and the journal a restart resumes from."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """The final replica and the JSON log."""
    gossip: GossipConfig = field(default_factory=GossipConfig)
    """How updates spread."""
    statesync: StateSyncConfig = field(default_factory=StateSyncConfig)
    """Snapshot transfers to joining peers (both sides)."""
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    """Closed runs and per-remote rate limits."""

    def validate(self) -> JoinConfig:
        """Every section checked (ConfigError or ValueError, with the field named); the device is checked where
        the peer starts, since that needs torch."""
        for section in (self.spec, self.network, self.training, self.checkpoint, self.logging, self.gossip,
                        self.statesync, self.admission):
            section.validate()
        for address in self.network.bootstrap:  # a typo answers now, before torch and the node load (the doctor
            check_multiaddr(address, require_peer_id=True)  # checks its own NetworkConfig address by address)
        require(not (self.gossip.aggregate and self.spec.defence.reads_payloads()),
                "--gossip.aggregate needs exact merge weights: a sum cannot carry vetting that reads payloads; add "
                "--spec.defence.copy-cosine 0 (and no reference tests), or run with sponsors")
        return self
