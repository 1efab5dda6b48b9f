"""Aggregation on the real network (net/gossip/tree.py): N `p2p-diloco join` processes on loopback
(examples/local_swarm.py), full dissemination against the aggregation tree, side by side on equal rounds.

    python benchmarks/bench_aggregation_real.py --peers 4 8 16 --rounds 30 --fan-in 4 \
        --out benchmarks/results/aggregation_real

Both arms: `test` preset, H=50, int8 updates, the copy rule off (a sum carries exact weights only), the same
rounds per peer. Per arm: bytes each peer sent and received per round while training (from the end of round 2 to
the end of the last, so the start-up state sync and the final linger are not counted), median and max over
peers (an inner node of the tree carries the most); final eval loss (mean over peers), replica divergence
(max ||theta_i - mean|| / ||mean||), and the tree's counters summed over peers (totals merged, fallbacks,
audits, timeouts). What is counted is what the gossip, the tree and state sync send (bytes_sent /
bytes_received), not the DHT's own traffic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def events(path: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e.get("event") == kind]


def run_arm(n: int, rounds: int, fan_in: int, workdir: Path, extra: list[str]) -> dict:
    tree = ["--gossip.aggregate", str(fan_in), "--gossip.aggregate-epoch-s", "10"] if fan_in else []
    cmd = [sys.executable, str(ROOT / "examples" / "local_swarm.py"), "--peers", str(n), "--rounds", str(rounds),
           "--workdir", str(workdir), "--timeout-s", "1800", "--", "--inner-steps", "50",
           "--spec.defence.copy-cosine", "0", "--eval-every", "0", *tree, *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=2400)
    wall_s = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"local swarm failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    import torch

    sent, received, losses, thetas = [], [], [], []
    counters: Counter[str] = Counter()
    for i in range(n):
        log = workdir / f"peer{i}.jsonl"
        rs = events(log, "round")
        first, last = rs[1], rs[-1]
        span = last["round"] - first["round"]
        sent.append((last["bytes_sent"] - first["bytes_sent"]) / span)
        received.append((last["bytes_received"] - first["bytes_received"]) / span)
        final = events(log, "final")[-1]
        losses.append(final["eval_loss"])
        counters.update(final.get("tree", {}))
        thetas.append(torch.load(workdir / f"peer{i}-state" / "theta.pt"))
    mean = torch.stack(thetas).mean(0)
    divergence = max(float((t - mean).norm() / mean.norm()) for t in thetas)
    return {"n": n, "mode": f"tree{fan_in}" if fan_in else "full", "rounds": rounds, "wall_s": round(wall_s, 1),
            "sent_median": statistics.median(sent), "sent_max": max(sent),
            "received_median": statistics.median(received), "received_max": max(received),
            "eval_loss": statistics.fmean(losses), "divergence": divergence, "counters": dict(counters)}


def table(rows: list[dict]) -> str:
    lines = ["| N | mode | sent / peer / round, median (max) | received, median (max) | eval loss | divergence | "
             "totals merged | fallbacks | audits passed |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = r["counters"]
        lines.append(f"| {r['n']} | {r['mode']} | {r['sent_median'] / 1e3:,.0f} KB ({r['sent_max'] / 1e3:,.0f}) | "
                     f"{r['received_median'] / 1e3:,.0f} KB ({r['received_max'] / 1e3:,.0f}) | "
                     f"{r['eval_loss']:.4f} | {r['divergence']:.1e} | {c.get('tree_totals_merged', 0)} | "
                     f"{c.get('tree_fallbacks', 0)} | {c.get('audits_passed', 0)} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--fan-in", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results/aggregation_real")
    ap.add_argument("--workdir", default="/tmp/bench-aggregation-real")
    args, extra = ap.parse_known_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"# {time.strftime('%Y-%m-%d')} `{' '.join(sys.argv)}`", flush=True)
    rows = []
    for n in args.peers:
        for fan_in in (0, args.fan_in):
            workdir = Path(args.workdir) / f"n{n}-{'tree' if fan_in else 'full'}"
            subprocess.run(["rm", "-rf", str(workdir)], check=True)
            row = run_arm(n, args.rounds, fan_in, workdir, [a for a in extra if a != "--"])
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "side_by_side.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
