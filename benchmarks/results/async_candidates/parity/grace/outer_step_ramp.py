"""An outer step that moves from the 10-round step (lr 1.4, mu 0.3) to DiLoCo's (lr 0.7, mu 0.9) by the swarm's
clock: an ad-hoc candidate (2026-11-28), kept with its log. 100 rounds, H=50, the noise scenario, a shard per unit.

    python benchmarks/results/async_candidates/parity/grace/outer_step_ramp.py

Sender-side only, so the merge rule (and equal replicas) is untouched: receivers merge every payload at the
spec's outer_lr (1.4), and the sender scales what goes into its momentum by lr(r) / 1.4 and uses mu(r), where r is
the swarm's rounds as its replica shows them (train/phase.py `swarm_rounds`), linear from round R0 to R1. Below
R0 it is the default exactly, so a 10-round run is unchanged. Rows: async with the grace window (0.5) and sync,
both with the ramp, against the long-run rows in BENCHMARKS ("The grace window").
"""

import dataclasses
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # benchmarks/

R0, R1 = 10.0, 30.0
LR0, LR1, MU0, MU1 = 1.4, 0.7, 0.3, 0.9


def ramp(rounds: float) -> float:
    return min(1.0, max(0.0, (rounds - R0) / (R1 - R0)))


def install() -> None:
    from p2p_diloco.train import learner
    from p2p_diloco.train.phase import swarm_rounds

    outer_update = learner.outer_update

    def ramped(delta, state, cfg, codec, rounds=1, **kw):
        f = ramp(swarm_rounds(kw["replica"].version_vector)) if kw.get("replica") is not None else 0.0
        delta.mul_((LR0 + (LR1 - LR0) * f) / cfg.outer_lr)
        cfg = dataclasses.replace(cfg, momentum=MU0 + (MU1 - MU0) * f)
        return outer_update(delta, state, cfg, codec, rounds, **kw)

    learner.outer_update = ramped


def run(job: tuple) -> dict:
    install()
    from long_run import run_one

    return run_one(job)


if __name__ == "__main__":
    from long_run import LONG_METHODS

    graced = {**LONG_METHODS["async-new"], "grace": 0.5}
    jobs = [("async-grace-0.5-ramp", graced, 50, 100, "noise", seed, False) for seed in (0, 2, 4)]
    jobs.append(("sync-ramp", LONG_METHODS["sync-new"], 50, 100, "noise", 0, False))
    with ProcessPoolExecutor(2) as pool:
        for r in pool.map(run, jobs):
            print(f"{r['method']:22s} seed {r['seed']}: {r['loss']:.4f}  round view {r['round_loss']:.4f}  "
                  f"tail {r['tail_loss']:.4f}  utilization {r['utilization']:.0%}", flush=True)
