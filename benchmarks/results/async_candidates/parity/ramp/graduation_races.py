"""Why the crowd-copied late volunteer does not graduate under timing noise (2026-11-28): per sponsor and per
volunteer update, the sponsor seqs it was judged against (`lseq`), the value the judge would give (`v`, before
the copy rule), whether a crowd copy reached that sponsor first (`copied`: then the volunteer's own slot gets no
judgment and no record there), the cosine with the sponsors' latest work, the proposal's length against a
sponsor's update, and the cosine with the sponsors' summed updates of each round. Found: the values are mostly
at or above PROVEN (0.11-0.17); the volunteer lost the copy race at nearly every sponsor (the instant crowd).

    python benchmarks/results/async_candidates/parity/ramp/graduation_races.py GRACE SEED
"""
import dataclasses
import sys

sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[5]))  # the repository root
import torch

from p2p_diloco.config import SimConfig
from p2p_diloco.sim.crowd import CrowdAttack, CrowdSwarm
from p2p_diloco.sync import sponsorship as S
from p2p_diloco.train.data.corpus import load_corpus
from tests.sim.test_graduation_swarm import STEPS, _spec

grace, seed = float(sys.argv[1]), int(sys.argv[2])
orig = S.Sponsorship.merged
samples, log = {}, []
def merged(self, author, seq, sample, step, factor=1.0, at=None):
    if self.judging and sample is not None:
        samples.setdefault((author, seq), sample.clone())
        if author not in self.sponsors:
            u = S._unit(sample)
            if u is not None:
                v, keep, copied = self._value(sample, u)
                log.append((self.self_id, author, seq, {a: None for a in self._latest}, v, copied,
                            {a: s for a, s in getattr(self, '_lseq', {}).items()}, self.graduated(author)))
        else:
            if not hasattr(self, '_lseq'):
                self._lseq = {}
            self._lseq[author] = seq
    return orig(self, author, seq, sample, step, factor, at)
S.Sponsorship.merged = merged
spec = _spec()
# as measured: a shard per unit (iid=False below) and the constant step, the defaults then
spec = dataclasses.replace(spec, outer=dataclasses.replace(spec.outer, schedule="constant"))
sim = SimConfig(iid=False, peers=3, sponsors=3, total_steps=STEPS + STEPS // 3, eval_batches=8,
                eval_every_s=float(STEPS),
                join=(f"{STEPS // 6}",), grace=grace, phase_jitter=0.15, latency_jitter_s=0.1, start_spread_s=1.0,
                timing_seed=seed)
swarm = CrowdSwarm(spec, sim, load_corpus(spec.data), CrowdAttack(10, "copy", source=3))
swarm.run()
vol = swarm.peers[3].learner.peer_id
sponsors = [p.learner.peer_id for p in swarm.peers[:3]]
def cos(a, b):
    return float(torch.dot(a, b) / (a.norm() * b.norm()))
for sp, a, s, _, v, copied, lseq, grad in log:
    if a != vol:
        continue
    p = samples[(a, s)]
    lat = torch.stack([samples[(x, lseq[x])] for x in sponsors if x in lseq]).sum(0)
    rounds = []
    base = min(lseq.values())
    for j in range(base - 1, base + 3):
        parts = [samples.get((x, j)) for x in sponsors]
        if all(x is not None for x in parts):
            rounds.append(f"{j}:{cos(p, torch.stack(parts).sum(0)):+.2f}")
    print(f"sp {sponsors.index(sp)} vol {s} lseq {[lseq.get(x) for x in sponsors]} v {v:.3f} copied {int(copied)} grad {int(grad)} cos(lat) {cos(p, lat):+.2f} |p|/|s| {float(p.norm())/float(samples[(sponsors[0], base)].norm()):.2f} |", " ".join(rounds))
