"""After the last round: keep serving and merging until every live peer holds our replica (the swarm is quiet)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from p2p_diloco.net.discovery.status import is_quiet


def linger(network: Any, learner: Any, *, stop: threading.Event, linger_s: float, at_round: int,
           out: Callable[[str], None], log: Any) -> None:
    """Announce "done", then wait (at most `linger_s`, or until `stop`) for every live peer to hold our
    version vector; the network keeps serving and merging meanwhile."""
    network.local = {**network.local, "state": "done"}
    network.request_announce()
    out(f"finished {at_round} rounds; serving until the swarm is quiet (at most {linger_s:g}s)")
    log.write("linger", round=at_round)
    deadline = time.monotonic() + linger_s
    quiet_checks = 0
    while not stop.wait(0.5):
        digest = learner.replica.version_vector.digest().hex()[:16]
        # Twice in a row: our own record must also have been refreshed since our replica last changed.
        quiet = is_quiet(network.peers, learner.peer_id, digest) and not network.settling()
        quiet_checks = quiet_checks + 1 if quiet else 0
        if quiet_checks >= 2:
            out(f"swarm quiet: every live peer holds version vector {digest}")
            return
        if time.monotonic() > deadline:
            out(f"linger time over ({linger_s:g}s) before the swarm went quiet")
            return
