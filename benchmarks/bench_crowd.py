"""Open runs against a crowd (issue 16): how far two honest peers fall behind each other, and how much of the
victim's uplink goes to the crowd, when 0, 10 or 100 fresh identities stall or flood them on loopback.

Honest peers A and B run in this process (tests/helpers/crowd/ `start_honest`: SwarmNode + Gossip + PeerGuard, the
default gossip and rate-limit settings unless `--uplink-mb` is given), each publishing a signed update of
`--numel` values (int8: ~1 byte each) every `--publish-s`. The crowd (tests/helpers/crowd/ `Crowd`: one p2pd per
identity, in worker processes) is dialled to both. Per crowd size the crowd starts once; per behaviour a fresh
pair A, B exchanges updates until each merged one of the other (each a contributor in the other's ledger),
then a baseline window (`--base-s`, the crowd idle), then the attack (`--attack-s`):

    stall   every identity announces to A and B, twice a second, an update of its own that they lack, and never
            answers their pulls (holding each stream open)
    flood   every identity pulls everything from A in a loop, reading every stream to its end
    idle    (on request) the crowd only acks announces and answers pulls with nothing: with --records, what
            its presence in the views alone costs
    (size 0: the same windows with no crowd at all)

Reported per row: the honest merge lag under attack (how many of the other's published updates a peer lacks,
sampled every 50 ms: median and worst, both directions) and the merge delay (publish to merge, seconds: median
and worst; an update still missing at the end counts with its age), the baseline's worst for comparison, the
crowd's share of what A served (bytes A served to the crowd / all bytes A served in the window) and its MB/s,
and for stall how many pulls the crowd held and for how long in all. Also the crowd's start time and memory
(PSS of its daemons and workers) per identity. Results: JSON and a markdown table under `--out`.

With `--records` the crowd is also in the honest peers' views, as its DHT records would put it in an open run
(then announces and anti-entropy pick crowd members too). Poisoning (eval loss under sign-flip or x5 crowds)
is benchmarks/bench_crowd_poison.py's (the simulator), not measured here.

    python benchmarks/bench_crowd.py --sizes 0,10,100 --out benchmarks/results/crowd
    python benchmarks/bench_crowd.py --quick --tag head     # sizes 0 and 10, short windows
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.helpers: the crowd harness the tests use

import p2p_diloco  # noqa: E402
from p2p_diloco.config import preset  # noqa: E402
from p2p_diloco.config.admission import RateLimitConfig  # noqa: E402
from p2p_diloco.net.gossip.service import GossipConfig  # noqa: E402
from tests.helpers.crowd.crowd import Crowd  # noqa: E402
from tests.helpers.crowd.group import leftover_daemons  # noqa: E402
from tests.helpers.crowd.honest import start_honest, stop_honest  # noqa: E402
from tests.helpers.crowd.scenarios import disengage, engage, measure  # noqa: E402

SPEC = dataclasses.replace(preset("test"), run_id="bench-crowd")
BEHAVIOURS = ("stall", "flood")
"""Run by default; "idle" (the crowd only acks announces and answers pulls with nothing) on request."""


def limits(uplink_mb: float | None) -> RateLimitConfig:
    """The default rate limits; `uplink_mb` sets the uplink budget where the code has one."""
    has_uplink = "uplink_bytes_per_s" in {f.name for f in dataclasses.fields(RateLimitConfig)}
    if uplink_mb is None or not has_uplink:
        return RateLimitConfig()
    return dataclasses.replace(RateLimitConfig(), uplink_bytes_per_s=uplink_mb * 1e6)


async def scenario(workdir: Path, crowd: Crowd | None, behaviour: str, args: argparse.Namespace) -> dict:
    """A fresh honest pair, engaged with `crowd`, measured under `behaviour`; always stopped."""
    honest = await start_honest(workdir, 2, spec=SPEC, numel=args.numel, gossip=GossipConfig(),
                                limits=limits(args.uplink_mb))
    try:
        tasks = await engage(honest, crowd, spec=SPEC, numel=args.numel, publish_s=args.publish_s,
                             records=args.records)
        try:
            return await measure(honest, crowd, behaviour, base_s=args.base_s, attack_s=args.attack_s)
        finally:
            await disengage(tasks)
    finally:
        await stop_honest(honest)


def row(size: int, behaviour: str, result: dict, crowd_info: dict) -> dict:
    """One table row from `measure`'s result."""
    attack, base, seconds = result["attack"], result["base"], result["seconds"]
    served, crowd_bytes = result["served_bytes"], result["crowd_bytes"]
    counters = result["crowd"]
    return {"size": size, "behaviour": behaviour if size else "none",
            "lag_median": attack["lag_median"], "lag_worst": attack["lag_worst"],
            "delay_median_s": round(attack["delay_median_s"], 3), "delay_worst_s": round(attack["delay_worst_s"], 3),
            "base_lag_worst": base["lag_worst"], "base_delay_worst_s": round(base["delay_worst_s"], 3),
            "merged": attack["merged"], "missing_at_end": attack["missing_at_end"],
            "crowd_share": round(crowd_bytes / served, 4) if served else 0.0,
            "crowd_mb_s": round(crowd_bytes / seconds / 1e6, 2), "served_mb_s": round(served / seconds / 1e6, 2),
            "pulls_held": counters.get("pulls_held", 0), "held_s": round(counters.get("held_ms", 0) / 1000, 1),
            "announces": counters.get("announces", 0), "crowd_counters": counters, "seconds": round(seconds, 2),
            **crowd_info}


