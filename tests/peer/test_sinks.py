"""Optional round sinks: TensorBoard and wandb are never required, a missing one is one clear error, and what
TensorBoard gets is the round's figures, read back from its event file."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

from p2p_diloco.config import ConfigError
from p2p_diloco.config.join import LoggingConfig
from p2p_diloco.peer.sinks import open_sinks, scalars
from tests.helpers.swarm import PEER_ARGS, cli

ROUND = {"round": 3, "loss": 2.5, "eval_loss": None, "utilization": 0.9, "tau": 1, "peers": 2, "vv_total": 6,
         "bytes_sent": 1000, "bytes_received": 2000, "merged": 3, "rejected": 0, "samples_per_s": 50.0,
         "round_s": 0.4, "tokens": 30720, "weight": True}


def test_scalars_keep_the_numbers_only():
    got = scalars(ROUND)
    assert got["loss"] == 2.5 and got["bytes_sent"] == 1000.0 and "eval_loss" not in got and "weight" not in got


def test_no_sink_unless_asked():
    assert open_sinks(LoggingConfig(), "12D3KooWx", spec=None) == []


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_a_missing_package_is_one_clear_error_naming_the_fix():
    with pytest.raises(ConfigError, match="pip install wandb"):
        open_sinks(LoggingConfig(wandb_project="p"), "12D3KooWx", spec=None)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_gets_each_rounds_figures(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (sink,) = open_sinks(LoggingConfig(tensorboard_dir=str(tmp_path)), "12D3KooWx", spec=None)
    sink.write(ROUND)
    sink.write({**ROUND, "round": 4, "tokens": 40960, "loss": 2.4})
    sink.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("loss")] == [(30720, 2.5), (40960, 2.4)]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_join_with_a_missing_sink_exits_2_with_one_line(tmp_path: Path):
    done = subprocess.run(cli("join", *PEER_ARGS, "--identity", str(tmp_path / "k"), "--rounds", "1",
                              "--logging.wandb-project", "x", "--checkpoint-every", "0"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "needs the wandb package; pip install wandb" in done.stderr and "Traceback" not in done.stderr
