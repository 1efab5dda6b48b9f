"""On a CUDA device (skipped elsewhere; `pytest -m gpu`): precision, micro-batches, a bf16 unit's update that a CPU
peer merges, and a real out-of-memory that names the flag to lower. Imports only train/ (runs with --noconftest
on a machine without the network stack)."""

from __future__ import annotations

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2p_diloco.config import DataConfig, InnerConfig, ModelConfig, RunSpec
from p2p_diloco.train.hardware.compute import Compute, OutOfMemory, resolve_precision
from p2p_diloco.train.inner import inner_step, make_inner_optimizer
from p2p_diloco.train.learner import Learner, SwarmView
from p2p_diloco.train.models.build import build_model, flat_params
from p2p_diloco.wire.identity import Identity

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SPEC = RunSpec(model=ModelConfig(arch="llama", n_layer=2, n_head=4, n_embd=128, block_size=64, vocab_size=1024),
               data=DataConfig(batch_size=8), inner=InnerConfig(inner_steps=6, warmup_steps=2))


def _corpus():
    from types import SimpleNamespace

    data = torch.randint(0, 1024, (200_000,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    return SimpleNamespace(train=data, eval=data[:10_000])


def _round(device: str, precision: str, micro_batch: int = 0):
    key = Identity(Ed25519PrivateKey.from_private_bytes(bytes(32)))
    learner = Learner(SPEC, key, _corpus(), shard=0, num_shards=1, device=device,
                      compute=Compute(device=device, precision=precision, micro_batch=micro_batch))
    phase = learner.begin_phase()
    result = learner.run_inner(phase)
    update = learner.finish_phase(phase, result, SwarmView(num_peers=1, samples_per_round=result.samples))
    return learner, learner.codec.decompress(update.payload, learner.numel), phase.losses


def test_auto_precision_on_this_gpu():
    expected = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    assert resolve_precision("auto", "cuda") == expected


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_round_is_close_to_fp32_and_keeps_fp32_state(precision):
    ref, ref_values, ref_losses = _round("cuda", "fp32")
    learner, values, losses = _round("cuda", precision)
    assert next(learner.model.parameters()).dtype == torch.float32  # master weights
    assert learner.replica.snapshot()[0].dtype == torch.float32 and learner.outer_state.momentum.dtype == torch.float32
    assert all(abs(a - b) < 0.05 for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    cos = torch.nn.functional.cosine_similarity(values, ref_values, dim=0)
    assert cos > 0.9, float(cos)


def test_micro_batches_on_the_gpu_take_the_same_step():
    _, whole, _ = _round("cuda", "fp32")
    _, parts, _ = _round("cuda", "fp32", micro_batch=2)
    # Adam's normalised steps turn float-order differences into visible ones over 6 steps: compare directions.
    assert torch.nn.functional.cosine_similarity(whole, parts, dim=0) > 0.99


def test_a_real_out_of_memory_names_the_flag_to_lower():
    model = build_model(ModelConfig(arch="llama", n_layer=1, n_head=2, n_embd=64, block_size=4096,
                                    vocab_size=32768), 0).cuda()
    opt = make_inner_optimizer(model, InnerConfig())
    x = torch.randint(0, 32768, (2048, 4096), device="cuda")  # logits alone: 2048 x 4096 x 32768 floats
    with pytest.raises(OutOfMemory, match="--micro-batch 1024"):
        inner_step(model, opt, x, x, 0, InnerConfig(), compute=Compute(device="cuda", precision="bf16"))
    del x
    torch.cuda.empty_cache()
    assert flat_params(model).isfinite().all()  # the model is still usable
