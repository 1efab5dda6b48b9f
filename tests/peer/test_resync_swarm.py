"""A running peer that cannot catch up by pulls re-syncs state by itself (issue 12), on the real swarm: `p2p-diloco
join` processes on 127.0.0.1.

C is frozen (SIGSTOP) while A and B train on; they retain only a few updates (--gossip-retained-bytes) and the
run skips gaps of at most 2 seqs (max_hole_span), so after C resumes no pull can bring the updates it missed
and no gap expiry may skip them: every later update of A and B waits in C's buffer. Before this, C's replica
stayed diverged for good; now C notices (peer/lag.py), re-syncs from A or B between two rounds, keeps its own
seqs, trains on, and the replicas end equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.faults import assert_replicas_agree, incarnations, of
from tests.helpers.swarm import Launcher, wait_until

pytestmark = pytest.mark.timeout(420)

START_S = 90
ARGS = ("--gossip-retained-bytes", "800000", "--spec.defence.max-hole-span", "2",
        "--spec.defence.gap-timeout-s", "3", "--resync-window-s", "4", "--checkpoint-every", "0")


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason="at the end one replica lacks a few updates of one peer (e.g. A holds 33 of "
                   "37) in about 1 run in 3: under load a peer skips a 1-2 seq gap after the 3 s gap timeout, the "
                   "800 KB retention then evicts the missing updates everywhere, and it leaves with holes nobody "
                   "can serve (the lag watch does not count holes). Needs repair before leaving; it still runs")
def test_a_frozen_peer_that_pulls_cannot_catch_up_resyncs_and_replicas_agree(tmp_path: Path) -> None:
    with Launcher(tmp_path) as launcher:
        _, bootstrap = launcher.bootstrap()
        others = [launcher.peer(name, bootstrap, *ARGS, linger_s=60, nice=10) for name in ("A", "B")]
        victim = launcher.peer("C", bootstrap, *ARGS, linger_s=60)
        everyone = [*others, victim]
        wait_until(lambda: all(len(p.rounds()) >= 2 for p in everyone), START_S, "3 peers to train", procs=everyone)
        victim.pause()
        paused_at = len(victim.rounds())
        before = {p.name: len(p.rounds()) for p in others}
        wait_until(lambda: all(len(p.rounds()) >= before[p.name] + 10 for p in others), START_S,
                   "A and B to publish far more than they retain", procs=others)
        victim.resume()
        resync = wait_until(lambda: [e for e in victim.events("resync") if e["ok"]], 120,
                            "C to re-sync state", procs=everyone)[0]
        wait_until(lambda: len(victim.rounds()) >= paused_at + 4, 60, "C to train on", procs=everyone)
        for proc in everyone:
            proc.finish()
        for proc in everyone:
            assert proc.wait(180) == 0, proc.tail()

        assert resync["why"] in ("gap beyond max_hole_span", "buffer full", "no progress"), resync  # peer/lag.py
        assert resync["donor"] in {of(incarnations(p)[0], "start")[0]["peer_id"] for p in others}, resync
        assert resync["lost_own"] == 0 and resync["resyncs"] == 1, resync
        assert "cannot catch up by pulls (behind by" in victim.output()
        seqs = [r["seq"] for r in victim.rounds()]
        assert seqs == list(range(1, len(seqs) + 1))  # no own seq lost or used twice across the re-sync
        final = victim.events("final")[-1]
        assert any(r.get("kind") == "resync" for r in final["repairs"]), final["repairs"]
        assert_replicas_agree(everyone)
