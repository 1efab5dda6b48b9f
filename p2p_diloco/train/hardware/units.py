"""Which learner unit this process is part of: one process (`SoloUnit`), or a rank of a torchrun unit whose ranks
each hold the whole model (`RankGroup`, DDP: train/hardware/unit.py) or a shard of it (`ShardedUnit`, FSDP2:
train/hardware/sharded.py), as `training.parallel` says."""

from __future__ import annotations

import os

from p2p_diloco.config import ConfigError
from p2p_diloco.train.hardware.unit import RankGroup, SoloUnit


def unit_from_env(device: str, parallel: str = "ddp") -> SoloUnit:
    """Under torchrun with WORLD_SIZE > 1 this process's rank of the unit (`rank_group`), else the solo unit."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return SoloUnit()
    return rank_group(device, parallel)


def rank_group(device: str, parallel: str) -> RankGroup:
    """This process's rank of a torchrun unit: "ddp" (a full copy of the model per rank) or "fsdp" (sharded)."""
    if parallel == "fsdp":
        from p2p_diloco.train.hardware.sharded import ShardedUnit  # torch.distributed.tensor: 0.7 s of imports

        return ShardedUnit(device)
    if parallel != "ddp":
        raise ConfigError(f"unknown training.parallel {parallel!r}; use ddp or fsdp")
    return RankGroup(device)
