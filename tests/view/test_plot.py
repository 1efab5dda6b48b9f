"""`p2p-diloco plot`: JSON logs as a swarm leaves them (a restart appended to the same file, one peer over two
files, a torn last line, rounds without "tokens", other JSON in the folder) read and drawn; the PNGs opened and
looked at; the numbers behind them checked; bad input is one clear line and exit code 2; and the log of a real
`join` peer plotted end to end."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from p2p_diloco.cli.plot import add_plot_command
from p2p_diloco.view.plot import (
    PNG_NAMES,
    bytes_per_round,
    eval_progress,
    progress_axis,
    read_logs,
    tokens_per_round,
)

REPO = Path(__file__).resolve().parents[2]
PID_A = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAaaaaaaaa"
PID_B = "12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBbbbbbbbb"
PID_C = "12D3KooWCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCcccccccc"
PID_D = "12D3KooWDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDdddddddd"
T0 = 1_700_000_000.0
TOKENS_PER_STEP = 4096


def run_events(peer_id: str, t0: float, rounds: range, *, steps_per_round: int = 10, tokens: bool = True,
               start_extra: dict | None = None, sent_per_round: int = 1000, received_per_round: int = 3000,
               eval_every: int = 2) -> list[dict]:
    """The events one `join` process writes: start, eval at round 0, then per round an eval every `eval_every`
    rounds (logged just before its round event) and the round; the byte counters count from zero per process."""
    events = [{"event": "start", "time": t0, "peer_id": peer_id, "shard": 3, "num_shards": 16, "spec_hash": "ab",
               "numel": 120576, "device": "cpu", **(start_extra or {})},
              {"event": "eval", "time": t0 + 0.5, "round": 0, "eval_loss": 5.5}]
    for i, r in enumerate(rounds, start=1):
        t = t0 + 2.0 * i
        step = r * steps_per_round
        eval_loss = 5.0 - 0.2 * r if r % eval_every == 0 else None
        if eval_loss is not None:
            events.append({"event": "eval", "time": t - 0.01, "round": r, "eval_loss": eval_loss})
        event = {"event": "round", "time": t, "peer_id": peer_id, "round": r, "step": step, "loss": 5.2 - 0.25 * r,
                 "eval_loss": eval_loss, "peers": 3, "tau": r % 2, "weight": 1.0, "seq": r, "vv_total": 3 * r,
                 "bytes_sent": sent_per_round * i, "bytes_received": received_per_round * i + 7 * i * i,
                 "merged": 2 * i, "rejected": 0, "samples_per_s": 700.0 + r, "round_s": 2.0,
                 "utilization": min(0.95, 0.5 + 0.05 * i), "compute_s": 1.5 * i}
        if tokens:
            event["tokens"] = step * TOKENS_PER_STEP
        events.append(event)
    return events


def dump(events: list[dict]) -> str:
    return "".join(json.dumps(e) + "\n" for e in events)


def write_swarm(folder: Path) -> dict[str, Path]:
    """Three peers' logs as a killed, restarted, interrupted swarm leaves them.

    A: one file; killed while writing round 4 (its line torn), restarted with the same --json-log, so the new
       process's start event is appended to the torn line; it restored round 3 and trains rounds 4..6.
    B: two files (restarted with another --json-log, in a subfolder); its first process logged no "tokens"
       (an older version) but its start event gives tokens_per_step.
    C: killed in the middle of its last line (the torn last line).
    Plus a version_vector.json (not a log, pretty-printed) that a folder scan must pass over quietly."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sub").mkdir(exist_ok=True)
    a_first = dump(run_events(PID_A, T0, range(1, 4)))
    a_torn = json.dumps(run_events(PID_A, T0, range(1, 5))[-1])[:57]  # round 4, cut mid-line: no newline
    a_second = dump(run_events(PID_A, T0 + 20, range(4, 7)))
    (folder / "a.jsonl").write_text(a_first + a_torn + a_second)
    (folder / "b-first.jsonl").write_text(dump(run_events(PID_B, T0 + 1, range(1, 4), tokens=False,
                                                          start_extra={"tokens_per_step": TOKENS_PER_STEP})))
    (folder / "sub" / "b-second.json").write_text(dump(run_events(PID_B, T0 + 12, range(4, 8))))
    c = dump(run_events(PID_C, T0 + 3, range(1, 6), sent_per_round=5000, received_per_round=9000))
    (folder / "sub" / "c.jsonl").write_text(c[:-40])
    (folder / "sub" / "version_vector.json").write_text(json.dumps({"version_vector": {PID_A: 3}, "total": 3},
                                                                   indent=1))
    return {"a": folder / "a.jsonl", "c": folder / "sub" / "c.jsonl"}


def run_plot(*argv: str) -> int:
    """`p2p-diloco plot ...` through a parser of our own (the command as cli/main.py registers it)."""
    parser = argparse.ArgumentParser(prog="p2p-diloco")
    add_plot_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plot", *argv])
    return args.func(args)


