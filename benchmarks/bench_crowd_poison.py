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

Attacks designed against the rules (sim/crowd_attacks.py): near copies (`near_copy`: negated plus each identity's
own 5% noise, so no two payloads are copies; `near_copy_pos`: not negated), `scale_bound` (a negated near copy
at the norm bound), `mixed_adaptive` (those and noise in turn), a crowd that copies a late honest volunteer
(`copy_newcomer`: exact copies, `near_copy_newcomer`: negated near copies; a 4th honest peer joins halfway and
its multipliers by seq are reported), and hostile peers WITH compute: K identities that train on their own
data, spend the token budget like honest peers, and publish their own update negated (`train_negate`), times 5
capped under the norm bound (`train_scale`), negated and so capped (`train_negate_bound`), negated with the K
of them sharing as much compute as the honest peers together (`train_negate_shared`), or negated, each phase
trained from an honest replica's state rather than its own (`train_negate_tracked`), or, built against a run
with sponsors' graduation, two honest updates between two tampered ones (`train_sleeper`: negated,
`train_sleeper_scale`: x5 capped, `train_sleeper_bound`: negated x5 capped), or negated and tilted toward the
swarm's recent direction until its cosine with it is 0.3 (`train_tilt`) or 0.9 (`train_tilt9`), or, built against a
judge that reads a few fixed coordinates, honest on the copy test's public ones and negated (`train_mask`) or
negated x5 capped (`train_mask_bound`) on every other. For `train_*`, K is the
number of hostile peers and no crowd signs anything. The defence `standing` is the spec's defaults (whatever
the code under test makes them).

    python benchmarks/bench_crowd_poison.py --crowds 0,10,100,1000 --seeds 3 --jobs 2
writes benchmarks/results/crowd/poison.json and poison.md.

    python benchmarks/bench_crowd_poison.py --crowds 0,3,10,100 --attacks adaptive --defences standing \
        --seeds 1 --no-volunteer --out benchmarks/results/crowd/adaptive
runs the attacks designed against the rules (`train_*` at K <= --max-trainers only).
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
from p2p_diloco.sim.adversary import Adversary, Hostility
from p2p_diloco.sim.crowd import CrowdAttack, CrowdSwarm
from p2p_diloco.sync.probation import probation_multiplier
from p2p_diloco.sync.verdict import REFUSALS, TIED
from p2p_diloco.train.data.corpus import load_corpus


@dataclasses.dataclass(frozen=True)
class Attack:
    mode: str = "sign_flip"  # the crowd's (sim/crowd_attacks.py), or the hostile trainers' with `hostile`
    factor: float = 1.0
    norm_bound: float = 1.0
    after: int = 0
    newcomer: bool = False  # a 4th honest peer joins halfway; the crowd copies it
    hostile: Hostility | None = None  # K hostile peers that train (spending the budget) instead of a crowd
    bounded: bool = False  # hostile scale: capped under the norm bound
    shared: bool = False  # the K hostile peers together have as much compute as the honest ones
    track: bool = False  # the hostile peers train from an honest replica's state, not their own
    sleeper: int = 0  # the hostile peers publish this many honest updates between two tampered ones
    lag: int = 0  # tilt: toward theta's move of this many updates ago


