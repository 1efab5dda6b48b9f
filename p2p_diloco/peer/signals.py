"""Stop and finish requests from signals: SIGINT/SIGTERM (leave now) and SIGUSR1 (end after this round)."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType


def install_stop_handlers(stop: threading.Event, finish: threading.Event | None = None) -> None:
    """SIGINT and SIGTERM set `stop` (the peer then leaves cleanly); a second one interrupts at once.
    SIGUSR1 sets `finish`: the peer ends its current round as if it were its last (`--rounds`), lingers until
    the swarm is quiet, and exits (for a planned shutdown that should waste no work).

    Processes forked after this (hivemind's DHT process) inherit the handler: there it restores the default
    action and re-raises, so `kill` and hivemind's own terminate() still work on them (SIGUSR1 is ignored).
    """
    owner = os.getpid()
    usr1 = getattr(signal, "SIGUSR1", None)  # not on Windows

    def handler(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_IGN if signum == usr1 else signal.SIG_DFL)
            if signum != usr1:
                os.kill(os.getpid(), signum)
            return
        if signum == usr1:
            if finish is not None:
                finish.set()
            return
        if stop.is_set():
            raise KeyboardInterrupt()
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    if usr1 is not None:
        signal.signal(usr1, handler)
