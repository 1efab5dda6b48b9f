"""Foundation benchmark: async p2p DiLoCo vs synchronous DiLoCo vs data-parallel, in the in-process swarm.

Every run uses the same model, data shards and token budget (inner steps summed over peers). Experiments:
  main      async vs sync vs dp, several seeds
  nesterov  outer Nesterov (0.7, 0.9) vs plain averaging (outer SGD, lr 1, no momentum), async and sync
  slow      one peer 4x slower: simulated wall-clock time to a target loss, async vs sync
  codecs    loss cost of fp32 / fp16 / int8 / int4 (async)
  bytes     bytes sent per peer per token for each codec at H=100, N=4, vs ring all-reduce of fp32 gradients

    python benchmarks/bench_diloco.py --preset tiny --seeds 0,1 --out benchmarks/results/diloco
writes OUT.json, OUT.png (loss curves) and prints the markdown tables that go into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from p2p_diloco.config import RunSpec, SimConfig, preset
from p2p_diloco.sim.plot import plot_curves
from p2p_diloco.sim.result import SimResult
from p2p_diloco.sim.runner import simulate
from p2p_diloco.train.data.corpus import load_corpus


def with_outer(spec: RunSpec, **kw) -> RunSpec:
    return dataclasses.replace(spec, outer=dataclasses.replace(spec.outer, **kw))


def run(label: str, spec: RunSpec, sim: SimConfig, corpus, log: list) -> SimResult:
    t0 = time.time()
    result = simulate(spec, sim, corpus)
    wall = time.time() - t0
    bpt = statistics.mean(p.bytes_per_token for p in result.peers)
    print(f"  {label:<28} eval_loss={result.eval_loss:.4f} sim_time={result.sim_time_s:.0f}s "
          f"bytes/token/peer={bpt:.3f} divergence={result.divergence:.1e} ({wall:.0f}s wall)", flush=True)
    log.append({"label": label, "spec": spec.to_dict(), "sim": dataclasses.asdict(sim), "wall_s": wall,
                "result": result.to_dict()})
    return result


def exp_main(spec, base, seeds, corpus, log, curves):
    rows = {}
    for method in ("async", "sync", "dp"):
        losses = []
        for seed in seeds:
            r = run(f"{method} seed={seed}", dataclasses.replace(spec, seed=seed),
                    dataclasses.replace(base, method=method), corpus, log)
            losses.append(r.eval_loss)
            if seed == seeds[0]:
                curves[method] = r.curve
        rows[method] = losses
    a, s, d = (statistics.median(rows[m]) for m in ("async", "sync", "dp"))
    print("\n| method | eval loss per seed | median | vs sync DiLoCo | vs data-parallel |\n|---|---|---|---|---|")
    for m in ("async", "sync", "dp"):
        med = statistics.median(rows[m])
        per_seed = ", ".join(f"{x:.4f}" for x in rows[m])
        print(f"| {m} | {per_seed} | {med:.4f} | {med / s - 1:+.2%} | {med / d - 1:+.2%} |")
    print(f"\nasync vs sync: {a / s - 1:+.2%} (target within 2%); async vs dp: {a / d - 1:+.2%} (target within 3%)")
    return rows


def exp_nesterov(spec, base, seeds, corpus, log, curves, main_rows=None):
    """The preset's outer step is Nesterov (0.7, 0.9): the main experiment's runs are reused for it."""
    print("\n| method | outer | eval loss per seed | median |\n|---|---|---|---|")
    for method in ("async", "sync"):
        for name, kw in (("Nesterov lr 0.7 mu 0.9", dict(outer_lr=0.7, momentum=0.9, nesterov=True)),
                         ("averaging (SGD lr 1)", dict(outer_lr=1.0, momentum=0.0))):
            if main_rows and name.startswith("Nesterov"):
                losses = main_rows[method]
            else:
                losses = [run(f"{method} {name} seed={seed}", with_outer(dataclasses.replace(spec, seed=seed), **kw),
                              dataclasses.replace(base, method=method), corpus, log).eval_loss for seed in seeds]
            print(f"| {method} | {name} | {', '.join(f'{x:.4f}' for x in losses)} | {statistics.median(losses):.4f} |")


def exp_slow(spec, base, corpus, log, curves):
    slow = dataclasses.replace(base, speeds=("1", "1", "1", "0.25"), eval_every_s=base.step_time_s * 5)
    results = {m: run(f"{m} one peer 4x slower", spec, dataclasses.replace(slow, method=m), corpus, log)
               for m in ("async", "sync")}
    target = max(r.eval_loss for r in results.values()) + 0.02
    print(f"\ntarget loss {target:.4f} (the worse final loss + 0.02)")
    print("| method | final loss | time to target (simulated s) |\n|---|---|---|")
    times = {}
    for m, r in results.items():
        times[m] = r.time_to_loss(target)
        curves[f"{m}, 1 peer 4x slower"] = r.curve
        reached = f"{times[m]:.0f}" if times[m] is not None else "never"
        print(f"| {m} | {r.eval_loss:.4f} | {reached} |")
    if all(times.values()):
        print(f"\nsync needs {times['sync'] / times['async']:.2f}x the wall-clock time of async to reach the target")


def exp_codecs(spec, base, corpus, log, curves):
    print("\n| codec | eval loss | vs fp32 |\n|---|---|---|")
    losses = {c: run(f"async codec={c}", with_outer(spec, codec=c), base, corpus, log).eval_loss
              for c in ("fp32", "fp16", "int8", "int4")}
    for c, loss in losses.items():
        print(f"| {c} | {loss:.4f} | {loss / losses['fp32'] - 1:+.2%} |")


def exp_bytes(corpus, log):
    """Bytes only: the test model, one round at H=100, N=4; the ratio does not depend on model size."""
    spec = dataclasses.replace(preset("test"), inner=dataclasses.replace(preset("test").inner, inner_steps=100))
    sim = SimConfig(peers=4, total_steps=400 * 2, eval_batches=1)
    dp = run("dp bytes", spec, dataclasses.replace(sim, method="dp"), corpus, log)
    dp_bpt = statistics.mean(p.bytes_per_token for p in dp.peers)
    print(f"\nH=100, N=4: data-parallel ring all-reduce sends {dp_bpt:.3f} bytes/token/peer\n"
          "| codec | bytes/token/peer | reduction vs data-parallel |\n|---|---|---|")
    for c in ("fp32", "fp16", "int8", "int4"):
        r = run(f"async bytes codec={c}", with_outer(spec, codec=c), sim, corpus, log)
        bpt = statistics.mean(p.bytes_per_token for p in r.peers)
        print(f"| {c} | {bpt:.4f} | {dp_bpt / bpt:.0f}x |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--inner-steps", type=int, default=50)
    ap.add_argument("--steps-per-peer", type=int, default=300, help="token budget = peers x this many inner steps")
    ap.add_argument("--experiments", default="main,nesterov,slow,codecs,bytes")
    ap.add_argument("--out", default="benchmarks/results/diloco")
    args = ap.parse_args()
    spec = preset(args.preset)
    spec = dataclasses.replace(spec, inner=dataclasses.replace(spec.inner, inner_steps=args.inner_steps,
                                                               decay_steps=args.steps_per_peer))
    base = SimConfig(peers=args.peers, total_steps=args.peers * args.steps_per_peer, eval_batches=16)
    seeds = [int(s) for s in args.seeds.split(",")]
    corpus = load_corpus(spec.data)
    log: list = []
    curves: dict = {}
    print(f"# {time.strftime('%Y-%m-%d')} preset={args.preset} N={args.peers} H={args.inner_steps} "
          f"budget={base.total_steps} inner steps ({base.total_steps * spec.data.batch_size * spec.model.block_size} "
          f"tokens) seeds={seeds}\n`{' '.join(sys.argv)}`", flush=True)
    exps = args.experiments.split(",")
    main_rows = exp_main(spec, base, seeds, corpus, log, curves) if "main" in exps else None
    if "nesterov" in exps:
        exp_nesterov(spec, base, seeds, corpus, log, curves, main_rows)
    if "slow" in exps:
        exp_slow(spec, base, corpus, log, curves)
    if "codecs" in exps:
        exp_codecs(spec, base, corpus, log, curves)
    if "bytes" in exps:
        exp_bytes(corpus, log)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(log, indent=1))
    if curves:
        plot_curves(curves, str(out.with_suffix(".png")), title=f"eval loss, preset {args.preset}, N={args.peers}")
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
