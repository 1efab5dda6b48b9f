"""Why the grace window stays off by default (2026-11-28): with it on in the simulator, the sponsors' judge valued
an honest late volunteer's work below PROVEN (0.1), and it never graduated (tests/sim/test_graduation_swarm.py
`test_a_late_volunteer_copied_by_a_crowd_is_relayed_as_a_member_from_its_third_update`, the same scenario). Prints,
for each of the volunteer's updates judged at each sponsor: (sponsor, author, seq, value, copied, graduated, the
cosine with the sponsors' latest work, the length cap). Ad hoc: it wraps Sponsorship.merged to log.

    python benchmarks/results/async_candidates/parity/ramp/grace_graduation.py 0     # no window
    python benchmarks/results/async_candidates/parity/ramp/grace_graduation.py 0.5   # grace 0.5
"""
import dataclasses
import sys

sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[5]))  # the repository root
from p2p_diloco.config import SimConfig
from p2p_diloco.sim.crowd import CrowdAttack, CrowdSwarm
from p2p_diloco.sync import sponsorship as S
from p2p_diloco.train.data.corpus import load_corpus
from tests.sim.test_graduation_swarm import STEPS, _spec

grace = float(sys.argv[1])
orig = S.Sponsorship.merged
log = []
def merged(self, author, seq, sample, step, factor=1.0, at=None):
    if self.judging and author not in self.sponsors and sample is not None:
        u = S._unit(sample)
        if u is not None:
            v = self._value(sample, u)
            import torch
            latest = list(self._latest.values())
            if latest and self.self_id in self._latest:
                own = torch.stack(latest).sum(0)
                length = sum(float(x.norm()) for x in latest) / len(latest)
                if self._own_length > 0:
                    length = min(length, self._own_length)
                cos = float(torch.dot(sample, own)) / (float(sample.norm()) * float(own.norm()))
                cap = min(1, length / float(sample.norm()))
                log.append((self.self_id[-4:], author[-4:], seq, round(v[0], 3), v[2], self.graduated(author),
                            'cos', round(cos, 3), 'cap', round(cap, 3), 'nlatest', len(latest)))
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
vol = swarm.peers[3].learner.peer_id[-4:]
for entry in log:
    if entry[1] == vol:
        print(entry)
crowd = [entry for entry in log if entry[1] != vol]
print("crowd entries", len(crowd), "copied", sum(1 for entry in crowd if entry[4]))
