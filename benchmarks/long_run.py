"""A long run: where does the gap between DiLoCo and data-parallel go after 100+ outer rounds, and at what H?

    python benchmarks/long_run.py --rounds 100 --inner-steps 10,20,50 --out benchmarks/results/long_run
    python benchmarks/long_run.py --rounds 100 --inner-steps 50 --timing noise --timing-seeds 2,4 \
        --methods async-new,async-diloco-step --out benchmarks/results/long_run_noise

The simulator, the `test` preset, N=4 units, orderly timing, equal tokens for every method (rounds x N x H
inner steps, the lr decayed over each unit's rounds x H steps), every unit its own stream over the whole split
(`--shards`: a file shard each): async p2p DiLoCo with the RunSpec's and the simulator's defaults (the outer
step's ramp from lr 1.4 / mu 0.3 to DiLoCo's, a grace window of 0.5), synchronous DiLoCo (outer Nesterov lr 0.7,
mu 0.9), synchronous DiLoCo with the default outer step and its ramp (`sync-new`), the step without the ramp
(`sync-constant`, `async-constant`), and data-parallel (one AdamW step on N batches per step). Prints
each method's gap to data-parallel at equal tokens after 10, 25, 50... rounds: the trend.
Writes OUT.json (final losses and curves) and OUT.png (eval loss vs tokens, one panel per H).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_timing import METHODS, NOISE, OLD_OUTER, ORDERLY, candidate, grace_of  # noqa: E402  (the matrix's)

LONG_METHODS = {"async-new": METHODS["async-new"], "sync-diloco": METHODS["sync-diloco"],
                "sync-new": METHODS["sync-new"], "data-parallel": {"sim": "dp", "outer": {}, "inner": {}},
                **{name: METHODS[name] for name in ("async-grace", "async-no-window", "sync-ramp", "async-ramp",
                                                    "async-ramp-grace", "sync-constant", "async-constant")},
                # DiLoCo's outer step with the swarm clock: which outer step wins a long run under real timing
                "async-diloco-step": {"sim": "async", "outer": OLD_OUTER, "inner": {}}}
DEFAULT_METHODS = "async-new,sync-diloco,sync-new,data-parallel"


def run_one(job: tuple) -> dict:
    name, method, H, rounds, timing, seed, iid = job
    import torch

    torch.set_num_threads(1)
    from p2p_diloco.config import SimConfig, preset
    from p2p_diloco.sim.runner import simulate

    spec = preset("test")
    spec = dataclasses.replace(
        spec, inner=dataclasses.replace(spec.inner, inner_steps=H, decay_steps=rounds * H, **method["inner"]),
        outer=dataclasses.replace(spec.outer, **method["outer"]))
    total = rounds * 4 * H
    over = NOISE if timing == "noise" else ORDERLY
    sim = SimConfig(peers=4, total_steps=total, method=method["sim"], timing_seed=seed, iid=iid,
                    eval_every_s=rounds * H * over["step_time_s"] / 25,
                    **grace_of(method), **over)
    t0 = time.time()
    result = simulate(spec, sim)
    return {"method": name, "H": H, "rounds": rounds, "timing": timing, "seed": seed, "loss": result.eval_loss,
            "round_loss": result.round_loss,  # the model without the round under way (sync/round_view.py)
            "tail_loss": result.tail_loss, "iid": iid,
            "utilization": sum(p.utilization for p in result.peers) / len(result.peers),
            "wall_s": time.time() - t0,
            "curve": [(p.tokens, p.loss) for p in result.curve]}


def loss_at(curve: list, tokens: float) -> float:
    """The eval loss at `tokens`, linearly interpolated between the curve's points."""
    pts = sorted(curve)
    for (t0, l0), (t1, l1) in zip(pts, pts[1:]):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / max(t1 - t0, 1e-9)
    return pts[-1][1] if tokens >= pts[-1][0] else pts[0][1]


