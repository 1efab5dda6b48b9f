"""The run's model behind one interface: the built-in GPT (train/models/gpt.py) or a Hugging Face causal LM
(train/models/hf.py), and the flat parameter vector the outer loop works on.

DiLoCo peers must start from the same theta, so `build_model` draws every initial weight from a local
`torch.Generator` seeded from the run's seed: (config, seed) -> bit-identical parameters on every peer,
whatever else has touched the global RNG. `flat_params` / `load_flat_params` give the outer loop one flat
vector to diff, average and load back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from p2p_diloco.config import ModelConfig
from p2p_diloco.train.models.gpt import GPT

if TYPE_CHECKING:  # transformers is imported only when a run asks for an HF model
    from p2p_diloco.train.models.hf import HFCausalLM


def build_model(config: ModelConfig, seed: int) -> GPT | HFCausalLM:
    """The run's initial model: bit-identical parameters for equal (config, seed), on CPU. The built-in GPT for
    arch "gpt"; a Hugging Face causal LM behind the same interface otherwise (train/models/hf.py).

    The weights come from a local generator; constructing the nn.Modules draws from the global RNG for
    their default init (which we then overwrite), so we fork it to leave the caller's RNG untouched.
    """
    if config.arch != "gpt":
        from p2p_diloco.train.models.hf import build_hf_model  # transformers only when a run asks for it

        return build_hf_model(config, seed)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        return GPT(config, generator=generator)


def flat_params(model: nn.Module) -> torch.Tensor:
    """A 1-D float32 copy of every parameter, in `model.parameters()` order, on the parameters' device
    (add `.cpu()` for the network-facing state of a model trained on a GPU)."""
    # torch.cat inside parameters_to_vector already copies; .float() is a no-op for fp32 models.
    return nn.utils.parameters_to_vector(p.detach() for p in model.parameters()).float()


@torch.no_grad()
def load_flat_params(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat vector (as made by `flat_params`, on any device) into the parameters in place.

    In place matters: nn.utils.vector_to_parameters rebinds `.data` to views of `flat`, which would
    detach the optimizer's state from the parameters and alias the caller's buffer.
    """
    params = list(model.parameters())
    expected = sum(p.numel() for p in params)
    if flat.dim() != 1 or flat.numel() != expected:
        raise ValueError(
            f"flat parameter vector has shape {tuple(flat.shape)} ({flat.numel()} values) but the model has "
            f"{expected} parameters; was it made from a model with the same config?"
        )
    flat = flat.to(params[0].device)  # one host-to-device copy, not one per parameter (no-op on the same device)
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(flat[offset:offset + n].view_as(p))
        offset += n
