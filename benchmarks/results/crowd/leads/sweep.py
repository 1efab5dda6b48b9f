"""echo_soft's cosine swept at K identities: python sweep.py preset K cos[,cos...] (run with PYTHONPATH=<tree>)"""
import json, sys
sys.path.insert(0, 'benchmarks')
import bench_crowd_poison as b
from p2p_diloco.sim import crowd_attacks
from p2p_diloco.sync import sponsorship
preset, k = sys.argv[1], int(sys.argv[2])
for c in [float(x) for x in sys.argv[3].split(',')]:
    crowd_attacks.SOFT_COSINE = c
    r = b.run_one(dict(preset=preset, peers=3, inner_steps=20, steps_per_peer=200, crowd=k, attack='echo_soft',
                       defence='sponsors', seed=0, iid=False, adjacent=False))
    print(json.dumps(dict(preset=preset, k=k, cosine=c, echo_of=sponsorship.ECHO_OF, loss=r['eval_loss'],
                          div=r['divergence'], wall=r['wall_s'])), flush=True)
