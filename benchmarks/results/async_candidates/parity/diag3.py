import sys, torch, json
sys.path.insert(0, "/tmp/wt27/benchmarks")
torch.set_num_threads(1)
import async_timing as at
from p2p_diloco.config import SimConfig
import p2p_diloco.sim.swarm as swm
from p2p_diloco.train.data.corpus import load_corpus
class PerUnit(swm.TokenBudget):
    def __init__(self, swarm):
        super().__init__(swarm); self.used = 0
    def admit(self):
        H = self.swarm.spec.inner.inner_steps
        if self.used + H > self.swarm.sim.total_steps // self.swarm.sim.peers: return False
        self.used += H; self.swarm.steps_started += H; return True
swm.TokenBudget = PerUnit
method = at.METHODS["async-new"] if len(sys.argv) < 3 else json.loads(sys.argv[2])
spec = at.spec_for(method)
for seed in map(int, sys.argv[1].split(",")):
    sim = SimConfig(peers=4, total_steps=2000, method="async", timing_seed=seed, **at.NOISE)
    r = swm.AsyncSwarm(spec, sim, load_corpus(spec.data)).run()
    print("seed", seed, "loss", round(r.eval_loss, 4), flush=True)
