"""The command line: every sub-command has --help, bad input gets one clear line and exit code 2."""

import subprocess
import sys

import pytest

from p2p_diloco.cli.main import build_parser, main


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "p2p_diloco.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_subcommands_and_documents_every_option():
    parser = build_parser()
    text = parser.format_help()
    for name in ("simulate", "keygen", "id"):
        assert name in text
    sim_help = " ".join(_run("simulate", "--help").stdout.split())  # argparse wraps lines where it likes
    assert "--inner-steps" in sim_help and "H: inner steps per outer round" in sim_help
    assert "--outer-lr" in sim_help and "(default: 1.4)" in sim_help


def test_every_subcommand_help_formats():
    # argparse %-formats help text, so one stray "%" in a config docstring breaks --help of a whole command
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert {"simulate", "bootstrap", "join", "status"} <= set(commands)
    for name, sub in commands.items():
        assert "usage:" in sub.format_help(), name


@pytest.mark.parametrize("args, message", [
    (["simulate", "--preset", "huge"], "invalid choice: 'huge'"),
    (["simulate", "--corpus", "/nonexistent/text"], "/nonexistent/text"),
    (["simulate", "--inner-steps", "0"], "inner_steps must be > 0"),
    (["simulate", "--codec", "zip"], "codec must be one of"),
    (["simulate", "--peers", "two"], "invalid int value: 'two'"),
    (["simulate", "--inner-stepz", "3"], "unrecognized arguments: --inner-stepz"),
    (["simulate", "--sim.peerz", "3"], "unrecognized arguments: --sim.peerz 3 (did you mean --sim.peers?)"),
])
def test_bad_input_gets_a_clear_error(args, message):
    proc = _run(*args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_keygen_and_id(tmp_path, capsys):
    key = tmp_path / "id.key"
    assert main(["keygen", "--identity", str(key)]) == 0
    peer_id = capsys.readouterr().out.split()[-1]
    assert peer_id.startswith("12D3KooW")
    assert main(["id", "--identity", str(key)]) == 0
    assert capsys.readouterr().out.strip() == peer_id
    assert main(["keygen", "--identity", str(key)]) == 2  # never overwrite an identity silently
    assert main(["id", "--identity", str(tmp_path / "missing.key")]) == 2


def test_simulate_runs_and_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    proc = _run("simulate", "--peers", "2", "--total-steps", "40", "--max-corpus-mb", "1", "--eval-batches", "2",
                "--json-out", str(out), "--plot", str(png), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "eval_loss=" in proc.stdout and out.stat().st_size > 0 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("content, message", [
    ("[spec]\nmodel = 5", "run.toml: [spec] 'model' must be a table [spec.model], got 5"),
    ('[spec.inner]\ninner_steps = "abc"', "run.toml: [spec.inner] inner_steps must be an integer, got 'abc'"),
    ("[sim]\npeerz = 2", "run.toml: [sim] unknown key 'peerz' (did you mean 'peers'?)"),
    ("[spec.inner\n", "run.toml: not valid TOML"),
])
def test_bad_config_file_gets_a_clear_error(tmp_path, content, message):
    path = tmp_path / "run.toml"
    path.write_text(content)
    proc = _run("simulate", "--config", str(path))
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
