"""A learner unit that trains a few phases and writes its updates: run by tests/train/test_unit.py and
benchmarks/bench_unit.py, under torchrun (a unit of several processes) or alone (a unit of one).

    unit_worker.py OUT ARCH MICRO_BATCH [ROUNDS INNER_STEPS PRESET]

Rank 0 writes each round's decoded update (fp32 codec) and sample count to OUT (safetensors), then the eval loss of
the final replica, and prints one JSON line with samples/s of the inner steps. Between rounds the replica is moved
as a remote update would move it, so the parameters rank 0 sets at a phase's start must reach the other ranks.
Every rank prints a JSON line with its peak resident memory to stderr. UNIT_PARALLEL=fsdp shards the model over
the ranks (train/hardware/sharded.py; default ddp); UNIT_MODEL="n_layer=8,n_embd=512,n_head=8" sets its size;
UNIT_RESTORE=1 restores the unit from its own checkpoint state after the first round, with a fresh AdamW state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import time

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import save_file

from p2p_diloco.config import ModelConfig, preset
from p2p_diloco.train.data.corpus import eval_batches, load_corpus
from p2p_diloco.train.hardware.compute import Compute
from p2p_diloco.train.hardware.unit import follow, is_follower
from p2p_diloco.train.hardware.units import unit_from_env
from p2p_diloco.train.learner import Learner, SwarmView
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.identity import Identity


def main(out: str, arch: str, micro_batch: int, rounds: int = 2, inner_steps: int = 3, preset_name: str = "",
         parallel: str = "", restore: bool = False) -> None:
    torch.set_num_threads(int(os.environ.get("UNIT_THREADS", "1")))
    parallel = parallel or os.environ.get("UNIT_PARALLEL", "ddp")
    restore = restore or bool(os.environ.get("UNIT_RESTORE"))
    if preset_name:
        spec = preset(preset_name)
        spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, arch=arch))
    else:  # the test's: a tiny model, so that the test is fast; 34 wide, so that 4 ranks shard some rows unevenly
        spec = dataclasses.replace(preset("test"), model=ModelConfig(arch=arch, n_layer=1, n_head=1, n_embd=34,
                                                                      block_size=32))
    if os.environ.get("UNIT_MODEL"):
        sizes = {k: int(v) for k, v in (kv.split("=") for kv in os.environ["UNIT_MODEL"].split(","))}
        spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, **sizes))
    spec = dataclasses.replace(spec, inner=dataclasses.replace(spec.inner, inner_steps=inner_steps),
                               outer=dataclasses.replace(spec.outer, codec="fp32"))
    compute = Compute(device="cpu", micro_batch=micro_batch)
    unit = unit_from_env("cpu", parallel)
    if is_follower():
        steps = follow(spec, unit, compute, "cpu")
        assert steps == rounds * inner_steps, steps
        unit.close()
        _print_memory(unit.rank)
        return
    # The same identity in every run (the same PeerID, so the same data and sender).
    learner = Learner(spec, Identity(Ed25519PrivateKey.from_private_bytes(bytes(range(32)))), load_corpus(spec.data),
                      shard=0, num_shards=1, compute=compute, unit=unit)
    codec, tensors, compute_s, samples = get_codec("fp32"), {}, 0.0, 0
    for round_ in range(rounds):
        phase = learner.begin_phase()
        t0 = time.perf_counter()
        result = learner.run_inner(phase)
        compute_s += time.perf_counter() - t0
        samples += result.samples
        update = learner.finish_phase(phase, result, SwarmView(num_peers=1, samples_per_round=result.samples))
        tensors[f"round{round_}"] = codec.decompress(update.payload, learner.numel)
        tensors[f"samples{round_}"] = torch.tensor([update.header.samples])
        if restore and round_ == 0:  # a restart from a checkpoint between phases
            learner.load_state_dict(*learner.state_dict())
            if unit.saves_optimizer_state:  # the reference takes the fresh AdamW state an FSDP unit restarts with
                learner.optimizer.state.clear()
        theta, vv = learner.replica.snapshot()
        learner.replica.load(theta + 0.01, vv)  # a "remote" move
    # The final replica's loss, as Learner.evaluate takes it between phases: theta into the unit's own model.
    batches = eval_batches(load_corpus(spec.data), block_size=spec.model.block_size,
                           batch_size=spec.data.batch_size, num_batches=2)
    theta, _ = learner.replica.snapshot()
    unit.set_params(learner.model, lambda s: theta[s])
    tensors["eval"] = torch.tensor([unit.evaluate(learner.model, batches)])
    unit.stop()
    unit.close()
    save_file(tensors, out)
    _print_memory(0)
    print(json.dumps({"samples_per_s": round(samples / compute_s, 1), "params_M": round(learner.numel / 1e6, 2)}))


def _print_memory(rank: int) -> None:
    """This process's peak resident memory (Linux counts ru_maxrss in KiB)."""
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rank": rank, "max_rss_mb": round(peak_mb, 1)}), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *(int(a) for a in sys.argv[4:6]), *sys.argv[6:7])
