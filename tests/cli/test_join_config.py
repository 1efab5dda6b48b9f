"""`join`'s one nested config: a short --help, a complete --help-all, a TOML file under command-line options,
and a mistake in either is one line and exit code 2 before anything touches the network."""

import dataclasses
import subprocess
import sys
import time

import pytest

from p2p_diloco.cli.args import dotted_flag
from p2p_diloco.cli.main import build_parser
from p2p_diloco.cli.swarm import join_config
from p2p_diloco.config import JoinConfig, SimulateConfig, preset
from p2p_diloco.config.load import leaves
from p2p_diloco.config.spec import InnerConfig, OuterConfig

OPTION_LINE = r"^ +(-[A-Za-z], )?--[a-z]"


def _run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "p2p_diloco.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _options(text: str) -> list[str]:
    import re

    return [line for line in text.splitlines() if re.match(OPTION_LINE, line)]


def test_join_help_is_short_and_points_to_help_all():
    proc = _run("join", "--help")
    assert proc.returncode == 0
    assert len(_options(proc.stdout)) <= 25, proc.stdout
    flat = " ".join(proc.stdout.split())
    assert "--SECTION.FIELD" in flat and "--help-all" in flat
    for flag in ("--config", "--bootstrap", "--identity", "--preset", "--device", "--rounds", "--out-dir"):
        assert flag in proc.stdout


@pytest.mark.parametrize("command, root", [("join", JoinConfig), ("simulate", SimulateConfig)])
def test_help_all_lists_every_field_by_section(command, root):
    proc = _run(command, "--help-all")
    assert proc.returncode == 0, proc.stderr
    for path, _owner, _tp in leaves(root):
        assert dotted_flag(path) in proc.stdout, dotted_flag(path)
    if command == "join":
        for section in ("[network]", "[training]", "[checkpoint]", "[gossip]", "[admission.rate]", "[spec.outer]"):
            assert section in proc.stdout
        assert "Random peers to announce to after publishing" in proc.stdout and "(default: 3)" in proc.stdout


def _join_args(*argv: str):
    return build_parser().parse_args(["join", *argv])


BOOT = "/ip4/1.2.3.4/tcp/1/p2p/12D3KooWGnTpqbfX2NJGtHVg8BE1L3m8rRmZf1oK7DfFrCqH8ZkF"


def test_toml_file_then_command_line_over_it(tmp_path):
    path = tmp_path / "peer.toml"
    path.write_text('[spec]\nrun_id = "mine"\n[spec.inner]\ninner_steps = 7\n[gossip]\nfanout = 5\n'
                    f'[training]\nrounds = 3\n[network]\nbootstrap = ["{BOOT}"]\n[admission.rate]\nburst_s = 4\n')
    config = join_config(_join_args("--preset", "tiny", "--config", str(path), "--gossip.fanout", "2",
                                    "--rounds", "9", "--spec.inner.lr", "0.01", "--checkpoint-every", "4"))
    tiny = preset("tiny")
    assert config.spec.run_id == "mine" and config.spec.inner.inner_steps == 7  # the file over the preset
    assert config.spec.model == tiny.model  # the preset where the file says nothing
    assert config.gossip.fanout == 2 and config.training.rounds == 9  # the command line over the file
    assert config.spec.inner.lr == 0.01 and config.checkpoint.every == 4  # dotted, and an older flat name
    assert config.network.bootstrap == (BOOT,) and config.admission.rate.burst_s == 4.0
    assert config.gossip == dataclasses.replace(JoinConfig().gossip, fanout=2)


def test_profiles_load(tmp_path):
    from pathlib import Path

    runs = {"cpu-volunteer": "cpu-volunteers", "slow-link-volunteer": "cpu-volunteers", "gpu-24gb": "gpu-24gb",
            "gpu-llama-135m": "gpu-llama-135m", "multi-gpu-host": "gpu-llama-135m"}
    peers = Path(__file__).resolve().parents[2] / "peers"
    assert sorted(p.stem for p in peers.glob("*.toml")) == sorted(runs)
    configs = {}
    for name, run_id in runs.items():
        config = configs[name] = join_config(_join_args("--config", str(peers / f"{name}.toml")))
        assert config.spec.run_id == run_id
        # A profile spells out the whole spec; its outer step and lr clock must be today's defaults, not a copy
        # of older ones (BENCHMARKS.md "Async quality").
        assert config.spec.outer.outer_lr == OuterConfig().outer_lr
        assert config.spec.outer.momentum == OuterConfig().momentum
        assert config.spec.inner.schedule_clock == InnerConfig().schedule_clock
    # The per-peer variants join their base profile's run: the same RunSpec (hash), only their own tables differ.
    assert configs["slow-link-volunteer"].spec == configs["cpu-volunteer"].spec
    slow = configs["slow-link-volunteer"].admission.rate
    assert slow.uplink_bytes_per_s < JoinConfig().admission.rate.uplink_bytes_per_s and slow.measure_uplink
    assert configs["multi-gpu-host"].spec == configs["gpu-llama-135m"].spec
    gpus = configs["multi-gpu-host"].training.gpus
    assert gpus > 1 and configs["multi-gpu-host"].spec.data.batch_size % gpus == 0


