"""The inner phase: H steps of AdamW on local data (DiLoCo, Douillard et al. 2023, Algorithm 1 lines 4-8).

The AdamW state persists across inner phases, as in DiLoCo. The learning-rate schedule runs on the clock the
learner gives (by default the swarm's progress, `Learner.lr_clock`), but a unit always warms up over its own
first `warmup_steps` steps: a peer that joins a swarm long past its warmup starts a fresh AdamW state, and its
first steps must not be at the swarm's full lr.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from p2p_diloco.config import InnerConfig
from p2p_diloco.train.hardware.compute import Compute


def lr_at(step: int, cfg: InnerConfig, own_step: int | None = None) -> float:
    """Linear warm-up to `lr`, then cosine down to `lr * min_lr_ratio` at `decay_steps`, flat after. With
    `own_step` (this unit's own cumulative steps, when `step` is another clock), never above the unit's own
    warm-up."""
    lr = _schedule(step, cfg)
    return lr if own_step is None or own_step >= cfg.warmup_steps else min(lr, _warmup(own_step, cfg))


def _warmup(step: int, cfg: InnerConfig) -> float:
    return cfg.lr * (step + 1) / cfg.warmup_steps


def _schedule(step: int, cfg: InnerConfig) -> float:
    if step < cfg.warmup_steps:
        return _warmup(step, cfg)
    span = max(1, cfg.decay_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def make_inner_optimizer(model: torch.nn.Module, cfg: InnerConfig) -> torch.optim.AdamW:
    # No weight decay on biases and LayerNorm gains (nanoGPT's split): decaying them only hurts.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused kernel, on the GPU and the CPU alike: one pass per tensor and no temporaries (the per-tensor loop
    # makes a parameter-sized denominator for each): 7% faster and 0.7 B/parameter less at a CPU unit's peak
    # (BENCHMARKS.md "Big models").
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)


@dataclass
class InnerResult:
    """What one inner phase did."""

    steps: int
    samples: int
    mean_loss: float
    last_loss: float
    compute_s: float


def inner_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               step: int, cfg: InnerConfig, own_step: int | None = None, *, compute: Compute | None = None,
               lr: float | None = None, no_sync=None) -> float:
    """One AdamW step on a batch at schedule step `step` (see `lr_at`; or at `lr` when given); returns the training
    loss. `compute` sets precision and micro-batches (default: fp32, the whole batch at once)."""
    compute = compute or _FP32
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, cfg, own_step) if lr is None else lr
    optimizer.zero_grad(set_to_none=True)
    loss = compute.forward_backward(model, x, y, no_sync)
    compute.step(optimizer, [p for group in optimizer.param_groups for p in group["params"]], cfg.grad_clip)
    return loss


_FP32 = Compute()
