"""Which device a learner's model trains on: `--device auto|cpu|cuda|cuda:N|mps`.

Only the local model (phi), its AdamW state and the batches live there. The replica, the outer state and
everything on the wire stay on the CPU in float32, so they are bit-identical on every peer whatever its device.
"""

from __future__ import annotations

import re

import torch

from p2p_diloco.config import ConfigError

DEVICE_NAMES = "auto, cpu, cuda, cuda:N or mps"


def resolve_device(name: str) -> str:
    """'auto' -> the best device this torch can use (cuda, then mps, else cpu); any other name is checked.

    Raises ConfigError for an unknown name or a device this machine (or this torch build) does not have.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cpu":
        return name
    match = re.fullmatch(r"cuda(?::(\d+))?", name)
    if match:
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name} was asked for but torch.cuda.is_available() is False: this torch "
                              f"is a CPU build, or no GPU is visible; use --device cpu (or auto)")
        index, count = int(match.group(1) or 0), torch.cuda.device_count()
        if index >= count:
            raise ConfigError(f"--device {name} was asked for but only {count} CUDA device(s) are visible "
                              f"(cuda:0..cuda:{count - 1})")
        return name
    if name == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError("--device mps was asked for but torch.backends.mps.is_available() is False: "
                              "MPS needs Apple silicon and a torch built with it; use --device cpu (or auto)")
        return name
    raise ConfigError(f"unknown --device {name!r}; use {DEVICE_NAMES}")
