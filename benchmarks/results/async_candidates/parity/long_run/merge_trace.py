"""Where does the async long run's final jump come from? Logs the eval loss at peer 0 after every merge, and after
every phase end, in the last 4% of a 100-round run (H=50, timing noise, `test` preset, async default). An ad-hoc
trace (it wraps AsyncSwarm's methods), kept with its logs (merge_trace_seed0.log, _seed2.log); 2026-11-28.

    python benchmarks/results/async_candidates/parity/long_run/merge_trace.py SEED [ROUNDS]
"""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))
from async_timing import NOISE  # noqa: E402

from p2p_diloco.config import SimConfig, preset  # noqa: E402
from p2p_diloco.sim import swarm as S  # noqa: E402
from p2p_diloco.sim.runner import simulate  # noqa: E402

torch.set_num_threads(1)
seed = int(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 100
H = 50
spec = preset("test")
spec = dataclasses.replace(spec, inner=dataclasses.replace(spec.inner, inner_steps=H, decay_steps=rounds * H),
                           outer=dataclasses.replace(spec.outer, schedule="constant"))  # as measured: the defaults then
total = rounds * 4 * H
sim = SimConfig(peers=4, total_steps=total, method="async", timing_seed=seed, iid=False, grace=0.0,
                eval_every_s=rounds * H * NOISE["step_time_s"] / 25, **NOISE)
receive, end_phase = S.AsyncSwarm._receive, S.AsyncSwarm._end_phase


def traced_receive(self, peer, data):
    before = peer.learner.replica.version_vector
    receive(self, peer, data)
    if peer.index == 0 and self.steps_published > 0.96 * total and peer.learner.replica.version_vector != before:
        print("merge", round(self.queue.now, 1), peer.learner.evaluate(self.eval_set), flush=True)


def traced_end_phase(self, peer, incarnation):
    end_phase(self, peer, incarnation)
    if self.steps_published > 0.96 * total:
        print("end_phase", peer.index, round(self.queue.now, 1), "steps_started", self.steps_started,
              "loss@0", self.peers[0].learner.evaluate(self.eval_set), flush=True)


S.AsyncSwarm._receive, S.AsyncSwarm._end_phase = traced_receive, traced_end_phase
result = simulate(spec, sim)
print("final", result.eval_loss, [(p.index, p.steps) for p in result.peers])
