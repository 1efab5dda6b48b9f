"""`p2p-diloco data prepare`: a good run prints how to use the dataset; each mistake is one line, exit code 2,
and leaves no half-written --out behind."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from p2p_diloco.cli.data import add_data_command
from p2p_diloco.cli.main import CliError
from p2p_diloco.config import ConfigError


def _main(argv: list[str]) -> int:
    """cli/main.py's dispatch and error handling, with only the `data` command registered."""
    parser = argparse.ArgumentParser(prog="p2p-diloco")
    sub = parser.add_subparsers(dest="command", required=True)
    add_data_command(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (CliError, ConfigError) as err:
        print(f"p2p-diloco {args.command}: error: {err}", file=__import__("sys").stderr)
        return 2


def _corpus(root):
    rng = random.Random(0)
    root.mkdir()
    for i in range(8):
        (root / f"f{i}.txt").write_text("\n".join(" ".join(rng.choice(["ab", "cd", "ef", "gh", "def", "x"])
                                                           for _ in range(10)) for _ in range(30)))
    return root


def _leftovers(parent, out_name):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{out_name}."))


def test_prepare_prints_the_dataset_and_how_to_use_it(tmp_path, capsys):
    corpus = _corpus(tmp_path / "corpus")
    out = tmp_path / "ds"
    assert _main(["data", "prepare", str(corpus), "--out", str(out), "--vocab-size", "300"]) == 0
    stdout, stderr = capsys.readouterr()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["fingerprint"] in stdout and f"vocab {manifest['vocab_size']} (uint16)" in stdout
    assert stdout.strip().splitlines()[-1] == f"use it with: --corpus {out}"
    assert "[data prepare] tokenizing: 100%" in stderr  # progress on stderr (not a terminal: lines)
    # --force replaces it; the same input gives the same dataset
    assert _main(["data", "prepare", str(corpus), "--out", str(out), "--vocab-size", "300", "--force"]) == 0
    assert json.loads((out / "manifest.json").read_text())["fingerprint"] == manifest["fingerprint"]
    assert _leftovers(tmp_path, "ds") == []


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("empty", "no text found"),
    ("no_field", "no field 'text'"),
    ("exists", "already exists and is not empty; pass --force"),
    ("not_tokenizer", "is not a tokenizer"),
    ("nothing", "nothing to prepare"),
    ("vocab", "--vocab-size must be at least 257"),
])
def test_mistakes_are_one_line_and_leave_nothing(tmp_path, capsys, case, message):
    corpus = _corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    args = ["data", "prepare", str(corpus), "--out", str(out), "--vocab-size", "300"]
    if case == "missing":
        args[2] = str(tmp_path / "nope")
    elif case == "empty":
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "a.txt").write_text("")
        args[2] = str(tmp_path / "empty")
    elif case == "no_field":
        (tmp_path / "r.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
        args[2] = str(tmp_path / "r.jsonl")
    elif case == "exists":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif case == "not_tokenizer":
        (tmp_path / "tok").mkdir()
        (tmp_path / "tok" / "config.json").write_text("{}")
        args[5:7] = ["--tokenizer", str(tmp_path / "tok")]
    elif case == "nothing":
        del args[2]
    elif case == "vocab":
        args[-1] = "100"
    assert _main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    if case == "exists":
        assert (out / "keep.txt").read_text() == "mine"
    else:
        assert not out.exists()
    assert _leftovers(tmp_path, "out") == []


def test_help_formats():
    parser = argparse.ArgumentParser(prog="p2p-diloco")
    add_data_command(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["data", "prepare", "--help"])
