"""The timing matrix: how much an async swarm's final loss depends on when its updates land, for synchronous
DiLoCo, the old default outer step and the new one, side by side on equal tokens, in one run.

    python benchmarks/async_timing.py --seeds 8 --real 5 --out benchmarks/results/async_timing.json

Scenarios (the `test` preset, N=4, H=50, 2,000 inner steps in all, lr decayed over each unit's 500 steps; every
unit samples the whole training split in its own stream, as real peers do; `--shards`: a file shard each):
- **noise**: the simulator with the timing measured from real local swarms (BENCHMARKS.md, "Session 2"):
  steps of 0.032 s, start spread 1 s, phase jitter 0.15, latency 0.15 s + uniform(0, 0.3) s, under
  `--seeds` timing seeds. Sync DiLoCo waits for every unit, so its result does not depend on the seed.
- **orderly**: every unit starts at 0, every phase lasts exactly H steps, 50 ms latency.
- **slow**: orderly, one unit 4x slower (speeds 1, 1, 1, 0.25): final loss at equal tokens, and the simulated
  time to reach a target loss (the worse final loss of sync DiLoCo and the new default, + 0.02).
- **run-seeds** (not in the default list): orderly timing, `--seeds` seeds of the run itself (model init,
  data order) instead of timing seeds: how much a result moves with luck that has nothing to do with timing,
  for sync DiLoCo too. The yardstick for the noise scenario's spread.
- **real** (`--real K`): K real local swarms (examples/local_swarm.py, 4 processes on loopback, 10 rounds)
  with the new default; the mean eval loss of the replicas per swarm.

Methods: `sync-diloco` (DiLoCo: outer Nesterov lr 0.7, mu 0.9), `async-old` (the same outer step, as the
async default was: the lr schedule on each unit's own steps, remote updates rebased at every step) and
`async-new` (the RunSpec's and the simulator's defaults now: a grace window of 0.5, the outer step's ramp),
`async-grace` (the same, named), `async-no-window` (the defaults with no window);
`sync-new` is synchronous DiLoCo with the new outer step (and its ramp), to separate what the outer step gains in
lockstep from what it gains under async timing. `sync-ramp`, `async-ramp` (no window), `async-ramp-grace`: the ramp
to DiLoCo's step after 10 swarm rounds, named (`outer.schedule ramp`, the default); `sync-constant`,
`async-constant`: without it (the same as with it over the 10 rounds here, not over 100).
`--candidates FILE` adds more (a JSON list of {"name", "outer", "inner", "sim"} overrides) for the search that
chose the default.

Writes a JSON list of rows with `method`, `scenario`, `losses`, `median`, `worst`, `sync_median` (sync DiLoCo's
median in the same scenario), `round_losses` / `round_median` / `round_worst` (the round view: the model without
the round still under way, sync/round_view.py; a sync run is always at a complete round) and, for `slow`,
`time_to_target_s`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOISE = {"step_time_s": 0.032, "latency_s": 0.15, "latency_jitter_s": 0.3, "start_spread_s": 1.0,
         "phase_jitter": 0.15}
ORDERLY = {"step_time_s": 1.0, "latency_s": 0.05}
SLOW = {**ORDERLY, "speeds": ("1", "1", "1", "0.25"), "eval_every_s": 25.0}
OLD_OUTER = {"outer_lr": 0.7, "momentum": 0.9, "nesterov": True}
OLD_INNER = {"schedule_clock": "own", "rebase_window": 1.0}
METHODS = {
    "sync-diloco": {"sim": "sync", "outer": OLD_OUTER, "inner": OLD_INNER},
    "async-old": {"sim": "async", "outer": OLD_OUTER, "inner": OLD_INNER, "grace": 0.0},
    "async-new": {"sim": "async", "outer": {}, "inner": {}},  # the defaults: the grace window of 0.5 since it
    "async-no-window": {"sim": "async", "outer": {}, "inner": {}, "grace": 0.0},  # became one; the default before
    "sync-new": {"sim": "sync", "outer": {}, "inner": {}},  # sync DiLoCo with the new outer step, for reference
    # the new step without its ramp (the default before 2026-11-29): over 10 rounds the same as with it
    "sync-constant": {"sim": "sync", "outer": {"schedule": "constant"}, "inner": {}},
    "async-constant": {"sim": "async", "outer": {"schedule": "constant"}, "inner": {}},
    "async-grace": {"sim": "async", "outer": {}, "inner": {}, "grace": 0.5},  # the defaults and a grace window
    # the new step with its ramp to DiLoCo's after 10 swarm rounds (outer.schedule ramp): over the 10 rounds of the
    # matrix the same as without; over 100 (long_run.py) not
    "sync-ramp": {"sim": "sync", "outer": {"schedule": "ramp"}, "inner": {}},
    "async-ramp": {"sim": "async", "outer": {"schedule": "ramp"}, "inner": {}, "grace": 0.0},  # = async-no-window
    "async-ramp-grace": {"sim": "async", "outer": {"schedule": "ramp"}, "inner": {}, "grace": 0.5},
}


def candidate(c: dict) -> dict:
    """A method from a `--candidates` entry ({"name", "outer", "inner", "sim", "grace"}, all but name optional)."""
    return {"sim": c.get("sim", "async"), "outer": c.get("outer", {}), "inner": c.get("inner", {}),
            **grace_of(c)}


def grace_of(method: dict) -> dict:
    """The method's grace window as SimConfig keywords: its own if it names one, else the simulator's default."""
    return {"grace": method["grace"]} if "grace" in method else {}


def spec_for(method: dict, H: int = 50, budget_per_unit: int = 500):
    from p2p_diloco.config import preset

    spec = preset("test")
    inner = dataclasses.replace(spec.inner, **{"inner_steps": H, "decay_steps": budget_per_unit,
                                               **method.get("inner", {})})
    return dataclasses.replace(spec, inner=inner, outer=dataclasses.replace(spec.outer, **method.get("outer", {})))


def run_one(job: tuple) -> dict:
    """One simulation (in a worker process, one torch thread)."""
    name, method, scenario, sim_over, seed = job
    import torch

    torch.set_num_threads(1)
    from p2p_diloco.config import SimConfig
    from p2p_diloco.sim.runner import simulate

    spec = spec_for(method)
    if scenario == "run-seeds":  # the seed of the run itself (model init, data order), timing orderly
        spec, timing_seed = dataclasses.replace(spec, seed=seed), 0
    else:
        timing_seed = seed
    sim = SimConfig(peers=4, total_steps=2000, method=method["sim"], timing_seed=timing_seed,
                    **grace_of(method), **sim_over)
    result = simulate(spec, sim)
    return {"method": name, "scenario": scenario, "seed": seed, "loss": result.eval_loss,
            "utilization": statistics.mean(p.utilization for p in result.peers), "sim_time_s": result.sim_time_s,
            "round_loss": result.round_loss,  # the model without the round under way (sync/round_view.py)
            "tail_loss": result.tail_loss,
            "curve": [(p.time_s, p.tokens, p.loss) for p in result.curve]}


def time_to(curve: list, target: float) -> float | None:
    return next((t for t, _, loss in curve if loss <= target), None)


def real_swarms(k: int, workdir: Path, graces: tuple[float | None, ...] = (None,)) -> dict[float | None, list[float]]:
    """K real local swarms with the RunSpec's defaults per grace window (None: the default's, 0: none), alternating
    so that a machine's load falls on each alike (bench_swarm.py runs and evaluates them): {grace: losses}."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_swarm

    from p2p_diloco.train.data.corpus import eval_batches, load_corpus

    spec = spec_for(METHODS["async-new"], budget_per_unit=500)
    corpus = load_corpus(spec.data)
    batches = eval_batches(corpus, block_size=spec.model.block_size, batch_size=spec.data.batch_size, num_batches=16)
    args = argparse.Namespace(peers=4, inner_steps=50, rounds=10, preset="test", codec=spec.outer.codec,
                              outer_lr=spec.outer.outer_lr, momentum=spec.outer.momentum)
    losses: dict[float | None, list[float]] = {grace: [] for grace in graces}
    for i in range(k):
        for grace in graces:
            run = workdir / f"real{i}-grace{grace}"
            bench_swarm.run_real(argparse.Namespace(**vars(args), grace=grace), run)
            rows = bench_swarm.real_rows(run, spec, 4, batches)
            losses[grace].append(statistics.mean(r["eval_loss"] for r in rows))
            util = statistics.mean(r["util"] for r in rows)
            print(f"real swarm {i}, grace {grace}: {losses[grace][-1]:.4f}  utilization {util:.0%}", flush=True)
    return losses


