"""After the last round: keep serving and merging until every live peer holds our replica (the swarm is quiet).

Quiet is judged from the peers' records (net/discovery/status.py `is_quiet`): every other live peer must say
"done" and name our version vector's digest. A peer still "syncing" or "training" has not published all its
updates yet, so the swarm is not quiet while one is listed. The judgment must hold on two reads of the records
in a row (the list is replaced whole on each read), so one read from before a newcomer's first record, or
before a peer's last update reached us, cannot end the linger on its own. A peer that has not announced itself
at all cannot be waited for: a run that needs every unit's updates in every replica starts every unit before
any can finish its rounds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from p2p_diloco.net.discovery.status import is_quiet

if TYPE_CHECKING:
    from p2p_diloco.peer.network import PeerNetwork
    from p2p_diloco.peer.output import JsonLog
    from p2p_diloco.train.learner import Learner

CHECK_INTERVAL_S = 0.5
QUIET_READS = 2
"""Reads of the peer records in a row that must find the swarm quiet."""


def linger(network: PeerNetwork, learner: Learner, *, stop: threading.Event, linger_s: float, at_round: int,
           out: Callable[[str], None], log: JsonLog, catch_up: Callable[[], object] | None = None) -> None:
    """Announce "done", then wait (at most `linger_s`, or until `stop`) for every live peer to hold our
    version vector; the network keeps serving and merging meanwhile. `catch_up` is called at every check: the
    round loop's re-sync (peer/resync.py), so a replica that pulls cannot complete (a gap whose updates every
    store evicted) is re-synced before we leave, not left apart from the others."""
    network.local = {**network.local, "state": "done"}
    network.request_announce()
    out(f"finished {at_round} rounds; serving until the swarm is quiet (at most {linger_s:g}s)")
    log.write("linger", round=at_round)
    deadline = time.monotonic() + linger_s
    quiet_reads, last_read = 0, network.peers
    while not stop.wait(CHECK_INTERVAL_S):
        if catch_up is not None:
            catch_up()
        records = network.peers
        digest = learner.replica.version_vector.digest().hex()[:16]
        quiet = is_quiet(records, learner.peer_id, digest) and not network.settling()
        if not quiet:
            quiet_reads = 0
        elif records is not last_read:  # a new read of the records, not the one we judged last time
            quiet_reads += 1
        last_read = records
        if quiet_reads >= QUIET_READS:
            out(f"swarm quiet: every live peer holds version vector {digest}")
            return
        if time.monotonic() > deadline:
            out(f"linger time over ({linger_s:g}s) before the swarm went quiet")
            return