ATTACKS = {"sign_flip": Attack("sign_flip"), "scale5": Attack("scale", 5.0),
           "scale5-nobound": Attack("scale", 5.0, 0.0), "scale2": Attack("scale", 2.0), "noise": Attack("noise"),
           "noise_shaped": Attack("noise_shaped"),
           # the crowd starts once peer 0 is in good standing (its 5th update): its copies lose every pair
           "sign_flip-late": Attack("sign_flip", after=4), "scale5-nobound-late": Attack("scale", 5.0, 0.0, 4),
           # designed against the rules: the copy test at |cos| >= 0.9999, probation, the norm bound
           "near_copy": Attack("near_copy"), "near_copy_pos": Attack("near_copy_pos"),
           "scale_bound": Attack("scale_bound", 5.0), "mixed_adaptive": Attack("mixed_adaptive", 1.0),
           # built against the sponsors' judge of directions, with no compute: the swarm's move plus own noise
           "echo_noise": Attack("echo_noise"), "echo_source": Attack("echo_source"),
           # built against the sponsors' echo test: a softer echo, and an echo of a late volunteer's updates
           "echo_soft": Attack("echo_soft"), "echo_newcomer": Attack("echo_source", newcomer=True),
           "copy_newcomer": Attack("copy", newcomer=True), "near_copy_newcomer": Attack("near_copy", newcomer=True),
           # built against crowding (sync/relayed.py): softer echoes of a volunteer's, less near each other
           "echo_soft_newcomer": Attack("echo_soft", newcomer=True),
           # K more peers that train and publish honestly (WITHHOLD with no seq withheld): the baseline of the
           # train_* rows, as the K take K of the data shards (the honest peers see less data than in the clean run)
           "train_honest": Attack(hostile=Hostility.WITHHOLD),
           "train_negate": Attack(hostile=Hostility.SIGN_FLIP),
           "train_scale": Attack(factor=5.0, hostile=Hostility.SCALE, bounded=True),
           "train_negate_bound": Attack(factor=-5.0, hostile=Hostility.SCALE, bounded=True),
           "train_negate_shared": Attack(hostile=Hostility.SIGN_FLIP, shared=True),
           "train_negate_tracked": Attack(hostile=Hostility.SIGN_FLIP, track=True),
           # built against graduation (sync/sponsorship.py RECORD = 2): graduate, strike, graduate again
           "train_sleeper": Attack(hostile=Hostility.SIGN_FLIP, sleeper=2),
           "train_sleeper_scale": Attack(factor=5.0, hostile=Hostility.SCALE, bounded=True, sleeper=2),
           "train_sleeper_bound": Attack(factor=-5.0, hostile=Hostility.SCALE, bounded=True, sleeper=2),
           # built against the sponsors' judge of directions: negated work tilted to cosine 0.3 with the swarm's
           "train_tilt": Attack(factor=0.3, hostile=Hostility.TILT),
           "train_tilt9": Attack(factor=0.9, hostile=Hostility.TILT),
           # the swarm's own recent move echoed at the honest length (no negated work in it); built against the
           # sponsors' removal of their recent moves (sync/sponsorship.py ECHO = 2): theta's move of 2 updates ago
           "train_echo": Attack(factor=0.9999, hostile=Hostility.TILT),
           "train_echo_lag": Attack(factor=0.9999, hostile=Hostility.TILT, lag=2),
           "train_tilt9_lag": Attack(factor=0.9, hostile=Hostility.TILT, lag=2),
           # built against a judge that reads the copy test's public coordinates: honest there, the attack elsewhere
           "train_mask": Attack(factor=-1.0, hostile=Hostility.MASK),
           "train_mask_bound": Attack(factor=-5.0, hostile=Hostility.MASK, bounded=True),
           # built against a judge that reads a sample, however secret: honest but for a few coordinates at the bound
           "train_spike": Attack(factor=0.001, hostile=Hostility.SPIKE),
           "train_spike10": Attack(factor=0.01, hostile=Hostility.SPIKE),
           "train_undercut": Attack(factor=0.05, hostile=Hostility.UNDERCUT),
           "train_undercut0": Attack(factor=0.01, hostile=Hostility.UNDERCUT)}
ADAPTIVE = ["near_copy", "near_copy_pos", "scale_bound", "noise", "noise_shaped", "mixed_adaptive", "echo_noise",
            "echo_source", "echo_soft", "echo_newcomer", "echo_soft_newcomer",
            "copy_newcomer", "near_copy_newcomer", "train_honest",
            "train_negate", "train_scale", "train_negate_bound",
            "train_negate_shared", "train_negate_tracked", "train_sleeper", "train_sleeper_scale",
            "train_sleeper_bound", "train_tilt", "train_tilt9", "train_echo", "train_echo_lag", "train_tilt9_lag",
            "train_mask", "train_mask_bound"]
CLEAN = {"clean": Attack(), "clean_join": Attack(newcomer=True)}
DEFENCES = {"today": dict(probation=1.0, min_agreement=-1.0, max_norm_ratio=0.0, full_agreement=0.0,
                          copy_cosine=0.0),
            "standing": {},
            # a run with founders: the honest peers' keys are the spec's sponsors (sync/sponsorship.py)
            "sponsors": {}}
_CORPUS: dict = {}


