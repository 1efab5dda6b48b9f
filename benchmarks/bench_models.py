"""Tokens/s of the learner's inner steps: the built-in byte-level GPT against Hugging Face models of the same size
(gpt2: the same architecture through transformers; llama: SwiGLU, RMSNorm, rotary, untied head).

    python benchmarks/bench_models.py --preset small --steps 12 --repeats 5 --json-out results/models.json

Each model is built through the real learner (train/learner.py, one model path) on the byte corpus; the archs
are timed in rotation, `repeats` times, so that a busy machine slows them alike; medians and the ratio to the
built-in GPT are reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from p2p_diloco.config import preset
from p2p_diloco.train.data.corpus import load_corpus
from p2p_diloco.train.learner import Learner
from p2p_diloco.wire.identity import Identity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--archs", default="gpt,gpt2,llama")
    parser.add_argument("--steps", type=int, default=10, help="timed inner steps per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = preset(args.preset)
    corpus = load_corpus(base.data)
    learners, phases, rates = {}, {}, {}
    for arch in args.archs.split(","):
        spec = dataclasses.replace(base, model=dataclasses.replace(base.model, arch=arch))
        learners[arch] = Learner(spec, Identity.generate(), corpus, shard=0, num_shards=1)
        phases[arch] = learners[arch].begin_phase()
        learners[arch].run_inner(phases[arch], 2)  # warm-up
        rates[arch] = []
    tokens_per_step = base.data.batch_size * base.model.block_size
    for _ in range(args.repeats):
        for arch, learner in learners.items():
            t0 = time.perf_counter()
            learner.run_inner(phases[arch], args.steps)
            rates[arch].append(args.steps * tokens_per_step / (time.perf_counter() - t0))
    ref = statistics.median(rates[next(iter(rates))])
    rows = []
    for arch, r in rates.items():
        row = {"arch": arch, "params_M": round(learners[arch].numel / 1e6, 2),
               "tokens_s_median": round(statistics.median(r)), "tokens_s_min": round(min(r)),
               "tokens_s_max": round(max(r)), "vs_builtin": round(statistics.median(r) / ref, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"preset": args.preset, "threads": torch.get_num_threads(), "steps": args.steps,
                       "repeats": args.repeats, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
