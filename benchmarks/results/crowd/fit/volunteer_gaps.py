"""Diagnostic behind BENCHMARKS "Fit checks": bench_graduation's `volunteer` row (test preset, H=20, a file shard
per unit, 10 identities racing copies of the volunteer), with every fit check the sponsors make printed: the
gap, and the loss change the step makes on the first 4 batches of the phase it declares (its shard's loss level
beside it). Run from the repository root:

    python benchmarks/results/crowd/fit/volunteer_gaps.py SEED [FIT_SHARE]
"""

import dataclasses
import sys

import torch

import p2p_diloco.train.fit as F
from p2p_diloco.config import DefenceConfig, SimConfig, preset
from p2p_diloco.sim.crowd import CrowdAttack, CrowdSwarm
from p2p_diloco.train.data.corpus import evaluate, load_corpus
from p2p_diloco.train.models.build import load_flat_params

_gap = F.FitJudge.gap


def gap(self, position, sampler, step, theta):  # noqa: ANN001, ANN201
    g = _gap(self, position, sampler, step, theta)
    first = [sampler.batch(position.first_step + i) for i in range(4)]
    load_flat_params(self.model, theta)
    before = evaluate(self.model, first)
    load_flat_params(self.model, theta - step)
    after = evaluate(self.model, first)
    print(f"check at {tuple(position)}: gap {g:+.4f}, dL on the phase's first 4 batches {before - after:+.4f}, "
          f"their loss {before:.3f}, |step| {float(step.norm()):.3f}", flush=True)
    return g


F.FitJudge.gap = gap
seed, steps = int(sys.argv[1]), 600
F.FIT_SHARE = float(sys.argv[2]) if len(sys.argv) > 2 else 0.25
torch.set_num_threads(1)
base = dataclasses.replace(preset("test"), seed=seed)
spec = dataclasses.replace(base, inner=dataclasses.replace(base.inner, inner_steps=20, decay_steps=steps // 3),
                           defence=DefenceConfig())
sim = SimConfig(peers=3, sponsors=3, total_steps=steps + steps // 3, eval_batches=8, eval_every_s=float(steps),
                join=(f"{steps // 6}",), iid=False)
swarm = CrowdSwarm(spec, sim, load_corpus(spec.data), CrowdAttack(10, "copy", source=3))
print("eval", swarm.honest_summary(swarm.run())["eval_loss"])
