"""Aggregation in the in-process swarm (sim/aggregation.py): bytes per peer per round and loss, the aggregation
tree against full dissemination, side by side in one run.

The in-process swarm (the real sign-verify-merge path, group sums merged by `Replica.offer_sum`), `test` preset,
H=20, 100 Mbit/s, the copy rule off (a sum carries exact weights only: ARCHITECTURE.md "Aggregation"). Rows:

    full@N        every update to every peer (today's dissemination)
    tree@N        the aggregation tree, fan-in 8
    *_jitter@N    the same with phase jitter 0.3 (units finish their phases at different times)
    *_churn@N     two peers crash mid-run (whatever their places: an inner one dies holding parts) and two join
    tree_liar@N   one inner peer adds its own direction into every sum it sends (audits: sync/sum_audit.py)

Per row: final eval loss (mean over live peers), replica divergence (max |theta_i - theta_j|), bytes each peer
sent per round (mean and max over peers), tau p50/p90, grace waits, totals merged, timeouts, fallbacks.

    python benchmarks/bench_aggregation.py --peers 4 16 64 --rounds 10 --jobs 2 --out benchmarks/results/aggregation
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import statistics
import time
from pathlib import Path


def run_one(job: dict) -> dict:
    import logging

    import torch

    from p2p_diloco.config import SimConfig, preset
    from p2p_diloco.sim.swarm import AsyncSwarm
    from p2p_diloco.train.data.corpus import load_corpus

    torch.set_num_threads(1)
    logging.getLogger("p2p_diloco").setLevel(logging.ERROR)
    row, n, rounds = job["row"], job["peers"], job["rounds"]
    base = preset("test")
    spec = dataclasses.replace(base, defence=dataclasses.replace(base.defence, copy_cosine=0.0))
    H = spec.inner.inner_steps
    churn = "churn" in row
    sim = SimConfig(peers=n, total_steps=n * H * rounds, aggregate=8 if row.startswith("tree") else 0,
                    phase_jitter=0.3 if "jitter" in row else 0.0,
                    crash=("0@70", "1@130") if churn else (), join=("90", "150") if churn else ())
    started = time.time()
    swarm = AsyncSwarm(spec, sim, load_corpus(spec.data))
    if "liar" in row:
        from p2p_diloco.sim.liars import lying_aggregator
        lying_aggregator(swarm, silent="silent" in row)
    result = swarm.run()
    live = [p for p in result.peers if p.alive]
    sent = [p.bytes_sent / rounds for p in live]
    taus = sorted(t for p in result.peers for t in p.taus)
    counts = dict(swarm.tree.counts) if swarm.tree is not None else {}
    return dict(row=row, peers=n, rounds=rounds, loss=result.eval_loss, divergence=result.divergence,
                sent_mean=statistics.mean(sent), sent_max=max(sent), tau_p50=taus[len(taus) // 2] if taus else 0,
                tau_p90=taus[int(len(taus) * 0.9)] if taus else 0,
                wait_mean=statistics.mean([w for p in result.peers for w in p.waits] or [0.0]),
                totals=counts.get("totals", 0), timeouts=counts.get("timeouts", 0),
                fallbacks=counts.get("fallbacks", 0), caught=counts.get("caught", 0),
                refused=counts.get("total_refused_lie", 0), wall_s=time.time() - started,
                counts=counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--rows", nargs="+", default=["full", "tree"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/aggregation"))
    args = ap.parse_args()
    jobs = [dict(row=r, peers=n, rounds=args.rounds) for n in args.peers for r in args.rows]
    jobs.sort(key=lambda j: -j["peers"])  # the long ones first: the pool ends together
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        results = pool.map(run_one, jobs, chunksize=1)
    results.sort(key=lambda r: (r["peers"], r["row"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(dict(args=vars(args) | {"out": str(args.out)},
                                                             results=results), indent=1))
    print("| row | N | loss | vs full | divergence | sent / peer / round (mean, max) | tau p50/p90 | wait (s) "
          "| totals | timeouts | fallbacks | caught | wall (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    full = {(r["peers"], r["row"].replace("tree", "full").split("_liar")[0]): r["loss"] for r in results
            if r["row"].startswith("full")}
    for r in results:
        ref = full.get((r["peers"], r["row"].replace("tree", "full").replace("_liar", "")))
        vs = f"{(r['loss'] / ref - 1) * 100:+.2f}%" if ref else "-"
        print(f"| {r['row']} | {r['peers']} | {r['loss']:.4f} | {vs} | {r['divergence']:.1e} | "
              f"{r['sent_mean'] / 1e3:.0f} KB, {r['sent_max'] / 1e3:.0f} KB | {r['tau_p50']}/{r['tau_p90']} | "
              f"{r['wait_mean']:.2f} | {r['totals']} | {r['timeouts']} | {r['fallbacks']} | {r['caught']} | "
              f"{r['wall_s']:.0f} |")


if __name__ == "__main__":
    main()