def summarize(results: list[dict], real: dict[float | None, list[float]]) -> list[dict]:
    by = {}
    for r in results:
        by.setdefault((r["method"], r["scenario"]), []).append(r)
    rows = []
    for (name, scenario), runs in sorted(by.items()):
        runs.sort(key=lambda r: r["seed"])
        losses = [r["loss"] for r in runs]
        sync = [r["loss"] for r in by.get(("sync-diloco", scenario), [])]
        rounds = [r["round_loss"] for r in runs if r.get("round_loss") is not None]
        tails = [r["tail_loss"] for r in runs if r.get("tail_loss") is not None]
        rows.append({"method": name, "scenario": scenario, "seeds": [r["seed"] for r in runs], "losses": losses,
                     "median": statistics.median(losses), "worst": max(losses),
                     "sync_median": statistics.median(sync) if sync else None, "round_losses": rounds,
                     "round_median": statistics.median(rounds) if rounds else None,
                     "round_worst": max(rounds) if rounds else None,
                     "tail_median": statistics.median(tails) if tails else None,
                     "utilization": statistics.median(r["utilization"] for r in runs) if "utilization" in runs[0]
                     else None})
    slow = {r["method"]: r for r in results if r["scenario"] == "slow"}
    if "sync-diloco" in slow and "async-new" in slow:
        target = max(slow["sync-diloco"]["loss"], slow["async-new"]["loss"]) + 0.02
        for row in rows:
            if row["scenario"] == "slow":
                row["target"] = target
                row["time_to_target_s"] = time_to(slow[row["method"]]["curve"], target)
    # Under timing noise, the same question at sync with the new step's loss (+0.02): how soon, on the clock, and
    # how many timing seeds get there at all (a grace window trades idle time for loss: train/grace.py).
    sync_new = by.get(("sync-new", "noise"))
    if sync_new:
        target = sync_new[0]["loss"] + 0.02
        for row in rows:
            if row["scenario"] == "noise":
                times = [time_to(r["curve"], target) for r in by[(row["method"], "noise")]]
                reached = sorted(t for t in times if t is not None)
                row["target"] = target
                row["reached"] = f"{len(reached)}/{len(times)}"
                row["time_to_target_s"] = statistics.median(reached) if len(reached) * 2 > len(times) else None
    if real:
        noise_sync = next((r["median"] for r in rows if r["method"] == "sync-diloco" and r["scenario"] == "noise"),
                          None)
        for grace, losses in real.items():
            rows.append({"method": "async-new" if grace is None else f"async-grace-{grace}", "scenario": "real",
                         "losses": losses, "median": statistics.median(losses), "worst": max(losses),
                         "sync_median": noise_sync})
    return rows


