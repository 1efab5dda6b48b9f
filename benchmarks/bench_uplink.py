"""Bandwidth awareness and fair share (issue 12, "Over the internet"): what one remote pulling "everything" in a
loop gets from an honest peer's uplink, and what the honest peers still get, with and without the fair share.

The issue's measurement on main before issue 16: one remote that had only joined the DHT pulled everything in
a loop and got 3.5 GB in 60 s (58 MB/s) from one peer, for 20 KB of requests, with no refusal or penalty.

A real local swarm on 127.0.0.1 (tests/helpers/crowd/): honest peers A and B (SwarmNode + Gossip + PeerGuard in this
process, A the DHT bootstrap of B), each publishing a signed update of `--numel` values (int8: ~1 byte each)
every `--publish-s`, and one more identity (its own key and p2pd, no DHT, as cheap as a remote gets) that pulls
everything from A in a loop, reading every stream to its end. Per row a fresh A and B exchange updates until
each merged one of the other, then a baseline window (`--base-s`), then the loop (`--attack-s`).

Rows, A's settings (the honest peers' `uplink_bytes_per_s` is `--uplink-mb`, what a 20 Mbit/s home link's
operator would set; loopback itself moves far more):
    none         no uplink budget, no fair share, no meter: main before issue 16 (per-remote limits only)
    reciprocity  issue 16: the budget shared by reciprocity, no fair share, no meter
    fair         this change: the budget, min'd with the measured uplink, and the per-remote fair share
    measured     the fair share on the measured uplink alone (no budget set: on loopback the meter reads GB/s)
each with the looper a newcomer (it never gave A anything) and a contributor (A's ledger credits it with one
gift first, so A unchokes it: only the fair share holds it).

Reported per row: the looper's MB/s and share of what A served, what B got from A (MB/s), B's merge lag and
delay under the loop (and the baseline's worst lag), the looper's refusals, A's measured uplink, fanout and
pulls served at once at the end, A's fair-share refusals. Results: JSON and a markdown table under `--out`.

    python benchmarks/bench_uplink.py                      # 20 s loops, uplink 2.5 MB/s
    python benchmarks/bench_uplink.py --quick --tag head   # 6 s loops
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.helpers: the crowd harness the tests use

from p2p_diloco.config import preset  # noqa: E402
from p2p_diloco.config.admission import RateLimitConfig  # noqa: E402
from p2p_diloco.net.gossip.service import GossipConfig  # noqa: E402
from tests.helpers.crowd.crowd import Crowd  # noqa: E402
from tests.helpers.crowd.group import leftover_daemons  # noqa: E402
from tests.helpers.crowd.honest import start_honest, stop_honest  # noqa: E402
from tests.helpers.crowd.scenarios import disengage, engage, measure  # noqa: E402

SPEC = dataclasses.replace(preset("test"), run_id="bench-uplink")
MODES = ("none", "reciprocity", "fair", "measured")
NOTE = ("Loopback moves far more than the budget: the budget is enforced only by the refusals, so a row without a "
        "cap on the looper shows what it would take of a real link (all of it). \"A serves\" and \"A fanout\" "
        "follow min(budget, measured) in every row (this change; the budget alone where the meter is off). "
        "\"A measured\" is 0 where the meter is off or had no sample: on loopback a capped looper's responses "
        "take milliseconds, too little sending time for a sample.")
LOOPERS = ("newcomer", "contributor")


def limits(mode: str, uplink_mb: float) -> RateLimitConfig:
    budget = 0.0 if mode in ("none", "measured") else uplink_mb * 1e6
    on = mode in ("fair", "measured")
    return dataclasses.replace(RateLimitConfig(), uplink_bytes_per_s=budget, fair_share=on, measure_uplink=on)


async def scenario(workdir: Path, crowd: Crowd, mode: str, looper: str, args: argparse.Namespace) -> dict:
    """A fresh honest pair, the looper pulling from A under `mode`; always stopped."""
    honest = await start_honest(workdir, 2, spec=SPEC, numel=args.numel, gossip=GossipConfig(),
                                limits=limits(mode, args.uplink_mb))
    a, b = honest
    try:
        tasks = await engage(honest, crowd, spec=SPEC, numel=args.numel, publish_s=args.publish_s)
        if looper == "contributor":
            a.guard.ledger.gave(crowd.peer_ids[0], 1, 1 << 20)
        got_before = b.gossip.stats["bytes_received"]
        try:
            result = await measure(honest, crowd, "flood", base_s=args.base_s, attack_s=args.attack_s)
        finally:
            await disengage(tasks)
        result["b_received"] = b.gossip.stats["bytes_received"] - got_before
        result["a"] = {"uplink_bps": a.guard.uplink_rate_bps, "fanout": a.gossip.fanout(),
                       "serves": a.gossip.max_serves(), "rejections": dict(a.guard.rejections.totals),
                       "serves_cut": a.gossip.stats["serves_cut"], "serves_busy": a.gossip.stats["serves_busy"]}
        return result
    finally:
        await stop_honest(honest)


def row(mode: str, looper: str, result: dict) -> dict:
    attack, base, seconds = result["attack"], result["base"], result["seconds"]
    served, looped = result["served_bytes"], result["crowd_bytes"]
    a, crowd = result["a"], result["crowd"]
    return {"mode": mode, "looper": looper, "looper_mb_s": round(looped / seconds / 1e6, 3),
            "looper_share": round(looped / served, 3) if served else 0.0,
            "honest_mb_s": round(max(served - looped, 0) / seconds / 1e6, 3),
            "b_received_mb_s": round(result["b_received"] / seconds / 1e6, 3),
            "lag_worst": attack["lag_worst"], "base_lag_worst": base["lag_worst"],
            "delay_median_s": round(attack["delay_median_s"], 3), "delay_worst_s": round(attack["delay_worst_s"], 3),
            "merged": attack["merged"], "missing_at_end": attack["missing_at_end"],
            "looper_refused": sum(v for k, v in crowd.items() if k.startswith("pull_")),
            "looper_updates": crowd.get("updates_received", 0),
            "a_uplink_mb_s": round((a["uplink_bps"] or 0) / 1e6, 1), "a_fanout": a["fanout"], "a_serves": a["serves"],
            "a_fair_share_refusals": a["rejections"].get("uplink_fair_share", 0),
            "a_newcomer_refusals": a["rejections"].get("uplink_newcomers", 0),
            "a_serves_cut": a["serves_cut"], "seconds": round(seconds, 2), "looper_counters": crowd}


COLUMNS = (("mode", "A's settings"), ("looper", "looper"), ("looper_mb_s", "looper MB/s"),
           ("looper_share", "looper share of A's upload"), ("honest_mb_s", "B got MB/s"),
           ("lag_worst", "B lag worst"), ("base_lag_worst", "base lag worst"), ("delay_worst_s", "delay worst s"),
           ("looper_refused", "looper refused"), ("a_fair_share_refusals", "fair-share refusals"),
           ("a_uplink_mb_s", "A measured MB/s"), ("a_fanout", "A fanout"), ("a_serves", "A serves"))


def table(rows: list[dict]) -> str:
    head = "| " + " | ".join(title for _, title in COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in COLUMNS) + "|"
    return "\n".join([head, rule, *("| " + " | ".join(str(r.get(k, "")) for k, _ in COLUMNS) + " |" for r in rows)])


def header(run: dict[str, Any]) -> str:
    return (f"Looping puller on loopback (benchmarks/bench_uplink.py), checkout {run['checkout']}, {run['date']}: "
            f"honest updates of {run['numel']} int8 values every {run['publish_s']:g} s, baseline {run['base_s']:g} "
            f"s, loop {run['attack_s']:g} s, A's uplink budget {run['uplink_mb']:g} MB/s where set, fair-share window "
            f"{RateLimitConfig().fair_share_window_s:g} s, re-serves x{RateLimitConfig().reserve_charge:g}.\n"
            f"Command: `{run['command']}`\n\n{NOTE}")


async def run_all(args: argparse.Namespace, workdir: Path) -> list[dict]:
    rows = []
    async with Crowd(1, workdir, run_id=SPEC.run_id) as crowd:
        for mode in args.modes:
            for looper in args.loopers:
                rows.append(row(mode, looper, await scenario(workdir, crowd, mode, looper, args)))
                print(table(rows[-1:]), flush=True)
    leftovers = leftover_daemons(workdir)
    assert not leftovers, f"p2pd daemons outlived the run: {leftovers}"
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES), help="none, reciprocity, fair, measured (comma-separated)")
    ap.add_argument("--loopers", default=",".join(LOOPERS), help="newcomer, contributor (comma-separated)")
    ap.add_argument("--numel", type=int, default=1_000_000, help="values per honest update (int8: ~1 byte each)")
    ap.add_argument("--publish-s", type=float, default=0.5, help="seconds between an honest peer's updates")
    ap.add_argument("--base-s", type=float, default=4.0, help="baseline window (no loop)")
    ap.add_argument("--attack-s", type=float, default=20.0, help="the looping window")
    ap.add_argument("--uplink-mb", type=float, default=2.5, help="A's uplink_bytes_per_s in MB/s (2.5: 20 Mbit/s)")
    ap.add_argument("--quick", action="store_true", help="base 2 s, loop 6 s")
    ap.add_argument("--tag", default="", help="suffix of the output files")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "uplink"))
    args = ap.parse_args()
    if args.quick:
        args.base_s, args.attack_s = 2.0, 6.0
    args.modes = [m for m in args.modes.split(",") if m]
    args.loopers = [m for m in args.loopers.split(",") if m]
    assert set(args.modes) <= set(MODES) and set(args.loopers) <= set(LOOPERS), (args.modes, args.loopers)
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0])), *sys.argv[1:]])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{command}\n{date}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-uplink-") as workdir:
        rows = asyncio.run(run_all(args, Path(workdir)))
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    run = {**{k: v for k, v in vars(args).items() if k != "out"}, "command": command, "date": date,
           "checkout": head.stdout.strip() + " + working tree", "python": platform.python_version(),
           "rate_limits": dataclasses.asdict(RateLimitConfig()), "gossip": dataclasses.asdict(GossipConfig())}
    name = "uplink" + (f"-{args.tag}" if args.tag else "")
    (out / f"{name}.json").write_text(json.dumps({"settings": run, "wall_s": round(time.time() - started, 1),
                                                  "rows": rows}, indent=2) + "\n")
    (out / f"{name}.md").write_text(header(run) + "\n\n" + table(rows) + "\n")
    print(table(rows))
    print(f"wrote {out / name}.json and .md")


if __name__ == "__main__":
    main()
