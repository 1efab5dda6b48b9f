"""Poisoning benchmark (issue 5): one of N peers is hostile; eval loss of the honest peers vs the clean run.

The in-process swarm (sim/adversary.py `HostileSwarm`, the real sign-verify-merge path) with peer N-1 hostile in
each mode, under each defence setting of the RunSpec (`defence`):

    attacks   clean (no attacker), nan (a NaN in the payload), scale (payload x100), scale5 (payload x5: still
              under the norm bound, the careful attacker), sign_flip (payload negated)
    defences  none             norm_bound 0, sum: only the invariants (signatures, finiteness) remain
              norm_bound       the default: reject and ban above the spec's per-coordinate bound (sync/robust.py)
              coord_clip       clip each coordinate to coord_clip x that bound, keep the sender (norm bound off)
              centered_clip    CenteredClip around this replica's recent updates (norm bound off)
              norm+coord_clip  both;  norm+centered  both

The clean row under each defence is that defence's cost to convergence. "nan, banned not weighed": as nan, but
senders weigh their updates without the peer every live peer has banned (the plain simulator, like the real
peer list, still counts it, so a banned peer costs the swarm its share of every outer step). The nan row is
what banning at the first update achieves: the attacker's compute and its data shard are lost to the swarm.
"shard lost" is the reference for that: no attacker, but the would-be attacker trains on the next peer's
shard instead of its own, so its shard is seen by nobody (an N-1 peer run over N-1 shards is no reference: it
sees all the data). Every run has the same model, shards, token budget and seed; losses are the mean over the
honest peers' replicas (held-out split, nats per byte).

    python benchmarks/bench_poison.py --steps-per-peer 200 --jobs 2 --out benchmarks/results/poison
writes OUT.json (every run), OUT.md (the tables) and OUT.log (this output).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import sys
import time
from pathlib import Path

from p2p_diloco.config import DefenceConfig, RunSpec, SimConfig, preset
from p2p_diloco.sim.adversary import Adversary, HostileSwarm, Hostility
from p2p_diloco.sync.robust import honest_coord_bound
from p2p_diloco.train.data.corpus import load_corpus

DEFENCES = {
    "none": DefenceConfig(norm_bound=0.0, aggregation="sum"),
    "norm_bound": DefenceConfig(),
    "coord_clip": DefenceConfig(norm_bound=0.0, aggregation="coord_clip"),
    "centered_clip": DefenceConfig(norm_bound=0.0, aggregation="centered_clip"),
    "norm+coord_clip": DefenceConfig(aggregation="coord_clip"),
    "norm+centered": DefenceConfig(aggregation="centered_clip"),
}
ATTACKS = {"clean": (None, 1.0), "nan": (Hostility.NAN, 1.0), "scale": (Hostility.SCALE, 100.0),
           "scale5": (Hostility.SCALE, 5.0), "sign_flip": (Hostility.SIGN_FLIP, 1.0)}
REWEIGHED = "nan, banned not weighed"
SHARD_LOST = "shard lost (no attack)"
_CORPUS: dict = {}


def run_one(job: tuple[str, str, dict, dict]) -> dict:
    """One simulation (in a worker process); returns its row."""
    import logging

    import torch

    torch.set_num_threads(1)
    logging.getLogger("p2p_diloco").setLevel(logging.ERROR)  # rejections are the point here; they are counted
    attack, defence, spec_dict, sim_dict, hostile = job
    spec = RunSpec.from_dict(spec_dict)
    sim = SimConfig(**sim_dict)
    if "corpus" not in _CORPUS:
        _CORPUS["corpus"] = load_corpus(spec.data)
    mode, factor = ATTACKS.get("nan" if attack == REWEIGHED else attack, (None, 1.0))
    adversaries = [Adversary(hostile, mode, factor=factor)] if mode is not None else []
    t0 = time.time()
    if attack == SHARD_LOST:
        swarm = ShardLostSwarm(spec, sim, _CORPUS["corpus"], lost_shard=hostile)
    else:
        swarm = HostileSwarm(spec, sim, _CORPUS["corpus"], adversaries, weigh_banned=attack != REWEIGHED)
    result = swarm.run()
    summary = swarm.honest_summary(result)
    return {"attack": attack, "defence": defence, "wall_s": time.time() - t0, "sim_time_s": result.sim_time_s,
            **summary, "honest_peak_ratio": honest_peak_ratio(swarm, spec),
            "peers": [dataclasses.asdict(p) for p in result.peers]}


class ShardLostSwarm(HostileSwarm):
    """No attacker; peer `lost_shard` trains on the next peer's shard, so shard `lost_shard` is seen by nobody."""

    def __init__(self, spec: RunSpec, sim: SimConfig, corpus, *, lost_shard: int) -> None:  # noqa: ANN001
        self.lost_shard = lost_shard
        super().__init__(spec, sim, corpus)

    def _shard_of(self, index: int) -> int:
        shard = super()._shard_of(index)
        return (shard + 1) % self.num_shards if shard == self.lost_shard else shard


