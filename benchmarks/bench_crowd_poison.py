"""Poisoning by a crowd of fresh identities (issue 16): honest eval loss against the clean run, 0 to 1000 identities.

The in-process swarm (sim/crowd.py `CrowdSwarm`, the real sign-verify-merge path and the real merge rule) with
3 honest peers and a crowd on top that spends none of the token budget: every time honest peer 0 publishes,
each identity re-signs that update tampered (sign_flip: negated; scale5: x5, which the default norm bound
already bans; scale5-nobound: x5 with the norm bound off, so only vetting stands in the way; scale2: x2, under
every threshold; noise: a random direction at the honest update's norm, which no cosine test refuses: these two
are the residual) under its own key, at the full weight, to every honest peer. Two defences:

    today     what main did before issue 16: no probation, no vetting, and every identity with a record counts
              in the swarm's size (`count=records`)
    standing  the default now (sync/standing.py): probation by seq, vetting against the replica's reference,
              the swarm's size from what merged recently

Rows: median over seeds of the honest replicas' eval loss (nats per byte; inf: the run broke down, an honest
peer's own update no longer passed its own replica's checks), its cost against the clean run of the same
defence, the replicas' divergence (relative L2: equal replicas ~1e-7), and what vetting did.
Also: how many updates a late honest volunteer needs to reach full weight (probation: deterministic).

    python benchmarks/bench_crowd_poison.py --crowds 0,10,100,1000 --seeds 3 --jobs 2
writes benchmarks/results/crowd/poison.json and poison.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import statistics
import time
from pathlib import Path

from p2p_diloco.config import DefenceConfig, SimConfig, preset
from p2p_diloco.sim.crowd import CrowdAttack, CrowdSwarm
from p2p_diloco.sync.probation import probation_multiplier
from p2p_diloco.sync.verdict import REFUSALS, TIED
from p2p_diloco.train.data.corpus import load_corpus

ATTACKS = {"sign_flip": ("sign_flip", 1.0, 1.0), "scale5": ("scale", 5.0, 1.0),
           "scale5-nobound": ("scale", 5.0, 0.0), "scale2": ("scale", 2.0, 1.0), "noise": ("noise", 1.0, 1.0),
           # the crowd starts once peer 0 is in good standing (its 5th update): its copies lose every pair
           "sign_flip-late": ("sign_flip", 1.0, 1.0, 4), "scale5-nobound-late": ("scale", 5.0, 0.0, 4)}
DEFENCES = {"today": dict(probation=1.0, min_agreement=-1.0, max_norm_ratio=0.0, full_agreement=0.0,
                          copy_cosine=0.0),
            "standing": {}}
_CORPUS: dict = {}


def run_one(job: dict) -> dict:
    """One simulation, in a worker process."""
    import logging

    import torch

    torch.set_num_threads(1)
    logging.getLogger("p2p_diloco").setLevel(logging.ERROR)
    base = preset(job["preset"])
    mode, factor, norm_bound, *after = ATTACKS.get(job["attack"], ("sign_flip", 1.0, 1.0))  # clean: no crowd
    defence = DefenceConfig(norm_bound=norm_bound, **DEFENCES[job["defence"]])
    inner = dataclasses.replace(base.inner, inner_steps=job["inner_steps"], decay_steps=job["steps_per_peer"])
    spec = dataclasses.replace(base, seed=job["seed"], inner=inner, defence=defence)
    total = job["peers"] * job["steps_per_peer"]
    sim = SimConfig(peers=job["peers"], total_steps=total, eval_batches=16, eval_every_s=float(total))
    if "corpus" not in _CORPUS:
        _CORPUS["corpus"] = load_corpus(spec.data)
    count = "records" if job["defence"] == "today" else "proven"
    t0 = time.time()
    swarm = CrowdSwarm(spec, sim, _CORPUS["corpus"], CrowdAttack(job["crowd"], mode, factor, count, *after))
    try:
        result = swarm.run()
    except Exception as e:  # noqa: BLE001 (a replica pushed so far that an honest update fails its checks)
        return {**job, "wall_s": round(time.time() - t0, 1), "eval_loss": float("inf"), "divergence": float("nan"),
                "finite": False, "error": str(e), **swarm.crowd_summary()}
    summary = swarm.honest_summary(result)
    return {**job, "wall_s": round(time.time() - t0, 1), "eval_loss": summary["eval_loss"],
            "divergence": summary["divergence"], "finite": summary["finite"], **swarm.crowd_summary()}


def late_volunteer(preset_name: str, inner_steps: int, steps_per_peer: int, crowd: int) -> dict:
    """A 4th honest peer joins halfway through (state sync from a live one) while a sign-flipping crowd attacks:
    the multiplier each of its updates merged at on the other honest replicas, by seq."""
    import logging

    import torch

    torch.set_num_threads(1)
    logging.getLogger("p2p_diloco").setLevel(logging.ERROR)
    base = preset(preset_name)
    inner = dataclasses.replace(base.inner, inner_steps=inner_steps, decay_steps=steps_per_peer)
    spec = dataclasses.replace(base, inner=inner)
    total = 4 * steps_per_peer
    sim = SimConfig(peers=3, total_steps=total, eval_batches=8, eval_every_s=float(total),
                    join=(str(steps_per_peer / 2),))
    swarm = CrowdSwarm(spec, sim, load_corpus(spec.data), CrowdAttack(crowd, "sign_flip"))
    swarm.run()
    joiner = swarm.peers[3].learner.peer_id
    by_seq: dict[int, list[float]] = {}  # the weight each of its updates holds at the end on the other replicas
    for peer in swarm.peers[:3]:
        replica = peer.learner.replica
        for seq in range(1, replica.version_vector.get(joiner) + 1):
            by_seq.setdefault(seq, []).append(replica.merged_weight(joiner, seq))
    return {"crowd": crowd, "multipliers_by_seq": {k: sorted(v) for k, v in sorted(by_seq.items())}}


def table(rows: list[dict], crowds: list[int], attacks: list[str]) -> str:
    def median(key: str, **match: object) -> float:
        vals = [r[key] for r in rows if all(r[k] == v for k, v in match.items())]
        return statistics.median(vals) if vals else float("nan")

    lines = ["| attack | identities | defence | honest eval loss | cost vs clean | divergence | refused / distrusted |",
             "|---|---:|---|---:|---:|---:|---|"]
    for defence in DEFENCES:
        clean = median("eval_loss", crowd=0, defence=defence)
        div = median("divergence", crowd=0, defence=defence)
        lines.append(f"| clean | 0 | {defence} | {clean:.3f} | - | {div:.1e} | - |")
    for attack in attacks:
        for crowd in (c for c in crowds if c):
            for defence in DEFENCES:
                clean = median("eval_loss", crowd=0, defence=defence)
                loss = median("eval_loss", crowd=crowd, defence=defence, attack=attack)
                cells = [r for r in rows if r["crowd"] == crowd and r["defence"] == defence and r["attack"] == attack]
                refused = statistics.median([sum(r["verdicts"].get(k, 0) for k in (*REFUSALS, TIED))
                                             for r in cells]) if cells else 0
                distrusted = statistics.median([r["distrusted_min"] for r in cells]) if cells else 0
                cost = (loss / clean - 1) * 100
                lines.append(f"| {attack} | {crowd} | {defence} | {loss:.3f} | {cost:+.1f}% | "
                             f"{median('divergence', crowd=crowd, defence=defence, attack=attack):.1e} | "
                             f"{refused:.0f} / {distrusted:.0f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="test")
    ap.add_argument("--peers", type=int, default=3, help="honest peers")
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--steps-per-peer", type=int, default=200)
    ap.add_argument("--crowds", default="0,10,100,1000")
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/crowd/poison")
    args = ap.parse_args()
    crowds = [int(c) for c in args.crowds.split(",")]
    attacks = args.attacks.split(",")
    common = dict(preset=args.preset, peers=args.peers, inner_steps=args.inner_steps,
                  steps_per_peer=args.steps_per_peer)
    jobs = [dict(common, crowd=0, attack="clean", defence=d, seed=s) for d in DEFENCES for s in range(args.seeds)]
    jobs += [dict(common, crowd=c, attack=a, defence=d, seed=s) for c in crowds if c for a in attacks
             for d in DEFENCES for s in range(args.seeds)]
    t0 = time.time()
    rows = []
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        for i, row in enumerate(pool.imap_unordered(run_one, jobs), 1):
            rows.append(row)
            print(f"[{i}/{len(jobs)} {time.time() - t0:.0f}s] {row['attack']} crowd={row['crowd']} "
                  f"{row['defence']} seed={row['seed']}: eval {row['eval_loss']:.3f} div {row['divergence']:.1e} "
                  f"({row['wall_s']}s)", flush=True)
    ramp = [probation_multiplier(k, DefenceConfig().probation) for k in range(1, 6)]
    late = next(k for k, m in enumerate(ramp, 1) if m >= 1.0)
    volunteer = late_volunteer(args.preset, args.inner_steps, args.steps_per_peer, max(crowds))
    seen = "; ".join(f"update {k}: {', '.join(f'{m:g}' for m in v)}" for k, v in
                     volunteer["multipliers_by_seq"].items())
    md = table(rows, crowds, attacks) + (
        f"\n\nA late honest volunteer's k-th update merges at {', '.join(f'{m:g}' for m in ramp)} of its weight "
        f"(k = 1..5): full weight from its update {late} on, on every replica alike. Measured: a 4th honest peer "
        f"joining halfway through, with {max(crowds)} sign-flipping identities attacking, merged on the 3 "
        f"other replicas at {seen}.\n")
    rows.append({"late_volunteer": volunteer})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
