"""Cost of one outer update's life, per million parameters: compress + sign + verify + decompress + merge.

Compared with the compute of one round (H inner steps) of the same model, measured here on this machine.

    python benchmarks/bench_update_cost.py --preset small --repeats 5
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

from p2p_diloco.config import preset
from p2p_diloco.sync.replica import Replica
from p2p_diloco.train.data.corpus import ShardSampler, load_corpus
from p2p_diloco.train.inner import inner_step, make_inner_optimizer
from p2p_diloco.train.models.build import build_model, flat_params
from p2p_diloco.train.outer import OuterState, outer_update
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import decode_update, encode_update, make_update
from p2p_diloco.wire.identity import Identity


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def measure(spec, name: str, delta, theta, identity, repeats: int) -> tuple[float, ...]:
    """Median seconds of: compress (with Nesterov + error feedback), sign+encode, decode+verify, decompress, merge."""
    numel = delta.numel()
    cfg = dataclasses.replace(spec.outer, codec=name)
    codec = get_codec(name, cfg.codec_block)
    t_comp, (payload, _) = timed(lambda: outer_update(delta, OuterState.zeros(numel), cfg, codec), repeats)

    def sign():
        u = make_update(run_id="bench", spec_hash="0" * 64, seq=1, tau=0, samples=1, weight=0.25, codec=name,
                        numel=numel, payload=payload, identity=identity)
        return encode_update(u)

    t_sign, data = timed(sign, repeats)
    t_verify, update = timed(lambda: decode_update(data, max_bytes=len(data) + 1), repeats)
    t_dec, decoded = timed(lambda: codec.decompress(update.payload, numel), repeats)
    replica = Replica(theta.clone(), outer_lr=0.7, max_weight=1.0, codec=codec)

    def merge():
        with replica.lock:  # the axpy itself, as Replica.offer applies it
            replica.theta.add_(decoded, alpha=-0.7 * 0.25)

    t_merge, _ = timed(merge, repeats)
    return t_comp, t_sign, t_verify, t_dec, t_merge


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--step-samples", type=int, default=3, help="inner steps timed to estimate a round's compute")
    args = ap.parse_args()
    spec = preset(args.preset)
    model = build_model(spec.model, spec.seed)
    theta = flat_params(model)
    numel = theta.numel()
    per_m = numel / 1e6
    identity = Identity.generate()
    corpus = load_corpus(spec.data)
    sampler = ShardSampler(corpus.train, shard=0, num_shards=1, block_size=spec.model.block_size,
                           batch_size=spec.data.batch_size, seed=0)
    optimizer = make_inner_optimizer(model, spec.inner)
    inner_step(model, optimizer, *sampler.batch(0), 0, spec.inner)  # warm-up
    step_s, _ = timed(lambda: inner_step(model, optimizer, *sampler.batch(1), 1, spec.inner), args.step_samples)
    round_s = step_s * spec.inner.inner_steps
    delta = torch.randn(numel) * 1e-3
    print(f"# {time.strftime('%Y-%m-%d')} preset={args.preset} params={numel / 1e6:.2f}M H={spec.inner.inner_steps} "
          f"inner step={step_s * 1e3:.0f} ms -> round compute {round_s:.1f} s "
          f"(torch threads={torch.get_num_threads()})")
    print("| codec | compress | sign+encode | decode+verify | decompress | merge | total | per M params | "
          "round, N=4 | share of round |\n|---|---|---|---|---|---|---|---|---|---|")
    for name in ("fp32", "fp16", "int8", "int4"):
        times = measure(spec, name, delta, theta, identity, args.repeats)
        total = sum(times)
        t_comp, t_sign, t_verify, t_dec, t_merge = times
        # One round with N=4: our own update (compress, sign) plus three remote ones (verify, decompress, merge).
        per_round = t_comp + t_sign + 3 * (t_verify + t_dec + t_merge)
        cells = " | ".join(f"{t * 1e3:.0f} ms" for t in times)
        print(f"| {name} | {cells} | {total * 1e3:.0f} ms | {total / per_m * 1e3:.1f} ms | {per_round * 1e3:.0f} ms "
              f"| {per_round / round_s:.3%} |")
    print("\n(compress includes the outer Nesterov step and error feedback; a receiver pays decode+verify, "
          "decompress and merge once per remote update)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
