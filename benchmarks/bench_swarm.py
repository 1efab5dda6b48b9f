"""Real swarm vs simulator: N peers as separate processes on loopback, and the same run in the in-process
simulator, side by side on equal tokens (same RunSpec, seeds and data shards).

    python benchmarks/bench_swarm.py --peers 4 --rounds 10 --inner-steps 50

Reports eval loss of every real replica and of the simulator's, compute utilization per peer while training
(time in inner steps / wall time, start-up excluded), and bytes sent per token against data-parallel ring
all-reduce of fp32 gradients.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from p2p_diloco.config import SimConfig, preset
from p2p_diloco.sim.runner import simulate
from p2p_diloco.train.data import eval_batches, evaluate, load_corpus
from p2p_diloco.train.model import build_model, load_flat_params

ROOT = Path(__file__).resolve().parent.parent


def events(path: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e.get("event") == kind]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="test")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--inner-steps", type=int, default=50)
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    n, H, R = args.peers, args.inner_steps, args.rounds
    spec = preset(args.preset)
    spec = dataclasses.replace(spec, inner=dataclasses.replace(spec.inner, inner_steps=H, decay_steps=R * H),
                               outer=dataclasses.replace(spec.outer, codec=args.codec, outer_lr=args.outer_lr,
                                                         momentum=args.momentum))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-swarm-"))
    print(f"# {time.strftime('%Y-%m-%d')} preset={args.preset} N={n} H={H} rounds={R} codec={args.codec} "
          f"outer_lr={args.outer_lr} momentum={args.momentum} "
          f"workdir={workdir}\n`{' '.join(sys.argv)}`", flush=True)

    t0 = time.time()
    cmd = [sys.executable, str(ROOT / "examples" / "local_swarm.py"), "--peers", str(n), "--rounds", str(R),
           "--preset", args.preset, "--workdir", str(workdir), "--", "--inner-steps", str(H),
           "--decay-steps", str(R * H), "--codec", args.codec, "--outer-lr", str(args.outer_lr),
           "--momentum", str(args.momentum), "--eval-every", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        return 1
    real_wall = time.time() - t0

    corpus = load_corpus(spec.data)
    batches = eval_batches(corpus, block_size=spec.model.block_size, batch_size=spec.data.batch_size,
                           num_batches=16)
    model = build_model(spec.model, spec.seed)
    tokens_per_step = spec.data.batch_size * spec.model.block_size
    numel = sum(p.numel() for p in model.parameters())
    dp_bytes_per_token = 2 * (n - 1) / n * 4 * numel / tokens_per_step
    rows = []
    for i in range(n):
        theta = torch.load(workdir / f"peer{i}-state" / "theta.pt")
        load_flat_params(model, theta)
        rounds = events(workdir / f"peer{i}.jsonl", "round")
        final = events(workdir / f"peer{i}.jsonl", "final")[-1]
        # Utilization while training: from the end of round 1 to the end of the last round, so the DHT start,
        # the spec check and the first phase's warm-up are not counted as idle time.
        first, last = rounds[0], rounds[-1]
        util = (last["compute_s"] - first["compute_s"]) / max(1e-9, last["time"] - first["time"])
        tokens = final["step"] * tokens_per_step
        rows.append({"peer": i, "eval_loss": evaluate(model, batches), "util": util, "steps": final["step"],
                     "bytes_per_token": final["bytes_sent"] / tokens, "merged": final["merged"],
                     "rejected": final["rejected"]})

    sim = simulate(spec, SimConfig(peers=n, total_steps=n * R * H, eval_batches=16), corpus)
    real = statistics.mean(r["eval_loss"] for r in rows)
    print("\n| peer | eval loss | inner steps | utilization (training) | bytes/token sent | vs data-parallel |"
          " merged | rejected |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['peer']} | {r['eval_loss']:.4f} | {r['steps']} | {r['util']:.1%} | {r['bytes_per_token']:.2f} | "
              f"{dp_bytes_per_token / r['bytes_per_token']:.0f}x less | {r['merged']} | {r['rejected']} |")
    sim_bpt = statistics.mean(p.bytes_per_token for p in sim.peers)
    print(f"\nreal swarm: mean eval loss {real:.4f} ({real_wall:.0f}s wall for the whole swarm)\n"
          f"simulator:  eval loss {sim.eval_loss:.4f}, bytes/token {sim_bpt:.2f}\n"
          f"real vs simulator: {real / sim.eval_loss - 1:+.2%} (target within 1%)\n"
          f"data-parallel ring all-reduce: {dp_bytes_per_token:.1f} bytes/token/peer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