def assert_drawn(path: Path, min_width: int = 400) -> None:
    """The PNG opens, is of a sensible size and is not blank: enough pixels differ from the background."""
    assert path.stat().st_size > 5000, path
    pixels = matplotlib.image.imread(path)[..., :3]
    height, width = pixels.shape[:2]
    assert width >= min_width and height >= 300, (path, pixels.shape)
    assert pixels.std() > 0.05, f"{path} looks blank (std {pixels.std():.4f})"
    inked = (pixels.min(axis=2) < 0.8).mean()
    assert 0.01 < inked < 0.6, f"{path}: {inked:.1%} of its pixels are drawn"
    coloured = (pixels.max(axis=2) - pixels.min(axis=2) > 0.25).mean()  # the peers' lines, not just black axes
    assert coloured > 0.001, f"{path}: no coloured curves ({coloured:.3%})"


# ---- the pictures --------------------------------------------------------------------------------------------


def test_plot_writes_five_pngs_that_show_something(tmp_path: Path, capsys) -> None:
    write_swarm(tmp_path / "logs")
    out = tmp_path / "plots"
    assert run_plot(str(tmp_path / "logs"), "--out-dir", str(out)) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [f"wrote {out / name}" for name in PNG_NAMES]
    notes = captured.err.splitlines()
    assert len(notes) == 1 and notes[0].startswith("p2p-diloco plot: skipped 2 lines that did not parse"), notes
    assert "a.jsonl (1)" in notes[0] and "c.jsonl (1)" in notes[0]
    for name in PNG_NAMES:
        assert_drawn(out / name, min_width=1200 if name == "summary.png" else 400)


def test_default_out_dir_and_a_single_file(tmp_path: Path, capsys, monkeypatch) -> None:
    logs = write_swarm(tmp_path / "logs")
    monkeypatch.chdir(tmp_path)
    assert run_plot(str(logs["a"])) == 0
    assert capsys.readouterr().out.splitlines()[0] == "wrote plots/loss_time.png"
    assert_drawn(tmp_path / "plots" / "loss_tokens.png")


# ---- the numbers behind them ---------------------------------------------------------------------------------


def test_logs_are_merged_by_peer_and_time(tmp_path: Path) -> None:
    write_swarm(tmp_path / "logs")
    notes: list[str] = []
    logs = read_logs([tmp_path / "logs", tmp_path / "logs" / "a.jsonl"], say=notes.append)  # a.jsonl twice: once
    assert list(logs) == ["aaaaaaaa", "bbbbbbbb", "cccccccc"]  # labels: the PeerIDs' last 8 characters, by start
    a, b, c = logs.values()
    # A: the torn round 4 is gone, the restart's start event (appended to the torn line) was recovered
    assert [(r["run"], r["round"]) for r in a.rounds] == [(1, 1), (1, 2), (1, 3), (2, 4), (2, 5), (2, 6)]
    assert [e["round"] for e in a.evals] == [0, 2, 0, 4, 6]
    assert all(e["peer_id"] == PID_A for e in a.events)  # eval events name no peer: their file's peer
    # B: two files, one peer, in time order
    assert sorted(p.name for p in b.files) == ["b-first.jsonl", "b-second.json"]
    assert [r["round"] for r in b.rounds] == list(range(1, 8))
    assert [r["run"] for r in b.rounds] == [1, 1, 1, 2, 2, 2, 2]
    # C: its last round's line is torn
    assert [r["round"] for r in c.rounds] == [1, 2, 3, 4]
    assert notes == ["skipped 2 lines that did not parse (torn by a killed peer?) in a.jsonl (1), c.jsonl (1)"]


def test_bytes_per_round_are_the_differences_of_the_cumulative_counters(tmp_path: Path) -> None:
    events = run_events(PID_A, T0, range(1, 4)) + run_events(PID_A, T0 + 20, range(4, 6))
    cumulative = [(100, 1000), (250, 1000), (400, 4000), (50, 4500), (120, 4700)]  # a new process at round 4
    for r, (sent, received) in zip([e for e in events if e["event"] == "round"], cumulative):
        r["bytes_sent"], r["bytes_received"] = sent, received
    path = tmp_path / "a.jsonl"
    path.write_text(dump(events))
    (log,) = read_logs([path]).values()
    assert bytes_per_round(log) == ([100, 150, 150, 50, 70], [1000, 0, 3000, 4500, 200])

    # the restart's start line lost: one counter that went down still marks a new process (for both)
    path.write_text(dump([e for e in events if not (e["event"] == "start" and e["time"] == T0 + 20)]))
    (log,) = read_logs([path]).values()
    assert bytes_per_round(log) == ([100, 150, 150, 50, 70], [1000, 0, 3000, 4500, 200])


