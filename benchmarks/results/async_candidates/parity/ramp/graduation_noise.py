"""Is the grace window what keeps the crowd-copied late volunteer from graduating? (2026-11-28) The scenario of
tests/sim/test_graduation_swarm.py's first test (3 sponsors, a volunteer joining at 100 s, 10 identities copying
each of its updates), but under timing noise (phase jitter 15%, latency jitter 0.1 s, starts spread over 1 s;
the test has none, so its phase offsets are fixed: without a window the volunteer's proposals land 0.1 s after
the sponsors' concurrent round, with one 0.2 s before it). Prints, per run, the first of the volunteer's seqs
each sponsor relayed as a member's (null: none of its 7), how many copiers graduated anywhere, the honest eval
loss and the replicas' divergence.

    python benchmarks/results/async_candidates/parity/ramp/graduation_noise.py GRACE SEED [everyone] [causal]

`everyone`: the window as it was before a run with sponsors waited only for sponsors (everyone awaits everyone).
`causal`: the crowd copies only what it has received (sim/crowd.py `CrowdAttack.causal`); without it its copies
leave the instant the volunteer publishes.
"""
import dataclasses
import json
import sys

sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[5]))  # the repository root
import p2p_diloco.train.grace as G
import p2p_diloco.train.loop as L
from p2p_diloco.config import SimConfig
from p2p_diloco.sim.crowd import CrowdAttack, CrowdSwarm
from p2p_diloco.train.data.corpus import load_corpus
from tests.sim.test_graduation_swarm import STEPS, _spec

grace, seed = float(sys.argv[1]), int(sys.argv[2])
extra = sys.argv[3:]
if "everyone" in extra:
    L.awaited = lambda vv, me, live=0, sponsors=(): G.awaited(vv, me, live)
spec = _spec()
# as measured: a shard per unit (iid=False below) and the constant step, the defaults then
spec = dataclasses.replace(spec, outer=dataclasses.replace(spec.outer, schedule="constant"))
sim = SimConfig(iid=False, peers=3, sponsors=3, total_steps=STEPS + STEPS // 3, eval_batches=8,
                eval_every_s=float(STEPS),
                join=(f"{STEPS // 6}",), grace=grace, phase_jitter=0.15, latency_jitter_s=0.1, start_spread_s=1.0,
                timing_seed=seed)
swarm = CrowdSwarm(spec, sim, load_corpus(spec.data), CrowdAttack(10, "copy", source=3, causal="causal" in extra))
summary = swarm.honest_summary(swarm.run())
by_seq = swarm.relayed_by_seq(swarm.peers[3].learner.peer_id)
first = [min((s for s, shares in by_seq.items() if shares[i] > 0), default=None) for i in range(3)]
crowd = {identity.peer_id for identity in swarm.crowd}
copiers = sum(len(set(p.learner.replica.standing.sponsorship.graduates) & crowd) for p in swarm.peers[:3])
print(json.dumps({"grace": grace, "window": "everyone" if "everyone" in extra else "sponsors", "seed": seed,
                  "crowd": "causal" if "causal" in extra else "instant",
                  "member_from": first, "copiers_graduated": copiers, "eval_loss": round(summary["eval_loss"], 4),
                  "divergence": summary["divergence"]}))
