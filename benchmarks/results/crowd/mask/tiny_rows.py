"""Driver for BENCHMARKS.md "Judged where nobody can aim" (run from the repository root): rows of
bench_crowd_poison.run_one, 3 honest sponsors + 3 hostile trainers. Usage: python <this> OUT.json ATTACK[,ATTACK...]
(spike_variants.py: no arguments)."""
import sys, json
sys.path.insert(0, 'benchmarks')
from concurrent.futures import ProcessPoolExecutor
import bench_crowd_poison as b
jobs = [dict(preset='tiny', peers=3, inner_steps=20, steps_per_peer=200, crowd=3, attack=a, defence='sponsors',
             seed=0, iid=False) for a in sys.argv[2].split(',')]
with ProcessPoolExecutor(2) as ex:
    rows = list(ex.map(b.run_one, jobs))
for r in rows:
    print(r['attack'], r['seed'], round(r['eval_loss'], 4), r['divergence'], r['wall_s'], flush=True)
json.dump(rows, open(sys.argv[1], 'w'), default=str)
