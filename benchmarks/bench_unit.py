"""A learner unit of 2 processes (torchrun, gloo, CPU) against a unit of 1: samples/s of the inner steps, and
whether the two sign the same update.

    python benchmarks/bench_unit.py --json-out results/unit.json

Both train the same phases from the same identity (so the same batches): the 1-process unit with 2 torch
threads and with 1, the 2-process unit with 1 thread per rank (this machine has 2 cores). Each prints its
samples/s; the decoded updates are compared (max |difference| / max |update|).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "train" / "unit_worker.py"  # shared with the test


def launch(ranks: int, out: Path, args, env: dict[str, str]) -> tuple[dict, subprocess.CompletedProcess]:
    """The unit worker as `ranks` processes (torchrun when > 1): its stats line, and the finished process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    prefix = [sys.executable] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    cmd = [*prefix, str(WORKER), str(out), args.arch, "0", str(args.rounds), str(args.inner_steps), args.preset]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc


def run(ranks: int, threads: int, out: Path, args) -> dict:
    stats, _ = launch(ranks, out, args, {"OMP_NUM_THREADS": str(threads), "UNIT_THREADS": str(threads)})
    return {"ranks": ranks, "threads_per_rank": threads, **stats, "updates": load_file(str(out))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run(1, 2, Path(tmp, "solo2.st"), args), run(1, 1, Path(tmp, "solo1.st"), args),
                run(2, 1, Path(tmp, "duo.st"), args)]
    ref = runs[0]["updates"]
    rows = []
    for r in runs:
        diffs = [float((r["updates"][k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref if "round" in k]
        row = {k: v for k, v in r.items() if k != "updates"}
        row["max_rel_diff_vs_solo"] = max(diffs)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"arch": args.arch, "preset": args.preset, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
