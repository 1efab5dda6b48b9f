"""Driver for BENCHMARKS.md "Judged where nobody can aim" (run from the repository root): rows of
bench_crowd_poison.run_one, 3 honest sponsors + 3 hostile trainers. Usage: python <this> OUT.json ATTACK[,ATTACK...]
(spike_variants.py: no arguments)."""
import sys, json
sys.path.insert(0, 'benchmarks')
from concurrent.futures import ProcessPoolExecutor
import bench_crowd_poison as b
from p2p_diloco.sim.adversary import Hostility

def job(args):
    frac, sign, seed = args
    import torch
    import p2p_diloco.sim.adversary as adv
    if sign == "negated":
        def spiked(honest, theta, fraction, bound):
            g = torch.Generator().manual_seed(0x5B1CE)
            at = torch.randperm(honest.numel(), generator=g)[:max(1, round(fraction * honest.numel()))]
            out = honest.clone()
            out[at] = -0.99 * bound * torch.where(honest[at] >= 0, 1.0, -1.0)
            return out
        adv.spiked = spiked
    b.ATTACKS["x"] = b.Attack(factor=frac, hostile=Hostility.SPIKE)
    r = b.run_one(dict(preset='test', peers=3, inner_steps=20, steps_per_peer=200, crowd=3, attack="x",
                       defence='sponsors', seed=seed, iid=False))
    return frac, sign, seed, round(r['eval_loss'], 4)

jobs = [(f, s, seed) for f in (0.0003, 0.003, 0.03, 0.1) for s in ("away", "negated") for seed in (0,)]
with ProcessPoolExecutor(2) as ex:
    for row in ex.map(job, jobs):
        print(*row, flush=True)
