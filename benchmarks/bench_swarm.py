"""Real swarm vs simulator: N peers as separate processes on loopback, and the same run in the in-process
simulator, side by side on equal tokens (same RunSpec, seeds and data: every unit its own stream over the whole split).

    python benchmarks/bench_swarm.py --peers 4 --rounds 10 --inner-steps 50 --repeats 5 --timing-seeds 5

Reports eval loss of every real replica and of the simulator's, compute utilization per peer while training
(time in inner steps / wall time, start-up excluded), and bytes sent per token against data-parallel ring
all-reduce of fp32 gradients.

Two simulator references:
- **orderly**: every peer starts at t=0, every phase lasts exactly H steps, 50 ms latency (the foundation
  benchmark's setting);
- **timed like the real runs**: the start spread, step time, phase-length spread and message delay are measured
  from the real peers' JSON logs (`measure_timing`), and the simulator replays runs with that timing under
  several timing seeds. Async DiLoCo's result depends on when updates land, so a real run is one draw from a
  distribution; the fair comparison is median against median.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from p2p_diloco.config import SimConfig, preset
from p2p_diloco.sim.runner import simulate
from p2p_diloco.train.data.corpus import eval_batches, evaluate, load_corpus
from p2p_diloco.train.models.build import build_model, load_flat_params

ROOT = Path(__file__).resolve().parent.parent


def events(path: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e.get("event") == kind]


def measure_timing(workdir: Path, n: int, H: int) -> dict:
    """The real run's timing, in the simulator's terms.

    - step_time_s: median phase length / H;
    - phase_jitter: uniform(-j, j) with the phases' coefficient of variation (j = sqrt(3) * cv);
    - start_spread_s: spread of the first phases' start times;
    - delay: the publish-to-merge delay L that best explains each peer's `merged` counter at the end of each of
      its rounds (updates of the others published more than L before that moment), fitted on a 10 ms grid.
    """
    rounds = {i: events(workdir / f"peer{i}.jsonl", "round") for i in range(n)}
    phases = [r["round_s"] for rs in rounds.values() for r in rs]
    median = statistics.median(phases)
    cv = statistics.pstdev(phases) / statistics.mean(phases)
    starts = [rs[0]["time"] - rs[0]["round_s"] for rs in rounds.values()]
    published = {i: [r["time"] for r in rs] for i, rs in rounds.items()}

    def misfit(delay: float) -> float:
        err = 0.0
        for i, rs in rounds.items():
            for r in rs:
                predicted = sum(1 for j in published if j != i for t in published[j] if t < r["time"] - delay)
                err += (predicted - r["merged"]) ** 2
        return err

    delay = min((k / 100 for k in range(0, 301)), key=misfit)
    return {"step_time_s": median / H, "phase_jitter": min(0.9, math.sqrt(3) * cv),
            "start_spread_s": max(starts) - min(starts), "delay_s": delay}


def run_real(args, workdir: Path) -> float:
    n, H, R = args.peers, args.inner_steps, args.rounds
    cmd = [sys.executable, str(ROOT / "examples" / "local_swarm.py"), "--peers", str(n), "--rounds", str(R),
           "--preset", args.preset, "--workdir", str(workdir), "--", "--inner-steps", str(H),
           "--decay-steps", str(R * H), "--codec", args.codec, "--outer-lr", str(args.outer_lr),
           "--momentum", str(args.momentum), "--eval-every", "0"]
    if getattr(args, "grace", None) is not None:  # the grace window (train/grace.py); else the default's
        cmd += ["--training.grace", str(args.grace)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"local swarm failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.time() - t0


def real_rows(workdir: Path, spec, n: int, batches) -> list[dict]:
    model = build_model(spec.model, spec.seed)
    tokens_per_step = spec.data.batch_size * spec.model.block_size
    rows = []
    for i in range(n):
        load_flat_params(model, torch.load(workdir / f"peer{i}-state" / "theta.pt"))
        rounds = events(workdir / f"peer{i}.jsonl", "round")
        final = events(workdir / f"peer{i}.jsonl", "final")[-1]
        # Utilization while training: from the end of round 1 to the end of the last round, so the DHT start,
        # the spec check and the first phase's warm-up are not counted as idle time.
        first, last = rounds[0], rounds[-1]
        util = (last["compute_s"] - first["compute_s"]) / max(1e-9, last["time"] - first["time"])
        rows.append({"peer": i, "eval_loss": evaluate(model, batches), "util": util, "steps": final["step"],
                     "bytes_per_token": final["bytes_sent"] / (final["step"] * tokens_per_step),
                     "merged": final["merged"], "rejected": final["rejected"]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="test")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--inner-steps", type=int, default=50)
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--repeats", type=int, default=1, help="real swarm runs (each a fresh swarm)")
    ap.add_argument("--timing-seeds", type=int, default=3, help="simulator runs with the measured timing")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    n, H, R = args.peers, args.inner_steps, args.rounds
    spec = preset(args.preset)
    spec = dataclasses.replace(spec, inner=dataclasses.replace(spec.inner, inner_steps=H, decay_steps=R * H),
                               outer=dataclasses.replace(spec.outer, codec=args.codec, outer_lr=args.outer_lr,
                                                         momentum=args.momentum))
    base = Path(args.workdir or tempfile.mkdtemp(prefix="bench-swarm-"))
    print(f"# {time.strftime('%Y-%m-%d')} preset={args.preset} N={n} H={H} rounds={R} codec={args.codec} "
          f"outer_lr={args.outer_lr} momentum={args.momentum} repeats={args.repeats} "
          f"workdir={base}\n`{' '.join(sys.argv)}`", flush=True)
    corpus = load_corpus(spec.data)
    batches = eval_batches(corpus, block_size=spec.model.block_size, batch_size=spec.data.batch_size, num_batches=16)
    numel = sum(p.numel() for p in build_model(spec.model, spec.seed).parameters())
    dp_bytes_per_token = 2 * (n - 1) / n * 4 * numel / (spec.data.batch_size * spec.model.block_size)

    runs = []
    for k in range(args.repeats):
        workdir = base / f"run{k}"
        wall = run_real(args, workdir)
        rows, timing = real_rows(workdir, spec, n, batches), measure_timing(workdir, n, H)
        runs.append({"rows": rows, "timing": timing, "wall_s": wall,
                     "eval_loss": statistics.mean(r["eval_loss"] for r in rows)})
        print(f"real run {k}: eval loss {runs[-1]['eval_loss']:.4f} ({wall:.0f}s wall), timing "
              + ", ".join(f"{key}={v:.3f}" for key, v in timing.items()), flush=True)

    print("\n| run | peer | eval loss | inner steps | utilization (training) | bytes/token sent | vs data-parallel |"
          " merged | rejected |\n|---|---|---|---|---|---|---|---|---|")
    for k, run in enumerate(runs):
        for r in run["rows"]:
            print(f"| {k} | {r['peer']} | {r['eval_loss']:.4f} | {r['steps']} | {r['util']:.1%} | "
                  f"{r['bytes_per_token']:.2f} | {dp_bytes_per_token / r['bytes_per_token']:.0f}x less | "
                  f"{r['merged']} | {r['rejected']} |")

    orderly = simulate(spec, SimConfig(peers=n, total_steps=n * R * H, eval_batches=16), corpus)
    # The timing of the median real run (by measured delay), replayed under several timing seeds.
    timing = {key: statistics.median(run["timing"][key] for run in runs) for key in runs[0]["timing"]}
    timed_cfg = SimConfig(peers=n, total_steps=n * R * H, eval_batches=16, step_time_s=timing["step_time_s"],
                          latency_s=timing["delay_s"] / 2, latency_jitter_s=timing["delay_s"],
                          start_spread_s=timing["start_spread_s"], phase_jitter=timing["phase_jitter"])
    timed = []
    for seed in range(args.timing_seeds):
        timed.append(simulate(spec, dataclasses.replace(timed_cfg, timing_seed=seed), corpus).eval_loss)
        print(f"simulator, real timing, timing seed {seed}: {timed[-1]:.4f}", flush=True)

    real = [run["eval_loss"] for run in runs]
    real_med, timed_med = statistics.median(real), statistics.median(timed)
    sim_bpt = statistics.mean(p.bytes_per_token for p in orderly.peers)
    print(f"\nreal swarm, {len(real)} run(s): eval loss {', '.join(f'{x:.4f}' for x in real)}; median {real_med:.4f}\n"
          f"simulator, timed like the real runs ({len(timed)} timing seeds): "
          f"{', '.join(f'{x:.4f}' for x in timed)}; median {timed_med:.4f}\n"
          f"simulator, orderly: {orderly.eval_loss:.4f}, bytes/token {sim_bpt:.2f}\n"
          f"real vs simulator timed like it (medians): {real_med / timed_med - 1:+.2%} (target within 1%)\n"
          f"real vs orderly simulator: {real_med / orderly.eval_loss - 1:+.2%}\n"
          f"data-parallel ring all-reduce: {dp_bytes_per_token:.1f} bytes/token/peer")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"runs": runs, "timing": timing, "sim_timed": timed,
                                                   "sim_orderly": orderly.eval_loss}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
