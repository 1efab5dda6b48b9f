"""A crude grace window: every unit waits a fixed time after each phase before the next, so that the round's other
updates arrive first. Loss at equal tokens, IID streams, the noise scenario, 8 timing seeds, against sync with the
same outer step (1.9692). An ad-hoc script (it wraps AsyncSwarm._end_phase), kept with its log; 2026-11-28.

    python benchmarks/results/async_candidates/parity/iid_fixed_wait.py
"""

import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from async_timing import METHODS, NOISE, run_one  # noqa: E402

SYNC_NEW = 1.9692


def fixed_wait(wait: float) -> None:
    """From now on, in this process, every simulated unit starts its next phase `wait` seconds after a phase ends."""
    from p2p_diloco.sim import swarm

    start, end = swarm.AsyncSwarm._start_phase, swarm.AsyncSwarm._end_phase

    def end_then_wait(self, peer, incarnation):  # as _end_phase, with the next phase `wait` seconds later
        swarm.AsyncSwarm._start_phase = lambda s, p: s.queue.push(s.queue.now + wait, start, s, p)
        try:
            end(self, peer, incarnation)
        finally:
            swarm.AsyncSwarm._start_phase = start

    swarm.AsyncSwarm._end_phase = end_then_wait


def run(job: tuple) -> dict:
    *job, wait = job
    fixed_wait(wait)
    return run_one(tuple(job))


if __name__ == "__main__":
    for wait in (0.15, 0.3, 0.45):
        jobs = [("async-new", METHODS["async-new"], "noise", {**NOISE, "iid": True}, seed, wait) for seed in range(8)]
        with ProcessPoolExecutor(2) as pool:
            losses = [r["loss"] for r in pool.map(run, jobs)]
        median, worst = statistics.median(losses), max(losses)
        print(f"wait {wait} s ({wait / 1.6:.0%} of a phase idle): median {median:.4f} worst {worst:.4f}  "
              f"{(median / SYNC_NEW - 1) * 100:+.2f}% / {(worst / SYNC_NEW - 1) * 100:+.2f}%", flush=True)