def table(rows: list[dict]) -> str:
    out = ["| scenario | method | runs | median | worst | vs sync median | vs sync, worst | time to target |",
           "|---|---|---|---|---|---|---|---|"]
    def rel(x: float, sync: float | None) -> str:
        return f"{(x / sync - 1) * 100:+.2f}%" if sync else "-"

    for r in rows:
        sync = r["sync_median"]
        ttt = r.get("time_to_target_s")
        out.append(f"| {r['scenario']} | {r['method']} | {len(r['losses'])} | {r['median']:.4f} | {r['worst']:.4f} | "
                   f"{rel(r['median'], sync)} | {rel(r['worst'], sync)} | {'-' if ttt is None else f'{ttt:.0f} s'} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=8, help="timing seeds of the noise scenario")
    ap.add_argument("--real", type=int, default=0, help="real local swarms with the new default")
    ap.add_argument("--real-grace", type=float, default=None,
                    help="also K real swarms with this grace window (--training.grace; 0: none), alternating with the "
                         "default")
    ap.add_argument("--scenarios", default="noise,orderly,slow")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--candidates", help="JSON file: more methods [{name, outer, inner, sim (async)}]")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shards", action="store_true",
                    help="a contiguous file shard per unit (the simulator's data before 2026-11-29), not every unit "
                         "its own stream over the whole split (the default, as real peers read)")
    ap.add_argument("--workdir", default="/tmp/async-timing")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "async_timing.json"))
    args = ap.parse_args()
    methods = {name: METHODS[name] for name in args.methods.split(",") if name}
    if args.candidates:
        for c in json.loads(Path(args.candidates).read_text()):
            methods[c["name"]] = candidate(c)
    scenarios = {name: {**over, "iid": not args.shards}
                 for name, over in {"noise": NOISE, "orderly": ORDERLY, "slow": SLOW, "run-seeds": ORDERLY}.items()}
    jobs = []
    for scenario in args.scenarios.split(","):
        for name, method in methods.items():
            seeded = scenario == "run-seeds" or (scenario == "noise" and method["sim"] == "async")
            for seed in (range(args.seeds) if seeded else [0]):
                jobs.append((name, method, scenario, scenarios[scenario], seed))
    t0 = time.time()
    print(f"# {time.strftime('%Y-%m-%d')} `{' '.join(sys.argv)}`: {len(jobs)} simulations", flush=True)
    results = []
    with ProcessPoolExecutor(args.workers) as pool:
        for r in pool.map(run_one, jobs):
            results.append(r)
            rv = "-" if r["round_loss"] is None else f"{r['round_loss']:.4f}"
            print(f"{r['scenario']:8s} {r['method']:14s} seed {r['seed']}: {r['loss']:.4f}  round view {rv}  "
                  f"utilization {r['utilization']:.0%}", flush=True)
    graces = (None, args.real_grace) if args.real_grace is not None else (None,)
    real = real_swarms(args.real, Path(args.workdir), graces) if args.real else {}
    rows = summarize(results, real)
    print(table(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
