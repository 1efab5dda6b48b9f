"""Every configuration of the runtime, as frozen dataclasses with a docstring under each field.

Light by rule: the standard library only, so `p2p-diloco ... --help` (built from these docstrings by
cli/args.py) never imports torch or hivemind. Nothing here reads the environment.

  errors.py     ConfigError, and `require`, the check every `validate()` states its rules with
  spec.py       the RunSpec every peer of a run shares (model, data, inner, outer, defence), CODECS
  defence.py    DefenceConfig: the spec's `defence` section, what every peer does with hostile input
  presets.py    named RunSpecs (`--preset`)
  join.py       JoinConfig: one nested config for `p2p-diloco join` (spec, network, training, checkpoint, ...)
  network.py    NetworkConfig, GossipConfig, StateSyncConfig; BootstrapConfig and StatusConfig for those commands
  admission.py  AccessConfig (closed runs), RateLimitConfig, AdmissionConfig
  sim.py        SimConfig and SimulateConfig (`p2p-diloco simulate`)
  load.py       a TOML file into a config, one clear line per mistake
"""

from p2p_diloco.config.admission import AccessConfig, AdmissionConfig, RateLimitConfig
from p2p_diloco.config.defence import AGGREGATIONS, DefenceConfig
from p2p_diloco.config.errors import ConfigError
from p2p_diloco.config.join import CheckpointConfig, JoinConfig, LoggingConfig, TrainingConfig
from p2p_diloco.config.network import (
    DEFAULT_BOOTSTRAP_PORT,
    BootstrapConfig,
    GossipConfig,
    NetworkConfig,
    StateSyncConfig,
    StatusConfig,
)
from p2p_diloco.config.presets import PRESETS, preset
from p2p_diloco.config.sim import SimConfig, SimulateConfig
from p2p_diloco.config.spec import CODECS, MODEL_ARCHS, DataConfig, InnerConfig, ModelConfig, OuterConfig, RunSpec

__all__ = [
    "AGGREGATIONS", "CODECS", "DEFAULT_BOOTSTRAP_PORT", "PRESETS", "AccessConfig", "AdmissionConfig",
    "BootstrapConfig", "CheckpointConfig", "ConfigError", "DataConfig", "DefenceConfig", "GossipConfig",
    "InnerConfig", "JoinConfig", "LoggingConfig", "MODEL_ARCHS", "ModelConfig", "NetworkConfig", "OuterConfig",
    "RateLimitConfig", "RunSpec", "SimConfig", "SimulateConfig", "StateSyncConfig", "StatusConfig", "TrainingConfig",
    "preset",
]
