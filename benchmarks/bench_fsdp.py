"""Peak resident memory of each rank of a learner unit: one process, DDP and FSDP over 2 and 4 processes (torchrun,
gloo, CPU), and whether each signs the one-process unit's update.

    python benchmarks/bench_fsdp.py --model n_layer=10,n_embd=512,n_head=8 --json-out results/fsdp.json

On the CPU every rank is its own process, so a rank's peak RSS is what its device would hold (weights, gradients,
AdamW state: whole with DDP, 1/N with FSDP; activations) plus the process's base (torch, the corpus), and rank 0
adds the unit's host state (replica, the phase's base, outer momentum, error feedback). Every run trains the same
phases from the same identity (tests/train/unit_worker.py), one torch thread per rank, with glibc's mmap
threshold fixed (MALLOC_MMAP_THRESHOLD_=131072; set it in the environment to measure another).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from pathlib import Path

import torch
from bench_unit import launch  # the same worker and launch as the DDP benchmark (run from benchmarks/)
from safetensors.torch import load_file


def run(ranks: int, parallel: str, out: Path, args: argparse.Namespace) -> dict:
    # A fixed mmap threshold: glibc's default raises it after each large free, so freed tensors stay in the heap,
    # fragment it, and a rank's RSS measures that instead of what it holds (DDP and FSDP alike).
    env = {"MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "131072"), "OMP_NUM_THREADS": "1",
           "UNIT_THREADS": "1", "UNIT_PARALLEL": parallel, "UNIT_MODEL": args.model}
    stats, proc = launch(ranks, out, args, env)
    # The ranks write their lines at once: two may share a line of stderr.
    memory = sorted((json.loads(m) for m in re.findall(r'\{"rank": \d+, "max_rss_mb": [\d.]+\}', proc.stderr)),
                    key=lambda m: m["rank"])
    return {"ranks": ranks, "parallel": parallel if ranks > 1 else "solo", **stats,
            "max_rss_mb": [m["max_rss_mb"] for m in memory], "updates": load_file(str(out))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--preset", default="test")
    parser.add_argument("--model", default="n_layer=10,n_embd=512,n_head=8", help="sizes over the preset's model")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    configs = [(1, "ddp"), (2, "ddp"), (2, "fsdp"), (4, "ddp"), (4, "fsdp")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks, parallel in configs:
            r = run(ranks, parallel, Path(tmp, f"{parallel}{ranks}.st"), args)
            ref = rows[0]["updates"] if rows else r["updates"]
            r["max_rel_diff_vs_solo"] = max(float((r["updates"][k] - ref[k]).abs().max() / ref[k].abs().max())
                                            for k in ref if k.startswith("round"))
            r["eval_diff_vs_solo"] = float((r["updates"]["eval"] - ref["eval"]).abs().max())
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "updates"}), flush=True)
    result = [{k: v for k, v in r.items() if k != "updates"} for r in rows]
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"arch": args.arch, "preset": args.preset, "model": args.model,
                                                   "torch": torch.__version__, "rows": result}, indent=1))


if __name__ == "__main__":
    main()