@pytest.mark.parametrize("content, extra, message", [
    ("[gossip]\nfanot = 3\n", [], "peer.toml: [gossip] unknown key 'fanot' (did you mean 'fanout'?)"),
    ('[gossip]\nfanout = "three"\n', [], "peer.toml: [gossip] fanout must be an integer, got 'three'"),
    ("[trainig]\nrounds = 3\n", [], "peer.toml: unknown key 'trainig' (did you mean 'training'?)"),
    ("[training\nrounds = 3\n", [], "peer.toml: not valid TOML: Expected ']' at the end of a table declaration "
                                    "(at line 1, column 10)"),
    ("[training]\nrounds = -1\n", [], "rounds and eval_every must be >= 0"),
    ("", ["--gossip.fanout", "x"], "argument --gossip.fanout: invalid int value: 'x'"),
    ("", ["--training.duty-cycle", "0"], "duty_cycle must be in (0, 1], got 0.0"),
    ("", ["--gossip.fanot", "3"], "unrecognized arguments: --gossip.fanot 3 (did you mean --gossip.fanout?)"),
])
def test_a_mistake_is_one_line_and_exit_2_before_the_network(tmp_path, content, extra, message):
    path = tmp_path / "peer.toml"
    path.write_text(content)
    # A bootstrap nobody answers: had the node started, this would take seconds and print more than one line.
    t0 = time.monotonic()
    proc = _run("join", "--config", str(path), "--identity", str(tmp_path / "id.key"),
                "--bootstrap", "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWGnTpqbfX2NJGtHVg8BE1L3m8rRmZf1oK7DfFrCqH8ZkF",
                *extra, timeout=30)
    assert proc.returncode == 2, proc.stderr
    message = message.replace("peer.toml", str(path), 1) if message.startswith("peer.toml") else message
    assert proc.stderr.strip().splitlines() == [f"p2p-diloco join: error: {message}"], proc.stderr
    assert proc.stdout == "" and not (tmp_path / "id.key").exists() and time.monotonic() - t0 < 30


def test_gpus_that_do_not_split_the_batch_are_one_line_before_anything_starts():
    proc = _run("join", "--gpus", "3", "--rounds", "1")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "divisible by 3" in proc.stderr, proc.stderr


@pytest.mark.parametrize("command, extra", [("join", ["--identity", "id.key"]), ("status", [])])
def test_a_bad_bootstrap_multiaddr_is_answered_before_torch_or_hivemind_load(tmp_path, command, extra):
    """The options are checked in config/ (config/multiaddrs.py): a typo answers in a quarter of a second, where the
    node's imports would take seconds; the same message as the node's own check."""
    from p2p_diloco.config import ConfigError, NetworkConfig, StatusConfig

    bad = "/ip4/203.0.113.5/tcp/notaport/p2p/12D3KooWxyz"
    for config in (JoinConfig(network=NetworkConfig(bootstrap=(bad,))), StatusConfig(bootstrap=(bad,))):
        with pytest.raises(ConfigError, match="bad multiaddr .*invalid base 10 integer; expected e.g. /ip4/"):
            config.validate()
    with pytest.raises(ConfigError, match="must end with /p2p/<peer id>"):
        JoinConfig(network=NetworkConfig(bootstrap=("/ip4/1.2.3.4/tcp/1",))).validate()
    probe = ("import sys; from p2p_diloco.cli.main import main; rc = main(sys.argv[1:]); "
             "print(rc, 'torch' in sys.modules, 'hivemind' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe, command, "--bootstrap", bad, *extra], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert proc.stdout.split() == ["2", "False", "False"], (proc.stdout, proc.stderr)
    assert proc.stderr.strip().splitlines() == [
        f"p2p-diloco {command}: error: bad multiaddr '{bad}': Invalid MultiAddr '{bad}': invalid base 10 integer; "
        "expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."], proc.stderr
    assert not (tmp_path / "id.key").exists()


def test_aggregation_is_refused_with_a_clear_error_where_sums_cannot_carry_the_weights() -> None:
    from p2p_diloco.config import ConfigError
    from p2p_diloco.config.network import GossipConfig

    with pytest.raises(ConfigError, match="--gossip.aggregate needs exact merge weights.*copy-cosine 0"):
        JoinConfig(gossip=GossipConfig(aggregate=8)).validate()  # the copy rule reads payloads
    with pytest.raises(ValueError, match="fan-in\\) must be 0 or >= 2, got 1"):
        JoinConfig(gossip=GossipConfig(aggregate=1)).validate()
    spec = preset("test")
    no_copy_rule = dataclasses.replace(spec, defence=dataclasses.replace(spec.defence, copy_cosine=0.0))
    assert JoinConfig(spec=no_copy_rule, gossip=GossipConfig(aggregate=8)).validate().gossip.aggregate == 8
