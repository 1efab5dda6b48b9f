"""A learner unit on one GPU: a ~150M-parameter Llama config through the real learner (train/learner.py), in
bf16 autocast and in fp32 (TF32 matmuls), with micro-batches: tokens/s, MFU, peak memory, and the outer update's
cost (pseudo-gradient, Nesterov, int8 compression with error feedback, signing, merge) as a share of a round.

    python benchmarks/bench_gpu.py --json-out gpu.json          # on a CUDA machine
    python benchmarks/bench_gpu.py --tiny                       # a smoke run on the CPU

MFU: model FLOPs per token 6 N (N = parameters without the embedding table, which is a lookup) plus attention's
12 L T d (PaLM's appendix B accounting), times tokens/s, over the GPU's dense bf16 peak (H100/H200 SXM: 989
TFLOP/s). The tokens are random ids: the speed of a step does not depend on what the tokens say.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from types import SimpleNamespace

import torch

from p2p_diloco.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, RunSpec
from p2p_diloco.train.hardware.compute import Compute
from p2p_diloco.train.learner import Learner, SwarmView
from p2p_diloco.wire.identity import Identity

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def spec_150m(tiny: bool, batch: int = 32) -> RunSpec:
    if tiny:
        model = ModelConfig(arch="llama", n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=512)
        return RunSpec(model=model, data=DataConfig(batch_size=4), inner=InnerConfig(inner_steps=4))
    # Llama-style 12 x 768, SwiGLU 2048, 32k vocabulary (untied): 134M parameters, 85M of them in the blocks.
    model = ModelConfig(arch="llama", n_layer=12, n_head=12, n_embd=768, ffn_hidden=2048, block_size=1024,
                        vocab_size=32768)
    return RunSpec(model=model, data=DataConfig(batch_size=batch), inner=InnerConfig(inner_steps=500, lr=6e-4),
                   outer=OuterConfig(codec="int8"))


def flops_per_token(spec: RunSpec, numel: int) -> float:
    m = spec.model
    non_embedding = numel - m.vocab_size * m.n_embd  # the input table is a lookup; the output head is a matmul
    return 6 * non_embedding + 12 * m.n_layer * m.block_size * m.n_embd


def measure(spec: RunSpec, device: str, precision: str, micro_batch: int, steps: int, warmup: int,
            compile_: bool = False) -> dict:
    data = torch.randint(0, spec.model.vocab_size, (4_000_000,), dtype=torch.int32)
    corpus = SimpleNamespace(train=data, eval=data[:100_000])
    compute = Compute(device=device, precision=precision, micro_batch=micro_batch, compile=compile_)
    learner = Learner(spec, Identity.generate(), corpus, shard=0, num_shards=1, device=device, compute=compute)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    phase = learner.begin_phase()
    learner.run_inner(phase, warmup)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        learner.run_inner(phase, 1)  # returns after the loss is read: the step has finished on the GPU
        times.append(time.perf_counter() - t0)
    result = phase.result()
    t0 = time.perf_counter()
    learner.finish_phase(phase, result, SwarmView(num_peers=4, samples_per_round=result.samples))
    outer_s = time.perf_counter() - t0
    step_s = statistics.median(times)
    tokens_s = spec.data.batch_size * spec.model.block_size / step_s
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    flops = flops_per_token(spec, learner.numel) * tokens_s
    round_s = spec.inner.inner_steps * step_s
    return {"device": name, "precision": compute.precision, "compile": compile_,
            "micro_batch": micro_batch or spec.data.batch_size,
            "params_M": round(learner.numel / 1e6, 1), "step_s_median": round(step_s, 4),
            "step_s_min": round(min(times), 4), "step_s_max": round(max(times), 4),
            "tokens_per_s": round(tokens_s), "model_tflops": round(flops / 1e12, 1),
            "mfu": round(flops / peak, 3) if peak else None,
            "peak_mem_GiB": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
            "outer_update_s": round(outer_s, 3), "round_s_at_H": round(round_s, 1),
            "outer_share_of_round": round(outer_s / (round_s + outer_s), 4), "H": spec.inner.inner_steps,
            "loss_first_last": [round(phase.losses[0], 3), round(phase.losses[-1], 3)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (a smoke run)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="sequences of 1024 tokens per inner step")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--precisions", default="bf16,fp32", help="rows without compile or micro-batches")
    parser.add_argument("--variants", default="micro,compile", help="extra rows: micro, compile, compile-micro")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 row: what a user gets with TF32 on (PyTorch's advice)
    spec = spec_150m(args.tiny, args.batch)
    if device == "cpu":
        args.precisions, args.variants = "fp32", ""
    runs = [(p, 0, False) for p in args.precisions.split(",")]
    variants = args.variants.split(",")
    runs += [("bf16", spec.data.batch_size // 4, False)] if "micro" in variants else []
    runs += [("bf16", 0, True)] if "compile" in variants else []
    runs += [("bf16", spec.data.batch_size // 2, True)] if "compile-micro" in variants else []
    rows = []
    for precision, micro, compile_ in runs:
        row = measure(spec, device, precision, micro, args.steps, args.warmup if not compile_ else args.warmup + 3,
                      compile_)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if device != "cpu":
            torch.cuda.empty_cache()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"spec": dataclasses.asdict(spec.model), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