async def run_size(size: int, args: argparse.Namespace, workdir: Path) -> list[dict]:
    """Every behaviour against one crowd of `size` (none for 0)."""
    if size == 0:
        return [row(0, "none", await scenario(workdir, None, "none", args), {})]
    processes = args.processes if args.processes is not None else (0 if size <= 20 else 2)
    rows = []
    async with Crowd(size, workdir, run_id=SPEC.run_id, processes=processes) as crowd:
        memory = crowd.memory_mib()
        info = {"start_s": round(crowd.start_s, 1), "mib_per_identity": round(memory["per_identity"], 1),
                "processes": processes}
        print(f"crowd of {size}: started in {crowd.start_s:.1f}s, {memory['per_identity']:.1f} MiB per identity",
              flush=True)
        for behaviour in args.behaviours:
            rows.append(row(size, behaviour, await scenario(workdir, crowd, behaviour, args), info))
            print(table(rows[-1:]), flush=True)
    leftovers = leftover_daemons(workdir)
    assert not leftovers, f"p2pd daemons outlived the crowd: {leftovers}"
    return rows


COLUMNS = (("size", "crowd"), ("behaviour", "attack"), ("lag_median", "lag med"), ("lag_worst", "lag worst"),
           ("delay_median_s", "delay med s"), ("delay_worst_s", "delay worst s"), ("base_lag_worst", "base lag worst"),
           ("crowd_share", "crowd share of A's uplink"), ("crowd_mb_s", "crowd MB/s"), ("pulls_held", "pulls held"),
           ("held_s", "held s"))


def table(rows: list[dict]) -> str:
    head = "| " + " | ".join(title for _, title in COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(str(r.get(key, "")) for key, _ in COLUMNS) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def header(run: dict[str, Any]) -> str:
    """What a table measured, in one line above it."""
    rate = run["rate_limits"]
    uplink = (f"uplink {rate['uplink_bytes_per_s'] / 1e6:g} MB/s, newcomers' share {rate['newcomer_share']:g}"
              if run["defence"] else "no uplink shares")
    return (f"Crowd on loopback (benchmarks/bench_crowd.py), code {run.get('code') or run['checkout']}: honest updates "
            f"of {run['numel']} values every {run['publish_s']:g} s, baseline {run['base_s']:g} s, attack "
            f"{run['attack_s']:g} s, {uplink}, burst {rate['burst_s']:g} s"
            + (", the crowd in the honest views (records)" if run["records"] else "") + ".")


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What the run measured: the arguments, the code (where p2p_diloco came from, the commit of this checkout,
    whether the code has the defence's settings) and the honest peers' limits."""
    fields = dataclasses.asdict(limits(args.uplink_mb))
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {**{k: v for k, v in vars(args).items() if k != "out"}, "p2p_diloco": str(Path(p2p_diloco.__file__).parent),
            "checkout": head.stdout.strip(), "defence": "newcomer_share" in fields, "rate_limits": fields,
            "gossip": dataclasses.asdict(GossipConfig()), "python": platform.python_version()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0,10,100", help="crowd sizes, comma-separated")
    ap.add_argument("--behaviours", default=",".join(BEHAVIOURS), help="stall, flood, idle (comma-separated)")
    ap.add_argument("--numel", type=int, default=1_000_000, help="values per honest update (int8: ~1 byte each)")
    ap.add_argument("--publish-s", type=float, default=0.5, help="seconds between an honest peer's updates")
    ap.add_argument("--base-s", type=float, default=10.0, help="baseline window (crowd idle)")
    ap.add_argument("--attack-s", type=float, default=30.0, help="attack window")
    ap.add_argument("--uplink-mb", type=float, default=None, help="honest uplink_bytes_per_s in MB/s (default: "
                    "the setting's default)")
    ap.add_argument("--processes", type=int, default=None, help="crowd worker processes (default: 0 up to 20 "
                    "identities, else 2)")
    ap.add_argument("--records", action="store_true", help="the crowd is in the honest peers' views")
    ap.add_argument("--quick", action="store_true", help="sizes 0,10, base 4 s, attack 10 s")
    ap.add_argument("--tag", default="", help="suffix of the output files, e.g. head or defence")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "crowd"))
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.base_s, args.attack_s = "0,10", 4.0, 10.0
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.behaviours = [b for b in args.behaviours.split(",") if b]
    assert set(args.behaviours) <= {*BEHAVIOURS, "idle"}, args.behaviours
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started, rows = time.time(), []
    with tempfile.TemporaryDirectory(prefix="bench-crowd-") as workdir:
        for size in args.sizes:
            rows += asyncio.run(run_size(size, args, Path(workdir)))
    name = "crowd" + (f"-{args.tag}" if args.tag else "") + ("-records" if args.records else "")
    result = {"settings": settings(args), "wall_s": round(time.time() - started, 1), "rows": rows}
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.md").write_text(header(result["settings"]) + "\n\n" + table(rows) + "\n")
    print(table(rows))
    print(f"wrote {out / name}.json and .md")


if __name__ == "__main__":
    main()