def run_one(job: dict) -> dict:
    """One simulation, in a worker process."""
    import logging

    import torch

    from p2p_diloco.train import fit

    torch.set_num_threads(1)
    logging.getLogger("p2p_diloco").setLevel(logging.ERROR)
    fit.FIT_SHARE = job.get("fit_share", fit.FIT_SHARE)  # the sponsors' fit checks (0: none)
    base = preset(job["preset"])
    attack = CLEAN[job["attack"]] if job["attack"] in CLEAN else ATTACKS[job["attack"]]
    defence = DefenceConfig(norm_bound=attack.norm_bound, **DEFENCES[job["defence"]])
    spp, honest, k = job["steps_per_peer"], job["peers"], job["crowd"]
    inner = dataclasses.replace(base.inner, inner_steps=job["inner_steps"], decay_steps=spp)
    spec = dataclasses.replace(base, seed=job["seed"], inner=inner, defence=defence)
    trainers = k if attack.hostile is not None else 0
    speed = honest / k if attack.shared and k else 1.0
    # The budget: each honest peer's share as in the clean run, each hostile one's at its speed, a newcomer's.
    total = round((honest + trainers * speed + attack.newcomer) * spp)
    sim = SimConfig(peers=honest + trainers, total_steps=total, eval_batches=16, eval_every_s=float(total),
                    speeds=("1",) * honest + (f"{speed:g}",) * trainers,
                    join=(f"{spp / 2:g}",) if attack.newcomer else (),
                    sponsors=honest if job["defence"] == "sponsors" else 0, iid=job["iid"])
    adversaries = [Adversary(i, attack.hostile, factor=attack.factor, bounded=attack.bounded, track=attack.track,
                             sleeper=attack.sleeper, lag=attack.lag)
                   for i in range(honest, honest + trainers) if attack.hostile is not None]
    if "corpus" not in _CORPUS:
        _CORPUS["corpus"] = load_corpus(spec.data)
    count = "records" if job["defence"] == "today" else "proven"
    crowd = CrowdAttack(0 if trainers else k, attack.mode, attack.factor, count, attack.after,
                        source=honest + trainers if attack.newcomer else 0, adjacent=job.get("adjacent", False))
    t0 = time.time()
    swarm = CrowdSwarm(spec, sim, _CORPUS["corpus"], crowd, adversaries=adversaries)
    try:
        result = swarm.run()
    except Exception as e:  # noqa: BLE001 (a replica pushed so far that an honest update fails its checks)
        return {**swarm.crowd_summary(), **job, "wall_s": round(time.time() - t0, 1), "eval_loss": float("inf"),
                "divergence": float("nan"), "finite": False, "error": str(e)}
    summary = swarm.honest_summary(result)
    hostile_steps = sum(p.learner.step for p in swarm.peers if p.index in swarm.adversaries)
    return {**swarm.crowd_summary(), **job, "wall_s": round(time.time() - t0, 1), "eval_loss": summary["eval_loss"],
            "divergence": summary["divergence"], "finite": summary["finite"], "rejected": summary["counts"],
            "hostile_steps": hostile_steps, "honest_steps": sum(p.learner.step for p in swarm.honest())}


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


def baseline(attack: str) -> str:
    return "clean_join" if attack in ATTACKS and ATTACKS[attack].newcomer else "clean"


