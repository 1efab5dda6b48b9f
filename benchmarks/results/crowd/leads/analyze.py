import json, glob, statistics as st
import numpy as np
def q(xs, p): return float(np.percentile(xs, p)) if xs else float('nan')
for f in sorted(glob.glob('/work/notes/unique/*.json')):
    d = json.load(open(f))
    by = {}
    for r in d['records']:
        by.setdefault(r['label'], []).append(r)
    for lab, rs in by.items():
        pm = [max(map(abs, r['plain'])) for r in rs]; um = [max(r['unique']) for r in rs]
        # unique cos at the sponsor of max plain
        ua = [r['unique'][r['plain'].index(max(r['plain']))] for r in rs]
        sh = [s for r in rs for s in r['share']]
        print(f"{d['row']:32s} {lab:7s} n={len(rs):5d} hits={sum(r['hit'] for r in rs):4d} plain max: p50 {q(pm,50):.3f} p1 {q(pm,1):.3f} p99 {q(pm,99):.3f} max {max(pm):.3f} | unique max: p50 {q(um,50):.3f} p1 {q(um,1):.3f} p99 {q(um,99):.3f} max {max(um):.3f} | share p50 {q(sh,50):.2f}")
