"""Diagnostic behind BENCHMARKS "The lift": how often honest work is judged not to teach its stream when it is
stale (trained from theta as it was k of the judge's phases ago: a slow peer, or one back from a pause). A judge
trains on file shard 0 of 3 (`test` preset, H = 20) phase after phase; an honest author trains one phase on shard
2 (a shard the judge has not learned) or shard 1 (one like the judge's) from the judge's theta k phases back, and
the judge checks it at its current theta against its own last step (train/fit.py, 4 unseen batches a check, as
a sponsor does). Run from the repository root:

    python benchmarks/results/crowd/fit/lift_stale.py
"""

import dataclasses

import torch

from p2p_diloco.config import preset
from p2p_diloco.train.data.corpus import load_corpus
from p2p_diloco.train.fit import FitJudge
from p2p_diloco.train.inner import inner_step, make_inner_optimizer
from p2p_diloco.train.models.build import build_model, flat_params, load_flat_params
from p2p_diloco.train.phase import make_sampler
from p2p_diloco.wire.identity import Identity
from p2p_diloco.wire.position import DataPosition

SPEC = preset("test")
H, SHARDS, PHASES, DRAWS = SPEC.inner.inner_steps, 3, 24, 6
torch.manual_seed(0)
torch.set_num_threads(1)
corpus = load_corpus(SPEC.data)
model = build_model(SPEC.model, SPEC.seed)


def phase(start: torch.Tensor, shard: int, first: int) -> torch.Tensor:
    """One phase of H inner steps on file shard `shard` from `start`: its step (start - end)."""
    load_flat_params(model, start)
    sampler = make_sampler(corpus, SPEC, "", shard=shard, num_shards=SHARDS)
    opt = make_inner_optimizer(model, SPEC.inner)
    for step in range(first, first + H):
        inner_step(model, opt, *sampler.batch(step), 0, SPEC.inner, lr=SPEC.inner.lr)
    return start - flat_params(model)


thetas = [flat_params(model).clone()]
steps = []
for k in range(PHASES):  # the judge's own run on shard 0
    steps.append(phase(thetas[-1], 0, k * H))
    thetas.append(thetas[-1] - steps[-1])
me = Identity.generate().peer_id
spec = dataclasses.replace(SPEC, defence=dataclasses.replace(SPEC.defence, sponsors=(me,)))
judge = FitJudge.for_sponsor(build_model(SPEC.model, SPEC.seed), corpus, spec, 7, me, share=0.05)
assert judge is not None
for shard in (2, 1):
    for stale in (0, 1, 2, 4, 8):
        passed, lifts = 0, []
        for d in range(DRAWS):
            now = PHASES - d  # judged at theta after the judge's phase `now`, its own step that phase's
            work = phase(thetas[now - stale], shard, 1000 + 37 * d)
            judge.credit = 1e9
            ok = judge.fits("author", tuple(DataPosition(1000, H, shard, SHARDS, 0)), work, thetas[now],
                            steps[now - 1])
            lift, loss = judge.lift(judge.sampler_for("", DataPosition(1000, H, shard, SHARDS, 0)),
                                    work * min(1.0, float(steps[now - 1].norm() / work.norm())), steps[now - 1],
                                    thetas[now])
            passed += int(bool(ok))
            lifts.append(lift / loss)
        print(f"shard {shard} stale by {stale} phases: fits {passed}/{DRAWS}, lift/loss "
              f"{min(lifts):+.2%} .. {max(lifts):+.2%}", flush=True)
