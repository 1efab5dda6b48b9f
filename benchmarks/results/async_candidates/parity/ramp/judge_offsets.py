"""Why the grace window keeps an honest late volunteer from graduating (2026-11-28, the scenario of
tests/sim/test_graduation_swarm.py's late volunteer): the cosine of each of its proposals with the sponsors' summed
updates of each sponsor round (the first sponsor's samples), and which sponsor rounds were its `latest` when it
was judged. Found: without a window the proposal lands after the sponsors' concurrent round (`latest` = the round
it aligns with best, cos 0.22-0.42); with grace 0.5 (lockstep) it lands just before it, so it is judged against
the round before its own work (cos 0.06-0.21), while the concurrent round (one later) gives 0.32-0.38. Sponsor
pairs: cos 0.65 for the same round, 0.15-0.2 one round apart. deferred_record.patch (beside this; not in the code)
judges each proposal a second time once every sponsor's next update is in, against both rounds, for its record
only; see the end of the log for what it did and why it is not enough.

    python benchmarks/results/async_candidates/parity/ramp/judge_offsets.py 0.5
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

grace = float(sys.argv[1])
orig = S.Sponsorship.merged
samples = {}      # at the first sponsor: (author, seq) -> sample
arrival = []      # (author, seq, {sponsor: latest seq}) at the first sponsor
first = []
def merged(self, author, seq, sample, step, factor=1.0, at=None):
    if self.judging and sample is not None:
        if not first:
            first.append(self.self_id)
        if self.self_id == first[0]:
            samples[(author, seq)] = sample.clone()
            arrival.append((author, seq))
    return orig(self, author, seq, sample, step, factor, at)
S.Sponsorship.merged = merged
spec = _spec()
# as measured: a shard per unit (iid=False below) and the constant step, the defaults then
spec = dataclasses.replace(spec, outer=dataclasses.replace(spec.outer, schedule="constant"))
sim = SimConfig(iid=False, peers=3, sponsors=3, total_steps=STEPS + STEPS // 3, eval_batches=8,
                eval_every_s=float(STEPS),
                join=(f"{STEPS // 6}",), grace=grace)
swarm = CrowdSwarm(spec, sim, load_corpus(spec.data), CrowdAttack(10, "copy", source=3))
swarm.run()
vol = swarm.peers[3].learner.peer_id
sponsors = [p.learner.peer_id for p in swarm.peers[:3]]
def cos(a, b):
    return float(torch.dot(a, b) / (a.norm() * b.norm()))
# where the volunteer's proposal arrived in the sequence: latest sponsor seqs at its arrival
latest = {}
at_arrival = {}
for a, s in arrival:
    if a in sponsors:
        latest[a] = s
    elif a == vol and (a, s) not in at_arrival:
        at_arrival[s] = dict(latest)
print("grace", grace)
for k in sorted(at_arrival):
    p = samples[(vol, k)]
    lat = at_arrival[k]
    base = min(lat.values()) if lat else 0
    row = []
    for j in range(base - 2, base + 3):
        parts = [samples.get((s, j)) for s in sponsors]
        if all(x is not None for x in parts):
            row.append(f"{j}:{cos(p, torch.stack(parts).sum(0)):+.3f}")
    cur = torch.stack([samples[(s, lat[s])] for s in sponsors if s in lat]).sum(0) if lat else None
    print(f"vol seq {k} latest {[lat.get(s) for s in sponsors]} cos(latest) {cos(p, cur) if cur is not None else 0:+.3f} |", " ".join(row))
# sponsor-vs-sponsor for reference: cos(U_a,j, U_b,j+d)
for d in (-1, 0, 1):
    vals = []
    for j in range(3, 30):
        for a in sponsors:
            for b in sponsors:
                if a != b and (a, j) in samples and (b, j + d) in samples:
                    vals.append(cos(samples[(a, j)], samples[(b, j + d)]))
    if vals:
        vals.sort()
        print(f"sponsor pairs offset {d}: median {vals[len(vals)//2]:+.3f} n {len(vals)}")
