"""The terminal view (`status --watch`) as a person runs it: on a pseudo-terminal, frames drawn live, the cursor
given back, and Ctrl-C leaving the last frame on screen with exit code 0."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.view.test_terminal import AGREED

ROOT = Path(__file__).resolve().parents[2]


CHILD = textwrap.dedent(
    """
    import copy, json, sys
    from rich.console import Console
    from p2p_diloco.view.terminal import watch
    base = json.loads(sys.argv[1])
    calls = []
    def fetch():
        snap = copy.deepcopy(base)
        snap["run_id"] = "frame%d" % len(calls)
        calls.append(1)
        return snap
    frames = int(sys.argv[2])
    sys.exit(watch(fetch, interval_s=float(sys.argv[3]), console=Console(force_terminal=True, width=160),
                   max_frames=frames or None))
    """
)


def run_in_pty(frames: int, interval_s: float, until=None, timeout_s: float = 60.0) -> tuple[int, bytes]:
    """Run CHILD on a pseudo-terminal; `until(output, proc)` may act (send Ctrl-C) once. Returns (rc, output)."""
    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color", PYTHONPATH=str(ROOT), COLUMNS="160", LINES="50")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(AGREED), str(frames), str(interval_s)],
                            stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    out, deadline, acted = b"", time.monotonic() + timeout_s, until is None
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed its side
                    chunk = b""
                if not chunk:
                    break
                out += chunk
            if not acted and until(out, proc):
                acted = True
        rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        return rc, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_watch_under_a_pseudo_terminal_draws_frames_and_restores_the_cursor():
    rc, out = run_in_pty(frames=3, interval_s=0.2)
    assert rc == 0, out
    assert b"frame0" in out and b"frame1" in out and b"frame2" in out and b"frame3" not in out
    assert b"\x1b[?25l" in out  # the cursor was hidden while live
    assert out.rstrip(b"\r\n").endswith(b"\x1b[?25h"), out[-200:]
    assert b"Alpha111" in out and b"replicas agree" in out


def test_ctrl_c_under_a_pseudo_terminal_exits_0_and_keeps_the_frame():
    sent: list[float] = []

    def ctrl_c_after_the_first_frame(out: bytes, proc) -> bool:
        if b"frame0" in out:
            proc.send_signal(signal.SIGINT)  # the child now waits 30 s for the next frame
            sent.append(time.monotonic())
            return True
        return False

    rc, out = run_in_pty(frames=0, interval_s=30, until=ctrl_c_after_the_first_frame)
    assert rc == 0, out
    # Ctrl-C ends the wait for the next frame at once (the child's start-up is not timed: a loaded machine)
    assert sent and time.monotonic() - sent[0] < 15 and b"frame1" not in out
    assert b"Traceback" not in out and b"KeyboardInterrupt" not in out
    assert out.count(b"frame0") >= 2  # drawn live, then drawn once more for good when Live stopped
    assert out.rstrip(b"\r\n").endswith(b"\x1b[?25h"), out[-200:]


def test_ctrl_c_while_frames_are_being_drawn_never_breaks_the_exit():
    """Ctrl-C at many points of a loop that redraws every 2 ms: exit 0, no traceback, the cursor back.

    CI once saw `status --watch` exit 1 with "release unlocked lock": a KeyboardInterrupt raised inside Event.wait. The
    window is narrow and this test did not hit it on the old code in 6 runs; the mechanism that closes it (no exception
    raised from the signal handler) is tested in test_terminal.py."""
    for delay_frames in (1, 3, 7, 15, 31):
        want = b"frame%d" % delay_frames

        def ctrl_c_mid_redraw(out: bytes, proc, want: bytes = want) -> bool:
            if want in out:
                proc.send_signal(signal.SIGINT)
                return True
            return False

        rc, out = run_in_pty(frames=0, interval_s=0.002, until=ctrl_c_mid_redraw)
        assert rc == 0, out[-2000:]
        assert b"Traceback" not in out and b"release unlocked lock" not in out, out[-2000:]
        assert out.rstrip(b"\r\n").endswith(b"\x1b[?25h"), out[-200:]
