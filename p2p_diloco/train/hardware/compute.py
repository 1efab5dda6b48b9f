"""How an inner step computes: precision, micro-batches with gradient accumulation, activation checkpointing, and
what an out-of-memory says.

Only the forward and backward run in reduced precision (autocast): the local model's parameters and its AdamW
state stay float32 (master weights), and so do the replica, the outer momentum and the error feedback. So a
bf16 GPU unit, an fp16 one and an fp32 CPU unit train one run together, and what they send is comparable.

`--precision auto` takes bf16 where the GPU supports it (Ampere and later), fp16 with a loss scaler on older
GPUs, fp32 on the CPU (CPU bf16 autocast works but is slower than fp32 on most CPUs). `--micro-batch N` splits
the run's batch into chunks of N sequences whose gradients add up to the whole batch's, so a 24 GB card and an
80 GB card train the same batch; the loss is scaled by each chunk's share, so the step is the same as one
whole-batch step (up to float rounding).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import torch

from p2p_diloco.config import ConfigError

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class OutOfMemory(ConfigError):
    """The inner step ran out of device memory; the message says which flag to lower."""


def resolve_precision(name: str, device: str) -> str:
    """`auto` -> bf16 | fp16 | fp32 for this device; an explicit name is checked against what the device can do."""
    if name not in PRECISIONS:
        raise ConfigError(f"unknown --precision {name!r}; use {', '.join(PRECISIONS)}")
    cuda = device.startswith("cuda")
    if name == "auto":
        if not cuda:
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    if name == "fp16" and not cuda:
        raise ConfigError(f"--precision fp16 needs a CUDA device (this unit trains on {device}); use bf16 or fp32")
    if name == "bf16" and cuda and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ConfigError(f"--precision bf16: {torch.cuda.get_device_name(device)} has no bf16 (pre-Ampere); "
                          f"use --precision fp16 (with a loss scaler) or auto")
    return name


@dataclass
class Compute:
    """Precision and micro-batching of one learner's inner steps."""

    device: str = "cpu"
    precision: str = "fp32"
    micro_batch: int = 0
    """Sequences per forward/backward (0: the whole batch at once)."""
    activation_checkpointing: bool = False
    compile: bool = False
    """torch.compile the training model (fuses the norms, rotary and SwiGLU element-wise work on GPUs)."""

    @classmethod
    def for_training(cls, cfg, device: str) -> Compute:
        """From `join`'s [training] settings (config/join.py TrainingConfig), on `device`."""
        return cls(device=device, precision=cfg.precision, micro_batch=cfg.micro_batch,
                   activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile)

    def __post_init__(self) -> None:
        self.precision = resolve_precision(self.precision, self.device)
        if self.micro_batch < 0:
            raise ConfigError(f"--micro-batch must be >= 0, got {self.micro_batch}")
        self.device_type = self.device.split(":")[0]
        # fp16's range is small: scale the loss so small gradients do not flush to zero (bf16 has fp32's range).
        self.scaler = torch.amp.GradScaler(self.device_type) if self.precision == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=_DTYPES[self.precision])

    def prepare(self, model: torch.nn.Module) -> None:
        setter = getattr(model, "set_activation_checkpointing", None)
        if setter is not None:
            setter(self.activation_checkpointing)
        elif self.activation_checkpointing:
            raise ConfigError(f"activation checkpointing is not available for {type(model).__name__}")

    def compiled(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the inner steps call: compiled with --compile (it shares the parameters), else itself."""
        # For a module torch.compile returns an OptimizedModule (an nn.Module); its stubs only say Callable.
        return cast(torch.nn.Module, torch.compile(model)) if self.compile else model

    def chunks(self, x: torch.Tensor, y: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        size = self.micro_batch or x.shape[0]
        yield from zip(x.split(size), y.split(size))

    def forward_backward(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                         no_sync: Callable[[], contextlib.AbstractContextManager] | None = None) -> float:
        """Gradients of the mean loss over the batch into `.grad` (accumulated over micro-batches); the loss.

        `no_sync` (a DDP module's) skips the gradient all-reduce on every micro-batch but the last."""
        with self._oom_hint(x):
            parts = list(self.chunks(x, y))
            total = torch.zeros((), device=x.device)
            for i, (xc, yc) in enumerate(parts):
                share = xc.shape[0] / x.shape[0]
                quiet = no_sync() if (no_sync is not None and i < len(parts) - 1) else contextlib.nullcontext()
                with quiet:
                    with self.autocast():
                        _, loss = model(xc, yc)
                    scaled = loss * share
                    (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                total += scaled.detach()
            return float(total)  # one device sync per step, not one per micro-batch

    def step(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grad_clip: float) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        if self.scaler is not None:
            self.scaler.step(optimizer)  # skips the step when the scaled gradients overflowed
            self.scaler.update()
        else:
            optimizer.step()

    @contextlib.contextmanager
    def _oom_hint(self, x: torch.Tensor) -> Iterator[None]:
        try:
            yield
        except torch.OutOfMemoryError as e:
            raise OutOfMemory(self.oom_message(x.shape[0], x.shape[1])) from e
        except RuntimeError as e:  # the CPU allocator's out-of-memory is a plain RuntimeError
            if "can't allocate memory" not in str(e) and "out of memory" not in str(e).lower():
                raise
            raise OutOfMemory(self.oom_message(x.shape[0], x.shape[1])) from e

    def oom_message(self, batch: int, block: int) -> str:
        size = self.micro_batch or batch
        hints = [f"--micro-batch {max(1, size // 2)}" if size > 1 else None,
                 None if self.activation_checkpointing else "--activation-checkpointing true",
                 "--precision bf16" if self.precision == "fp32" and self.device_type == "cuda" else None]
        fix = ", or ".join(h for h in hints if h) or "a smaller model, or a device with more memory"
        return (f"out of memory on {self.device} at micro-batch {size} of {batch} sequences x {block} tokens "
                f"(precision {self.precision}); lower it: {fix}")
