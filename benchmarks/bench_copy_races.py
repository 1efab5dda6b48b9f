"""Copy races (sync/heralds.py): do copiers that race an honest volunteer's updates to the sponsors graduate, with
and without heralds, and with the payload kept back until the sponsors acked its heralds? The scenario of
tests/sim/test_graduation_swarm.py: 3 sponsors, an honest volunteer joining at 100 s, 10 identities copying each
of its updates (`test` preset, H=20, a stream per unit: the default layout).

Crowds (sim/crowd.py `CrowdAttack`): `instant` (copies and their heralds leave the moment the original does: no
network allows it), `adjacent` (the crowd holds the original as soon as its payload could first have crossed the
volunteer's uplink, plain latency: the strongest a network allows), `causal` (the crowd is one more gossip target
of the volunteer's). Timing: `fixed` (the test's: no noise, no grace window) or a timing seed (phase jitter 15%,
latency jitter 0.1 s, starts spread over 1 s, the grace window 0.5).

`--mbps`: every uplink; the payload's transfer time is the margin a herald gives the original (10 ms at the
default 100 Mbit/s for the `test` model, against up to 100 ms of latency jitter per message).

Per run: the first of the volunteer's seqs each sponsor relayed as a member's, (sponsor, copier) pairs graduated,
what the sponsors relayed of the crowd's copies against the volunteer's own work, honest eval loss, divergence.

    python benchmarks/bench_copy_races.py --jobs 2 --out benchmarks/results/copy_races/heralds.json
    python benchmarks/bench_copy_races.py --heralds on,wait --crowds adjacent,causal --timings 0,1,2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests/ (the scenario)


def run_one(job: dict) -> dict:
    import dataclasses
    import logging

    import torch

    from p2p_diloco.config import SimConfig
    from p2p_diloco.sim.crowd import CrowdAttack, CrowdSwarm
    from p2p_diloco.train.data.corpus import load_corpus
    from tests.sim.test_graduation_swarm import STEPS, _spec

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    spec, timing = _spec(), job["timing"]
    noise = {"grace": 0.0} if timing == "fixed" else dict(grace=0.5, phase_jitter=0.15, latency_jitter_s=0.1,
                                                          start_spread_s=1.0, timing_seed=int(timing))
    sim = SimConfig(peers=3, sponsors=3, total_steps=STEPS + STEPS // 3, eval_batches=8, eval_every_s=float(STEPS),
                    join=(f"{STEPS // 6}",), heralds=job["heralds"] != "off",
                    herald_wait=job["heralds"] == "wait", bandwidth_mbps=job["mbps"], **noise)
    attack = dataclasses.replace(CrowdAttack(10, "copy", source=3), causal=job["crowd"] == "causal",
                                 adjacent=job["crowd"] == "adjacent")
    started = time.monotonic()
    swarm = CrowdSwarm(spec, sim, load_corpus(spec.data), attack)
    summary = swarm.honest_summary(swarm.run())
    volunteer = swarm.peers[3].learner.peer_id
    by_seq = swarm.relayed_by_seq(volunteer)
    crowd = {identity.peer_id for identity in swarm.crowd}
    sponsorships = [p.learner.replica.standing.sponsorship for p in swarm.peers[:3]]
    # A seq some sponsor never judged (its judgment still held when the run ended) has fewer shares.
    first = [min((s for s, shares in by_seq.items() if len(shares) > i and shares[i] > 0), default=None)
             for i in range(3)]
    return {**job, "member_from": first,
            "copier_graduations": sum(len(set(s.graduates) & crowd) for s in sponsorships),
            "relayed_crowd": [round(sum(s.relayed.get(a, 0.0) for a in crowd), 3) for s in sponsorships],
            "relayed_volunteer": [round(s.relayed.get(volunteer, 0.0), 3) for s in sponsorships],
            "eval_loss": round(summary["eval_loss"], 4), "divergence": summary["divergence"],
            "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--crowds", default="instant,adjacent,causal")
    parser.add_argument("--timings", default="fixed,0,1,2")
    parser.add_argument("--heralds", default="off,on,wait",
                        help="off; on (the payload right behind the heralds); wait (the payload once every sponsor "
                             "acked its herald: the default); any of them, comma-separated")
    parser.add_argument("--mbps", type=float, default=100.0, help="every uplink (the simulator's default: 100)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    jobs = [{"heralds": h, "crowd": c, "timing": t, "mbps": args.mbps} for h in args.heralds.split(",")
            for c in args.crowds.split(",") for t in args.timings.split(",")]
    rows = []
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        for i, row in enumerate(pool.imap_unordered(run_one, jobs), 1):
            rows.append(row)
            print(f"[{i}/{len(jobs)}] " + json.dumps(row), flush=True)
    rows.sort(key=lambda r: (r["heralds"], r["crowd"], r["timing"]))
    print("\n| heralds | crowd | timing | member from | copier graduations | relayed crowd / volunteer | loss |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['heralds']} | {r['crowd']} | {r['timing']} | {r['member_from']} | "
              f"{r['copier_graduations']} | {r['relayed_crowd']} / {r['relayed_volunteer']} | {r['eval_loss']} |")
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
