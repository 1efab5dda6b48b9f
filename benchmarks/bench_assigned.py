"""Did an update's author train on the data it was given? The loss gap on its own batches against unseen ones.

A judge of directions cannot tell an echo of published work, plus an identity's own noise, from honest work
trained beside the judge (BENCHMARKS "Echo crowds": 100 identities echoing a sponsor's update, +6.1%): both
point along the swarm's mean. And one update's loss change on shared held-out data is no judge with a file shard
per unit (BENCHMARKS "Can a paired loss change tell honest work from an attack?": 70% of honest updates raise
it late in a run). What compute leaves in an update and nothing else does is its fit to the batches it was
trained on. A unit's batches are a pure function of (seed, shard, stream, step) (`ShardSampler.batch`; a real
peer's stream is its PeerID), so anyone can redraw the batches of an author's phase (`steps`: the range its
update would declare) and, from the same sampler, batches at steps it has not reached. The measure
(templar's Gauntlet, on assigned pages against random ones):

    gap(u) = dL(u, trained batches) - dL(u, unseen batches of the same stream),  dL(u, B) = L_B(base) - L_B(base - u)

at the author's base (the point every replica can rebuild: bench_usefulness.py). Honest work should fit its
own batches better than unseen ones from the same stream (gap > 0); an echo of another unit's work, a copy, noise
or negated work should not: their fit to this author's batches is no better than to any other of its stream.
For every honest update it judges, at the same base, what an attacker would publish in its place: `negated`,
`noise` (honest length), `copy` (the latest step another unit published, scaled to the honest length),
`echo9` (that step at cosine 0.9 with the attacker's own noise: the echo crowd), and `echo_mix` (the mean of
every other unit's latest step plus noise at cosine 0.9: an echo of the swarm's sum). Rows: how often honest
work shows no gap (gap <= 0) and an attack shows one (gap > 0), per update and over an author's last k
updates; the median gap of each kind against the honest median; what a judgment costs.

    python benchmarks/bench_assigned.py --peers 4 --steps-per-peer 400 --inner-steps 20 --seeds 2 [--iid]
writes benchmarks/results/assigned[-iid].json and prints the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from bench_usefulness import stage

from p2p_diloco.config import SimConfig, preset
from p2p_diloco.sim.swarm import AsyncSwarm, SimPeer
from p2p_diloco.train.data.corpus import ShardSampler, evaluate, load_corpus
from p2p_diloco.train.inner import inner_step, make_inner_optimizer
from p2p_diloco.train.models.build import build_model, flat_params, load_flat_params

KINDS = ("honest", "negated", "noise", "copy", "echo9", "echo_mix", "fit_quarter")
UNSEEN = 10**7
"""Steps at which the unseen batches are drawn: far past any step a unit reaches in these runs."""


class GapSwarm(AsyncSwarm):
    """AsyncSwarm that keeps each update's base, phase steps and sampler, and judges the gap once per update."""

    def __init__(self, *args, batches: int, iid: bool = False, local: bool = False, **kwargs) -> None:
        self.iid, self.local = iid, local
        super().__init__(*args, **kwargs)
        self.model = build_model(self.spec.model, self.spec.seed)
        self.fitter = build_model(self.spec.model, self.spec.seed)  # the quarter-compute attacker's model
        self.batches, self.pick_rng = batches, torch.Generator().manual_seed(self.spec.seed + 5)
        self.noise_rng = torch.Generator().manual_seed(self.spec.seed + 7)
        self.info: dict[tuple[str, int], tuple[torch.Tensor, int, int, ShardSampler]] = {}
        self.latest: dict[str, torch.Tensor] = {}  # each author's latest published step, as a receiver decodes it
        self.rows: list[dict] = []
        self.forwards = 0

    def _add_peer(self, speed: float, state=None) -> SimPeer:
        peer = super()._add_peer(speed, state)
        spec = self.spec
        if self.iid:  # every unit samples the whole training split, each its own stream
            peer.learner.sampler = ShardSampler(self.corpus.train, shard=0, num_shards=1,
                                                block_size=spec.model.block_size, batch_size=spec.data.batch_size,
                                                seed=spec.seed, stream=f"unit{peer.index}")
        learner, finish = peer.learner, peer.learner.finish_phase

        def keep(phase, result, view):
            base = phase.base.clone()  # read before finish_phase turns the base buffer into the update
            first = learner.step - phase.steps_done
            update = finish(phase, result, view)
            self.info[(learner.peer_id, update.seq)] = (base, first, learner.step, learner.sampler)
            self._judge(learner, update)
            return update

        learner.finish_phase = keep  # type: ignore[method-assign]
        return peer

    def _loss(self, theta: torch.Tensor, batches: list) -> float:
        load_flat_params(self.model, theta)
        self.forwards += len(batches)
        return evaluate(self.model, batches)

    def _judge(self, learner, update) -> None:  # noqa: ANN001
        base, first, last, sampler = self.info[(learner.peer_id, update.seq)]
        h = update.header
        w = min(max(h.weight, 0.0), self.spec.outer.max_weight)
        step = self.spec.outer.outer_lr * w * learner.codec.decompress(update.payload, h.numel).float()
        others = [s for a, s in self.latest.items() if a != learner.peer_id]
        self.latest[learner.peer_id] = step
        if not others or last - first < self.batches:
            return
        length = step.norm()

        def noisy(direction: torch.Tensor) -> torch.Tensor:  # cos 0.9 with `direction`, at the honest length
            noise = torch.randn(step.numel(), generator=self.noise_rng)
            unit = direction / direction.norm()
            noise -= unit * torch.dot(noise, unit)
            return length * (0.9 * unit + (1 - 0.81) ** 0.5 * noise / noise.norm())

        other = others[int(torch.randint(len(others), (1,), generator=self.pick_rng))]
        noise = torch.randn(step.numel(), generator=self.noise_rng)
        echo = noisy(other)
        attacks = {"honest": step, "negated": -step, "noise": noise * (length / noise.norm()),
                   "copy": other * (length / other.norm()), "echo9": echo,
                   "echo_mix": noisy(torch.stack(others).mean(0)),
                   "fit_quarter": self._quarter_fit(base, sampler, first, last, echo)}
        trained = torch.randperm(last - first, generator=self.pick_rng)[: self.batches].tolist()
        unseen = torch.randint(UNSEEN, 2 * UNSEEN, (self.batches,), generator=self.pick_rng).tolist()
        sets = {"trained": [sampler.batch(first + i) for i in trained], "unseen": [sampler.batch(s) for s in unseen]}
        row: dict = {"t": self.steps_published / self.sim.total_steps, "author": learner.peer_id, "seq": update.seq}
        if self.local:  # at another unit's replica as it is now (what a sponsor holds), not at the author's base
            judge = next(p for p in self.peers if p.learner is not learner)
            base = judge.learner.replica.snapshot()[0]
        with torch.no_grad():  # per batch, so that rules other than the mean can be read from the rows
            at_base = {name: [self._loss(base, [b]) for b in bs] for name, bs in sets.items()}
            for kind, s in attacks.items():
                dl = {name: [before - self._loss(base - s, [b]) for before, b in zip(at_base[name], bs)]
                      for name, bs in sets.items()}
                unseen_mean = statistics.fmean(dl["unseen"])
                row[kind] = statistics.fmean(dl["trained"]) - unseen_mean
                row[f"unseen_{kind}"] = unseen_mean
                row[f"per_batch_{kind}"] = [d - unseen_mean for d in dl["trained"]]
        self.rows.append(row)

    def _quarter_fit(self, base: torch.Tensor, sampler: ShardSampler, first: int, last: int,
                     echo: torch.Tensor) -> torch.Tensor:
        """An echo that fakes the fit with a quarter of the compute: the inner steps on the first quarter of the
        phase's batches only, from the author's base (a fit 4x as concentrated as honest work's, on the batches
        it covers), at the echo's length, added to it, the sum at the honest length: the judge reads the fit on
        batches drawn from the whole phase."""
        spec = self.spec
        load_flat_params(self.fitter, base)
        optimizer = make_inner_optimizer(self.fitter, spec.inner)
        for i in range(max(1, (last - first) // 4)):
            inner_step(self.fitter, optimizer, *sampler.batch(first + i), 0, spec.inner, lr=spec.inner.lr)
        fit = base - flat_params(self.fitter)
        both = echo + fit * (echo.norm() / fit.norm())
        return both * (echo.norm() / both.norm())


def _share(hits: list[bool]) -> str:
    return f"{100 * sum(hits) / len(hits):.1f}%" if hits else "-"


def tables(rows: list[dict], sizes: tuple[int, ...] = (1, 2, 4)) -> str:
    """Per update, by stage: how often honest work shows no gap and an attack shows one; how often each clears a
    bar at a share of the honest median; by the author's record (the sum of its last k gaps, middle and late
    thirds); the median gap against the honest median."""
    ref = statistics.median(abs(r["honest"]) for r in rows) or 1.0
    out = ["| kind | early | middle | late | all | median gap / honest median | median dL on unseen batches |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for kind in KINDS:
        useful = kind != "honest"
        cells = [_share([(r[kind] > 0) == useful for r in rows if stage(r["t"]) == s])
                 for s in ("early", "middle", "late")]
        out.append(f"| {kind} ({'shows a gap' if useful else 'shows none'}) | {' | '.join(cells)} | "
                   f"{_share([(r[kind] > 0) == useful for r in rows])} | "
                   f"{statistics.median(r[kind] for r in rows) / ref:+.2f} | "
                   f"{statistics.median(r[f'unseen_{kind}'] for r in rows) / ref:+.2f} |")
    out += ["", "| a bar at ... of the honest median | honest under it | "
            + " | ".join(f"{k} over it" for k in KINDS[1:]) + " |", "|---:|" + "---:|" * len(KINDS)]
    for bar in (0.25, 0.5):
        cells = [_share([(r[kind] >= bar * ref) == (kind != "honest") for r in rows]) for kind in KINDS]
        out.append(f"| {bar} | {' | '.join(cells)} |")
    by_author: dict[tuple, list[dict]] = {}
    for r in rows:
        by_author.setdefault((r.get("seed"), r["author"]), []).append(r)
    out += ["", "| record of k updates | " + " | ".join(KINDS) + " | windows |", "|---:|" + "---:|" * (len(KINDS) + 1)]
    for k in sizes:
        windows = []
        for updates in by_author.values():
            updates.sort(key=lambda r: r["seq"])
            windows += [updates[i - k + 1: i + 1] for i in range(k - 1, len(updates)) if updates[i]["t"] >= 1 / 3]
        if windows:
            cells = [_share([(sum(r[kind] for r in w) > 0) == (kind != "honest") for w in windows]) for kind in KINDS]
            out.append(f"| {k} | {' | '.join(cells)} | {len(windows)} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="test")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--steps-per-peer", type=int, default=400)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--batches", type=int, default=4, help="trained and unseen batches per judgment (each)")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--iid", action="store_true", help="every unit samples the whole training split (no shards)")
    ap.add_argument("--local", action="store_true", help="judge at another unit's replica now, not at the base")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import logging

    logging.getLogger("p2p_diloco").setLevel(logging.ERROR)
    rows: list[dict] = []
    t0, forwards, updates = time.time(), 0, 0
    for seed in range(args.seeds):
        base = preset(args.preset)
        inner = dataclasses.replace(base.inner, inner_steps=args.inner_steps, decay_steps=args.steps_per_peer)
        spec = dataclasses.replace(base, seed=seed, inner=inner)
        total = args.peers * args.steps_per_peer
        sim = SimConfig(peers=args.peers, total_steps=total, eval_batches=4, eval_every_s=float(total), iid=False)
        swarm = GapSwarm(spec, sim, load_corpus(spec.data), batches=args.batches, iid=args.iid,
                         local=args.local)
        swarm.run()
        rows += [{**r, "seed": seed} for r in swarm.rows]
        forwards, updates = forwards + swarm.forwards, updates + len(swarm.rows)
    md = tables(rows)
    per = forwards / max(1, updates)
    H = args.inner_steps
    md += (f"\n\nOne judgment of one update: {2 * args.batches} x 2 forward passes of one batch (the kinds above share "
           f"the base's); a unit's phase: {H} training steps (~3 forward-equivalents each): {4 * args.batches}/{3 * H}"
           f" = {100 * 4 * args.batches / (3 * H):.1f}% of a unit's compute per judged update "
           f"(this run: {per:.0f} forwards per update for all {len(KINDS)} kinds).")
    print(md)
    out = Path(args.out or f"benchmarks/results/assigned{'-iid' if args.iid else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "table": md, "wall_s": round(time.time() - t0, 1)},
                              indent=1))
    print(f"\n{len(rows)} updates judged in {time.time() - t0:.0f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
