"""The byte-level GPT: shapes, init, determinism across peers, the flat-vector round trip, and that it learns."""

from __future__ import annotations

import math

import pytest
import torch

from p2p_diloco.config import ModelConfig, preset
from p2p_diloco.train.models.build import build_model, flat_params, load_flat_params
from p2p_diloco.train.models.gpt import GPT

CFG = preset("test").model


def _batch(cfg: ModelConfig, seed: int = 0, batch_size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(cfg.vocab_size, (batch_size, cfg.block_size + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def test_forward_shapes_and_optional_loss() -> None:
    model = build_model(CFG, seed=0)
    x, y = _batch(CFG)
    logits, loss = model(x)
    assert logits.shape == (4, CFG.block_size, CFG.vocab_size)
    assert loss is None
    logits, loss = model(x[:, :10], y[:, :10])  # shorter than block_size is fine
    assert logits.shape == (4, 10, CFG.vocab_size)
    assert loss is not None and loss.shape == ()


def test_initial_loss_is_uniform_over_bytes() -> None:
    # With std-0.02 weights the logits are near zero, so the model starts out predicting every byte equally.
    _, loss = build_model(CFG, seed=0)(*_batch(CFG))
    assert loss is not None
    assert abs(loss.item() - math.log(256)) < 0.1


def test_sequence_longer_than_block_size_is_a_clear_error() -> None:
    model = build_model(CFG, seed=0)
    idx = torch.zeros(1, CFG.block_size + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="block_size"):
        model(idx)


def test_build_model_is_deterministic_in_seed_and_ignores_global_rng() -> None:
    torch.manual_seed(1)
    a = flat_params(build_model(CFG, seed=7))
    torch.manual_seed(2)  # a peer whose global RNG is elsewhere must still get the same theta
    state = torch.get_rng_state()
    b = flat_params(build_model(CFG, seed=7))
    assert torch.equal(torch.get_rng_state(), state), "build_model must not consume the global RNG"
    assert torch.equal(a, b)
    assert not torch.equal(a, flat_params(build_model(CFG, seed=8)))


def test_gpt2_init_and_tied_embedding() -> None:
    cfg = ModelConfig(n_layer=4, n_head=2, n_embd=128, block_size=32)
    model = build_model(cfg, seed=0)
    assert model.lm_head.weight is model.transformer.wte.weight
    block = model.transformer.h[0]
    assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * cfg.n_layer), rel=0.05)
    assert torch.all(block.attn.c_attn.bias == 0) and torch.all(block.ln_1.weight == 1)


def test_flat_params_round_trip_in_place() -> None:
    src, dst = build_model(CFG, seed=0), build_model(CFG, seed=1)
    flat = flat_params(src)
    assert flat.dtype == torch.float32 and flat.dim() == 1 and flat.numel() == src.num_params()
    pointers = [p.data_ptr() for p in dst.parameters()]
    load_flat_params(dst, flat)
    assert torch.equal(flat_params(dst), flat)
    # In place: the optimizer's references to these tensors stay valid, and dst does not alias `flat`.
    assert [p.data_ptr() for p in dst.parameters()] == pointers
    flat.zero_()
    assert not torch.equal(flat_params(dst), flat)
    assert not torch.equal(flat_params(src), flat), "flat_params must return a copy"


def test_load_flat_params_size_mismatch() -> None:
    model = build_model(CFG, seed=0)
    with pytest.raises(ValueError, match=str(model.num_params())):
        load_flat_params(model, torch.zeros(model.num_params() - 1))


def test_preset_parameter_counts() -> None:
    counts = {name: build_model(preset(name).model, seed=0).num_params() for name in ("test", "tiny", "small")}
    assert counts["test"] < 1_000_000
    assert counts["tiny"] < 1_000_000
    assert 9_000_000 < counts["small"] < 12_000_000
    with torch.device("meta"):  # count the base model without allocating ~350 MB
        base = GPT(preset("base").model).num_params()
    assert 100_000_000 < base < 150_000_000  # "~125M, for GPUs"


def test_overfits_one_batch() -> None:
    torch.manual_seed(0)  # dropout is 0 in the test preset, but keep the run reproducible anyway
    model = build_model(CFG, seed=0)
    x, y = _batch(CFG, batch_size=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _, first = model(x, y)
    for _ in range(40):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert first is not None and loss.item() < 0.5 * first.item()
