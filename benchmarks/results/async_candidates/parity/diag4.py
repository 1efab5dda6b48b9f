import sys, torch, json
sys.path.insert(0, "/tmp/wt27/benchmarks")
torch.set_num_threads(1)
import async_timing as at
from p2p_diloco.config import SimConfig
from p2p_diloco.sim.runner import simulate
from p2p_diloco.train.data.corpus import load_corpus
spec = at.spec_for(at.METHODS["async-new"])
corpus = load_corpus(spec.data)
for label, over in [("nospread", {"start_spread_s": 0.0}), ("lat0.05", {"latency_s": 0.05, "latency_jitter_s": 0.0}), ("nojit", {"phase_jitter": 0.0})]:
    ls = []
    for seed in range(4):
        sim = SimConfig(peers=4, total_steps=2000, method="async", timing_seed=seed, **{**at.NOISE, **over})
        ls.append(round(simulate(spec, sim, corpus).eval_loss, 4))
    print(label, ls, flush=True)
