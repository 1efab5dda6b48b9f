"""The in-process swarm's configuration (`p2p-diloco simulate`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2p_diloco.config.errors import ConfigError, require
from p2p_diloco.config.spec import RunSpec


@dataclass(frozen=True)
class SimConfig:
    """The in-process swarm: N learner units on one simulated clock, and the network between them."""

    peers: int = 4
    """Learner units at the start."""
    method: str = "async"
    """async (p2p DiLoCo), sync (DiLoCo with a barrier every H steps) or dp (data-parallel, all-reduce every step)."""
    total_steps: int = 800
    """Token budget: inner steps summed over all peers (equal across methods)."""
    speeds: tuple[str, ...] = ()
    """Per-peer speed factors, comma-separated (e.g. 1,1,1,0.25); missing ones are 1."""
    step_time_s: float = 1.0
    """Simulated seconds per inner step at speed 1."""
    latency_s: float = 0.05
    """One-way message latency, seconds."""
    bandwidth_mbps: float = 100.0
    """Each peer's uplink, megabits per second."""
    loss: float = 0.0
    """Probability that a message is lost; lost updates come back through anti-entropy."""
    anti_entropy_s: float = 10.0
    """Simulated seconds until a lost message is recovered by anti-entropy."""
    latency_jitter_s: float = 0.0
    """Extra one-way latency per message, uniform in [0, this], seconds: real links and gossip hops vary."""
    start_spread_s: float = 0.0
    """Each peer starts at a time uniform in [0, this], seconds: real peers never start together."""
    phase_jitter: float = 0.0
    """Each inner phase lasts (1 + uniform(-j, j)) times its nominal time: a shared machine's noise."""
    timing_seed: int = 0
    """Seed of the timing noise (start spread, phase and latency jitter), apart from the run's seed."""
    crash: tuple[str, ...] = ()
    """Scripted crashes PEER@SECONDS, comma-separated (e.g. 2@300): the peer dies, its phase is lost."""
    join: tuple[str, ...] = ()
    """Scripted joins at SECONDS, comma-separated: a new peer syncs state from a live one and trains."""
    sponsors: int = 0
    """The first this many peers are the run's sponsors (their keys in the spec's `defence.sponsors`): a run with
    founders (sync/sponsorship.py). 0: the spec's own list."""
    heralds: bool = True
    """Proposers send their update's signed header to the sponsors ahead of the payload, and sponsors judge near
    copies in herald order (sync/heralds.py), as real peers do; False: in the order the payloads merged."""
    herald_wait: bool = True
    """A proposer sends its payload only once every sponsor acked its herald (at most sync/heralds.py
    HERALD_WAIT_S), as real peers do; False: right behind the heralds on its uplink."""
    iid: bool = True
    """Every unit samples the whole training split, each its own stream, as a real peer's units do (token datasets,
    and the byte corpus's default `num_shards` 1); False: a contiguous file shard each (`--training.num-shards N`)."""
    grace: float = 0.5
    """Async units wait after each round, at most this share of the phase, for the round's other updates
    (train/grace.py; the join config's `grace`; in a run with sponsors only they wait, for one another)."""
    eval_every_s: float = 0.0
    """Simulated seconds between eval points on the loss curve (0: about 20 points per run)."""
    eval_batches: int = 8
    """Eval batches per eval point."""
    aggregate: int = 0
    """Fan-in of the epoch's aggregation tree (sim/aggregation.py: group sums instead of a copy of every update to
    every peer); 0: full dissemination."""
    epoch_s: float = 0.0
    """Simulated seconds an aggregation tree lasts before it rotates (0: 10 of the fastest peer's phases)."""
    audits: bool = True
    """With `aggregate`: every sum is checked by the peer it goes to before it is used (sim/audits.py)."""
    fallback_epochs: int = 3
    """Sum timeouts (a quarter phase each, plus the tree's hops) after which an author sends an update some live
    peer still lacks to everyone itself."""
    device: str = "cpu"
    """Where every simulated peer's model trains: cpu (reproducible results), auto, cuda, cuda:N or mps."""

    def validate(self) -> SimConfig:
        require(self.peers >= 1, f"peers must be >= 1, got {self.peers}")
        require(self.method in ("async", "sync", "dp"), f"method must be async, sync or dp, got {self.method!r}")
        require(self.total_steps > 0, f"total_steps must be > 0, got {self.total_steps}")
        require(self.step_time_s > 0, f"step_time_s must be > 0, got {self.step_time_s}")
        require(self.latency_s >= 0, f"latency_s must be >= 0, got {self.latency_s}")
        require(self.bandwidth_mbps > 0, f"bandwidth_mbps must be > 0, got {self.bandwidth_mbps}")
        require(0 <= self.loss < 1, f"loss must be in [0, 1), got {self.loss}")
        require(self.anti_entropy_s > 0, f"anti_entropy_s must be > 0, got {self.anti_entropy_s}")
        require(self.latency_jitter_s >= 0, f"latency_jitter_s must be >= 0, got {self.latency_jitter_s}")
        require(self.start_spread_s >= 0, f"start_spread_s must be >= 0, got {self.start_spread_s}")
        require(0 <= self.phase_jitter < 1, f"phase_jitter must be in [0, 1), got {self.phase_jitter}")
        require(0 <= self.sponsors <= self.peers, f"sponsors must be in [0, peers], got {self.sponsors}")
        require(0 <= self.grace <= 4, f"grace must be in [0, 4], got {self.grace}")
        require(self.eval_batches > 0, f"eval_batches must be > 0, got {self.eval_batches}")
        require(self.aggregate == 0 or self.aggregate >= 2, f"aggregate must be 0 or >= 2, got {self.aggregate}")
        require(self.epoch_s >= 0 and self.fallback_epochs >= 1, "epoch_s must be >= 0 and fallback_epochs >= 1")
        speeds = self.speed_factors()
        require(all(s > 0 for s in speeds), f"speeds must all be > 0, got {self.speeds}")
        self.crashes()
        self.joins()
        return self

    def unit_data(self, index: int, shard: int, num_shards: int) -> tuple[int, int, str]:
        """(shard, num_shards, stream) for unit `index`'s Learner, the same for every method: with `iid` the whole
        split in a stream of its own, else file `shard` of `num_shards`."""
        return (0, 1, f"unit{index}") if self.iid else (shard, num_shards, "")

    def speed_factors(self) -> list[float]:
        try:
            given = [float(s) for s in self.speeds]
        except ValueError as err:
            raise ConfigError(f"speeds must be numbers, got {self.speeds}: {err}") from None
        require(len(given) <= self.peers, f"{len(given)} speeds given for {self.peers} peers")
        return given + [1.0] * (self.peers - len(given))

    def crashes(self) -> list[tuple[int, float]]:
        out = []
        for item in self.crash:
            peer, _, at = item.partition("@")
            try:
                out.append((int(peer), float(at)))
            except ValueError:
                raise ConfigError(f"crash must look like PEER@SECONDS (e.g. 2@300), got {item!r}") from None
            require(0 <= out[-1][0] < self.peers, f"crash names peer {out[-1][0]}, but peers are 0..{self.peers - 1}")
        return out

    def joins(self) -> list[float]:
        try:
            return [float(t) for t in self.join]
        except ValueError:
            raise ConfigError(f"join must be times in seconds, got {self.join}") from None


@dataclass(frozen=True)
class SimulateConfig:
    """Everything `p2p-diloco simulate` runs: the run's spec and the simulated swarm (TOML tables [spec...], [sim])."""

    spec: RunSpec = field(default_factory=RunSpec)
    """The run every simulated peer trains."""
    sim: SimConfig = field(default_factory=SimConfig)
    """The simulated swarm and its network."""

    def validate(self) -> SimulateConfig:
        self.spec.validate()
        self.sim.validate()
        return self
