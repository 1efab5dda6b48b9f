"""Progress a person can follow while `join` runs: a bar for the state sync's bytes and one for each inner
phase's steps on an interactive terminal (rich), plain lines when the output is piped (a log file must not fill
with bar redraws). The one-line summary of each round is the report's (peer/report.py).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from p2p_diloco.train.loop import PhaseBegun, StepDone, Tick

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

SYNC_LINE_EVERY = 0.25
"""Piped: a state-sync line at every quarter of the bytes."""


class JoinProgress:
    """`mode`: auto (bars on a terminal), on, off (plain lines). `tick` gets every tick of the round loop (compute
    thread); `sync` the state sync's (bytes done, total) (network thread)."""

    def __init__(self, mode: str, inner_steps: int, *, stream: TextIO | None = None,
                 out: Callable[[str], None] = print) -> None:
        self.stream = stream or sys.stdout
        self.bars = mode == "on" or (mode == "auto" and self.stream.isatty())
        self.inner_steps, self.out = inner_steps, out
        self._progress: Progress | None = None
        self._phase_task: TaskID | None = None
        self._sync_task: TaskID | None = None
        self._sync_shown = -1.0
        self._lock = threading.Lock()

    def _bars(self) -> Progress:
        if self._progress is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeRemainingColumn(), TextColumn("{task.fields[note]}"),
                                      console=Console(file=self.stream), transient=True)
            self._progress.start()  # prints (the round line) go above the bars while they are shown
        return self._progress

    def sync(self, done: int, total: int) -> None:
        with self._lock:
            if not self.bars:
                frac = done / max(total, 1)
                if frac - self._sync_shown >= SYNC_LINE_EVERY or done >= total:
                    self._sync_shown = frac
                    self.out(f"state sync: {done / 1e6:.1f} of {total / 1e6:.1f} MB ({frac:.0%})")
                return
            progress = self._bars()
            if self._sync_task is None:
                self._sync_task = progress.add_task("state sync (MB)", total=round(total / 1e6, 1), note="")
            progress.update(self._sync_task, completed=round(done / 1e6, 1))
            progress.refresh()  # a small snapshot is done before the next automatic refresh: show it anyway

    def tick(self, tick: Tick) -> None:
        if not self.bars:
            return
        with self._lock:
            progress = self._bars()
            if isinstance(tick, PhaseBegun):
                if self._sync_task is not None:
                    progress.remove_task(self._sync_task)
                    self._sync_task = None
                if self._phase_task is None:
                    self._phase_task = progress.add_task("", total=self.inner_steps, note="")
                progress.reset(self._phase_task, total=self.inner_steps, description="inner phase", note="")
            elif isinstance(tick, StepDone) and self._phase_task is not None:
                losses = tick.phase.losses
                note = f"loss {sum(losses[-10:]) / len(losses[-10:]):.3f}" if losses else ""
                progress.update(self._phase_task, completed=tick.phase.steps_done, note=note)

    def close(self) -> None:
        with self._lock:
            if self._progress is not None:
                self._progress.stop()
                self._progress = None
