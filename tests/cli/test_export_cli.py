"""`p2p-diloco export` and `generate` (cli/export.py): from a checkpoint to a folder transformers loads, then text;
bad inputs answer one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import p2p_diloco.cli.main as cli_main
from p2p_diloco.cli.export import add_export_commands
from p2p_diloco.config import preset
from p2p_diloco.train.models.build import build_model, flat_params
from p2p_diloco.train.state.checkpoint import CheckpointStore

pytestmark = pytest.mark.timeout(120)

SPEC = preset("test")


@pytest.fixture(autouse=True)
def export_wired(monkeypatch):
    """main's parser with `export` and `generate`, whether or not cli/main.py registers them itself yet."""
    build = cli_main.build_parser

    def build_with_export():
        parser = build()
        sub = next(a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict)
                   and "join" in a.choices)
        if "export" not in sub.choices:
            add_export_commands(sub)
        return parser

    monkeypatch.setattr(cli_main, "build_parser", build_with_export)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """A peer's checkpoint folder: one checkpoint recording the spec, written by the CheckpointStore."""
    folder = tmp_path_factory.mktemp("peer") / "checkpoints"
    theta = flat_params(build_model(SPEC.model, SPEC.seed)) * 1.5
    CheckpointStore(folder).save({"theta": theta}, {"round": 4, "step": 8, "spec_hash": SPEC.spec_hash(),
                                                    "spec": SPEC.to_dict(), "version_vector": {"a": 4, "b": 3}})
    return folder


def test_export_then_generate(tmp_path: Path, capsys, checkpoints: Path) -> None:
    out = tmp_path / "model"
    code, stdout, stderr = run(capsys, "export", "--checkpoint", checkpoints.parent, "--out", out)  # the out dir
    assert code == 0, stderr
    assert f"wrote {out}" in stdout and SPEC.spec_hash()[:12] in stdout
    assert "7 updates merged from 2 sender(s)" in (out / "README.md").read_text()
    code, stdout, stderr = run(capsys, "generate", out, "--prompt", "def ", "--max-new-tokens", "8",
                               "--device", "cpu")
    assert code == 0, stderr
    assert stdout.startswith("def ") and len(stdout.encode()) > len("def \n")
    again = run(capsys, "generate", out, "--prompt", "def ", "--max-new-tokens", "8", "--device", "cpu")
    assert again[1] == stdout  # the seed decides the sample
    code, greedy, stderr = run(capsys, "generate", out, "--prompt", "x" * 100, "--temperature", "0",
                               "--device", "cpu")
    assert code == 0 and "context is 64" in stderr and "prompt cut" in stderr


def test_export_refuses_bad_inputs(tmp_path: Path, capsys, checkpoints: Path) -> None:
    code, _, err = run(capsys, "export", "--checkpoint", tmp_path / "nope", "--out", tmp_path / "m")
    assert code == 2 and err.count("\n") == 1 and "p2p-diloco export: error:" in err and "no such folder" in err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    code, _, err = run(capsys, "export", "--checkpoint", checkpoints, "--out", tmp_path / "busy")
    assert code == 2 and "not empty" in err and "--force" in err and (tmp_path / "busy" / "x").exists()
    code, _, err = run(capsys, "export", "--out", tmp_path / "m")
    assert code == 2 and "--checkpoint PATH or --bootstrap" in err
    code, _, err = run(capsys, "generate", tmp_path, "--prompt", "hi")
    assert code == 2 and "not a model folder" in err


def test_older_checkpoint_needs_the_runs_options(tmp_path: Path, capsys) -> None:
    theta = flat_params(build_model(SPEC.model, SPEC.seed))
    folder = tmp_path / "old"
    CheckpointStore(folder).save({"theta": theta}, {"round": 1, "spec_hash": SPEC.spec_hash(), "version_vector": {}})
    code, _, err = run(capsys, "export", "--checkpoint", folder, "--out", tmp_path / "m")
    assert code == 2 and "does not record the run's spec" in err and "--preset" in err
    code, _, err = run(capsys, "export", "--checkpoint", folder, "--out", tmp_path / "m", "--preset", "tiny")
    assert code == 2 and "spec" in err and SPEC.spec_hash()[:12] in err
    code, _, err = run(capsys, "export", "--checkpoint", folder, "--out", tmp_path / "m", "--preset", "test")
    assert code == 0, err
    assert json.loads((tmp_path / "m" / "config.json").read_text())["n_positions"] == SPEC.model.block_size
