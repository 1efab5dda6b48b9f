"""Precision and micro-batches (train/hardware/compute.py): a micro-batched step is the whole-batch step,
reduced precision keeps float32 master weights, and out-of-memory names the flag to lower."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.config import ConfigError, InnerConfig, ModelConfig
from p2p_diloco.train.hardware.compute import Compute, OutOfMemory, resolve_precision
from p2p_diloco.train.inner import inner_step, make_inner_optimizer
from p2p_diloco.train.models.build import build_model, flat_params

CFG = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)


def _step(compute: Compute, arch: str = "gpt") -> tuple[torch.Tensor, float]:
    model = build_model(ModelConfig(**{**CFG.__dict__, "arch": arch}), seed=3)
    compute.prepare(model)
    opt = make_inner_optimizer(model, InnerConfig())
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (8, 16), generator=g)
    loss = inner_step(model, opt, x, x.roll(-1, 1), 10, InnerConfig(), compute=compute)
    return flat_params(model), loss


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_micro_batches_take_the_whole_batch_step(arch):
    whole, loss = _step(Compute(), arch)
    for mb in (1, 3, 4):  # 3 does not divide 8: the last chunk is smaller and weighs less
        parts, loss_mb = _step(Compute(micro_batch=mb), arch)
        assert loss_mb == pytest.approx(loss, rel=1e-5)
        assert torch.allclose(whole, parts, atol=1e-6)


def test_activation_checkpointing_gives_the_same_step():
    whole, _ = _step(Compute())
    for arch in ("gpt", "llama"):
        base, _ = _step(Compute(), arch)
        ckpt, _ = _step(Compute(activation_checkpointing=True), arch)
        assert torch.allclose(base, ckpt, atol=1e-6)


def test_bf16_autocast_keeps_float32_master_weights():
    params, loss = _step(Compute(precision="bf16"))
    assert params.dtype == torch.float32
    whole, loss32 = _step(Compute())
    assert loss == pytest.approx(loss32, rel=0.02)  # the same step, at bf16's precision
    assert not torch.equal(params, whole)  # and it did run in bf16


def test_precision_resolution():
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("bf16", "cpu") == "bf16"
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):
        resolve_precision("fp16", "cpu")
    with pytest.raises(ConfigError, match="unknown --precision"):
        resolve_precision("fp8", "cpu")


def test_out_of_memory_names_the_flag_to_lower():
    class Hungry(torch.nn.Module):
        def forward(self, x, y):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    compute = Compute(micro_batch=8)
    x = torch.zeros((16, 32), dtype=torch.long)
    with pytest.raises(OutOfMemory) as err:
        compute.forward_backward(Hungry(), x, x)
    assert "--micro-batch 4" in str(err.value) and "--activation-checkpointing" in str(err.value)
    assert isinstance(err.value, ConfigError)  # so `join` prints it as one line, exit 2
