"""The aggregation tree's delay on the real network: why the tree trained worse than full dissemination, and the
wait that fixes it. N `p2p-diloco join` processes on loopback (examples/local_swarm.py, as
bench_aggregation_real.py runs them), side by side on equal rounds:

    python benchmarks/bench_tree_delay.py --peers 6 --rounds 25 --fan-in 2 --wait-s 1 0 \
        --out benchmarks/results/tree_delay

Arms: full dissemination, then the tree once per `--gossip.aggregate-wait-s` (0: the default, a quarter of the
node's round). `test` preset, H=20 (rounds of about a second on 2 cores: the tree's delay is then a large share
of a round, which is what is measured), the copy rule off. Per arm, beside bench_aggregation_real's bytes, loss
and divergence:

- **missing at round end**: for each peer's round end (from round 12) and each other peer, how many updates that
  peer had published by then that this replica did not hold yet, mean over all pairs: the staleness the
  dissemination adds (the grace window, train/grace.py, waits for the round's updates: 0 is lockstep).
- **replay error**: a peer's last checkpoint against its previous checkpoint plus every journaled update
  merged one by one by a fresh replica, ||replay - last|| / ||last - previous||: whether the totals moved theta
  by exactly the sum of their parts' steps (the arithmetic), so that a loss gap is the learning's, not a bug's.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_aggregation_real import events, run_arm


def missing_at_round_end(workdir: Path, from_round: int = 12) -> float:
    """Mean over (peer, other peer) pairs at each round end: updates the other had published, not held here yet."""
    logs = {}
    for log in workdir.glob("*.jsonl"):  # each peer's JSON log (local_swarm: peerI, the netns bench: a, b, ...)
        rounds = events(log, "round")
        if rounds:
            logs[rounds[0]["peer_id"]] = rounds
    published = {p: ([r["time"] for r in rs], [r["seq"] for r in rs]) for p, rs in logs.items()}
    gaps = []
    for me, rounds in logs.items():
        for r in rounds:
            if r["round"] < from_round:
                continue
            for other, (times, seqs) in published.items():
                if other != me:
                    k = bisect.bisect_right(times, r["time"]) - 1
                    gaps.append((seqs[k] if k >= 0 else 0) - r["vv"].get(other, 0))
    return sum(gaps) / max(1, len(gaps))


def replay_error(workdir: Path) -> float | None:
    """A peer's last checkpoint against the one before it plus every journaled update, merged one by one (the
    first peer whose previous checkpoint the journals cover); None if none is covered."""
    import torch
    from safetensors.torch import load_file

    from p2p_diloco.config.spec import RunSpec
    from p2p_diloco.sync.replica import Replica
    from p2p_diloco.sync.version_vector import VersionVector
    from p2p_diloco.wire.codecs import get_codec
    from p2p_diloco.wire.envelope import decode_update

    updates = [decode_update(f.read_bytes(), max_bytes=1 << 30)
               for f in workdir.glob("*-state/checkpoints/journal/*.update")]
    first: dict[str, int] = {}
    for u in updates:
        first[u.sender] = min(first.get(u.sender, u.seq), u.seq)
    for state in sorted(workdir.glob("*-state")):
        checkpoints = sorted((state / "checkpoints").glob("ckpt-*"))
        if len(checkpoints) < 2:
            continue
        (before, meta), (last, _) = [(load_file(c / "state.safetensors")["theta"], json.loads(
            (c / "manifest.json").read_text())["body"]["meta"]) for c in checkpoints[-2:]]
        vv = VersionVector.from_dict(meta["version_vector"], holes=meta.get("version_vector_holes"))
        if any(vv.get(sender) < seq - 1 for sender, seq in first.items()):
            continue  # the journals were pruned past this checkpoint: updates between are not on disk
        spec = RunSpec.from_dict(meta["spec"])
        replica = Replica.from_spec(spec, before.clone(), codec=get_codec(spec.outer.codec, spec.outer.codec_block),
                                    self_id=meta["peer_id"])
        replica.load(before.clone(), vv)
        for update in sorted((u for u in updates if not vv.has(u.sender, u.seq)), key=lambda u: (u.seq, u.sender)):
            replica.offer(update)
        return float(torch.linalg.vector_norm(replica.theta - last) / torch.linalg.vector_norm(last - before))
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--fan-in", type=int, default=2)
    ap.add_argument("--wait-s", type=float, nargs="+", default=[1.0, 0.0])
    ap.add_argument("--out", default="benchmarks/results/tree_delay")
    ap.add_argument("--workdir", default="/tmp/bench-tree-delay")
    ap.add_argument("--repeats", type=int, default=1, help="passes over all arms (new keys, so new data streams)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"# {time.strftime('%Y-%m-%d')} `{' '.join(sys.argv)}`", flush=True)
    rows = []
    for repeat in range(args.repeats):
        for fan_in, wait_s in [(0, None), *((args.fan_in, w) for w in args.wait_s)]:
            workdir = Path(args.workdir) / f"r{repeat}" / (f"tree-wait{wait_s:g}" if fan_in else "full")
            subprocess.run(["rm", "-rf", str(workdir)], check=True)
            extra = ["--inner-steps", "20", "--torch-threads", "1"]
            if wait_s is not None:
                extra += ["--gossip.aggregate-wait-s", str(wait_s)]
            row = run_arm(args.peers, args.rounds, fan_in, workdir, extra)
            row.update(repeat=repeat, wait_s=wait_s, missing_at_round_end=missing_at_round_end(workdir),
                       replay_error=replay_error(workdir))
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "side_by_side.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    """Per arm: each repeat's loss against the same repeat's full dissemination (paired), then the medians."""
    full = {r["repeat"]: r["eval_loss"] for r in rows if r["wait_s"] is None}
    lines = ["| arm | eval loss, median (each) | vs full, median (each, paired) | missing at round end, median | "
             "sent / peer / round, median | replay error, max |", "|---|---:|---:|---:|---:|---:|"]
    for wait_s in dict.fromkeys(r["wait_s"] for r in rows):
        arm = [r for r in rows if r["wait_s"] == wait_s]
        name = "full" if wait_s is None else f"tree, wait {wait_s:g} s" if wait_s else "tree, wait a quarter round"
        losses = [r["eval_loss"] for r in arm]
        ratios = [r["eval_loss"] / full[r["repeat"]] - 1 for r in arm]
        errors = [r["replay_error"] for r in arm if r["replay_error"] is not None]
        error = f"{max(errors):.1e}" if errors else "no checkpoint pair the journals cover"
        lines.append(f"| {name} | {statistics.median(losses):.4f} ({', '.join(f'{x:.3f}' for x in losses)}) | "
                     f"{statistics.median(ratios):+.1%} ({', '.join(f'{x:+.0%}' for x in ratios)}) | "
                     f"{statistics.median(r['missing_at_round_end'] for r in arm):.2f} | "
                     f"{statistics.median(r['sent_median'] for r in arm) / 1e3:,.0f} KB | "
                     f"{error} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