def gap_trend(results: list[dict]) -> list[dict]:
    """Each method's gap to data-parallel at equal tokens after 10, 25, 50... rounds: the trend of the gap."""
    rows = []
    for r in results:
        if r["method"] == "data-parallel":
            continue
        dp = next(x for x in results if x["H"] == r["H"] and x["method"] == "data-parallel")
        per_round = max(t for t, _ in dp["curve"]) / r["rounds"]
        marks = [m for m in (10, 25, 50, 100, 200, 400) if m < r["rounds"]] + [r["rounds"]]
        gaps = {m: loss_at(r["curve"], m * per_round) / loss_at(dp["curve"], m * per_round) - 1
                for m in marks}
        rows.append({"method": r["method"], "H": r["H"], "gap_vs_dp": gaps})
    return rows


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hs = sorted({r["H"] for r in results})
    fig, axes = plt.subplots(1, len(hs), figsize=(6.5 * len(hs), 4.5), dpi=120, squeeze=False)
    for ax, H in zip(axes[0], hs):
        for r in (r for r in results if r["H"] == H):
            tokens, losses = zip(*r["curve"])
            seed = f" seed {r['seed']}" if r["timing"] == "noise" else ""
            ax.plot(tokens, losses, label=f"{r['method']}{seed} ({r['loss']:.3f})")
        ax.set_title(f"H={H}, {results[0]['rounds']} rounds, 4 units, {results[0]['timing']} timing")
        ax.set_xlabel("tokens (whole swarm)")
        ax.set_ylabel("eval loss")
        ax.set_ylim(top=min(3.5, ax.get_ylim()[1]))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--inner-steps", default="20,50")
    ap.add_argument("--methods", default=DEFAULT_METHODS, help=f"of {', '.join(LONG_METHODS)}")
    ap.add_argument("--timing", choices=("orderly", "noise"), default="orderly",
                    help="noise: async_timing.py's timing measured from real swarms")
    ap.add_argument("--timing-seeds", default="0", help="comma-separated, for --timing noise")
    ap.add_argument("--candidates", help="JSON file: more methods [{name, outer, inner, sim (async)}], as in "
                                         "async_timing.py; name them in --methods")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shards", action="store_true",
                    help="a contiguous file shard per unit (the simulator's data before 2026-11-29), not every unit "
                         "its own stream over the whole split (the default, as real peers read)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "long_run"))
    args = ap.parse_args()
    methods = dict(LONG_METHODS)
    if args.candidates:
        for c in json.loads(Path(args.candidates).read_text()):
            methods[c["name"]] = candidate(c)
    jobs = [(name, methods[name], int(H), args.rounds, args.timing, int(seed), not args.shards)
            for seed in args.timing_seeds.split(",") for H in args.inner_steps.split(",")
            for name in args.methods.split(",")]
    print(f"# {time.strftime('%Y-%m-%d')} `{' '.join(sys.argv)}`", flush=True)
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(run_one, jobs))
    for r in results:
        dp = next((x["loss"] for x in results if x["H"] == r["H"] and x["method"] == "data-parallel"), None)
        r["vs_dp"] = r["loss"] / dp - 1 if dp else None
        vs = f"vs DP {r['vs_dp'] * 100:+.2f}%" if dp else ""
        rv, tv = ("-" if x is None else f"{x:.4f}" for x in (r["round_loss"], r["tail_loss"]))
        print(f"H={r['H']:>3} seed {r['seed']} {r['method']:17s} {r['loss']:.4f}  round view {rv}  tail {tv}  {vs}  "
              f"utilization {r['utilization']:.0%} ({r['wall_s']:.0f} s)")
    has_dp = any(r["method"] == "data-parallel" for r in results)
    trend = gap_trend(results) if has_dp else []
    for t in trend:
        marks = "  ".join(f"r{m}: {g * 100:+.2f}%" for m, g in t["gap_vs_dp"].items())
        print(f"H={t['H']:>3} {t['method']:14s} gap to DP after  {marks}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"runs": results, "gap_trend": trend}, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
