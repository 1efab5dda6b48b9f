"""Print, per volunteer seq, how many of the 3 sponsors carried it as a member's, for the two timing-noise rows."""
import dataclasses, sys, json
sys.path.insert(0, '.')
from tests.sim.test_graduation_swarm import _spec, STEPS
from p2p_diloco.config import SimConfig
from p2p_diloco.sim.crowd import CrowdAttack, CrowdSwarm
from p2p_diloco.train.data.corpus import load_corpus

def row(name, timing, attack):
    spec = _spec()
    sim = dataclasses.replace(timing, peers=3, sponsors=3, total_steps=STEPS + STEPS // 3, eval_batches=8,
                              eval_every_s=float(STEPS))
    swarm = CrowdSwarm(spec, sim, load_corpus(spec.data), attack)
    summary = swarm.honest_summary(swarm.run())
    volunteer = swarm.peers[3].learner.peer_id
    every = swarm.relayed_by_seq(volunteer)
    carried = {seq: sum(s > 0 for s in shares) for seq, shares in sorted(every.items())}
    print(name, 'loss', round(summary['eval_loss'], 4), 'div', summary['divergence'], 'carried', carried, flush=True)

seeds = [int(s) for s in (sys.argv[1:] or ['0'])]
for seed in seeds:
    base = dict(join=(f"{STEPS // 6}",), grace=0.5, phase_jitter=0.15, latency_jitter_s=0.1, start_spread_s=1.0)
    try:
        base['timing_seed'] = seed
        SimConfig(**base)
    except TypeError:
        base.pop('timing_seed')
    row(f'causal s{seed}', SimConfig(**base), CrowdAttack(10, "copy", source=3, causal=True))
    row(f'adj10 s{seed}', SimConfig(**base, bandwidth_mbps=10.0), CrowdAttack(10, "copy", source=3, adjacent=True))
