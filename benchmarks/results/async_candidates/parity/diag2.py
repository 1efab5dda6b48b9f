import sys, dataclasses, torch, json
sys.path.insert(0, "/tmp/wt27/benchmarks")
torch.set_num_threads(1)
import async_timing as at
from p2p_diloco.config import SimConfig
from p2p_diloco.sim.swarm import AsyncSwarm
from p2p_diloco.train.data.corpus import load_corpus
method = at.METHODS["async-new"] if len(sys.argv) < 3 else json.loads(sys.argv[2])
spec = at.spec_for(method)
seed = int(sys.argv[1])
sim = SimConfig(peers=4, total_steps=2000, method="async", timing_seed=seed, **{**at.NOISE, "eval_every_s": 0.2})
sw = AsyncSwarm(spec, sim, load_corpus(spec.data))
orig = sw._end_phase
log = []
def end_phase(peer, inc):
    orig(peer, inc)
    log.append((round(sw.queue.now, 2), peer.index, len(peer.learner.history)))
sw._end_phase = end_phase
r = sw.run()
print("loss", r.eval_loss)
print("publishes", log[-12:])
print("curve", [(round(c.time_s, 1), round(c.loss, 3)) for c in r.curve if c.time_s > 12])
