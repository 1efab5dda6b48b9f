"""Aggregation across NATs with capped links: 8 peers in network namespaces (2 behind NAT, every uplink capped by tc
tbf), full dissemination against the aggregation tree (`--gossip.aggregate`), side by side on equal rounds.

    sudo .venv/bin/python benchmarks/bench_aggregation_netns.py --cap-mbit 20 --rounds 30 \
        --out benchmarks/results/aggregation_netns
    # rounds of ~20 s at a tenth of the CPU (closer to real rounds of minutes, where the tree's delay is small):
    sudo .venv/bin/python benchmarks/bench_aggregation_netns.py --rounds 15 --inner-steps 40 --duty-cycle 0.1 ...
    # tree arms only, one per hold-back (--gossip.aggregate-settle-s):  --no-full --settle-s 0 10
    # a node's wait for its children (--gossip.aggregate-wait-s) near one round, so that a node sums each child's
    # update of a round once rather than as each arrives:  --wait-s 1 3

The topology is tests/helpers/netns.py's NatTopology (a public bootstrap, which relays to the NATed peers); every
peer runs the plain `join --bootstrap ADDR`, `test` preset, H=20 (--inner-steps), the copy rule off, for --rounds
rounds. Per arm, from the peers' JSON logs: bytes sent and received per peer per round (round 2 to the last), eval
loss (mean), replica divergence (max ||theta_i - mean|| / ||mean||), the median round time, and the tree's counters
summed over peers. Needs root, `ip`, `iptables`, `tc`; namespaces and processes are always cleaned up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.helpers: the namespaces and the process launcher the netns tests use

from bench_tree_delay import missing_at_round_end, replay_error  # noqa: E402

from tests.helpers.netns import NatTopology, nat_unavailable  # noqa: E402
from tests.helpers.swarm import Launcher, wait_until  # noqa: E402

PEERS = {"a": "nat", "b": "nat", **{f"p{i}": "public" for i in range(6)}}
ARGS = ("--preset", "test", "--torch-threads", "1", "--eval-every", "0", "--record-ttl-s", "12",
        "--spec.defence.copy-cosine", "0")


def run_arm(workdir: Path, cap_mbit: float, rounds: int, fan_in: int, settle_s: float | None = None,
            inner_steps: int = 20, duty_cycle: float = 1.0, wait_s: float | None = None) -> dict:
    import torch

    base = (*ARGS, "--inner-steps", str(inner_steps), "--training.duty-cycle", str(duty_cycle))
    members = {"boot": "public", **PEERS}
    tree = ("--gossip.aggregate", str(fan_in), "--gossip.aggregate-epoch-s", "10") if fan_in else ()
    if fan_in and settle_s is not None:
        tree = (*tree, "--gossip.aggregate-settle-s", str(settle_s))
    if fan_in and wait_s is not None:
        tree = (*tree, "--gossip.aggregate-wait-s", str(wait_s))
    with NatTopology(members, {m: cap_mbit for m in PEERS}) as topo, Launcher(workdir) as launcher:
        boot, _ = launcher.bootstrap(host="0.0.0.0", prefix=topo.prefix("boot"))
        prefix = f"/ip4/{topo.host('boot')}/"
        address = wait_until(lambda: next((line for line in boot.output().splitlines() if line.startswith(prefix)),
                                          None), 30, "the bootstrap's public address", procs=[boot])
        procs = {name: launcher.peer(name, address, *tree, rounds=rounds, linger_s=120, base=base,
                                     prefix=topo.prefix(name)) for name in PEERS}
        deadline = time.monotonic() + 60 * rounds
        for proc in procs.values():  # each exits 0 once the swarm is quiet (wait_until's procs= calls that a failure)
            proc.wait(max(1.0, deadline - time.monotonic()))
        sent, received, losses, thetas = [], [], [], []
        counters: Counter[str] = Counter()
        for name, proc in procs.items():
            rs = proc.rounds()
            first, last = rs[1], rs[-1]
            span = last["round"] - first["round"]
            sent.append((last["bytes_sent"] - first["bytes_sent"]) / span)
            received.append((last["bytes_received"] - first["bytes_received"]) / span)
            final = proc.events("final")[-1]
            losses.append(final["eval_loss"])
            counters.update(final.get("tree", {}))
            thetas.append(torch.load(workdir / f"{name}-state" / "theta.pt"))
    mean = torch.stack(thetas).mean(0)
    round_s = statistics.median(r["round_s"] for proc in procs.values() for r in proc.rounds()[1:])
    return {"mode": f"tree{fan_in}" if fan_in else "full", "settle_s": settle_s, "wait_s": wait_s,
            "cap_mbit": cap_mbit, "rounds": rounds,
            "inner_steps": inner_steps, "duty_cycle": duty_cycle, "round_s": round_s,
            "sent_median": statistics.median(sent), "sent_max": max(sent),
            "received_median": statistics.median(received), "received_max": max(received),
            "eval_loss": statistics.fmean(losses),
            "divergence": max(float((t - mean).norm() / mean.norm()) for t in thetas), "counters": dict(counters),
            # the staleness the dissemination adds, and whether totals moved theta by exactly their parts' steps
            "missing_at_round_end": missing_at_round_end(workdir), "replay_error": replay_error(workdir)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap-mbit", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--fan-in", type=int, default=4)
    ap.add_argument("--settle-s", type=float, nargs="+", default=[None],
                    help="tree arms, one per --gossip.aggregate-settle-s (default: the setting's default)")
    ap.add_argument("--wait-s", type=float, nargs="+", default=[None],
                    help="tree arms, one per --gossip.aggregate-wait-s for each --settle-s (default: the setting's)")
    ap.add_argument("--no-full", action="store_true", help="tree arms only")
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--duty-cycle", type=float, default=1.0,
                    help="each peer computes this share of the time (longer rounds at the same CPU: train/pace.py)")
    ap.add_argument("--out", default="benchmarks/results/aggregation_netns")
    args = ap.parse_args()
    if reason := nat_unavailable():
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"# {time.strftime('%Y-%m-%d')} `{' '.join(sys.argv)}`", flush=True)
    rows = []
    arms = [] if args.no_full else [(0, None, None)]
    for fan_in, settle_s, wait_s in [*arms, *((args.fan_in, s, w) for s in args.settle_s for w in args.wait_s)]:
        rows.append(run_arm(Path(tempfile.mkdtemp(prefix="agg-netns-")), args.cap_mbit, args.rounds, fan_in,
                            settle_s, args.inner_steps, args.duty_cycle, wait_s))
        print(json.dumps(rows[-1]), flush=True)
        (out / "side_by_side.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
