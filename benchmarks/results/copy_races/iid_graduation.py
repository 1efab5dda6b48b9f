"""Do copiers graduate when every unit reads its own stream over the whole split? (2026-11-29) The scenario of
tests/sim/test_graduation_swarm.py (3 sponsors, an honest volunteer joining at 100 s, 10 identities copying each of
its updates), with a file shard per unit (as the test and every earlier measurement) or IID streams (the
simulator's and a real peer's default since 2026-11-29; token datasets always read that way). Prints, per run, the
first of the volunteer's seqs each sponsor relayed as a member's (null: none), how many (sponsor, copier) pairs
graduated, what the sponsors relayed of the crowd's copies against the volunteer's own work, and the honest eval
loss.

    python benchmarks/results/copy_races/iid_graduation.py shards|iid instant|causal SEED|fixed

`fixed`: the test's own timing (no noise, no window); a seed: timing noise (phase jitter 15%, latency jitter
0.1 s, starts spread over 1 s) with the grace window of 0.5.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root
from p2p_diloco.config import SimConfig  # noqa: E402
from p2p_diloco.sim.crowd import CrowdAttack, CrowdSwarm  # noqa: E402
from p2p_diloco.train.data.corpus import load_corpus  # noqa: E402
from tests.sim.test_graduation_swarm import STEPS, _spec  # noqa: E402

layout, crowd_kind, timing = sys.argv[1], sys.argv[2], sys.argv[3]
spec = _spec()
noise = {} if timing == "fixed" else dict(grace=0.5, phase_jitter=0.15, latency_jitter_s=0.1, start_spread_s=1.0,
                                          timing_seed=int(timing))
sim = SimConfig(peers=3, sponsors=3, total_steps=STEPS + STEPS // 3, eval_batches=8, eval_every_s=float(STEPS),
                join=(f"{STEPS // 6}",), iid=layout == "iid", **({"grace": 0.0} | noise))
swarm = CrowdSwarm(spec, sim, load_corpus(spec.data), CrowdAttack(10, "copy", source=3, causal=crowd_kind == "causal"))
summary = swarm.honest_summary(swarm.run())
volunteer = swarm.peers[3].learner.peer_id
by_seq = swarm.relayed_by_seq(volunteer)
first = [min((s for s, shares in by_seq.items() if shares[i] > 0), default=None) for i in range(3)]
crowd = {identity.peer_id for identity in swarm.crowd}
graduated = sum(len(set(p.learner.replica.standing.sponsorship.graduates) & crowd) for p in swarm.peers[:3])
relayed = [p.learner.replica.standing.sponsorship.relayed for p in swarm.peers[:3]]
print(json.dumps({"data": layout, "crowd": crowd_kind, "timing": timing, "member_from": first,
                  "copier_graduations": graduated,
                  "relayed_crowd": [round(sum(r.get(a, 0.0) for a in crowd), 3) for r in relayed],
                  "relayed_volunteer": [round(r.get(volunteer, 0.0), 3) for r in relayed],
                  "eval_loss": round(summary["eval_loss"], 4), "divergence": summary["divergence"]}), flush=True)
