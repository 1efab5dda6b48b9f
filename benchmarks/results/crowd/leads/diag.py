import dataclasses, sys
sys.path.insert(0, '.')
from tests.sim.test_graduation_swarm import _spec, STEPS
from p2p_diloco.config import SimConfig
from p2p_diloco.sim.crowd import CrowdAttack, CrowdSwarm
from p2p_diloco.train.data.corpus import load_corpus
import p2p_diloco.sync.sponsorship as sp
from p2p_diloco.sync import echoes
log = []
orig_worths = sp.Sponsorship._worths
def worths(self, samples, direction=None, own=lambda i: []):
    if False:
        published = __import__('torch').stack(list(self._latest.now.values()))
        hits = echoes.echoing(samples, self._fresh, published, sp.ECHO_OF)
        for i, a in enumerate(authors):
            if hits[i]:
                slots = self._latest.own(a)
                rows = self._window.rows_of(slots)
                wa = [(s.seq, s.round) for s in self._window.seen if s.author == a]
                log.append((self.self_id[-5:], a[-5:], self._round, sorted((x[0][-5:], x[1]) for x in slots), len(rows), wa,
                            {k[-5:]: sorted((x[0][-5:], x[1]) for x in v) for k, v in self._latest.carried.items()}))
    return orig_worths(self, samples, direction, own)
sp.Sponsorship._worths = worths
import torch
orig_eb = sp.echoing_beside
def eb(samples, fresh, published, near, own):
    hits0 = echoes.echoing(samples, fresh, published, near)
    hits = orig_eb(samples, fresh, published, near, own)
    for i in range(len(hits)):
        if hits0[i]:
            mine = own(i)
            s0 = echoes.new_parts(samples[i:i+1], fresh); p0 = echoes.new_parts(published, fresh)
            c0 = ((s0 @ p0.T).abs() / s0.norm() / p0.norm(dim=1)).tolist()
            c1 = None
            if mine:
                basis = echoes.orthonormal([*(f.clone() for f in fresh), *[m.clone() for m in mine]])
                s1 = echoes.new_parts(samples[i:i+1], basis); p1 = echoes.new_parts(published, basis)
                c1 = ((s1 @ p1.T).abs() / s1.norm() / p1.norm(dim=1)).tolist()
            log.append((len(mine), hits[i], [round(x, 3) for x in c0[0]], c1 and [round(x, 3) for x in c1[0]]))
    return hits
sp.echoing_beside = eb
spec = _spec()
timing = SimConfig(join=(f"{STEPS // 6}",), grace=0.5, phase_jitter=0.15, latency_jitter_s=0.1, start_spread_s=1.0)
sim = dataclasses.replace(timing, peers=3, sponsors=3, total_steps=STEPS + STEPS // 3, eval_batches=8,
                          eval_every_s=float(STEPS))
swarm = CrowdSwarm(spec, sim, load_corpus(spec.data), CrowdAttack(10, "copy", source=3, causal=True))
swarm.run()
vol = swarm.peers[3].learner.peer_id
print('volunteer', vol[-5:])
for p in swarm.peers[:3]:
    s = p.learner.replica.standing.sponsorship
    print(p.learner.peer_id[-5:], {seq: (round(v, 3), round(k, 3)) for (a, seq), (v, k) in s.judged.items() if a == vol})
for entry in log:
    print(entry)
