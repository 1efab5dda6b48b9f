"""`p2p-diloco plot`: a run's JSON logs (`join --json-log`, one event per line, see peer/output.py) drawn as PNGs.

The logs are read after the fact, from whatever the peers left behind: files torn by a kill, a restart that
appended to the same file, one peer's events spread over several files, folders holding other JSON as well.
So reading is lenient (a line that does not parse is counted and skipped, a file without events is not a log)
and everything is keyed by the PeerID in the events, not by the file. Matplotlib is imported inside the drawing
functions: the CLI builds every sub-command's parser on each call, and that must stay fast.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

PNG_NAMES = ("loss_time.png", "loss_tokens.png", "bytes.png", "utilization.png", "summary.png")


@dataclass
class PeerLog:
    """One peer's events from every file that holds them, by time. Each event carries "run": the number of
    "start" events up to it, so that a restart (a new process, its counters from zero again) can be told apart
    from the rounds before it."""

    peer_id: str
    label: str
    files: list[Path] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)

    @property
    def rounds(self) -> list[dict]:
        return [e for e in self.events if e["event"] == "round"]

    @property
    def evals(self) -> list[dict]:
        return [e for e in self.events if e["event"] == "eval" and e.get("eval_loss") is not None]


# ---- reading -------------------------------------------------------------------------------------------------


def _log_files(paths: Iterable[str | Path]) -> list[tuple[Path, bool]]:
    """(file, named by the user) for every path; a folder means every *.jsonl and *.json file under it."""
    found: dict[Path, bool] = {}
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            files = sorted(p for pattern in ("*.jsonl", "*.json") for p in path.rglob(pattern) if p.is_file())
            if not files:
                raise ValueError(f"no logs found under {raw} (no *.jsonl or *.json files)")
            for p in files:
                found.setdefault(p.resolve(), False)
        elif path.is_file():
            found[path.resolve()] = True
        else:
            raise ValueError(f"no logs found under {raw}: no such file or folder")
    return list(found.items())


def _parse_line(line: str) -> tuple[dict | None, bool]:
    """(event or None, torn). A peer killed mid-write leaves a line without its end; when the same peer is started
    again with the same --json-log, its first event is appended to that very line, so the last '{"event"' in a
    bad line is tried on its own (that is the restart's "start" event, which marks the counters' reset)."""
    try:
        event = json.loads(line)
        if isinstance(event, dict):
            return event, False
    except ValueError:
        pass
    at = line.rfind('{"event"')
    if at > 0:
        try:
            event = json.loads(line[at:])
            if isinstance(event, dict):
                return event, True
        except ValueError:
            pass
    return None, True


def _read_file(path: Path) -> tuple[list[dict], int]:
    """The file's events (each with "peer_id", filled in from the file's latest start or round event for those
    that lack it: eval, checkpoint, ...) and how many lines did not parse."""
    events, torn = [], 0
    with open(path, encoding="utf-8", errors="replace") as file:
        for line in file:
            if not line.strip():
                continue
            event, bad = _parse_line(line)
            torn += bad
            if event is not None and isinstance(event.get("event"), str) and \
                    isinstance(event.get("time"), (int, float)):
                events.append(event)
    peer_id = next((e["peer_id"] for e in events if e.get("peer_id")), None)
    for event in events:
        if event["event"] in ("start", "round") and event.get("peer_id"):
            peer_id = event["peer_id"]
        event["peer_id"] = event.get("peer_id") or peer_id
    return [e for e in events if e["peer_id"]], torn


def read_logs(paths: Iterable[str | Path], say: Callable[[str], None] | None = None) -> dict[str, PeerLog]:
    """Every peer's log, keyed by its label (the last 8 characters of its PeerID). `say` gets one-line notes:
    lines skipped because they do not parse, files left out because they hold no round events."""
    paths = list(paths)
    by_peer: dict[str, PeerLog] = {}
    torn_in: dict[Path, int] = {}
    without_rounds: list[Path] = []
    for path, named in _log_files(paths):
        events, torn = _read_file(path)
        if not any(e["event"] == "round" for e in events):
            if named:
                raise ValueError(f"{path}: no round events (not a --json-log file, or its peer never finished a round)")
            if events:  # a log in a folder whose peer stopped before its first round; other JSON files say nothing
                without_rounds.append(path)
            continue
        if torn:
            torn_in[path] = torn
        for event in events:
            log = by_peer.setdefault(event["peer_id"], PeerLog(event["peer_id"], event["peer_id"][-8:]))
            if path not in log.files:
                log.files.append(path)
            log.events.append(event)
    if not by_peer:
        raise ValueError(f"no round events in any log under {' '.join(map(str, paths))}")
    if say and torn_in:
        n = sum(torn_in.values())
        say(f"skipped {n} line{'s' * (n != 1)} that did not parse (torn by a killed peer?) in "
            + ", ".join(f"{p.name} ({k})" for p, k in torn_in.items()))
    if say and without_rounds:
        say(f"left out {len(without_rounds)} log{'s' * (len(without_rounds) != 1)} without round events: "
            + ", ".join(p.name for p in without_rounds))
    for log in by_peer.values():
        log.events.sort(key=lambda e: e["time"])  # stable: a file's order stands for equal times
        run = 0
        for event in log.events:
            run += event["event"] == "start"
            event["run"] = run
    labels = [log.label for log in by_peer.values()]
    for log in by_peer.values():  # two PeerIDs ending alike: show them whole rather than merge them
        if labels.count(log.label) > 1:
            log.label = log.peer_id
    return {log.label: log for log in sorted(by_peer.values(), key=lambda log: log.events[0]["time"])}


# ---- what is drawn -------------------------------------------------------------------------------------------


def bytes_per_round(log: PeerLog) -> tuple[list[int], list[int]]:
    """Bytes sent and received in each round (parallel to `log.rounds`): the differences of the cumulative
    counters. A new process counts from zero, so the first round after a restart (a "start" event, or any counter
    that went down, when the start line was lost) counts everything since that start."""
    keys = ("bytes_sent", "bytes_received")
    deltas: tuple[list[int], list[int]] = ([], [])
    prev: dict | None = None
    for r in log.rounds:
        now = [r.get(key, 0) for key in keys]
        before = [prev.get(key, 0) for key in keys] if prev else [0, 0]
        same_process = prev is not None and prev["run"] == r["run"] and all(n >= b for n, b in zip(now, before))
        for out, n, b in zip(deltas, now, before):
            out.append(n - b if same_process else n)
        prev = r
    return deltas


def tokens_per_round(log: PeerLog) -> list[float | None]:
    """The tokens this peer had trained at each round (parallel to `log.rounds`): the round's "tokens" field, else
    its step times the tokens per step its start event gives, else times the ratio its other rounds show (older
    peers logged no tokens); None where none of these is known."""
    starts = {e["run"]: e for e in log.events if e["event"] == "start"}
    ratios = [r["tokens"] / r["step"] for r in log.rounds if r.get("tokens") is not None and r.get("step")]
    out: list[float | None] = []
    for r in log.rounds:
        per_step = starts.get(r["run"], {}).get("tokens_per_step") or (ratios[-1] if ratios else None)
        if r.get("tokens") is not None:
            out.append(float(r["tokens"]))
        elif per_step is not None and r.get("step") is not None:
            out.append(float(r["step"] * per_step))
        else:
            out.append(None)
    return out


def progress_axis(logs: dict[str, PeerLog]) -> tuple[str, dict[str, list[float]]]:
    """The x axis of loss_tokens.png: tokens where every round of every peer has them, else inner steps (one
    unit for all peers, rather than a mix that would look comparable and is not)."""
    tokens = {label: tokens_per_round(log) for label, log in logs.items()}
    if all(t is not None for ts in tokens.values() for t in ts):
        return "tokens (this peer's)", tokens  # type: ignore[return-value]
    return "inner steps (this peer's)", {label: [float(r.get("step", 0)) for r in log.rounds]
                                         for label, log in logs.items()}


def eval_progress(log: PeerLog, progress: list[float]) -> list[float]:
    """The progress (tokens or steps) at each eval of `log.evals`. An eval at round r > 0 is of the model after
    round r, and is logged just before that round's event; round 0 is the model a process started from: the
    progress of the last round before it (after a restore), else 0."""
    rounds = log.rounds
    first_at: dict[tuple[object, object], int] = {}
    for i, r in enumerate(rounds):
        first_at.setdefault((r["run"], r.get("round")), i)
    times = [r["time"] for r in rounds]
    out = []
    for ev in log.evals:
        at = first_at.get((ev["run"], ev.get("round"))) if ev.get("round") else None
        if at is None or times[at] < ev["time"]:
            before = bisect.bisect_right(times, ev["time"])  # rounds logged up to the eval
            out.append(progress[before - 1] if before else 0.0)
        else:
            out.append(progress[at])
    return out


def _with_gaps(runs: list[int], *columns: list[float]) -> list[list[float]]:
    """The columns with a NaN row between processes, so that a line does not join the rounds across a restart."""
    out: list[list[float]] = [[] for _ in columns]
    for i, run in enumerate(runs):
        if i and run != runs[i - 1]:
            for col in out:
                col.append(float("nan"))
        for col, values in zip(out, columns):
            col.append(values[i])
    return out


def _time_unit(span_s: float) -> tuple[str, float]:
    return ("h", 3600.0) if span_s > 3 * 3600 else ("min", 60.0) if span_s > 600 else ("s", 1.0)


def _byte_unit(peak: float) -> tuple[str, float]:
    return next(((u, s) for u, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if peak >= s), ("B", 1.0))


# ---- drawing -------------------------------------------------------------------------------------------------


class _Panels:
    """The four panels, each drawn on an axes it is given: once alone in its own PNG, once in summary.png."""

    def __init__(self, logs: dict[str, PeerLog]):
        import matplotlib.pyplot as plt

        self.logs = logs
        cmap = plt.get_cmap("tab10" if len(logs) <= 10 else "tab20")
        self.colour = {label: cmap(i % cmap.N) for i, label in enumerate(logs)}
        self.t0 = min(log.events[0]["time"] for log in logs.values())
        span = max(log.events[-1]["time"] for log in logs.values()) - self.t0
        self.time_unit, self.time_scale = _time_unit(span)
        self.progress_label, self.progress = progress_axis(logs)

    def _times(self, events: list[dict]) -> list[float]:
        return [(e["time"] - self.t0) / self.time_scale for e in events]

    def _finish(self, ax, title: str, xlabel: str, ylabel: str) -> None:
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=1 + len(self.logs) // 8, title="peer", title_fontsize=7)

    def loss(self, ax, by: str) -> None:
        for label, log in self.logs.items():
            rounds, colour = log.rounds, self.colour[label]
            xs = self._times(rounds) if by == "time" else self.progress[label]
            x, y = _with_gaps([r["run"] for r in rounds], xs, [r.get("loss", float("nan")) for r in rounds])
            ax.plot(x, y, color=colour, linewidth=1.2, label=label)
            evals = log.evals
            ex = self._times(evals) if by == "time" else eval_progress(log, self.progress[label])
            ax.plot(ex, [e["eval_loss"] for e in evals], linestyle="none", marker="o", markersize=4, color=colour)
        xlabel = f"wall time since the first event ({self.time_unit})" if by == "time" else self.progress_label
        if by != "time":
            from matplotlib.ticker import EngFormatter

            ax.xaxis.set_major_formatter(EngFormatter())  # 250k, 1.5M, 3G: tokens run into the billions
        what = "time" if by == "time" else self.progress_label.split(" (")[0]
        self._finish(ax, f"loss vs {what}: train (lines), eval (dots)", xlabel, "loss")

    def bytes(self, ax) -> None:
        per_round = {label: bytes_per_round(log) for label, log in self.logs.items()}
        unit, scale = _byte_unit(max((max(s + r, default=0) for s, r in per_round.values()), default=0))
        for label, log in self.logs.items():
            sent, received = per_round[label]
            x, s, r = _with_gaps([e["run"] for e in log.rounds], self._times(log.rounds),
                                 [v / scale for v in sent], [v / scale for v in received])
            ax.plot(x, s, color=self.colour[label], marker=".", linewidth=1, label=label)
            ax.plot(x, r, color=self.colour[label], marker=".", linewidth=1, linestyle="--")
        ax.set_ylim(bottom=0)
        self._finish(ax, "bytes per round: sent (solid), received (dashed)",
                     f"wall time since the first event ({self.time_unit})", f"{unit} per round")

    def utilization(self, ax) -> None:
        for label, log in self.logs.items():
            rounds = log.rounds
            x, u = _with_gaps([r["run"] for r in rounds], self._times(rounds),
                              [100 * r.get("utilization", float("nan")) for r in rounds])
            ax.plot(x, u, color=self.colour[label], marker=".", linewidth=1, label=label)
        ax.set_ylim(0, 105)
        self._finish(ax, "utilization (compute time / time since training began)",
                     f"wall time since the first event ({self.time_unit})", "utilization (%)")


def plot_logs(paths: Iterable[str | Path], out_dir: str | Path,
              say: Callable[[str], None] | None = None) -> list[Path]:
    """Read the logs under `paths` and write loss_time.png, loss_tokens.png, bytes.png, utilization.png and
    summary.png (the four in a 2x2 grid) into `out_dir`; returns the files written."""
    logs = read_logs(paths, say)
    out = Path(out_dir).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot write plots into {out_dir}: {err.strerror or err}") from None

    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    panels = _Panels(logs)
    draws = [lambda ax: panels.loss(ax, "time"), lambda ax: panels.loss(ax, "tokens"), panels.bytes,
             panels.utilization]
    written = []
    for name, draw in zip(PNG_NAMES, draws):
        fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
        draw(ax)
        written.append(_save(fig, out / name))
    fig, axes = plt.subplots(2, 2, figsize=(15, 9.5), dpi=100)
    for ax, draw in zip(axes.flat, draws):
        draw(ax)
    fig.suptitle(f"{len(logs)} peer{'s' * (len(logs) != 1)}, {sum(len(log.rounds) for log in logs.values())} rounds")
    written.append(_save(fig, out / PNG_NAMES[-1]))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as err:
        raise ValueError(f"cannot write {path}: {err.strerror or err}") from None
    finally:
        plt.close(fig)
    return path
