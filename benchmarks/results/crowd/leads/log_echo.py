"""Log, for every judgment the echo test makes, the |cos| of the proposal's new part with each sponsor's latest
update's new part (plain) and with that update's part outside the other sponsors' new parts (unique), with the
author's label. Usage: python log_echo.py OUT.json grad:<preset>:<row>:<seed> | crowd:<preset>:<attack>:<k>:<seed>"""
import json, sys
sys.path.insert(0, '/work/main/benchmarks')
import torch
import p2p_diloco.sync.sponsorship as sp
from p2p_diloco.sync import echoes
from p2p_diloco.sim import crowd as crowd_mod

current: list[str] = []
records: list[dict] = []
orig_judge, orig_single = sp.Sponsorship.judge, sp.Sponsorship._judge


def judge(self, cur=None):
    current[:] = [p.author for p in self._pending]
    return orig_judge(self, cur)


def single(self, author, seq, *a, **kw):
    if kw.get('judged') is None and (len(a) < 7 or a[6] is None):
        current[:] = [author]
    return orig_single(self, author, seq, *a, **kw)


sp.Sponsorship.judge, sp.Sponsorship._judge = judge, single


def unit_rows(x):
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)


orig_echoing = sp.echoing


def echoing(samples, fresh, published, near):
    hits = orig_echoing(samples, fresh, published, near)
    s = echoes.new_parts(samples, fresh)
    p = echoes.new_parts(published, fresh)
    plain = (unit_rows(s) @ unit_rows(p).T)
    uniq = []
    for j in range(len(p)):
        others = [p[k].clone() for k in range(len(p)) if k != j]
        u = echoes.without(p[j].clone(), echoes.orthonormal(others)) if others else p[j].clone()
        uniq.append(u)
    uniq = torch.stack(uniq)
    unique = (unit_rows(s) @ unit_rows(uniq).T).abs()
    share = (uniq.norm(dim=1) / p.norm(dim=1).clamp_min(1e-30))
    basis = echoes.orthonormal([x.clone() for x in p])
    if basis:
        B = torch.stack(basis)
        sP = (s @ B.T) @ B
        align = (unit_rows(sP) @ unit_rows(p).T).abs()
        inplane = sP.norm(dim=1) / s.norm(dim=1).clamp_min(1e-30)
    else:
        align = torch.zeros(len(s), len(p)); inplane = torch.zeros(len(s))
    for i in range(len(samples)):
        records.append(dict(author=current[i] if i < len(current) else '?', hit=bool(hits[i]),
                            plain=[round(x, 4) for x in plain[i].tolist()],
                            unique=[round(x, 4) for x in unique[i].tolist()],
                            share=[round(x, 3) for x in share.tolist()],
                            align=[round(x, 4) for x in align[i].tolist()], inplane=round(float(inplane[i]), 4),
                            rank=len(basis)))
    return hits


sp.echoing = echoing
labels = {}
orig_hs = crowd_mod.CrowdSwarm.honest_summary


def hs(self, result):
    sponsors = set(self.spec.defence.sponsors) if hasattr(self, 'spec') else set()
    for p in self.peers:
        pid = p.learner.peer_id
        labels[pid] = 'sponsor' if pid in sponsors else ('hostile' if p.index in getattr(self, 'adversaries', {}) else 'honest')
    for c in getattr(self, 'crowd', []):
        labels[c.peer_id] = 'crowd'
    return orig_hs(self, result)


crowd_mod.CrowdSwarm.honest_summary = hs
out, spec = sys.argv[1], sys.argv[2].split(':')
if spec[0] == 'grad':
    import bench_graduation as bg
    r = bg.run_one(dict(row=spec[2], seed=int(spec[3]), steps=600, preset=spec[1]))
else:
    import bench_crowd_poison as bc
    r = bc.run_one(dict(preset=spec[1], peers=3, inner_steps=20, steps_per_peer=200, crowd=int(spec[3]),
                        attack=spec[2], defence='sponsors', seed=int(spec[4]), iid=False, adjacent=False))
for rec in records:
    rec['label'] = labels.get(rec['author'], '?')
json.dump(dict(row=sys.argv[2], loss=r['eval_loss'], records=records), open(out, 'w'))
print(sys.argv[2], r['eval_loss'], len(records), flush=True)