def table(rows: list[dict], crowds: list[int], attacks: list[str], defences: list[str]) -> str:
    def median(key: str, **match: object) -> float:
        vals = [r[key] for r in rows if all(r.get(k) == v for k, v in match.items())]
        return statistics.median(vals) if vals else float("nan")

    lines = ["| attack | identities | defence | honest eval loss | cost vs clean | divergence | attackers' weight "
             "| relayed to them | refused / distrusted |", "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    cleans = sorted({r["attack"] for r in rows if r["attack"] in CLEAN})
    for name in cleans:
        for defence in defences:
            clean = median("eval_loss", attack=name, defence=defence)
            div = median("divergence", attack=name, defence=defence)
            lines.append(f"| {name} | 0 | {defence} | {clean:.3f} | - | {div:.1e} | - | - | - |")
    notes = []
    for attack in attacks:
        for crowd in (c for c in crowds if c):
            for defence in defences:
                cells = [r for r in rows if r["crowd"] == crowd and r["defence"] == defence and r["attack"] == attack]
                if not cells:
                    continue
                clean = median("eval_loss", attack=baseline(attack), defence=defence)
                if ATTACKS[attack].hostile is not None and attack != "train_honest":  # against K honest trainers
                    withheld = median("eval_loss", attack="train_honest", crowd=crowd, defence=defence)
                    clean = withheld if withheld == withheld else clean
                loss = median("eval_loss", crowd=crowd, defence=defence, attack=attack)
                refused = statistics.median([sum(r["verdicts"].get(k, 0) for k in (*REFUSALS, TIED))
                                             for r in cells])
                distrusted = statistics.median([r["distrusted_min"] for r in cells])
                weight = statistics.median([r.get("attacker_weight", float("nan")) for r in cells])
                relayed = statistics.median([r.get("attacker_relayed", 0.0) for r in cells])
                cost = (loss / clean - 1) * 100
                lines.append(f"| {attack} | {crowd} | {defence} | {loss:.3f} | {cost:+.1f}% | "
                             f"{median('divergence', crowd=crowd, defence=defence, attack=attack):.1e} | "
                             f"{weight:.2f} | {relayed:.2f} | {refused:.0f} / {distrusted:.0f} |")
                for r in cells:
                    if "source_weights" in r:
                        seen = "; ".join(f"{k}: {', '.join(f'{m:g}' for m in v)}"
                                         for k, v in r["source_weights"].items())
                        held = "relayed as a member's by each sponsor" if defence == "sponsors" else \
                            "hold on the other honest replicas"
                        notes.append(f"- {attack}, {crowd} identities, {defence}, seed {r['seed']}: the newcomer's "
                                     f"updates {held}, by seq: {seen}")
    return "\n".join(lines) + ("\n\n" + "\n".join(notes) if notes else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="test")
    ap.add_argument("--peers", type=int, default=3, help="honest peers")
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--steps-per-peer", type=int, default=200)
    ap.add_argument("--crowds", default="0,10,100,1000")
    ap.add_argument("--attacks", default=",".join(a for a in ATTACKS if a not in ADAPTIVE),
                    help="comma-separated names, or 'adaptive' (the attacks designed against the rules), or 'all'")
    ap.add_argument("--defences", default=",".join(DEFENCES))
    ap.add_argument("--max-trainers", type=int, default=10, help="train_* attacks only at K up to this")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed+seeds-1")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--iid", action="store_true", help="every unit samples the whole training split (the simulator's "
                                                       "default; here a shard each unless given, as measured)")
    ap.add_argument("--adjacent", action="store_true",
                    help="the crowd holds each update only once its payload could have crossed the source's uplink "
                         "(sim/crowd.py `adjacent`: the strongest crowd a network allows); default: the instant crowd, "
                         "whose copies and heralds leave with the original (no network allows it: with heralds, it "
                         "dates its copies before the original at some sponsors: a copied newcomer never graduates)")
    ap.add_argument("--no-volunteer", action="store_true", help="skip the late volunteer's measurement")
    ap.add_argument("--fit-share", type=float, default=0.05,
                    help="the sponsors' fit checks' share of their compute (train/fit.py FIT_SHARE; 0: none)")
    ap.add_argument("--out", default="benchmarks/results/crowd/poison")
    args = ap.parse_args()
    crowds = [int(c) for c in args.crowds.split(",")]
    attacks = {"adaptive": ADAPTIVE, "all": list(ATTACKS)}.get(args.attacks, args.attacks.split(","))
    defences = args.defences.split(",")
    unknown = [a for a in attacks if a not in ATTACKS] + [d for d in defences if d not in DEFENCES]
    if unknown:
        ap.error(f"unknown attacks or defences: {unknown}")
    common = dict(preset=args.preset, peers=args.peers, inner_steps=args.inner_steps,
                  steps_per_peer=args.steps_per_peer, iid=args.iid, adjacent=args.adjacent, fit_share=args.fit_share)
    cleans = sorted({baseline(a) for a in attacks})
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    jobs = [dict(common, crowd=0, attack=c, defence=d, seed=s) for c in cleans for d in defences for s in seeds]
    jobs += [dict(common, crowd=c, attack=a, defence=d, seed=s) for c in crowds if c for a in attacks
             if ATTACKS[a].hostile is None or c <= args.max_trainers for d in defences for s in seeds]
    t0 = time.time()
    rows = []
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        for i, row in enumerate(pool.imap_unordered(run_one, jobs), 1):
            rows.append(row)
            print(f"[{i}/{len(jobs)} {time.time() - t0:.0f}s] {row['attack']} crowd={row['crowd']} "
                  f"{row['defence']} seed={row['seed']}: eval {row['eval_loss']:.3f} div {row['divergence']:.1e} "
                  f"weight {row.get('attacker_weight', 0):.2f} relayed {row.get('attacker_relayed', 0):.2f} "
                  f"({row['wall_s']}s)", flush=True)
    md = table(rows, crowds, attacks, defences)
    if not args.no_volunteer:
        ramp = [probation_multiplier(k, DefenceConfig().probation) for k in range(1, 6)]
        late = next(k for k, m in enumerate(ramp, 1) if m >= 1.0)
        volunteer = late_volunteer(args.preset, args.inner_steps, args.steps_per_peer, max(crowds))
        seen = "; ".join(f"update {k}: {', '.join(f'{m:g}' for m in v)}" for k, v in
                         volunteer["multipliers_by_seq"].items())
        md += (f"\n\nA late honest volunteer's k-th update merges at {', '.join(f'{m:g}' for m in ramp)} of its "
               f"weight (k = 1..5): full weight from its update {late} on, on every replica alike. Measured: a 4th "
               f"honest peer joining halfway through, with {max(crowds)} sign-flipping identities attacking, merged "
               f"on the 3 other replicas at {seen}.")
        rows.append({"late_volunteer": volunteer})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
