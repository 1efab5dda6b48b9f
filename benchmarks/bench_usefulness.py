"""How well does a loss change tell useful work from harm? The measurement a usefulness-weighted merge rests on.

An open run's merge weight should follow how an update's work changes the loss on data its author did not
choose (ARCHITECTURE.md "Who counts"). Before building that rule, this measures the signal it would read, on the
in-process swarm (sim/swarm.py: the real learner, merge rule and round loop), honest peers only:

    paired loss change  dL(u, theta) = L(theta) - L(theta - outer_lr * w * decode(u))   (> 0: u helps at theta)

on `--batches` held-out batches drawn from the eval split (a fresh draw per judgment: the author cannot pick
them). Two points to judge at:

    base    the replica the author last rebased onto before it published u (train/learner.py: u = base - phi,
            Nesterov'd): one point every replica can rebuild from the author's version vector then (merges are
            sums: sync/replica.py rule 1), the point the author itself stood on
    local   the receiving replica's theta when u arrives: what a peer holds without any undo, different on
            every replica and at every arrival time

For every honest update it also judges, at the same base point, what an attacker would publish in its place:
`negated` (trains and publishes minus its work: the issue's "train and negate"), `near_copy` (negated plus 5%
noise of its own: no two are copies), `noise` (a random direction at the honest length) and `scale3` (three
times the honest update: within most norm bounds early on). Rows: the fraction of honest updates judged harmful
(dL <= 0) and of attack updates judged useful (dL > 0), early / middle / late in the run, and with 1, 4 or 16
batches; the median dL of each kind relative to the honest median; what a judgment costs in forward passes.

    python benchmarks/bench_usefulness.py --peers 4 --steps-per-peer 400 --inner-steps 20 --seeds 2
writes benchmarks/results/usefulness.json and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from p2p_diloco.config import SimConfig, preset
from p2p_diloco.sim.adversary import tilt
from p2p_diloco.sim.swarm import AsyncSwarm, SimPeer
from p2p_diloco.train.data.corpus import Corpus, ShardSampler, eval_batches, evaluate, load_corpus
from p2p_diloco.train.models.build import build_model, load_flat_params

KINDS = ("honest", "negated", "near_copy", "noise", "scale3", "tilt9")
STAGES = ("early", "middle", "late")


class Judge:
    """Paired loss changes on fresh held-out batches, with one scratch model."""

    def __init__(self, swarm: AsyncSwarm, corpus: Corpus, batches: int, seed: int) -> None:
        spec = swarm.spec
        self.model = build_model(spec.model, spec.seed)
        self.pool = eval_batches(corpus, block_size=spec.model.block_size, batch_size=spec.data.batch_size,
                                 num_batches=256, seed=seed + 99)
        self.batches, self.rng = batches, torch.Generator().manual_seed(seed)
        self.forwards = 0

    def change(self, theta: torch.Tensor, step: torch.Tensor, n: int | None = None) -> float:
        """L(theta) - L(theta - step) on `n` (default: all `batches`) batches drawn afresh."""
        n = n or self.batches
        pick = torch.randperm(len(self.pool), generator=self.rng)[:n].tolist()
        batches = [self.pool[i] for i in pick]
        with torch.no_grad():
            load_flat_params(self.model, theta)
            before = evaluate(self.model, batches)
            load_flat_params(self.model, theta - step)
            after = evaluate(self.model, batches)
        self.forwards += 2 * n
        return before - after


class MeasuredSwarm(AsyncSwarm):
    """AsyncSwarm that keeps each author's phase-start theta and judges every update as it is received."""

    def __init__(self, *args, judge_batches: int, iid: bool = False, **kwargs) -> None:
        self.iid = iid
        super().__init__(*args, **kwargs)
        self.bases: dict[tuple[str, int], torch.Tensor] = {}
        self.rows: list[dict] = []
        self.judge = Judge(self, self.corpus, judge_batches, self.spec.seed)
        self.noise_rng = torch.Generator().manual_seed(self.spec.seed + 7)
        self.judged: set[tuple[str, int]] = set()
        self.own: dict[str, torch.Tensor] = {}

    def _add_peer(self, speed: float, state=None) -> SimPeer:
        peer = super()._add_peer(speed, state)
        if self.iid:  # every unit samples the whole training split, each its own stream
            spec = self.spec
            peer.learner.sampler = ShardSampler(self.corpus.train, shard=0, num_shards=1,
                                                block_size=spec.model.block_size, batch_size=spec.data.batch_size,
                                                seed=spec.seed, stream=f"unit{peer.index}")
        learner, finish = peer.learner, peer.learner.finish_phase

        def keep_base(phase, result, view):
            # Published as base - phi where `base` is the replica it last rebased onto (train/learner.py): the
            # point its author stood on, every remote update it held included. Read before finish_phase, which
            # turns the base buffer into the update in place.
            base = phase.base.clone()
            update = finish(phase, result, view)
            self.bases[(learner.peer_id, update.seq)] = base
            # The judge's own work (a sponsor's view): its last published step, decoded as a receiver would.
            self.own[learner.peer_id] = learner.codec.decompress(update.payload, update.header.numel).float()
            return update

        learner.finish_phase = keep_base  # type: ignore[method-assign]
        return peer

    def _receive(self, peer: SimPeer, data: bytes) -> None:
        from p2p_diloco.wire.envelope import decode_update

        update = decode_update(data, max_bytes=1 << 30)
        key = (update.sender, update.seq)
        base = self.bases.get(key)
        if base is not None:
            learner = peer.learner
            h = update.header
            w = min(max(h.weight, 0.0), self.spec.outer.max_weight)
            step = self.spec.outer.outer_lr * w * learner.codec.decompress(update.payload, h.numel).float()
            row = {"t": self.steps_published / self.sim.total_steps, "tau": h.tau, "author": update.sender,
                   "seq": update.seq, "local": self.judge.change(learner.replica.snapshot()[0], step)}
            if key not in self.judged:  # the base-point judgments once per update (the same on every replica)
                self.judged.add(key)
                noise = torch.randn(step.numel(), generator=self.noise_rng)
                attacks = {"honest": step, "negated": -step,
                           "near_copy": -step + 0.05 * step.norm() * noise / noise.norm(),
                           "noise": noise * (step.norm() / noise.norm()), "scale3": 3 * step}
                # sim/adversary.py `tilted` at 0.9: negated, tilted toward theta's move since the author's last
                # update (its first update is honest, as the attacker's is)
                previous = self.bases.get((update.sender, update.seq - 1))
                attacks["tilt9"] = step if previous is None else tilt(step, previous - base, 0.9)
                row.update({kind: self.judge.change(base, s) for kind, s in attacks.items()})
                own = self.own.get(learner.peer_id)
                if own is not None:  # the receiver judges by the direction of its own latest work
                    row.update({f"cos_{kind}": float(torch.nn.functional.cosine_similarity(s, own, dim=0))
                                for kind, s in attacks.items()})
                row.update({f"honest_{n}": self.judge.change(base, step, n) for n in (1, 4, 16)})
            self.rows.append(row)
        super()._receive(peer, data)


