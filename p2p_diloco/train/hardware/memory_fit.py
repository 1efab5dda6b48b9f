"""Does a unit fit this machine: the memory it has free, the plan for `join`'s settings, the refusal before start,
and the largest Llama that fits (train/hardware/memory_plan.py makes the estimate).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import torch

from p2p_diloco.config import ConfigError, JoinConfig, ModelConfig
from p2p_diloco.train.hardware.memory_plan import GPU_CONTEXT_BYTES, MemoryPlan, UnitSetup, model_shape, plan_memory


def _llama(n_layer: int, n_embd: int, n_head: int, ffn: int, kv: int = 0, vocab: int = 32000) -> ModelConfig:
    return ModelConfig(arch="llama", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=kv, ffn_hidden=ffn,
                       vocab_size=vocab)


LLAMA_FAMILY: dict[str, ModelConfig] = {
    "135M": _llama(12, 768, 12, 2048, vocab=32768),  # BENCHMARKS' GPU model
    "360M": _llama(24, 1024, 16, 2816),
    "1B": _llama(22, 2048, 32, 5632, kv=4),  # TinyLlama-1.1B's shape
    "2B": _llama(24, 2560, 20, 6912),  # Sheared-LLaMA-2.7B's width, 24 layers
    "3B": _llama(26, 3200, 32, 8640),  # OpenLLaMA-3B's
    "7B": _llama(32, 4096, 32, 11008),  # Llama-2's
    "13B": _llama(40, 5120, 40, 13824),
    "34B": _llama(48, 8192, 64, 22016, kv=8),  # Code Llama 34B's
    "70B": _llama(80, 8192, 64, 28672, kv=8),
}
"""Llama shapes from 135M to 70B parameters (untied head, Llama-2's 32k vocabulary); `largest_llama` walks them."""

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in '24GB' (10^9), '24GiB' (2^30), '512M', '1e9'... (a plain number is bytes)."""
    match = _SIZE.fullmatch(text)
    if not match:
        try:
            return int(float(text))
        except ValueError:
            raise ConfigError(f"cannot read {text!r} as a memory size; write e.g. 24GB, 24GiB or 512MB") from None
    number, prefix, binary = match.groups()
    power = "kmgt".find(prefix.lower()) + 1 if prefix else 0
    return int(float(number) * (1024 if binary else 1000) ** power)


def host_available() -> int | None:
    """The host's MemAvailable (/proc/meminfo); None where there is none (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def device_available(device: str) -> int | None:
    """Free memory on a CUDA device (torch.cuda.mem_get_info) as before this process made its CUDA context, which
    the plan counts itself; None for any other device."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return min(int(total), int(free) + GPU_CONTEXT_BYTES)


def resolve_plan_precision(name: str, gpu: bool) -> str:
    """`auto` as the learner resolves it: bf16 on a GPU (fp16 where the present one has no bf16), fp32 on the CPU."""
    if name != "auto":
        return name
    if not gpu:
        return "fp32"
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False):
        return "fp16"
    return "bf16"


def join_setup(config: JoinConfig, *, device: str, ranks: int) -> UnitSetup:
    """The plan's inputs for a `join` config (its spec resolved: the model's vocabulary known) on `device`."""
    cfg = config.training
    gpu = not device.startswith("cpu")
    return UnitSetup(model=config.spec.model, batch_size=config.spec.data.batch_size,
                     precision=resolve_plan_precision(cfg.precision, gpu), micro_batch=cfg.micro_batch,
                     activation_checkpointing=cfg.activation_checkpointing, ranks=max(1, ranks),
                     parallel=cfg.parallel, gpu=gpu,
                     retained_bytes=config.gossip.retained_bytes, outer_state_in_files=bool(cfg.outer_state_dir))


def check_join_memory(config: JoinConfig) -> JoinConfig:
    """`config` with its spec resolved (train/data/resolve.py: the model's vocabulary is the dataset's, resolved
    once here, not again later); ConfigError with one line naming what to change, before anything starts, when the
    unit will not fit this machine. Every rank checks its own device; `--training.memory-check false` skips it."""
    from p2p_diloco.train.data.resolve import resolve_spec
    from p2p_diloco.train.hardware.unit import unit_device

    config = dataclasses.replace(config, spec=resolve_spec(config.spec))
    if not config.training.memory_check:
        return config
    device = unit_device(config.training.device)
    # torchrun's contract (as unit.py reads it): WORLD_SIZE ranks in this unit
    ranks = max(config.training.gpus, int(os.environ.get("WORLD_SIZE", "1")))
    plan = plan_memory(join_setup(config, device=device, ranks=ranks))
    advice = plan.check(device_available(device), host_available())
    if advice is not None:
        raise ConfigError(f"{plan.describe()}: {advice} (`p2p-diloco plan` with the same options shows every part; "
                          f"--training.memory-check false skips this check)")
    return config


def largest_llama(template: UnitSetup, device_bytes: int | None,
                  host_bytes: int | None) -> list[tuple[str, MemoryPlan, bool]]:
    """(name, plan, fits) for every size of LLAMA_FAMILY, trained as `template` says (its batch, block size,
    precision, micro-batch, ranks); the largest that fits is the last with True."""
    rows = []
    for name, model in LLAMA_FAMILY.items():
        model = dataclasses.replace(model, block_size=template.model.block_size)
        plan = plan_memory(dataclasses.replace(template, model=model), model_shape(model))
        rows.append((name, plan, plan.check(device_bytes, host_bytes) is None))
    return rows