def test_tokens_come_from_the_field_else_from_the_steps(tmp_path: Path) -> None:
    write_swarm(tmp_path / "logs")
    logs = read_logs([tmp_path / "logs"])
    b = logs["bbbbbbbb"]
    # rounds 1..3 logged no tokens: step x tokens_per_step of their start event; 4..7 have the field
    assert tokens_per_round(b) == [r * 10 * TOKENS_PER_STEP for r in range(1, 8)]
    label, progress = progress_axis(logs)
    assert label.startswith("tokens") and progress["aaaaaaaa"] == [r * 10 * TOKENS_PER_STEP for r in range(1, 7)]
    # an eval at round r is of the model after round r; round 0 of the restored process: where it left off
    assert eval_progress(logs["aaaaaaaa"], progress["aaaaaaaa"]) == \
        [0, 20 * TOKENS_PER_STEP, 30 * TOKENS_PER_STEP, 40 * TOKENS_PER_STEP, 60 * TOKENS_PER_STEP]

    # no tokens field in a run and no tokens_per_step: the ratio the same peer's other rounds show
    events = run_events(PID_C, T0, range(1, 3), tokens=False) + run_events(PID_C, T0 + 9, range(3, 5))
    (tmp_path / "c.jsonl").write_text(dump(events))
    (c,) = read_logs([tmp_path / "c.jsonl"]).values()
    assert tokens_per_round(c) == [r * 10 * TOKENS_PER_STEP for r in range(1, 5)]

    # nothing to go by: every peer is drawn against inner steps, and the axis says so
    (tmp_path / "d.jsonl").write_text(dump(run_events(PID_D, T0, range(1, 4), tokens=False)))
    logs = read_logs([tmp_path / "logs", tmp_path / "d.jsonl"])
    assert tokens_per_round(logs["dddddddd"]) == [None, None, None]
    label, progress = progress_axis(logs)
    assert label.startswith("inner steps") and progress["dddddddd"] == [10, 20, 30]
    assert progress["aaaaaaaa"] == [10, 20, 30, 40, 50, 60]
    assert run_plot(str(tmp_path / "logs"), str(tmp_path / "d.jsonl"), "--out-dir", str(tmp_path / "p")) == 0
    assert_drawn(tmp_path / "p" / "loss_tokens.png")


# ---- bad input -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case, message", [
    ("empty folder", "no logs found under"),
    ("no such path", "no such file or folder"),
    ("no rounds", "no round events"),
    ("not a log", "no round events"),
    ("only other json", "no round events in any log under"),
])
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path: Path, capsys, case: str, message: str) -> None:
    target = tmp_path / "target"
    if case == "empty folder":
        target.mkdir()
        (target / "notes.txt").write_text("not a log")
    elif case == "no rounds":  # a peer killed during start-up
        target = tmp_path / "x.jsonl"
        target.write_text(dump(run_events(PID_A, T0, range(1, 1))))
    elif case == "not a log":
        target = tmp_path / "x.json"
        target.write_text(json.dumps({"total": 3}, indent=1))
    elif case == "only other json":
        target.mkdir()
        (target / "version_vector.json").write_text(json.dumps({"total": 3}))
    assert run_plot(str(target), "--out-dir", str(tmp_path / "plots")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("p2p-diloco plot: error: ") and message in lines[0], lines
    assert not (tmp_path / "plots").exists()


def test_out_dir_that_is_a_file(tmp_path: Path, capsys) -> None:
    logs = write_swarm(tmp_path / "logs")
    (tmp_path / "taken").write_text("")
    assert run_plot(str(logs["a"]), "--out-dir", str(tmp_path / "taken")) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("p2p-diloco plot: error: cannot write plots into") and "taken" in last, last


def test_the_installed_command(tmp_path: Path) -> None:
    write_swarm(tmp_path / "logs")
    cli = [sys.executable, "-m", "p2p_diloco.cli", "plot"]
    done = subprocess.run([*cli, str(tmp_path / "logs"), "--out-dir", str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"wrote {tmp_path / 'out' / name}" for name in PNG_NAMES]
    assert_drawn(tmp_path / "out" / "summary.png", min_width=1200)
    bad = subprocess.run([*cli, str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("p2p-diloco plot: error: no logs found under")
    assert "usage:" in subprocess.run([*cli, "--help"], capture_output=True, text=True, timeout=120).stdout


# ---- a real peer's log ---------------------------------------------------------------------------------------


def test_a_real_peers_log(tmp_path: Path, capsys) -> None:
    from tests.helpers.swarm import Launcher

    with Launcher(tmp_path / "run") as launcher:
        solo = launcher.peer("solo", None, rounds=3, linger_s=0)  # no bootstrap: the first peer of its run
        assert solo.wait(90) == 0, solo.tail()
    (log,) = read_logs([solo.json_log]).values()
    assert [r["round"] for r in log.rounds] == [1, 2, 3]
    assert log.peer_id.endswith(log.label) and len(log.label) == 8
    assert [e["round"] for e in log.evals] == [0, 2]  # --eval-every 2
    assert run_plot(str(tmp_path / "run"), "--out-dir", str(tmp_path / "plots")) == 0  # the folder: other JSON too
    assert capsys.readouterr().err == ""
    for name in PNG_NAMES:
        assert_drawn(tmp_path / "plots" / name, min_width=1200 if name == "summary.png" else 400)
