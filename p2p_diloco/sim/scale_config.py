"""The scale simulator's job description (`ScaleConfig`): chips, units, failures, compute, network, dissemination.

Kept apart from sim/scale.py so that the simulator's parts (scale_units, scale_baselines) read it without
importing the module that runs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

METHODS = ("decoupled", "sync", "dp")
GOSSIP_MODES = ("full", "tree")
HOUR_S = 3600.0


@dataclass(frozen=True)
class ScaleConfig:
    """One simulated job: chips in learner units, failures, compute, network and dissemination."""

    chips: int = 1_200_000
    """Accelerator chips in the whole job (data-parallel runs them all as one SPMD job)."""
    units: int = 8
    """Learner units the chips are split into, of equal size (chips_per_unit = chips / units)."""
    mtbf_chip_h: float = 160_000.0
    """Mean time between failures of one chip, in hours; failures are a Poisson process per chip. The default
    is calibrated so that data-parallel goodput at 1.2M chips, with the default repair, restart and checkpoint
    times, is DeepMind's 27 percent. Llama 3 saw about 50,000 h per GPU (419 interruptions in 54 days on
    16,384 GPUs)."""
    repair_s: float = 300.0
    """Seconds from a failure until the failed chips are replaced (repair, or reschedule onto a spare)."""
    restart_s: float = 180.0
    """Seconds to restart a unit (or the data-parallel job) from its checkpoint once its chips are back; a
    failure during the restart starts the repair over."""
    checkpoint_interval_s: float = 300.0
    """Seconds of compute between checkpoints; a failure loses the work since the last one. DiLoCo units also
    checkpoint at the end of each inner phase, before publishing."""
    checkpoint_cost_s: float = 0.0
    """Seconds each checkpoint blocks compute (0: asynchronous checkpoints)."""
    inner_steps: int = 100
    """H: inner steps per outer round."""
    step_time_s: float = 3.0
    """Seconds per inner step at speed 1 (one nominal round is inner_steps x step_time_s)."""
    speed_sigma: float = 0.0
    """Spread of compute speed across units: speed ~ lognormal(0, sigma) (0: all equal)."""
    params: int = 12_000_000_000
    """Model parameters (an update is params x codec_bits / 8 bytes plus a header)."""
    codec_bits: float = 4.0
    """Bits per parameter of a compressed outer update (int4 blockwise: about 4.1)."""
    header_bytes: int = 512
    """Bytes of an update's header and signature, and of an announce or pull request without its vector."""
    vector_entry_bytes: int = 60
    """Bytes per sender in a version vector on the wire (a 52-character PeerID and a seq)."""
    bandwidth_mbps: float = 10_000.0
    """Each unit's uplink and downlink bandwidth, in megabits per second."""
    latency_s: float = 0.03
    """One-way network latency between units, in seconds."""
    gossip: str = "full"
    """Dissemination of updates: 'full' (each update reaches every unit: announce to fanout, pull, re-announce)
    or 'tree' (updates are summed up a k-ary tree of live units and the sum sent down, every period)."""
    fanout: int = 3
    """Peers a unit announces to after publishing, and after a pull that brought something new."""
    dedup_inflight: bool = True
    """Skip a pull when a pull bringing the same update is already in flight, as the real gossip does (a pull asks
    only beyond what the pulls started before it will bring: net/gossip/pulls.py `_claims`). False: pull again
    from the second announcer (what the real gossip did before the claims: 36-50% of pulls were duplicates)."""
    anti_entropy_s: float = 5.0
    """Mean seconds before a unit that missed an update pulls it from a holder (anti-entropy)."""
    tree_fanin: int = 8
    """Children per node of the aggregation tree ('tree' mode)."""
    tree_rules: str = "ideal"
    """What a tree's sums cost ('tree' mode): 'ideal', a sum the size of one update and nothing else (the first
    rows); 'real', the rules net/gossip/tree.py runs: a leaf sends its updates themselves, a sum (and the total)
    is exact int32 (4 bytes a parameter) and names each part by its author's herald, and every sum is audited
    (the aggregator re-sends the updates it added itself to its auditor; the root to each of its children)."""
    aggregation_period_s: float = 0.0
    """Seconds between aggregation epochs in 'tree' mode (0: one nominal round)."""
    duration_h: float = 168.0
    """Simulated hours; every method gets the same allocation (units x duration)."""
    methods: tuple[str, ...] = METHODS
    """Methods to run: decoupled (p2p DiLoCo learner units), sync (synchronous DiLoCo), dp (data-parallel)."""
    samples: int = 100
    """Divergence samples over the run (each costs O(units^2))."""
    max_events: int = 50_000_000
    """Bound on simulated events (a run that needs more raises instead of running for hours)."""
    seed: int = 0
    """Seed of every random choice (failures, speeds, gossip targets)."""

    @property
    def chips_per_unit(self) -> float:
        return self.chips / self.units

    @property
    def unit_failure_rate_per_s(self) -> float:
        return self.chips_per_unit / (self.mtbf_chip_h * HOUR_S) if math.isfinite(self.mtbf_chip_h) else 0.0

    @property
    def update_bytes(self) -> int:
        return math.ceil(self.params * self.codec_bits / 8) + self.header_bytes

    @property
    def sum_bytes(self) -> int:
        """A group sum on the wire: the update's size under the 'ideal' rules, exact int32 under the 'real'."""
        return self.update_bytes if self.tree_rules == "ideal" else 4 * self.params + self.header_bytes

    @property
    def state_bytes(self) -> int:
        """A full state sync: theta in fp32."""
        return 4 * self.params + self.header_bytes

    @property
    def round_s(self) -> float:
        return self.inner_steps * self.step_time_s

    @property
    def duration_s(self) -> float:
        return self.duration_h * HOUR_S

    def validate(self) -> ScaleConfig:
        if not 1 <= self.units <= self.chips:
            raise ValueError(f"need 1 <= units <= chips, got units={self.units} chips={self.chips}")
        if not (self.mtbf_chip_h > 0 and self.step_time_s > 0 and self.inner_steps >= 1 and self.duration_h > 0):
            raise ValueError("mtbf_chip_h, step_time_s, duration_h must be > 0 and inner_steps >= 1")
        if min(self.repair_s, self.restart_s, self.checkpoint_cost_s, self.latency_s, self.speed_sigma) < 0:
            raise ValueError("repair_s, restart_s, checkpoint_cost_s, latency_s, speed_sigma must be >= 0")
        if not (self.checkpoint_interval_s > 0 and self.bandwidth_mbps > 0 and self.anti_entropy_s > 0):
            raise ValueError("checkpoint_interval_s, bandwidth_mbps and anti_entropy_s must be > 0")
        if self.gossip not in GOSSIP_MODES:
            raise ValueError(f"gossip must be one of {GOSSIP_MODES}, got {self.gossip!r}")
        if self.tree_rules not in ("ideal", "real"):
            raise ValueError(f"tree_rules must be ideal or real, got {self.tree_rules!r}")
        if self.fanout < 1 or self.tree_fanin < 2 or self.samples < 0 or self.aggregation_period_s < 0:
            raise ValueError("need fanout >= 1, tree_fanin >= 2, samples >= 0, aggregation_period_s >= 0")
        if not self.methods or set(self.methods) - set(METHODS):
            raise ValueError(f"methods must be a non-empty subset of {METHODS}, got {self.methods}")
        return self
