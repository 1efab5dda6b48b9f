"""What the ramp's looser norm bound lets one attacker do (2026-11-28): the bound follows the outer schedule's worst
end (`OuterConfig.peak_gain`), 3.5x the constant step's, so an attacker that sends every coordinate just under it
moves theta 3.5x further per update. One of 4 peers (the `test` preset, H=50, 500 steps a unit, the default
defence, a shard per unit) sends its honest payload x100 (or x-100: negated) capped under the bound (sim/adversary.py
`bounded`), under `outer.schedule` constant and ramp, with the clean runs beside them. Losses: the honest replicas.

    python benchmarks/results/async_candidates/parity/ramp/bound_attack.py
"""

import dataclasses
from concurrent.futures import ProcessPoolExecutor


def run(job: tuple) -> dict:
    import logging

    import torch

    torch.set_num_threads(1)
    logging.getLogger("p2p_diloco").setLevel(logging.ERROR)
    from p2p_diloco.config import SimConfig, preset
    from p2p_diloco.sim.adversary import Adversary, HostileSwarm, Hostility
    from p2p_diloco.train.data.corpus import load_corpus

    schedule, factor = job
    spec = preset("test")
    spec = dataclasses.replace(spec, inner=dataclasses.replace(spec.inner, inner_steps=50, decay_steps=500),
                               outer=dataclasses.replace(spec.outer, schedule=schedule))
    sim = SimConfig(peers=4, total_steps=2000, step_time_s=1.0, latency_s=0.05, iid=False, grace=0.0)  # as measured
    adversaries = [Adversary(3, Hostility.SCALE, factor=factor, bounded=True)] if factor else []
    swarm = HostileSwarm(spec, sim, load_corpus(spec.data), adversaries)
    summary = swarm.honest_summary(swarm.run())
    return {"schedule": schedule, "factor": factor, **{k: summary[k] for k in ("eval_loss", "divergence")}}


if __name__ == "__main__":
    jobs = [(s, f) for f in (0, 100.0, -100.0) for s in ("constant", "ramp")]
    with ProcessPoolExecutor(2) as pool:
        for r in pool.map(run, jobs):
            print(f"schedule {r['schedule']:8s} attack x{r['factor']:+6.0f} (bounded): honest loss "
                  f"{r['eval_loss']:.4f}  divergence {r['divergence']:.1e}", flush=True)