def honest_peak_ratio(swarm: HostileSwarm, spec: RunSpec) -> float:
    """The largest coordinate of any honest peer's own update, as a fraction of the norm bound's unit."""
    bound, peak = honest_coord_bound(spec), 0.0
    for peer in swarm.peers:
        if peer.index in swarm.adversaries:
            continue
        codec = peer.learner.codec
        for sender in peer.store.senders():
            if sender != peer.learner.peer_id:
                continue
            for seq in range(1, peer.learner.replica.version_vector.get(sender) + 1):
                update = peer.store.get(sender, seq)
                if update is not None:
                    d = codec.decompress(update.payload, update.header.numel)
                    peak = max(peak, float(d.abs().max()) / bound)
    return peak


def tables(rows: list[dict], attacks: list[str], defences: list[str], hostile: int, peers: int) -> str:
    by = {(r["attack"], r["defence"]): r for r in rows}
    clean = by.get(("clean", "none"), {}).get("eval_loss")
    out = [f"| attack (peer {hostile} of {peers}) | " + " | ".join(defences) + " |",
           "|---" * (len(defences) + 1) + "|"]
    for attack in [*attacks, REWEIGHED, SHARD_LOST]:
        cells = []
        for defence in defences:
            r = by.get((attack, defence))
            if r is None:
                cells.append("-")
                continue
            rel = f" ({r['eval_loss'] / clean - 1:+.1%})" if clean else ""
            ban = " banned" if r["banned"] else ""
            cells.append(f"{r['eval_loss']:.4f}{rel}{ban}")
        out.append(f"| {attack} | " + " | ".join(cells) + " |")
    out += ["", "Per run: honest replica divergence (max over honest peers of |theta_i - mean| / |mean|), the largest",
            "honest coordinate as a fraction of the norm bound's unit, and the rejections the honest peers counted:",
            "", "| attack | defence | divergence | largest honest coordinate / bound | rejections |",
            "|---|---|---|---|---|"]
    for r in rows:
        rejected = {k: v for k, v in r["counts"].items() if k not in ("merged", "buffered", "duplicate")}
        out.append(f"| {r['attack']} | {r['defence']} | {r['divergence']:.1e} | {r['honest_peak_ratio']:.3f} | "
                   f"{rejected or '-'} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="test")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--inner-steps", type=int, default=50)
    ap.add_argument("--steps-per-peer", type=int, default=200, help="token budget = peers x this many inner steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--defences", default=",".join(DEFENCES))
    ap.add_argument("--jobs", type=int, default=1, help="simulations run in parallel (one torch thread each)")
    ap.add_argument("--hostile-peer", type=int, default=None, help="which peer attacks (default: the last)")
    ap.add_argument("--clip-radius", type=float, default=None, help="override defence.clip_radius (centered_clip)")
    ap.add_argument("--out", default="benchmarks/results/poison")
    args = ap.parse_args()
    attacks, defences = args.attacks.split(","), args.defences.split(",")
    base = preset(args.preset)
    inner = dataclasses.replace(base.inner, inner_steps=args.inner_steps, decay_steps=args.steps_per_peer)
    total = args.peers * args.steps_per_peer // (args.peers * args.inner_steps) * (args.peers * args.inner_steps)
    sim = SimConfig(peers=args.peers, total_steps=total, eval_batches=16, eval_every_s=float(total),
                    iid=False)  # a shard per unit, as measured in BENCHMARKS.md
    settings = {d: dataclasses.replace(DEFENCES[d], clip_radius=args.clip_radius) if args.clip_radius else
                DEFENCES[d] for d in defences}
    hostile = args.peers - 1 if args.hostile_peer is None else args.hostile_peer
    if not 0 <= hostile < args.peers:
        ap.error(f"--hostile-peer must be in [0, {args.peers}), got {hostile}")
    jobs = [(a, d, dataclasses.replace(base, seed=args.seed, inner=inner, defence=settings[d]).to_dict(),
             dataclasses.asdict(sim), hostile) for a in attacks for d in defences]
    if "nan" in attacks and "none" in defences:
        plain = next(j[2] for j in jobs if j[:2] == ("nan", "none"))
        jobs += [(extra, "none", plain, dataclasses.asdict(sim), hostile) for extra in (REWEIGHED, SHARD_LOST)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 (closed below; written as we go)

    def say(line: str) -> None:
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    say(f"# {time.strftime('%Y-%m-%d')} preset={args.preset} N={args.peers} H={args.inner_steps} budget={total} "
        f"inner steps seed={args.seed}; hostile peer: {hostile}\n`{' '.join(sys.argv)}`")
    rows: list[dict] = []
    t0 = time.time()
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        for row in pool.imap_unordered(run_one, jobs):
            rows.append(row)
            say(f"  {row['attack']:<9} {row['defence']:<13} eval_loss={row['eval_loss']:.4f} "
                f"divergence={row['divergence']:.1e} banned={row['banned']} ({row['wall_s']:.0f}s wall)")
    order = [*attacks, REWEIGHED, SHARD_LOST]
    rows.sort(key=lambda r: (order.index(r["attack"]), defences.index(r["defence"])))
    md = tables(rows, attacks, defences, hostile, args.peers)
    say("\n" + md + f"\n\ntotal wall time {time.time() - t0:.0f}s")
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1, default=str))
    out.with_suffix(".md").write_text(md + "\n")
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