def stage(t: float) -> str:
    return STAGES[min(2, int(3 * t))]


def table(rows: list[dict]) -> str:
    base_rows = [r for r in rows if "honest" in r]
    ref = statistics.median(abs(r["honest"]) for r in base_rows) or 1.0
    out = ["| judged at | kind | early | middle | late | all | median dL / honest median |",
           "|---|---|---:|---:|---:|---:|---:|"]

    def frac(rs: list[dict], key: str, useful: bool) -> str:
        if not rs:
            return "-"
        hit = sum((r[key] > 0) == useful for r in rs)
        return f"{100 * hit / len(rs):.1f}%"

    for kind in KINDS:
        useful = kind != "honest"  # honest: how often judged harmful; an attack: how often judged useful
        cells = [frac([r for r in base_rows if stage(r["t"]) == s], kind, useful) for s in STAGES]
        med = statistics.median(r[kind] for r in base_rows) / ref
        out.append(f"| base | {kind} (judged {'useful' if useful else 'harmful'}) | {' | '.join(cells)} | "
                   f"{frac(base_rows, kind, useful)} | {med:+.2f} |")
    local = [r for r in rows if "local" in r]
    cells = [frac([r for r in local if stage(r["t"]) == s], "local", False) for s in STAGES]
    out.append(f"| local | honest (judged harmful) | {' | '.join(cells)} | {frac(local, 'local', False)} | "
               f"{statistics.median(r['local'] for r in local) / ref:+.2f} |")
    for n in (1, 4, 16):
        cells = [frac([r for r in base_rows if stage(r["t"]) == s], f"honest_{n}", False) for s in STAGES]
        out.append(f"| base, {n} batch{'es' if n > 1 else ''} | honest (judged harmful) | {' | '.join(cells)} | "
                   f"{frac(base_rows, f'honest_{n}', False)} | |")
    stale = [r for r in local if r["tau"] >= 2]
    if stale:
        out.append(f"| local, tau >= 2 | honest (judged harmful) | | | | {frac(stale, 'local', False)} "
                   f"(n={len(stale)}) | |")
    return "\n".join(out)


