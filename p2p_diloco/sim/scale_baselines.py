"""The baselines of the scale simulator, on the same failure trace as the decoupled units.

- Data-parallel (SPMD): every step needs every chip, so any chip failure stops the whole job until the failed
  chips are replaced and the job restarts from its last checkpoint; work since then is lost. Each step waits
  for the slowest unit. The per-step all-reduce is assumed hidden behind compute (optimistic for DP).
- Synchronous DiLoCo (Douillard et al. 2023): every unit runs H inner steps, then all meet at a barrier and
  all-reduce their updates (a ring). A failed unit repairs, restarts from its checkpoint and redoes its lost
  work while the others wait at the barrier; a failure during the all-reduce stalls it.

Both are plain loops over failures rather than event queues: there is one timeline (DP) or one per round.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from p2p_diloco.sim.scale_model import FailureClock, Ledger, MethodResult, progress, recover, wall_s

if TYPE_CHECKING:
    from p2p_diloco.sim.scale_config import ScaleConfig


def _result(method: str, ledger: Ledger, allocated: float, failures: int, rounds: float,
            traffic: dict[str, float]) -> MethodResult:
    return MethodResult(method=method, goodput=ledger.seconds["useful"] / allocated,
                        breakdown=ledger.fractions(allocated), failures=failures, rounds=rounds, traffic=traffic)


def run_data_parallel(cfg: ScaleConfig, clocks: Sequence[FailureClock], speeds: Sequence[float]) -> MethodResult:
    """One SPMD job over every unit's chips; any failure stops all of them."""
    n, horizon = len(clocks), cfg.duration_s
    heap = [(clock.next_at, u) for u, clock in enumerate(clocks)]
    heapq.heapify(heap)

    def next_failure() -> float:
        return heap[0][0]

    def pop_failure() -> float:
        at, u = heap[0]
        clocks[u].pop()
        heapq.heapreplace(heap, (clocks[u].next_at, u))
        return at

    # Each step lasts as long as the slowest unit's; a faster unit is busy only s_min / s_u of it.
    busy = sum(min(speeds) / s for s in speeds) / n
    t = retained = lost = ckpt = down = 0.0
    while t < horizon:
        failed_at = next_failure()
        end = min(failed_at, horizon)
        done, saved, ck = progress(end - t, math.inf, cfg.checkpoint_interval_s, cfg.checkpoint_cost_s)
        ckpt += ck
        if failed_at >= horizon:
            retained += done  # not lost: the job is still running when the allocation ends
            break
        pop_failure()
        retained += saved
        lost += done - saved
        up_at, _ = recover(failed_at, next_failure, pop_failure, cfg.repair_s, cfg.restart_s, horizon)
        down += min(up_at, horizon) - failed_at
        t = up_at
    ledger = Ledger()
    for category, seconds in (("useful", retained * busy), ("wait", retained * (1 - busy)), ("lost", lost),
                              ("checkpoint", ckpt), ("down", down)):
        ledger.add(category, seconds * n)
    # What DP would send per unit if its units were separate sites: a ring all-reduce of fp32 gradients per step.
    per_round = cfg.inner_steps * 2 * (n - 1) / n * 4 * cfg.params if n > 1 else 0.0
    traffic = {"sent_mean": per_round, "sent_max": per_round, "payload_sent_mean": per_round}
    failures = sum(clock.failures for clock in clocks)
    return _result("dp", ledger, n * horizon, failures, retained / cfg.round_s, traffic)


def _work(cfg: ScaleConfig, clock: FailureClock, start: float, work: float, horizon: float) -> dict[str, float]:
    """One unit doing `work` seconds of compute from `start`, through its failures: finish time and costs."""
    t, remaining = start, work
    out = {"lost": 0.0, "checkpoint": 0.0, "down": 0.0}
    while True:
        need = wall_s(remaining, cfg.checkpoint_interval_s, cfg.checkpoint_cost_s)
        if clock.next_at >= t + need or t >= horizon:
            out["checkpoint"] += need - remaining
            out["finish"] = t + need
            return out
        failed_at = clock.pop()
        done, saved, ck = progress(failed_at - t, remaining, cfg.checkpoint_interval_s, cfg.checkpoint_cost_s)
        out["lost"] += done - saved
        out["checkpoint"] += ck
        remaining -= saved
        up_at, _ = recover(failed_at, clock.peek, clock.pop, cfg.repair_s, cfg.restart_s, horizon)
        out["down"] += up_at - failed_at
        t = up_at


def _barrier(cfg: ScaleConfig, clocks: Sequence[FailureClock], costs: list[dict[str, float]], barrier: float,
             allreduce_s: float, horizon: float) -> float:
    """Every unit must be up from its finish until the all-reduce ends; a failure meanwhile (idle or inside the
    all-reduce) is repaired while the others wait, then the all-reduce runs again. Returns its end."""
    while True:
        before = barrier
        for clock, cost in zip(clocks, costs):
            while clock.next_at < barrier + allreduce_s and barrier < horizon:
                failed_at = clock.pop()
                up_at, _ = recover(failed_at, clock.peek, clock.pop, cfg.repair_s, cfg.restart_s, horizon)
                cost["down"] += up_at - failed_at
                barrier = max(barrier, up_at)
        if barrier == before or barrier >= horizon:
            return barrier + allreduce_s


def run_sync_diloco(cfg: ScaleConfig, clocks: Sequence[FailureClock], speeds: Sequence[float]) -> MethodResult:
    """Rounds of H inner steps per unit, a barrier, and a ring all-reduce of the updates."""
    n, horizon = len(clocks), cfg.duration_s
    bytes_per_s = cfg.bandwidth_mbps * 1e6 / 8
    ring_bytes = 2 * (n - 1) / n * cfg.update_bytes if n > 1 else 0.0
    allreduce_s = ring_bytes / bytes_per_s + 2 * (n - 1) * cfg.latency_s
    works = [cfg.round_s / s for s in speeds]
    ledger, rounds, t0 = Ledger(), 0, 0.0
    while t0 < horizon:
        costs = [_work(cfg, clock, t0, w, horizon) for clock, w in zip(clocks, works)]
        end = _barrier(cfg, clocks, costs, max(c["finish"] for c in costs), allreduce_s, horizon)
        if end > horizon:  # the round did not complete: none of its work reached the replicas
            ledger.add("unfinished", n * (horizon - t0))
            break
        for cost, w in zip(costs, works):
            spent = w + cost["lost"] + cost["checkpoint"] + cost["down"]
            ledger.add("useful", w)
            for category in ("lost", "checkpoint", "down"):
                ledger.add(category, cost[category])
            ledger.add("wait", (end - t0) - spent)
        rounds += 1
        t0 = end
    per_round = ring_bytes
    traffic = {"sent_mean": per_round, "sent_max": per_round, "payload_sent_mean": per_round,
               "copies_sent_mean": per_round / cfg.update_bytes}
    failures = sum(clock.failures for clock in clocks)
    return _result("sync", ledger, n * horizon, failures, rounds, traffic)
