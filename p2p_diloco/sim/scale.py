"""The discrete-event scale simulator: thousands to millions of chips in learner units, with failures.

No torch: it models time, failures and bytes, not tensors. It answers two questions:
- Resilience (Decoupled DiLoCo, DeepMind 2026): a chip failure stops only its learner unit, which restarts
  from its checkpoint while the others keep training; data-parallel (SPMD) stops every chip until the job
  restarts; synchronous DiLoCo (Douillard et al. 2023) stalls every barrier a failed unit has not reached.
  Goodput (ARCHITECTURE.md, "What we measure") = unit-seconds of compute whose updates reached the surviving
  replicas / unit-seconds allocated, including time lost to crashes, restarts and waiting.
- Scale (ARCHITECTURE.md, "The network"): per-unit traffic under full dissemination (the real gossip: announce to
  `fanout` peers, who pull and re-announce) grows O(N); tree aggregation keeps it O(1) per unit at the cost of latency.

Model, per unit: a Poisson failure process of rate chips_per_unit / MTBF_chip; repair (spare swapped in),
restart from checkpoint (a failure during it starts over), work since the last checkpoint lost; a lognormal
compute speed; inner phases of H steps; an update of params x codec_bits (plus a header); one uplink and one
downlink of `bandwidth_mbps` with `latency_s`. Each replica keeps a version vector, so staleness (tau) and
divergence are measured on the same rules as the real code (sync/version_vector.py, sync/replica.py).
Everything is deterministic by seed; every method sees the same failure trace.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field

from p2p_diloco.sim.scale_baselines import run_data_parallel, run_sync_diloco
from p2p_diloco.sim.scale_config import ScaleConfig
from p2p_diloco.sim.scale_model import FailureClock, MethodResult
from p2p_diloco.sim.scale_units import DecoupledSwarm


@dataclass
class ScaleResult:
    """The methods' results for one configuration."""

    config: ScaleConfig
    methods: dict[str, MethodResult] = field(default_factory=dict)

    def to_dict(self) -> dict:
        cfg = asdict(self.config)
        cfg.update(chips_per_unit=self.config.chips_per_unit, update_bytes=self.config.update_bytes,
                   round_s=self.config.round_s)
        return {"config": cfg, "methods": {k: asdict(v) for k, v in self.methods.items()}}


def unit_speeds(config: ScaleConfig) -> list[float]:
    """Per-unit compute speed, lognormal with median 1 (shared by every method)."""
    rng = random.Random(f"{config.seed}:speeds")
    return [rng.lognormvariate(0.0, config.speed_sigma) if config.speed_sigma > 0 else 1.0
            for _ in range(config.units)]


def failure_clocks(config: ScaleConfig) -> list[FailureClock]:
    """A fresh copy of every unit's failure clock (same seed: the same failure times for every method)."""
    rate, horizon = config.unit_failure_rate_per_s, config.duration_s
    return [FailureClock(rate, config.seed, u, horizon) for u in range(config.units)]


def simulate_scale(config: ScaleConfig) -> ScaleResult:
    """Run every method of `config.methods` on the same failure trace and speeds."""
    config.validate()
    result = ScaleResult(config)
    speeds = unit_speeds(config)
    runners = {"decoupled": lambda: DecoupledSwarm(config, failure_clocks(config), speeds).run(),
               "sync": lambda: run_sync_diloco(config, failure_clocks(config), speeds),
               "dp": lambda: run_data_parallel(config, failure_clocks(config), speeds)}
    for method in config.methods:
        t0 = time.perf_counter()
        res = runners[method]()
        res.wall_s = time.perf_counter() - t0
        result.methods[method] = res
    return result
