"""Optional places a peer also logs each round's figures: TensorBoard and Weights & Biases, when the operator
asks for them and has the package installed. Never required: a missing package is one clear error at start."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Protocol

from p2p_diloco.config import ConfigError, LoggingConfig, RunSpec

SCALARS = ("loss", "eval_loss", "utilization", "tau", "peers", "vv_total", "bytes_sent", "bytes_received",
           "merged", "rejected", "samples_per_s", "round_s", "alone")
FLAGS = ("alone",)
"""Booleans logged as 0/1 (alone: merged nothing while others publish, peer/isolation.py)."""


Figures = Mapping[str, object]
"""One round's figures, as the report keeps them (`PeerReport.last`)."""


class Sink(Protocol):
    def write(self, figures: Figures) -> None: ...

    def close(self) -> None: ...


def scalars(figures: Figures) -> dict[str, float]:
    """The round's numeric figures (None and non-numbers left out: eval_loss is None on most rounds; FLAGS as
    0/1)."""
    return {k: float(v) for k in SCALARS if isinstance(v := figures.get(k), (int, float))
            and (k in FLAGS or not isinstance(v, bool))}


class TensorBoardSink:
    def __init__(self, folder: str, peer_id: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError(f"--logging.tensorboard_dir needs the tensorboard package ({e}); "
                              "pip install tensorboard") from None
        self.writer = SummaryWriter(log_dir=folder, comment=peer_id[-8:])

    def write(self, figures: Figures) -> None:
        # x axis: tokens, comparable across peers
        step = int(_number(figures.get("tokens")) or _number(figures.get("round")))
        for name, value in scalars(figures).items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, peer_id: str, spec: RunSpec) -> None:
        try:
            wandb = importlib.import_module("wandb")  # optional: only with --logging.wandb_project
        except ImportError:
            raise ConfigError("--logging.wandb_project needs the wandb package; pip install wandb") from None
        self.wandb = wandb
        self.run = wandb.init(project=project, name=peer_id[-8:], config={"spec_hash": spec.spec_hash(),
                                                                         "run_id": spec.run_id})

    def write(self, figures: Figures) -> None:
        self.run.log({**scalars(figures), "tokens": figures.get("tokens", 0)}, step=int(_number(figures.get("round"))))

    def close(self) -> None:
        self.run.finish()


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def check_available(config: LoggingConfig) -> None:
    """ConfigError now, before the node starts, if a sink `config` asks for is not installed."""
    import importlib.util

    for wanted, module, flag in ((config.tensorboard_dir, "tensorboard", "--logging.tensorboard_dir"),
                                 (config.wandb_project, "wandb", "--logging.wandb_project")):
        if wanted and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{flag} needs the {module} package; pip install {module}")


def open_sinks(config: LoggingConfig, peer_id: str, spec: RunSpec) -> list[Sink]:
    """The sinks `config` asks for."""
    sinks: list[Sink] = []
    if config.tensorboard_dir:
        sinks.append(TensorBoardSink(config.tensorboard_dir, peer_id))
    if config.wandb_project:
        sinks.append(WandbSink(config.wandb_project, peer_id, spec))
    return sinks
