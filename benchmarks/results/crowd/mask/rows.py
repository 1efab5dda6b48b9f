"""Driver for BENCHMARKS.md "Judged where nobody can aim" (run from the repository root): rows of
bench_crowd_poison.run_one, 3 honest sponsors + 3 hostile trainers. Usage: python <this> OUT.json ATTACK[,ATTACK...]
(spike_variants.py: no arguments)."""
import sys, json
sys.path.insert(0, 'benchmarks')
from concurrent.futures import ProcessPoolExecutor
import bench_crowd_poison as b
jobs = []
for attack in sys.argv[2].split(','):
    for seed in (0, 1):
        jobs.append(dict(preset='test', peers=3, inner_steps=20, steps_per_peer=200, crowd=0 if attack.startswith('clean') else 3,
                         attack=attack, defence='sponsors', seed=seed, iid=False))
with ProcessPoolExecutor(2) as ex:
    rows = list(ex.map(b.run_one, jobs))
for r in rows:
    print(r['attack'], r['seed'], round(r['eval_loss'], 4), r['divergence'], r.get('relayed_to_crowd', ''), r['wall_s'])
json.dump(rows, open(sys.argv[1], 'w'), default=str)
