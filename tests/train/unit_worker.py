"""Run by tests/train/test_unit.py under torchrun (or alone): one learner unit trains two phases on the test preset
(with a mid-phase rebase between them) and rank 0 writes its updates' decoded payloads to OUT (safetensors)."""

from __future__ import annotations

import sys

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import save_file

from p2p_diloco.config import ModelConfig, preset
from p2p_diloco.train.compute import Compute
from p2p_diloco.train.data import load_corpus
from p2p_diloco.train.learner import Learner, SwarmView
from p2p_diloco.train.unit import RankGroup, follow, is_follower
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.identity import Identity


def main(out: str, arch: str, micro_batch: int) -> None:
    torch.set_num_threads(1)
    spec = preset("test")
    spec = spec.__class__(**{**spec.__dict__, "model": ModelConfig(arch=arch, n_layer=1, n_head=2, n_embd=32,
                                                                    block_size=32)})
    import dataclasses

    spec = dataclasses.replace(spec, inner=dataclasses.replace(spec.inner, inner_steps=3),
                               outer=dataclasses.replace(spec.outer, codec="fp32"))
    compute = Compute(device="cpu", micro_batch=micro_batch)
    unit = RankGroup.from_env("cpu")
    if is_follower():
        steps = follow(spec, unit, compute, "cpu")
        assert steps == 6, steps
        unit.close()
        return
    # The same identity in every run (the same PeerID, so the same data and sender).
    key = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
    learner = Learner(spec, Identity(key), load_corpus(spec.data), shard=0, num_shards=1, compute=compute,
                      unit=unit)
    codec, tensors = get_codec("fp32"), {}
    for round_ in range(2):
        phase = learner.begin_phase()
        result = learner.run_inner(phase)
        update = learner.finish_phase(phase, result, SwarmView(num_peers=1, samples_per_round=result.samples))
        tensors[f"round{round_}"] = codec.decompress(update.payload, learner.numel)
        learner.replica.load(learner.replica.snapshot()[0] + 0.01, learner.replica.snapshot()[1])  # a "remote" move
        tensors[f"samples{round_}"] = torch.tensor([update.header.samples])
    unit.stop()
    if hasattr(unit, "close"):
        unit.close()
    save_file(tensors, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
