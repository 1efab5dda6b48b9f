import sys, dataclasses, torch
sys.path.insert(0, "/tmp/wt27/benchmarks")
torch.set_num_threads(1)
import async_timing as at
from p2p_diloco.config import SimConfig
from p2p_diloco.sim.swarm import AsyncSwarm
from p2p_diloco.train.data.corpus import load_corpus
import json
method = at.METHODS["async-new"] if len(sys.argv) < 3 else json.loads(sys.argv[2])
spec = at.spec_for(method)
for seed in map(int, sys.argv[1].split(",")):
    sim = SimConfig(peers=4, total_steps=2000, method="async", timing_seed=seed, **at.NOISE)
    sw = AsyncSwarm(spec, sim, load_corpus(spec.data))
    r = sw.run()
    print("seed", seed, "loss", round(r.eval_loss, 4))
    for p in sw.peers:
        h = p.learner.history
        print("  peer", p.index, "steps", p.learner.step, "rounds", len(h), "taus", [x["tau"] for x in h], "w", [round(x["weight"], 3) for x in h])
    print("  curve", [(round(c.time_s, 1), round(c.loss, 3)) for c in r.curve[-8:]])
