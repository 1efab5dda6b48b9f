"""The raw values (cosine x length cap, before the 0.1 floor) each sponsor gave the late volunteer of
bench_graduation.py's `volunteer` row (`test`, file shards, seeds 0 and 1), and whether the echo test flagged it.
    python benchmarks/results/crowd/crowding/volunteer_values.py
"""
import sys, collections
ROOT = __import__("pathlib").Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "benchmarks")); sys.path.insert(0, str(ROOT))
import p2p_diloco.sync.sponsorship as sp
orig_worths, orig_judge = sp.worths, sp.Sponsorship.judge
STATE = {"authors": None}
RAW = collections.defaultdict(list)
def worths(samples, fresh, directions, length, share, floor=0.0, echoes=None):
    out = orig_worths(samples, fresh, directions, length, share, floor, echoes)
    raw = orig_worths(samples, fresh, directions, length, share, -1.0, None)
    authors = STATE["authors"] or ["?"] * len(out)
    for a, (v, _), (rv, _), e in zip(authors, out, raw, echoes or [False] * len(out)):
        RAW[a].append((round(rv, 3), bool(e)))
    return out
def judge(self, current=None):
    STATE["authors"] = [(self.self_id, p.author, p.seq) for p in self._pending]
    try:
        return orig_judge(self, current)
    finally:
        STATE["authors"] = None
sp.worths, sp.Sponsorship.judge = worths, judge
import bench_graduation as bg
from p2p_diloco.sim.crowd import CrowdSwarm
orig_run = CrowdSwarm.run
def run(self):
    r = orig_run(self)
    vol = self.peers[3].learner.peer_id
    for (sponsor, author, seq), vals in sorted(((k, v) for k, v in RAW.items() if k != "?" and k[1] == vol), key=lambda kv: (kv[0][0], kv[0][2])):
        print(sponsor[-6:], "seq", seq, vals)
    return r
CrowdSwarm.run = run
for seed in (0, 1):
    RAW.clear()
    out = bg.run_one({"row": "volunteer", "seed": seed, "steps": 600, "preset": "test"})
    print("seed", seed, out["eval_loss"], out["relayed_by_seq"])
