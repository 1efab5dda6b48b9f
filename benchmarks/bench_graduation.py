"""Graduation in a run with founders (issue 25, sync/sponsorship.py): what relaying a proven volunteer's work as a
member's does to an honest run, and what an author that graduates and then strikes gets.

The in-process swarm (sim/crowd.py, the real sign-verify-merge path), `test` preset (`--preset`), H=20. Rows,
each over seeds:

    plain6        6 honest peers, no sponsors (the spec's default defences)
    members@X     3 sponsors (the spec's `defence.sponsors`) and 3 honest non-sponsors, graduates relayed with
                  GRADUATE_SHARE = X (0: no graduation, every proposal at the newcomers' share)
    negate        3 sponsors and 3 peers that train and publish their work negated (never graduate)
    sleeper       3 sponsors and 3 peers that publish 2 honest updates, then one negated, and again (they
                  graduate exactly when they strike)
    volunteer     3 sponsors and an honest volunteer joining at 1/6 of the run while 10 identities race copies
                  of its updates to the sponsors: the share of each of its updates each sponsor relayed as a
                  member's, by seq
    volunteer_echo  the same, the 10 identities sending echoes of its updates with their own noise (cosine 0.6,
                  `echo_soft`) that declare its data position: built against the fit check, which then reads
                  the volunteer's stream for them; how many of them graduate, and what that costs

Median honest eval loss (nats per byte) and replica divergence (relative L2); the cost of each row against
`members@0.25` (today's setting, sync/sponsorship.py GRADUATE_SHARE) of the same seeds.

    python benchmarks/bench_graduation.py --seeds 2 --jobs 2 --out benchmarks/results/crowd/graduation
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import statistics
import time
from pathlib import Path

DEFAULT_SHARE, DEFAULT_RECORD = 0.25, 2  # sync/sponsorship.py's, set again in every job (pool workers are reused)
ROWS = ["plain6", "members@0", "members@0.25", "members@0.5", "members@1", "negate", "sleeper", "volunteer",
        "volunteer_echo"]
VOLUNTEERS = {"volunteer": dict(mode="copy"), "volunteer_echo": dict(mode="echo_soft", declare=True)}


def run_one(job: dict) -> dict:
    import logging

    import torch

    from p2p_diloco.config import DefenceConfig, SimConfig, preset
    from p2p_diloco.sim.adversary import Adversary, Hostility
    from p2p_diloco.sim.crowd import CrowdAttack, CrowdSwarm
    from p2p_diloco.sync import sponsorship
    from p2p_diloco.train import fit
    from p2p_diloco.train.data.corpus import load_corpus

    torch.set_num_threads(1)
    logging.getLogger("p2p_diloco").setLevel(logging.ERROR)
    row, steps = job["row"], job["steps"]
    share = float(row.split("@")[1]) if row.startswith("members@") else DEFAULT_SHARE
    sponsorship.GRADUATE_SHARE = share
    sponsorship.RECORD = DEFAULT_RECORD if share > 0 else 10**9  # 0: nobody graduates
    fit.FIT_SHARE = job["fit_share"]  # the sponsors' fit checks' share of their compute (0: none)
    base = dataclasses.replace(preset(job["preset"]), seed=job["seed"])
    inner = dataclasses.replace(base.inner, inner_steps=job["h"], decay_steps=steps // 3)
    spec = dataclasses.replace(base, inner=inner, defence=DefenceConfig())
    corpus = load_corpus(spec.data)
    t0 = time.time()
    if row in VOLUNTEERS:
        sim = SimConfig(peers=3, sponsors=3, total_steps=steps + steps // 3, eval_batches=8,
                        eval_every_s=float(steps), join=(f"{steps // 6}",), iid=False)  # as measured
        swarm = CrowdSwarm(spec, sim, corpus, CrowdAttack(10, source=3, adjacent=job["adjacent"], **VOLUNTEERS[row]))
    else:
        adversaries = {"negate": [Adversary(i, Hostility.SIGN_FLIP) for i in range(3, 6)],
                       "sleeper": [Adversary(i, Hostility.SIGN_FLIP, sleeper=2) for i in range(3, 6)]}.get(row, [])
        sim = SimConfig(peers=6, sponsors=0 if row == "plain6" else 3, total_steps=2 * steps, eval_batches=8,
                        eval_every_s=float(2 * steps), iid=False)  # a shard per unit, as measured
        swarm = CrowdSwarm(spec, sim, corpus, CrowdAttack(0, "copy"), adversaries=adversaries)
    summary = swarm.honest_summary(swarm.run())
    out = {**job, "eval_loss": summary["eval_loss"], "divergence": summary["divergence"],
           "wall_s": round(time.time() - t0, 1)}
    if row in VOLUNTEERS:
        out["relayed_by_seq"] = swarm.relayed_by_seq(swarm.peers[3].learner.peer_id)
        crowd = {i.peer_id for i in swarm.crowd}
        sponsorships = [p.learner.replica.standing.sponsorship for p in swarm.honest()
                        if p.learner.replica.standing is not None and p.learner.replica.standing.sponsorship.judging]
        out["crowd_graduates"] = [len(crowd & set(s.graduates)) for s in sponsorships]  # per sponsor, at the end
        out["crowd_relayed"] = round(sum(v for s in sponsorships for a, v in s.relayed.items() if a in crowd), 3)
    judges = [p.learner.fit for p in swarm.peers if p.learner.fit is not None]
    steps_done = sum(p.learner.step for p in swarm.peers if p.learner.fit is not None)
    out["fit"] = {k: sum(j.stats[k] for j in judges) for k in ("checks", "fits", "forwards")}
    out["fit"]["share_of_compute"] = out["fit"]["forwards"] / max(1, fit.FORWARDS_PER_STEP * steps_done)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--preset", default="test")
    ap.add_argument("--steps", type=int, default=600, help="per sponsor; the 6-peer rows have twice the budget")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--fit-share", type=float, default=0.05,
                    help="the sponsors' fit checks' share of their compute (train/fit.py FIT_SHARE; 0: no checks)")
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--adjacent", action="store_true",
                    help="the volunteer rows' crowd holds each update as soon as the payload could first cross the "
                         "volunteer's uplink (sim/crowd.py `adjacent`: the strongest crowd a network allows); "
                         "default: the instant crowd, whose copies leave as the volunteer publishes")
    ap.add_argument("--out", default="benchmarks/results/crowd/graduation")
    args = ap.parse_args()
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {ROWS}")
    jobs = [dict(row=r, seed=s, steps=args.steps, preset=args.preset, fit_share=args.fit_share, h=args.inner_steps,
                 adjacent=args.adjacent)
            for r in rows for s in range(args.seeds)]
    t0, results = time.time(), []
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        for i, res in enumerate(pool.imap_unordered(run_one, jobs), 1):
            results.append(res)
            print(f"[{i}/{len(jobs)} {time.time() - t0:.0f}s] {res['row']} seed={res['seed']}: "
                  f"eval {res['eval_loss']:.4f} div {res['divergence']:.1e}", flush=True)

    def median(row: str) -> float:
        vals = [r["eval_loss"] for r in results if r["row"] == row]
        return statistics.median(vals) if vals else float("nan")

    ref = median(f"members@{DEFAULT_SHARE:g}")
    lines = ["| row | honest eval loss (median) | per seed | vs today | divergence (max) |",
             "|---|---:|---|---:|---:|"]
    for row in rows:
        cells = sorted((r for r in results if r["row"] == row), key=lambda r: r["seed"])
        loss = median(row)
        per_seed = ", ".join(f"{r['eval_loss']:.4f}" for r in cells)
        lines.append(f"| {row} | {loss:.4f} | {per_seed} | "
                     f"{(loss / ref - 1) * 100:+.1f}% | {max(r['divergence'] for r in cells):.1e} |")
    for r in sorted((r for r in results if "relayed_by_seq" in r), key=lambda r: (r["row"], r["seed"])):
        seen = "; ".join(f"{k}: {', '.join(f'{m:g}' for m in v)}" for k, v in r["relayed_by_seq"].items())
        lines.append(f"\n- {r['row']}, seed {r['seed']}: the share of each of its updates each sponsor relayed as a "
                     f"member's, by seq: {seen}; the crowd's graduates at each sponsor {r['crowd_graduates']}, "
                     f"relayed to the crowd {r['crowd_relayed']:g} updates' worth")
    for r in sorted(results, key=lambda r: (r["row"], r["seed"])):
        f = r["fit"]
        lines.append(f"- {r['row']} seed {r['seed']}: fit checks {f['checks']}, fitted {f['fits']}, "
                     f"{f['forwards']} forwards, {100 * f['share_of_compute']:.1f}% of the sponsors' compute")
    md = "\n".join(lines)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": results}, indent=1))
    flags = [f"--{k.replace('_', '-')}" + ("" if isinstance(v, bool) else f" {v}") for k, v in vars(args).items()
             if v is not False]
    command = "python benchmarks/bench_graduation.py " + " ".join(flags)
    out.with_suffix(".md").write_text(f"`{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n\n{md}\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
