"""How much memory a learner unit needs, component by component, before anything is allocated.

Per device (each rank's accelerator; on a CPU unit the host itself) the inner steps hold float32 master weights,
gradients and AdamW's two moments (16 B/parameter, divided over the N ranks under FSDP), the reduced-precision
weight casts autocast keeps for backward, the activations and the logits. The host of rank 0 holds the outer state
(ARCHITECTURE.md "Models, data and hardware"): the replica, the phase's base point, the outer momentum and the
error feedback (12 B/parameter, m and e in bfloat16; never sharded: rank 0 speaks for the unit), the bounded chunk
buffers the outer step streams through, the gossip store's bound and the process itself.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
bytes per token per layer at 16 bits: attention 11 h, MLP 3 h + 4 f (gated: 2 h + 8 f), norms 4 h; the 5 a s / h
attention-score term is left out because the fused SDPA kernels never hold the scores. Hugging Face's Llama-style
families run RMSNorm and rotary embeddings as Python ops that keep float32 copies: +12 h and +4 h, which puts the
estimate 3-9% above the measured peaks of BENCHMARKS.md's eager 135M Llama on an H200 (batch 8-64 x 1024, bf16
and fp32). Activation
checkpointing keeps each layer's float32 input plus one layer's activations. fp32 doubles every stored value.
`torch.compile` stores less (the estimate stays an upper bound there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from p2p_diloco.config import ModelConfig

CHUNK_NUMEL = 16 * 2**20
"""Elements per chunk when the outer state is streamed (pseudo-gradient, compression, merge, checkpoint)."""
CHUNK_BUFFERS = 3
"""Chunk-sized float32 buffers alive at once in the outer step."""
PROCESS_BASE_BYTES = 450 * 10**6
"""One learner process before any model: python, torch, hivemind (measured: the ~0.4 GB intercept of BENCHMARKS)."""
GPU_CONTEXT_BYTES = 500 * 10**6
"""The CUDA context, cuBLAS workspaces and the caching allocator's slack on each GPU."""
MARGIN = 0.95
"""A plan fits when it needs at most this fraction of what is available (fragmentation, other processes)."""
GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know of a model, read from it built on the `meta` device."""

    params: int
    largest_unit: int
    """Parameters of the largest piece FSDP gathers at once: one block, or what lies outside the blocks."""
    n_layer: int
    hidden: int
    ffn: int
    vocab: int
    gated: bool
    """SwiGLU MLP (Llama, Qwen2, Mistral) rather than GELU (gpt, gpt2)."""
    python_norms: bool
    """RMSNorm and rotary as Python ops (Hugging Face's Llama-style families) rather than fused kernels."""


def _blocks(model: nn.Module) -> nn.ModuleList | None:
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    return max(lists, key=len, default=None)


def model_shape(config: ModelConfig) -> ModelShape:
    """Count the model's parameters exactly by building it on the `meta` device (no memory is allocated)."""
    from p2p_diloco.train.models.build import build_model

    with torch.device("meta"):
        model = build_model(config, seed=0)
    params = sum(p.numel() for p in model.parameters())
    blocks = _blocks(model)
    block = sum(p.numel() for p in blocks[0].parameters()) if blocks is not None else params
    n_layer = len(blocks) if blocks is not None else 1
    hidden, ffn, vocab, family = config.n_embd, config.ffn_hidden, config.vocab_size, config.arch
    if config.arch != "gpt":
        from p2p_diloco.train.models.hf import family_config

        d = family_config(config)
        family = str(d.get("model_type", family))
        hidden = int(d.get("hidden_size", d.get("n_embd", hidden)))
        ffn = int(d.get("intermediate_size") or d.get("n_inner") or 0)
        vocab = int(d.get("vocab_size", vocab))
    gelu = family in ("gpt", "gpt2")
    return ModelShape(params=params, largest_unit=max(block, params - n_layer * block), n_layer=n_layer,
                      hidden=hidden, ffn=ffn or 4 * hidden, vocab=vocab, gated=not gelu, python_norms=not gelu)


@dataclass(frozen=True)
class UnitSetup:
    """How a unit trains: what the estimate depends on besides the model."""

    model: ModelConfig
    batch_size: int
    """Sequences per inner step for the whole unit (split over the ranks)."""
    precision: str = "fp32"
    """fp32, bf16 or fp16 (resolved: not auto)."""
    micro_batch: int = 0
    activation_checkpointing: bool = False
    ranks: int = 1
    parallel: str = "ddp"
    """ddp (each rank holds the whole model) or fsdp (weights, gradients and AdamW state sharded over the ranks)."""
    gpu: bool = False
    """The device is an accelerator with its own memory; else the ranks train in host memory."""
    retained_bytes: int = 512 << 20
    """The gossip store's bound (`gossip.retained_bytes`)."""
    outer_state_in_files: bool = False
    """m and e live in files (`training.outer_state_dir`), out of memory during the inner steps."""

    @property
    def sequences(self) -> int:
        """Sequences one rank runs through one forward/backward."""
        per_rank = max(1, self.batch_size // max(1, self.ranks))
        return min(self.micro_batch, per_rank) if self.micro_batch else per_rank


def layer_activation_bytes(shape: ModelShape, precision: str) -> int:
    """Bytes one layer keeps for backward, per token (module docstring)."""
    h, f = shape.hidden, shape.ffn
    mlp = 2 * h + 8 * f if shape.gated else 3 * h + 4 * f
    units = 11 * h + 4 * h + mlp + (16 * h if shape.python_norms else 0)
    return units * (2 if precision == "fp32" else 1)


def _activations(shape: ModelShape, setup: UnitSetup) -> list[tuple[str, int]]:
    tokens = setup.sequences * setup.model.block_size
    layer = layer_activation_bytes(shape, setup.precision) * tokens
    if setup.activation_checkpointing:
        inputs = shape.n_layer * tokens * shape.hidden * 4  # the float32 residual stream at each layer's input
        layers = [(f"layer inputs ({shape.n_layer} layers, checkpointed)", inputs), ("one layer recomputed", layer)]
    else:
        layers = [(f"activations ({shape.n_layer} layers)", shape.n_layer * layer)]
    # float32 logits, their log-softmax and its gradient; under autocast also the 16-bit logits and their gradient
    per_logit = 12 if setup.precision == "fp32" else 16
    return layers + [("logits and loss", tokens * shape.vocab * per_logit)]


def plan_memory(setup: UnitSetup, shape: ModelShape | None = None) -> MemoryPlan:
    """The memory `setup` needs on each device and on the host of rank 0 (`shape`: model_shape(setup.model))."""
    shape = shape if shape is not None else model_shape(setup.model)
    n, p = shape.params, setup.ranks if setup.parallel == "fsdp" else 1
    low = setup.precision != "fp32"
    device = [("weights (fp32 master)", 4 * n // p), ("gradients (fp32)", 4 * n // p),
              ("AdamW moments (fp32)", 8 * n // p)]
    sharded = setup.parallel == "fsdp" and setup.ranks > 1
    if sharded:  # one gathered piece in use, the next one prefetched
        device.append(("gathered layers (2 in flight)", shape.largest_unit * (6 if low else 4) * 2))
    # DDP's all-reduce buckets hold the gradients themselves (gradient_as_bucket_view, train/hardware/unit.py)
    if low and not sharded:
        device.append((f"{setup.precision} weight casts", 2 * n))
    device += _activations(shape, setup)
    if setup.gpu:
        device.append(("GPU context", GPU_CONTEXT_BYTES))
    outer = [] if setup.outer_state_in_files else [("outer momentum (bfloat16)", 2 * n),
                                                    ("error feedback (bfloat16)", 2 * n)]
    host = [("replica theta", 4 * n), ("phase base point", 4 * n), *outer,
            ("chunk buffers", min(CHUNK_NUMEL, n) * 4 * CHUNK_BUFFERS),
            ("gossip store (bound)", setup.retained_bytes), ("process (python, torch, hivemind)", PROCESS_BASE_BYTES)]
    if setup.ranks > 1:
        host.append((f"other ranks' processes ({setup.ranks - 1})", (setup.ranks - 1) * PROCESS_BASE_BYTES))
    return MemoryPlan(setup, shape, tuple(device), tuple(host))


def gib(n: float) -> str:
    """Bytes for people: GiB, or MiB below one GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def count(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"


@dataclass(frozen=True)
class MemoryPlan:
    """The estimate: (name, bytes) per component on one device (each rank's) and on the host of rank 0."""

    setup: UnitSetup
    shape: ModelShape
    device: tuple[tuple[str, int], ...]
    host: tuple[tuple[str, int], ...]

    @property
    def params(self) -> int:
        return self.shape.params

    @property
    def device_total(self) -> int:
        return sum(b for _, b in self.device)

    @property
    def host_total(self) -> int:
        return sum(b for _, b in self.host)

    @property
    def host_need(self) -> int:
        """What the host must hold: rank 0's part, plus every rank's training state on a CPU unit (one memory)."""
        return self.host_total + (0 if self.setup.gpu else self.setup.ranks * self.device_total)

    def describe(self) -> str:
        s = self.setup
        micro = f", micro-batch {s.sequences}" if s.micro_batch else ""
        ckpt = ", activation checkpointing" if s.activation_checkpointing else ""
        ranks = (f"{s.ranks} GPUs" if s.ranks > 1 else "1 GPU") if s.gpu else (
            f"{s.ranks} CPU processes" if s.ranks > 1 else "the CPU")
        return (f"{s.model.arch} {count(self.params)} parameters, batch {s.batch_size} x {s.model.block_size} "
                f"tokens{micro}, {s.precision}{ckpt}, on {ranks}" + (f" ({s.parallel})" if s.ranks > 1 else ""))

    def table(self, device_bytes: int | None = None, host_bytes: int | None = None) -> str:
        """A plain-text table of every component and the totals (against what is available, when given)."""
        s = self.setup
        rows = [self.describe(), ""]
        where = "each GPU" if s.gpu else ("each rank, in host memory" if s.ranks > 1 else "in host memory")
        for title, parts, total, have in (
                (f"device ({where})", self.device, self.device_total, device_bytes if s.gpu else None),
                ("host (rank 0: the outer state)", self.host, self.host_total, None)):
            rows.append(title)
            rows += [f"  {name:<44}{gib(b):>12}" for name, b in parts]
            rows.append(f"  {'total':<44}{gib(total):>12}" + (f"  of {gib(have)} free" if have else ""))
        need = self.host_need
        label = "host needs (one memory: host + device x ranks)" if not s.gpu else "host needs"
        rows.append(f"{label:<46}{gib(need):>12}" + (f"  of {gib(host_bytes)} free" if host_bytes else ""))
        return "\n".join(rows)

    def device_short(self, device_bytes: int | None) -> str | None:
        """How a GPU is short, in words; None when it fits, on a CPU unit, or when `device_bytes` is unknown."""
        if not self.setup.gpu or device_bytes is None or self.device_total <= MARGIN * device_bytes:
            return None
        top = max(self.device, key=lambda c: c[1])
        return f"each GPU needs {gib(self.device_total)} of {gib(device_bytes)} free (most: {top[0]} {gib(top[1])})"

    def host_short(self, host_bytes: int | None) -> str | None:
        """How the host is short, in words; None when it fits or `host_bytes` is unknown."""
        if host_bytes is None or self.host_need <= MARGIN * host_bytes:
            return None
        top = max(self.host if self.setup.gpu else self.device + self.host, key=lambda c: c[1])
        return f"the host needs {gib(self.host_need)} of {gib(host_bytes)} free (most: {top[0]} {gib(top[1])})"

    def check(self, device_bytes: int | None, host_bytes: int | None) -> str | None:
        """None when the unit fits; else ONE line: what is short, and the first change (in order of preference:
        a micro-batch, activation checkpointing, bf16 on a GPU, FSDP over more GPUs) that makes it fit."""
        smaller = (f"train a smaller model (its weights, gradients, AdamW and outer state alone take "
                   f"{gib(32 * self.params)})")
        host = self.host_short(host_bytes)
        if host is not None and self.setup.gpu:  # the outer state is per parameter: no training flag shrinks it
            return f"will not fit: {host}; {smaller}"
        short = host or self.device_short(device_bytes)
        if short is None:
            return None
        for flags, setup in self._remedies():
            plan = plan_memory(setup, self.shape)
            if plan.host_short(host_bytes) is None and plan.device_short(device_bytes) is None:
                return f"will not fit: {short}; use {flags}"
        return f"will not fit: {short}; {smaller}"

    def _remedies(self) -> Iterator[tuple[str, UnitSetup]]:
        s, flags = self.setup, ""
        stages = [("", s)]
        if not s.activation_checkpointing:
            flags, s = flags + " --activation-checkpointing true", dataclasses.replace(s, activation_checkpointing=True)
            stages.append((flags, s))
        if s.gpu and s.precision == "fp32":
            flags, s = flags + " --precision bf16", dataclasses.replace(s, precision="bf16")
            stages.append((flags, s))
        if s.gpu:
            stages += [(f"{flags} --gpus {n} --training.parallel fsdp",
                        dataclasses.replace(s, ranks=n, parallel="fsdp"))
                       for n in (2, 4, 8) if n > s.ranks and s.batch_size % n == 0]
        for stage_flags, stage in stages:
            if stage_flags:
                yield stage_flags.strip(), stage
            k = stage.sequences // 2
            while k >= 1:
                yield f"{stage_flags} --micro-batch {k}".strip(), dataclasses.replace(stage, micro_batch=k)
                k //= 2
