"""A crowd of identities against real peers: 3 honest `p2p-diloco join` processes on 127.0.0.1 and K forging
identities, honest eval loss against the same run without them, in a run with founders and in an open run.

The simulator's crowd benchmark (bench_crowd_poison.py) in real processes: a bootstrap, 3 honest peers (`--preset`,
`--inner-steps 20`, `--rounds` each, their keys made before the run), and, for a crowd row, the forger
(tests/helpers/crowd/forger.py: one network node in this process with the real gossip, K signing identities)
that pulls what the honest peers publish and, for every update of honest peer A, re-signs a tampered copy under
each identity (sim/crowd_attacks.py's modes), heralds it to the sponsors and announces it. Two defences:

    sponsors  the 3 honest peers' keys are the spec's `defence.sponsors` (sync/sponsorship.py): anyone else's
              update merges at 0, the sponsors relay inside their own updates what they judge useful
    open      the defaults of an open run: probation by seq and vetting (sync/standing.py)

Rows: the honest replicas' eval loss (16 batches of the eval split, every replica evaluated; their mean), its
cost against the clean runs of the same defence (their median), the replicas' largest relative L2 difference,
the crowd updates each honest replica merged and what the sponsors relayed of them (updates' worth), and the
run's wall time. Real runs vary with the machine's timing: `--clean` clean runs per defence give the spread.

    python benchmarks/bench_crowd_real.py --out benchmarks/results/crowd/real
    python benchmarks/bench_crowd_real.py --quick        # sponsors: clean and one 10-identity scale_bound row
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.helpers: the launcher and the forger the tests use

import torch  # noqa: E402

import p2p_diloco  # noqa: E402
from p2p_diloco.train.data.corpus import eval_batches, evaluate, load_corpus  # noqa: E402
from p2p_diloco.train.models.build import build_model, load_flat_params  # noqa: E402
from tests.helpers.crowd.forger import run_spec, start_forger  # noqa: E402
from tests.helpers.swarm import Launcher, founder_key, max_relative_difference, wait_until  # noqa: E402

ARGS = ("--torch-threads", "1", "--eval-every", "0", "--eval-batches", "2", "--record-ttl-s", "12",
        "--gossip-anti-entropy-s", "1")
HONEST = ("A", "B", "C")
START_S = 120.0


def honest_keys(keydir: Path) -> None:
    """The honest peers' keys (NAME.key, and NAME.id its PeerID), made once for every run: each peer's data
    stream is keyed by its PeerID, so with the same keys the runs differ by their timing only."""
    keydir.mkdir(parents=True)
    for n in HONEST:
        (keydir / f"{n}.id").write_text(founder_key(keydir, n))


def run_case(workdir: Path, keys: Path, base: tuple[str, ...], defence: str, mode: str, size: int,
             rounds: int) -> dict[str, Any]:
    """One run: 3 honest peers (`join` options `base`, their keys in `keys`; sponsors, or an open run) and, if
    `size`, a forger with `size` identities."""
    workdir.mkdir(parents=True)
    ids = {}
    for n in HONEST:
        shutil.copy(keys / f"{n}.key", workdir / f"{n}.key")
        ids[n] = (keys / f"{n}.id").read_text()
    extra: tuple[str, ...] = ()
    if defence == "sponsors":
        extra = ("--spec.defence.sponsors", ",".join(ids[n] for n in HONEST))
    spec, numel = run_spec([*base, *extra])
    started = time.monotonic()
    with Launcher(workdir) as launcher:
        _, bootstrap = launcher.bootstrap()
        honest: list[str] = []  # the forger's view, filled as the honest peers start
        forger = start_forger(workdir, spec, numel, size=size, mode=mode, source="", honest=honest,
                              bootstrap=bootstrap) if size else None
        peers = [launcher.peer(n, bootstrap, *extra, rounds=rounds, linger_s=60, base=base) for n in HONEST]
        try:
            for proc in peers:
                honest.append(wait_until(lambda p=proc: p.events("start") and p.events("start")[0]["peer_id"],
                                         START_S, f"{proc.name}'s start", procs=[proc]))
                if forger is not None and proc is peers[0]:
                    forger.source = honest[0]  # it copies peer A's updates
            codes = [proc.wait(START_S + 60 * rounds) for proc in peers]
        finally:
            crowd = forger.stop() if forger is not None else {}
        wall_s = time.monotonic() - started
        failed = [f"{proc.name} exited {code}: {proc.tail(3)}" for proc, code in zip(peers, codes) if code != 0]
        if failed:  # e.g. an honest unit whose own training is no longer finite stops (the run broke down)
            print("\n".join(failed), flush=True)
            return {"defence": defence, "mode": mode if size else "clean", "size": size, "rounds": rounds,
                    "thetas": [], "failed": failed, "agreement": math.inf, "crowd_merged": [], "crowd_relayed": 0.0,
                    "crowd": crowd, "stagger_s": 0.0, "wall_s": round(time.monotonic() - started, 1)}
        finals = [proc.events("final")[-1] for proc in peers]
        states = [proc.state() for proc in peers]
        firsts = [proc.rounds()[0]["time"] for proc in peers]
    crowd_ids = set(forger.peer_ids) if forger is not None else set()
    merged = [sum(n for a, n in vv["version_vector"].items() if a in crowd_ids) for _, vv in states]
    relayed = [sum(w for a, w in f.get("relayed", {}).items() if a in crowd_ids) for f in finals]
    return {"defence": defence, "mode": mode if size else "clean", "size": size, "rounds": rounds,
            "thetas": [theta for theta, _ in states],
            "agreement": max(max_relative_difference(states[0][0], theta) for theta, _ in states[1:]),
            "crowd_merged": merged, "crowd_relayed": sum(relayed), "crowd": crowd,
            "vetting": [f.get("vetting", {}) for f in finals], "steps": [f["step"] for f in finals],
            "stagger_s": round(max(firsts) - min(firsts), 1),  # between the honest peers' first rounds
            "wall_s": round(wall_s, 1)}


def eval_loss(thetas: list[torch.Tensor], spec: Any, batches: Any) -> float:
    """The mean eval loss of the honest replicas (each evaluated: they may differ); inf if there are none (the
    run broke down)."""
    if not thetas:
        return math.inf
    model = build_model(spec.model, spec.seed)
    losses = []
    for theta in thetas:
        load_flat_params(model, theta)
        losses.append(evaluate(model, batches))
    return statistics.mean(losses)


def table(rows: list[dict]) -> str:
    out = ["| defence | crowd | K | eval loss | vs clean (median) | replicas (rel. L2) | crowd updates merged "
           "(per replica) | relayed to the crowd | first rounds apart | wall |",
           "|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        cost = f"{(r['eval_loss'] / r['clean_median'] - 1) * 100:+.1f}%" if r.get("clean_median") else "-"
        out.append(f"| {r['defence']} | {r['mode']} | {r['size']} | {r['eval_loss']:.4f} | {cost} | "
                   f"{r['agreement']:.1e} | {r['crowd_merged']} | {r['crowd_relayed']:.2f} | {r['stagger_s']:.1f} s | "
                   f"{r['wall_s']:.0f} s |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--defences", default="sponsors,open")
    ap.add_argument("--modes", default="scale_bound,near_copy_pos,noise,mixed_adaptive",
                    help="crowd modes (sim/crowd_attacks.py), each run against every defence")
    ap.add_argument("--open-modes", default="scale_bound", help="the modes run against the open run as well")
    ap.add_argument("--size", type=int, default=10, help="crowd identities")
    ap.add_argument("--clean", type=int, default=3, help="clean runs per defence (the timing's spread)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--preset", default="tiny", help="the model (rounds long enough that the peers' staggered "
                    "start-up is a few of them: on `test` a round of H=20 takes ~0.15 s)")
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="sponsors only: one clean run and a scale_bound crowd")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args()
    if args.quick:
        args.defences, args.modes, args.clean = "sponsors", "scale_bound", 1
    header = (f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} `{' '.join(sys.argv)}` "
              f"p2p_diloco {p2p_diloco.__version__} on {platform.node()}")
    print(header, flush=True)
    base = ("--preset", args.preset, "--inner-steps", str(args.inner_steps), *ARGS)
    spec, _ = run_spec(base)
    batches = eval_batches(load_corpus(spec.data), block_size=spec.model.block_size,
                           batch_size=spec.data.batch_size, num_batches=16)
    cases = []
    for defence in args.defences.split(","):
        cases += [(defence, "clean", 0)] * args.clean
        modes = args.modes.split(",") if defence == "sponsors" else args.open_modes.split(",")
        cases += [(defence, mode, args.size) for mode in modes if mode]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-crowd-real-") as tmp:
        honest_keys(Path(tmp) / "keys")
        for i, (defence, mode, size) in enumerate(cases):
            row = run_case(Path(tmp) / f"{i}-{defence}-{mode}", Path(tmp) / "keys", base, defence, mode, size,
                           args.rounds)
            row["eval_loss"] = eval_loss(row.pop("thetas"), spec, batches)
            rows.append(row)
            print(f"{defence:8s} {row['mode']:15s} K={size:3d}  eval {row['eval_loss']:.4f}  "
                  f"replicas {row['agreement']:.1e}  crowd merged {row['crowd_merged']}  "
                  f"relayed {row['crowd_relayed']:.2f}  apart {row['stagger_s']:.1f} s  {row['wall_s']:.0f} s",
                  flush=True)
    for defence in {r["defence"] for r in rows}:
        clean = [r["eval_loss"] for r in rows if r["defence"] == defence and r["size"] == 0
                 and math.isfinite(r["eval_loss"])]
        for r in rows:
            if r["defence"] == defence and clean:
                r["clean_median"] = statistics.median(clean)
    md = f"{header}\n\n{table(rows)}\n"
    print(md)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
        Path(args.out + ".md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
