"""Which options each command's `--help` lists, under which short names, and the older flat names kept working.

Everything else is reachable as `--SECTION.FIELD` or in the `--config` file, and listed by `--help-all`.
"""

from __future__ import annotations

from p2p_diloco.cli.args import Options, flat_names
from p2p_diloco.config import BootstrapConfig, JoinConfig, SimulateConfig, StatusConfig, preset

JOIN_SHOWN = {
    "spec.run_id": "--run-id",
    "spec.data.corpus": "--corpus",
    "spec.model.arch": "--model",
    "network.bootstrap": "--bootstrap",
    "network.identity": "--identity",
    "network.host": "--host",
    "network.port": "--port",
    "network.announce": "--announce",
    "network.use_auto_relay": "--use-auto-relay",
    "network.reachability": "--reachability",
    "training.rounds": "--rounds",
    "training.device": "--device",
    "training.precision": "--precision",
    "training.micro_batch": "--micro-batch",
    "training.gpus": "--gpus",
    "logging.out_dir": "--out-dir",
    "logging.status_port": "--status-port",
    "checkpoint.dir": "--checkpoint-dir",
    "admission.access.allow_peers": "--allow-peers",
    "admission.access.run_secret_file": "--run-secret-file",
}

# The flat names `join` had before its config was one nested JoinConfig (scripts and benchmarks pass them).
_JOIN_ALIAS_PREFIX = {"gossip": "gossip-", "statesync": "sync-", "admission.rate": "rate-"}
_CHECKPOINT_ALIASES = {"every": "checkpoint-every", "dir": "checkpoint-dir", "keep": "keep-checkpoints",
                       "catch_up_stall_s": "catch-up-stall-s", "resync_window_s": "resync-window-s"}


def _join_alias(path: tuple[str, ...]) -> str:
    section, name = ".".join(path[:-1]), path[-1]
    if section == "checkpoint":
        return "--" + _CHECKPOINT_ALIASES[name]
    return "--" + _JOIN_ALIAS_PREFIX.get(section, "") + name.replace("_", "-")


def _flat_alias(path: tuple[str, ...]) -> str:
    return "--" + path[-1].replace("_", "-")


def join_options(preset_name: str) -> Options:
    return Options(JoinConfig, JoinConfig(spec=preset(preset_name)), "join", JOIN_SHOWN, _join_alias)


SIMULATE_SHOWN = {
    "sim.peers": "--peers",
    "sim.method": "--method",
    "sim.total_steps": "--total-steps",
    "sim.speeds": "--speeds",
    "sim.crash": "--crash",
    "sim.join": "--join",
    "sim.latency_s": "--latency-s",
    "sim.bandwidth_mbps": "--bandwidth-mbps",
    "sim.loss": "--loss",
    "sim.device": "--device",
    "spec.seed": "--seed",
    "spec.data.corpus": "--corpus",
    "spec.model.arch": "--model",
    "spec.inner.inner_steps": "--inner-steps",
    "spec.outer.outer_lr": "--outer-lr",
    "spec.outer.codec": "--codec",
}


def simulate_options(preset_name: str) -> Options:
    return Options(SimulateConfig, SimulateConfig(spec=preset(preset_name)), "simulate", SIMULATE_SHOWN, _flat_alias)


def bootstrap_options() -> Options:
    return Options(BootstrapConfig, BootstrapConfig(), "bootstrap", flat_names(BootstrapConfig))


def status_options() -> Options:
    return Options(StatusConfig, StatusConfig(), "status", flat_names(StatusConfig))
