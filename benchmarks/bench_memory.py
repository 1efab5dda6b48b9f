"""A learner unit's peak resident memory per parameter: `join` on the CPU (fp32) for two Llama sizes under
`/usr/bin/time -v`, and the slope between them (bytes per parameter, the fixed process base cancels out).

    python benchmarks/bench_memory.py --json-out benchmarks/results/memory.json
    python benchmarks/bench_memory.py --code /tmp/wt_old --code .     # side by side: a worktree of older code
    python benchmarks/bench_memory.py --with "--training.outer-state-dir /tmp/outer"   # and with these options

Each size runs `join --model llama --corpus stdlib-bpe` as the first peer of a fresh run on 127.0.0.1, 2 rounds
of 2 inner steps, batch 2, block 128, with a checkpoint at the end. `bench_memory_plan.py` sets the planner's
estimate (`p2p-diloco plan`) beside such a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"17M": (4, 512, 8), "110M": (8, 1024, 8)}  # n_layer, n_embd, n_head


def model_args(size: str) -> list[str]:
    layers, width, heads = SIZES[size]
    return ["--model", "llama", "--corpus", "stdlib-bpe", "--preset", "small", "--spec.model.n-layer", str(layers),
            "--spec.model.n-embd", str(width), "--spec.model.n-head", str(heads), "--spec.model.block-size", "128",
            "--spec.data.batch-size", "2", "--spec.inner.inner-steps", "2"]


def measure(code: Path, size: str, work: Path, extra: list[str]) -> dict:
    out = work / f"{code.name}-{size}-{len(extra)}"
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "p2p_diloco", "join", *model_args(size), *extra,
           "--rounds", "2",
           "--host", "127.0.0.1", "--device", "cpu", "--identity", str(out / "id.key"), "--out-dir", str(out),
           "--run-id", f"mem-{size}"]
    env = {**os.environ, "PYTHONPATH": str(code)}
    proc = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True, timeout=1800)
    text = proc.stdout + proc.stderr
    if proc.returncode:
        raise RuntimeError(f"join failed ({size}, {code}):\n{text[-3000:]}")
    rss_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    params = int(re.search(r"([\d,]+) parameters, H=", text).group(1).replace(",", ""))
    return {"size": size, "params": params, "peak_rss_bytes": rss_kib * 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", action="append", type=Path, help="a checkout to measure (default: this one)")
    parser.add_argument("--with", dest="variants", action="append", default=[],
                        help="also measure each checkout with these extra join options (one string)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for code in [c.resolve() for c in (args.code or [ROOT])]:
            for variant in ["", *args.variants]:
                extra = shlex.split(variant)
                small, large = (measure(code, s, Path(tmp), extra) for s in SIZES)
                slope = (large["peak_rss_bytes"] - small["peak_rss_bytes"]) / (large["params"] - small["params"])
                rows.append({"code": str(code), "options": variant, "runs": [small, large], "bytes_per_param": slope})
                label = f"{code.name} {variant}".strip()
                for run in (small, large):
                    gib = run["peak_rss_bytes"] / 2**30
                    print(f"{label}: {run['params'] / 1e6:7.2f}M params  peak {gib:6.2f} GiB")
                print(f"{label}: slope {slope:.1f} B/param")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