def record_table(rows: list[dict], sizes: tuple[int, ...] = (1, 2, 4, 8)) -> str:
    """An author judged on its record: the sum of the base-point dL of its last k updates (each window of k
    consecutive updates of one author), against the same sum for what an attacker would publish in their place.
    Rows: how often an honest record is judged harmful (sum <= 0) and an attack's record useful (sum > 0), for
    windows ending in the middle or late third of the run (where single updates are judged worst)."""
    return _records([r for r in rows if "honest" in r and "author" in r], sizes, "")


def direction_table(rows: list[dict], sizes: tuple[int, ...] = (1, 4, 8)) -> str:
    """A receiver judging by direction: the cosine of an update (or what an attacker would publish in its place)
    with the receiver's own latest published step, data the author did not choose. Per single update and summed
    over an author's last k updates (middle and late thirds); and the median cosine of each kind."""
    crows = [r for r in rows if "cos_honest" in r and r["t"] >= 1 / 3]
    if not crows:
        return ""
    meds = ", ".join(f"{kind} {statistics.median(r[f'cos_{kind}'] for r in crows):+.3f}" for kind in KINDS)
    return _records(crows, sizes, "cos_") + f"\n\nMedian cosine with the receiver's own latest step: {meds}"


def _records(rows: list[dict], sizes: tuple[int, ...], prefix: str) -> str:
    """The table of records: for each k, over every window of k consecutive updates of one author that ends in
    the middle or late third, how often the summed judgment (`prefix + kind`) calls honest work harmful and an
    attack useful."""
    by_author: dict[tuple, list[dict]] = {}
    for r in rows:
        by_author.setdefault((r.get("seed"), r["author"]), []).append(r)
    out = ["| record of k updates | " + " | ".join(f"{kind} (judged {'useful' if kind != 'honest' else 'harmful'})"
                                                   for kind in KINDS) + " | windows |",
           "|---:|" + "---:|" * (len(KINDS) + 1)]
    for k in sizes:
        windows = []
        for updates in by_author.values():
            updates.sort(key=lambda r: r["seq"])
            windows += [updates[i - k + 1: i + 1] for i in range(k - 1, len(updates)) if updates[i]["t"] >= 1 / 3]
        if not windows:
            continue
        cells = []
        for kind in KINDS:
            useful = kind != "honest"
            hit = sum((sum(r[prefix + kind] for r in w) > 0) == useful for w in windows)
            cells.append(f"{100 * hit / len(windows):.1f}%")
        out.append(f"| {k} | {' | '.join(cells)} | {len(windows)} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="test")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--steps-per-peer", type=int, default=400)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--batches", type=int, default=4, help="held-out batches per judgment")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--timing-noise", action="store_true", help="the real swarms' timing (async_timing's noise)")
    ap.add_argument("--iid", action="store_true", help="every unit samples the whole training split (no shards)")
    ap.add_argument("--out", default="benchmarks/results/usefulness.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import logging

    logging.getLogger("p2p_diloco").setLevel(logging.ERROR)
    rows: list[dict] = []
    t0 = time.time()
    forwards = 0
    updates = 0
    for seed in range(args.seeds):
        base = preset(args.preset)
        inner = dataclasses.replace(base.inner, inner_steps=args.inner_steps, decay_steps=args.steps_per_peer)
        spec = dataclasses.replace(base, seed=seed, inner=inner)
        total = args.peers * args.steps_per_peer
        noise = dict(start_spread_s=1.0, phase_jitter=0.15, latency_s=0.15, latency_jitter_s=0.3) \
            if args.timing_noise else {}
        sim = SimConfig(peers=args.peers, total_steps=total, eval_batches=4, eval_every_s=float(total),
                        iid=False, **noise)  # a shard per unit here unless --iid (as measured in BENCHMARKS.md)
        swarm = MeasuredSwarm(spec, sim, load_corpus(spec.data), judge_batches=args.batches, iid=args.iid)
        swarm.run()
        rows += [{**r, "seed": seed} for r in swarm.rows]
        forwards += swarm.judge.forwards
        updates += len(swarm.judged)
    md = table(rows) + "\n\nBy the author's record (middle and late thirds):\n\n" + record_table(rows)
    md += "\n\nBy direction, against the receiver's own work (middle and late thirds):\n\n" + direction_table(rows)
    H, bs = args.inner_steps, preset(args.preset).data.batch_size
    cost = (f"\nOne judgment: 2 x {args.batches} forward passes of batch {bs}; a unit's phase: {H} training steps "
            f"(~3 forward-equivalents each) = {3 * H} forwards: judging every update of N peers costs "
            f"N x {2 * args.batches}/{3 * H} = N x {100 * 2 * args.batches / (3 * H):.1f}% of a unit's compute.")
    print(md + cost)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "table": md,
                                          "wall_s": round(time.time() - t0, 1), "updates": updates}, indent=1))
    print(f"\n{len(rows)} judgments of {updates} updates in {time.time() - t0:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
