"""Building blocks of the scale simulator: failure clocks, checkpointed work, recovery, time ledgers, summaries.

Time is simulated seconds; work is measured in unit-seconds of compute (a unit of `chips_per_unit` chips busy
for one second). Failures are a Poisson process per chip, so a unit of c chips fails at rate c / MTBF_chip: the
simulator follows units, never chips, which is what lets a 1.2M-chip job run in seconds.

Common random numbers: each unit owns one failure clock seeded by (seed, unit), so data-parallel, synchronous
DiLoCo and the decoupled units see exactly the same failure times in a comparison.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

CATEGORIES = ("useful", "lost", "down", "wait", "checkpoint", "unfinished")
"""Where allocated unit-seconds go (they sum to units x duration):
useful: compute whose update reached the surviving replicas; lost: compute thrown away by a failure (since the
last checkpoint); down: repair, restart and catch-up; wait: idle at a barrier, behind a straggler or in an
all-reduce; checkpoint: blocked writing checkpoints; unfinished: compute still in flight when the run ended."""


class FailureClock:
    """The failure times of one unit: a Poisson process of `rate_per_s`, from its own seeded stream."""

    __slots__ = ("_rng", "_rate", "_horizon", "next_at", "failures")

    def __init__(self, rate_per_s: float, seed: int, unit: int, horizon_s: float) -> None:
        self._rng = random.Random(f"{seed}:failures:{unit}")
        self._rate = rate_per_s
        self._horizon = horizon_s
        self.next_at = self._after(0.0)
        self.failures = 0  # consumed failures that fell inside the allocation

    def _after(self, t: float) -> float:
        return t + self._rng.expovariate(self._rate) if self._rate > 0 else math.inf

    def peek(self) -> float:
        """The next failure's time, not consumed."""
        return self.next_at

    def pop(self) -> float:
        """Consume the next failure; returns its time."""
        at = self.next_at
        self.next_at = self._after(at)
        self.failures += at < self._horizon
        return at


def checkpoints_in(work_s: float, interval_s: float) -> int:
    """Checkpoints written while doing `work_s`: one per full interval, plus one at the end (if any work)."""
    if work_s <= 0:
        return 0
    return max(1, math.ceil(work_s / interval_s - 1e-9))


def wall_s(work_s: float, interval_s: float, cost_s: float) -> float:
    """Wall seconds to do `work_s` of compute with a blocking checkpoint every `interval_s` and at the end."""
    return work_s + checkpoints_in(work_s, interval_s) * cost_s


def progress(elapsed_s: float, work_s: float, interval_s: float, cost_s: float) -> tuple[float, float, float]:
    """After `elapsed_s` of wall time on a piece of `work_s` (interrupted before it ended): (work done, work
    saved by a completed checkpoint, seconds spent checkpointing). The timeline is [work I][ckpt c][work I]...,
    the last work segment possibly shorter, then the final checkpoint."""
    cycle = interval_s + cost_s
    k = int(elapsed_s // cycle) if math.isfinite(cycle) else 0
    rem = elapsed_s - k * cycle
    done = k * interval_s + min(rem, interval_s)
    ckpt = k * cost_s + max(0.0, rem - interval_s)
    saved = k * interval_s
    if done > work_s:  # inside the (shorter) last segment's checkpoint: the work is done but not saved
        done = work_s
        ckpt = k * cost_s + max(0.0, elapsed_s - work_s - k * cost_s)
    return done, min(saved, done), ckpt


def recover(failed_at: float, next_failure: Callable[[], float], pop_failure: Callable[[], float],
            repair_s: float, restart_s: float, horizon_s: float) -> tuple[float, int]:
    """Time the failed chips are back and the restart from checkpoint is done, and the further failures that
    happened meanwhile. Failures during the repair extend it (spares are swapped in parallel); a failure during
    the restart starts the repair over, which is what makes a large synchronous job collapse."""
    until = failed_at + repair_s
    extra = 0
    while until < horizon_s:
        while next_failure() < until:
            extra += 1
            until = max(until, pop_failure() + repair_s)
        if next_failure() >= until + restart_s:
            return until + restart_s, extra
        extra += 1
        until = pop_failure() + repair_s
    return until + restart_s, extra


@dataclass
class Ledger:
    """Unit-seconds per category (CATEGORIES), summed over units."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))

    def add(self, category: str, unit_seconds: float) -> None:
        self.seconds[category] += unit_seconds

    def fractions(self, allocated_unit_s: float) -> dict[str, float]:
        return {k: v / allocated_unit_s if allocated_unit_s > 0 else 0.0 for k, v in self.seconds.items()}


def summarize(values: Iterable[float]) -> dict[str, float]:
    """count, mean, p50, p90, p99 and max of a sample (zeros for an empty one)."""
    xs = sorted(values)
    if not xs:
        return {"count": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}

    def q(p: float) -> float:
        return float(xs[min(len(xs) - 1, int(p * len(xs)))])

    return {"count": len(xs), "mean": sum(xs) / len(xs), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99),
            "max": float(xs[-1])}


class Reservoir:
    """A bounded uniform sample of a stream (Vitter's algorithm R), deterministic by seed."""

    def __init__(self, capacity: int, seed: str) -> None:
        self.capacity = capacity
        self.items: list[float] = []
        self.seen = 0
        self._rng = random.Random(seed)

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.items) < self.capacity:
            self.items.append(value)
        else:
            j = self._rng.randrange(self.seen)
            if j < self.capacity:
                self.items[j] = value


@dataclass
class MethodResult:
    """What one method (decoupled units, synchronous DiLoCo or data-parallel) achieved in a run."""

    method: str
    goodput: float
    """useful unit-seconds / allocated unit-seconds (ARCHITECTURE.md "What we measure")."""
    breakdown: dict[str, float]
    """Fraction of the allocated unit-seconds in each category of CATEGORIES (they sum to 1)."""
    failures: int
    """Unit failures during the run (the same failure trace for every method)."""
    rounds: float
    """Outer rounds of useful work: updates published / units (decoupled), barrier rounds (sync), or retained
    steps / H (data-parallel)."""
    traffic: dict[str, float] = field(default_factory=dict)
    """Per-unit bytes per round of updates (decoupled: per update published per unit, catch-ups included;
    sync and dp: per outer round): sent_mean, sent_max, payload_sent_mean, metadata_sent_mean, received_mean,
    copies_sent_mean (payload bytes / update bytes)."""
    staleness: dict[str, float] = field(default_factory=dict)
    """Summary of tau per published update: others' updates merged while the phase ran (tau)."""
    tau_histogram: dict[int, int] = field(default_factory=dict)
    """tau -> number of published updates with that tau."""
    delivery_latency_s: dict[str, float] = field(default_factory=dict)
    """Summary of the seconds from publish to merge, per (update, receiver), sampled."""
    divergence: dict[str, float] = field(default_factory=dict)
    """Replica divergence over periodic samples of the live replicas: missing updates per replica (in rounds of
    the swarm, i.e. / units), mean and max; fraction of samples where every live replica held the same set."""
    gossip: dict[str, float] = field(default_factory=dict)
    """Counters of the dissemination: pulls, duplicate pulls, lost transfers, repairs, catch-ups..."""
    converged: bool | None = None
    """After the run drained (no new updates, no failures), did every live replica hold the same set?"""
    double_merges: int = 0
    """Updates merged more than once into some replica (must be 0: ARCHITECTURE.md "Invariants", 2)."""
    events: int = 0
    wall_s: float = 0.0
