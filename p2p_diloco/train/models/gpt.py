"""A byte-level, decoder-only transformer in the style of karpathy/nanoGPT: the built-in model (`arch` gpt).

GPT-2 architecture (Radford et al., 2019): pre-LayerNorm blocks, causal self-attention, a 4x GELU MLP,
learned positional embeddings and an output head tied to the input embedding. The vocabulary is the
256 byte values, so there is no tokenizer to agree on. `init_weights` draws every weight from the generator
it is given, in a fixed order, so one seed gives bit-identical parameters (train/models/build.py seeds it).
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from p2p_diloco.config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)  # residual projection (scaled init)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim): attention runs per head.
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)  # residual projection (scaled init)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-LN: normalise the input of each sub-layer, keep the residual stream itself un-normalised.
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig, generator: torch.Generator | None = None) -> None:
        super().__init__()
        config.validate()
        self.config = config
        wte = nn.Embedding(config.vocab_size, config.n_embd)  # built first, as before: same RNG draw order
        self.transformer = nn.ModuleDict(dict(
            wte=wte,
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf, 2017): one matrix both embeds bytes and scores them.
        self.lm_head.weight = wte.weight
        self.checkpointing = False
        self.init_weights(generator)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 init: N(0, 0.02), residual projections N(0, 0.02/sqrt(2*n_layer)), zero biases, unit LN.

        named_parameters() visits each tensor once, in a fixed order (the tied head is skipped), so the
        same generator state always yields the same weights.
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)  # keeps the residual stream's variance flat
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif ".ln_" in name:  # LayerNorm gains (ln_1, ln_2, ln_f)
                p.fill_(1.0)
            else:
                std = residual_std if name.endswith("c_proj.weight") else 0.02
                p.normal_(0.0, std, generator=generator)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, T, vocab] and, given targets [B, T], the mean cross-entropy (else None)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds the model's block_size {self.config.block_size}; "
                "crop the input or build the model with a larger block_size"
            )
        pos = torch.arange(T, device=idx.device)
        trunk = self.transformer  # ModuleDict items are typed `Module`: index them, name the list's type
        x = trunk["drop"](trunk["wte"](idx) + trunk["wpe"](pos))
        for block in cast(nn.ModuleList, trunk["h"]):
            # Activation checkpointing: keep only each block's input, recompute the rest in backward.
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing and self.training else block(x)
        logits = self.lm_head(trunk["ln_f"](x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(B * T, -1).float(), targets.reshape(B * T), ignore_index=-1)
        return logits, loss

    def num_params(self) -> int:
        """Number of distinct parameters (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def set_activation_checkpointing(self, on: bool) -> None:
        self.checkpointing = on
