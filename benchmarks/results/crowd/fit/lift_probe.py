"""Diagnostic behind tests/train/test_fit.py and BENCHMARKS "Fit checks": the lift (train/fit.py) of one honest phase
on each file shard, after a judge trained on shard 0 (warm steps) and took one more phase there. Run from the
repository root: python benchmarks/results/crowd/fit/lift_probe.py"""
import torch, dataclasses
from p2p_diloco.config import preset
from p2p_diloco.train.data.corpus import load_corpus, evaluate
from p2p_diloco.train.fit import FitJudge
from p2p_diloco.train.inner import inner_step, make_inner_optimizer
from p2p_diloco.train.models.build import build_model, flat_params, load_flat_params
from p2p_diloco.train.phase import make_sampler
from p2p_diloco.wire.position import DataPosition
from p2p_diloco.wire.identity import Identity
SPEC = preset("test"); H = SPEC.inner.inner_steps
torch.manual_seed(0)
corpus = load_corpus(SPEC.data)
model = build_model(SPEC.model, SPEC.seed)
for NS in (3, 4):
  for warmsteps in (2*H, 6*H):
    load_flat_params(model, flat_params(build_model(SPEC.model, SPEC.seed)))
    warm = make_sampler(corpus, SPEC, "", shard=0, num_shards=NS)
    opt = make_inner_optimizer(model, SPEC.inner)
    for step in range(warmsteps):
        inner_step(model, opt, *warm.batch(step), 0, SPEC.inner, lr=SPEC.inner.lr)
    theta0 = flat_params(model).clone()
    def trained(shard, first, start):
        load_flat_params(model, start); s = make_sampler(corpus, SPEC, "", shard=shard, num_shards=NS)
        o = make_inner_optimizer(model, SPEC.inner)
        for st in range(first, first+H): inner_step(model, o, *s.batch(st), 0, SPEC.inner, lr=SPEC.inner.lr)
        return start - flat_params(model)
    own = trained(0, warmsteps, theta0); theta = theta0 - own
    me = Identity.generate().peer_id
    spec = dataclasses.replace(SPEC, defence=dataclasses.replace(SPEC.defence, sponsors=(me,)))
    judge = FitJudge.for_sponsor(build_model(SPEC.model, SPEC.seed), corpus, spec, 1, me, share=0.05); judge.batches=8
    for sh in range(NS):
        samp = judge.sampler_for("", DataPosition(100, H, sh, NS, 0))
        work = trained(sh, 100, theta)
        l, L = judge.lift(samp, work * min(1.0, float(own.norm()/work.norm())), own, theta)
        print(f"NS={NS} warm={warmsteps} shard {sh}: loss {L:.3f} lift {l:+.4f} ({l/L:+.2%}) |work|/|own| {float(work.norm()/own.norm()):.2f}", flush=True)
