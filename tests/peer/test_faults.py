"""Scripted faults on a real swarm (`p2p-diloco bootstrap | join` processes on 127.0.0.1, port 0).

One story (module fixture), each step a fault the issue names, each checked by the tests below:

    bootstrap; peers A, B, C, V train (H=2: every peer publishes several updates a second, so gossip
    transfers are always in flight), all serving snapshots in tiny chunks (a state sync takes seconds);
    1. pause: C's whole process group is SIGSTOPped for longer than the record TTL and the gossip timeout,
       then SIGCONTed: A and B must not stall; C's late update is merged by the others (with the staleness
       its sender computed); C catches up;
    2. kill during gossip: V is SIGKILLed (with its DHT process and p2pd) while updates stream between all
       peers: the others must not stall;
    3. bootstrap down: the bootstrap is SIGKILLed: A, B, C keep training together;
    4. join through a live peer, and a donor killed mid-sync: J joins with A's multiaddr as --bootstrap; the
       moment a donor logs that it served J a snapshot manifest (A, B, C run with -v), that donor is
       SIGKILLed while J fetches the chunks; J drops it, syncs from another donor and trains;
    5. the bootstrap comes back (same identity and port, knowing nobody): the running peers meet it again
       (Kademlia dropped it from their routing tables while it was dead), and K, a new peer given the
       original bootstrap address, finds the run through it, syncs state and trains with everyone;
    then every survivor gets SIGUSR1 (finish the round, linger until the swarm is quiet, write its replica).
After it: the standard assertion, every survivor's replica holds exactly the updates published (none lost,
none merged twice) and the replicas are equal.

Every wait is on a condition with a timeout; every process is killed at the end whatever happened
(Launcher). Assertions never depend on where exactly a kill lands.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers.faults import (
    assert_merged_once,
    assert_replicas_agree,
    listen_maddr_of,
    peer_id_of,
    published_counts,
)
from tests.helpers.swarm import Launcher, Proc, cli, wait_until

# The whole story is ~3 minutes of real processes: with issue 12's tests the default suite ran 735 s, over its
# 10-minute budget. Each fault keeps a default-suite twin: kill and restart (tests/peer/test_restart.py), a
# bootstrap restarted and met again (tests/net/test_net_node.py), a donor dropped mid-sync
# (tests/net/test_statesync.py), a hung then vanished peer (tests/net/test_gossip.py); `pytest -m slow` runs it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

START_S = 120  # one process's start-up on a loaded 2-core machine, with margin
PAUSE_S = 15.0  # longer than the record TTL (12 s) and the gossip RPC timeout (3 s)
MAX_ROUND_GAP_S = 8.0  # a peer that waits on a frozen or dead one stalls for a network timeout or more
ARGS = ("--preset", "test", "--inner-steps", "2", "--torch-threads", "1", "--eval-every", "0", "--eval-batches", "2",
        "--record-ttl-s", "12", "--gossip-anti-entropy-s", "1", "--gossip-rpc-timeout-s", "3",
        "--sync-chunk-bytes", "512", "--sync-parallel-chunks", "1", "--sync-timeout-s", "5")
"""Tiny model, 2 inner steps (updates always in flight), short timeouts; snapshots served in 512-byte chunks
one at a time, so that a state sync of the 0.5 MB replica takes about 1000 calls: seconds, not milliseconds."""


@dataclass
class Story:
    workdir: Path
    main: dict[str, Proc]  # A, B, C
    victim: Proc
    joiner: Proc
    late: Proc | None = None  # K, joined through the restarted bootstrap
    marks: dict[str, float] = field(default_factory=dict)  # time.time() of each fault
    seqs: dict[str, dict[str, int]] = field(default_factory=dict)  # snapshots of who had published what
    donor_killed: str = ""


def _rounds_after(proc: Proc, t: float) -> list[dict]:
    return [r for r in proc.rounds() if r["time"] > t]


def _verbose_peer(launcher: Launcher, name: str, bootstrap: str) -> Proc:
    """Like `launcher.peer`, with -v: the peer logs at INFO, e.g. each snapshot manifest it serves."""
    workdir = launcher.workdir
    argv = cli("-v", "join", *ARGS, "--identity", str(workdir / f"{name}.key"), "--json-log",
               str(workdir / f"{name}.jsonl"), "--out-dir", str(workdir / f"{name}-state"), "--linger-s", "120",
               "--bootstrap", bootstrap)
    return launcher.start(name, argv, json_log=workdir / f"{name}.jsonl", out_dir=workdir / f"{name}-state", nice=10)


def _wait_rounds_after(procs: list[Proc], t: float, n: int, what: str) -> None:
    wait_until(lambda: all(len(_rounds_after(p, t)) >= n for p in procs), START_S, what, procs=procs)


@pytest.fixture(scope="module")
def story(tmp_path_factory) -> Story:
    workdir = tmp_path_factory.mktemp("faults")
    with Launcher(workdir) as launcher:
        boot, bootstrap = launcher.bootstrap()
        main = {n: _verbose_peer(launcher, n, bootstrap) for n in ("A", "B", "C")}
        victim = launcher.peer("V", bootstrap, base=ARGS, nice=10)
        everyone = [*main.values(), victim]
        wait_until(lambda: all(len(p.rounds()) >= 3 for p in everyone), START_S, "4 peers to train", procs=everyone)
        s = Story(workdir, main, victim, joiner=None)  # type: ignore[arg-type]
        a, b, c = main.values()

        # 1. pause C (and its DHT process and p2pd) for longer than the timeouts, then let it go on
        c.pause()
        s.marks["paused"] = time.time()
        _wait_rounds_after([a, b], s.marks["paused"], 5, "A and B to train while C is frozen")
        wait_until(lambda: time.time() - s.marks["paused"] > PAUSE_S, PAUSE_S + 5, "the pause")
        s.seqs["at_resume"] = published_counts([a, b, victim])
        c.resume()
        s.marks["resumed"] = time.time()
        _wait_rounds_after([c], s.marks["resumed"], 3, "C to train again after SIGCONT")

        # 2. kill V while updates stream between everyone
        victim.kill_group()
        s.marks["victim_killed"] = time.time()
        victim.wait(30)
        _wait_rounds_after([a, b, c], s.marks["victim_killed"], 5, "A, B, C to train on after V died")

        # 3. the bootstrap dies; A, B, C know each other
        boot.kill_group()
        s.marks["boot_killed"] = time.time()
        boot.wait(30)
        _wait_rounds_after([a, b, c], s.marks["boot_killed"], 5, "A, B, C to train on without the bootstrap")

        # 4. J joins through A; its first donor dies while J fetches the snapshot's chunks
        j = s.joiner = launcher.peer("J", listen_maddr_of(a), base=ARGS, linger_s=120)
        jid = wait_until(lambda: j.events("start") and j.events("start")[0]["peer_id"], START_S, "J's start",
                         procs=[j])
        served = f"manifest served joiner={jid}"
        donor_proc = wait_until(lambda: next((p for p in main.values() if served in p.output()), None), START_S,
                                "a donor to serve J a snapshot manifest", procs=[j])
        donor_proc.kill_group()
        s.marks["donor_killed"], s.donor_killed = time.time(), peer_id_of(donor_proc)
        j.wait_rounds(3, START_S)

        # 5. the bootstrap comes back on its port, knowing nobody; the peers meet it again; K joins through it
        argv = list(boot.argv)
        argv[argv.index("--port") + 1] = re.search(r"/tcp/(\d+)/", bootstrap).group(1)
        argv[argv.index("--report-s") + 1] = "1"  # it prints how many live peers of the run it can see
        boot2 = launcher.start("bootstrap-again", argv)
        wait_until(lambda: "bootstrap ready" in boot2.output(), START_S, "the bootstrap to come back", procs=[boot2])
        s.marks["boot_back"] = time.time()
        wait_until(lambda: re.search(r"live peers: default=[3-9]", boot2.output()), START_S,
                   "the restarted bootstrap to see the run's peers (they meet it again)", procs=[boot2])
        k = s.late = launcher.peer("K", bootstrap, base=ARGS, linger_s=120)
        wait_until(lambda: len(k.rounds()) >= 3 and any(r["peers"] >= 4 for r in k.rounds()), START_S,
                   "K to train with the others", procs=[k])

        survivors = [p for p in (*main.values(), j, k) if p is not donor_proc]
        for proc in survivors:
            proc.finish()
        for proc in survivors:
            proc.wait(180)
        yield s


def _survivors(s: Story) -> list[Proc]:
    return [p for p in (*s.main.values(), s.joiner, s.late) if p is not None and peer_id_of(p) != s.donor_killed]


def _max_gap_s(proc: Proc, start: float, end: float) -> float:
    times = [start] + [r["time"] for r in proc.rounds() if start < r["time"] < end] + [end]
    return max(b - a for a, b in zip(times, times[1:]))


def test_others_keep_training_while_a_peer_is_frozen(story: Story) -> None:
    a, b = story.main["A"], story.main["B"]
    for proc in (a, b):
        assert _max_gap_s(proc, story.marks["paused"], story.marks["resumed"]) < MAX_ROUND_GAP_S, proc.name
        # and they go on merging each other's updates while C is frozen
        during = [r for r in proc.rounds() if story.marks["paused"] < r["time"] < story.marks["resumed"]]
        assert during[-1]["vv_total"] - during[0]["vv_total"] > during[-1]["seq"] - during[0]["seq"]


def test_paused_peer_catches_up_and_its_late_update_is_merged(story: Story) -> None:
    c = story.main["C"]
    cid = peer_id_of(c)
    before = [r for r in c.rounds() if r["time"] < story.marks["resumed"]]  # C was frozen after the last
    late = _rounds_after(c, story.marks["resumed"])[0]  # the phase the pause cut in two
    assert late["seq"] == before[-1]["seq"] + 1, (before[-1], late)
    assert late["tau"] >= 0 and late["weight"] > 0, late  # its staleness, as the sender computed it; not refused
    for proc in _survivors(story):
        if proc is not c:
            _, vv = proc.state()
            assert vv["version_vector"].get(cid, 0) >= late["seq"], f"{proc.name} never merged C's late update"
    # C catches up: within seconds its replica holds everything A, B and V had published when it woke up. Of V,
    # killed a few rounds later, only what anyone got before it died: an update it published just before the
    # resume may have gone with it (test_kill_during_gossip_does_not_stall_the_others allows the same).
    at_resume = dict(story.seqs["at_resume"])
    vid = peer_id_of(story.victim)
    # C's own last word on V: its final state, or, if C was the donor killed under J's state sync (the donor is
    # whoever served J's manifest first: C in some runs), its last round's vector.
    c_vv = c.rounds()[-1]["vv"] if cid == story.donor_killed else c.state()[1]["version_vector"]
    at_resume[vid] = min(at_resume.get(vid, 0), c_vv.get(vid, 0))
    caught = next((r for r in _rounds_after(c, story.marks["resumed"])
                   if r["vv_total"] >= sum(at_resume.values()) + late["seq"]), None)
    assert caught is not None, ("C never caught up", at_resume, late["seq"], c.rounds()[-1]["vv_total"])
    assert caught["time"] - story.marks["resumed"] < 30, caught["time"] - story.marks["resumed"]


def test_kill_during_gossip_does_not_stall_the_others(story: Story) -> None:
    vid = peer_id_of(story.victim)
    end = story.marks["boot_killed"]
    published = published_counts([story.victim])[vid]
    for proc in story.main.values():
        assert _max_gap_s(proc, story.marks["victim_killed"], end) < MAX_ROUND_GAP_S, proc.name
    # the survivors agree on what they got from V: all it published, less the updates nobody had pulled yet
    # (+1: an update published but not yet logged when the kill came)
    held = {proc.state()[1]["version_vector"].get(vid, 0) for proc in _survivors(story)}
    assert len(held) == 1 and 0 < held.pop() <= published + 1, (held, published)


def test_running_peers_keep_training_without_the_bootstrap(story: Story) -> None:
    start, end = story.marks["boot_killed"], story.marks["donor_killed"]
    ids = {peer_id_of(p) for p in story.main.values()}
    for proc in story.main.values():
        assert _max_gap_s(proc, start, end) < MAX_ROUND_GAP_S, proc.name
        after = [r for r in proc.rounds() if start < r["time"] < end]
        assert len(after) >= 10
        # merging goes on: the replica grows by more than the peer's own updates
        assert after[-1]["vv_total"] - after[0]["vv_total"] > after[-1]["seq"] - after[0]["seq"]
        assert after[-1]["peers"] >= 2, "it lost sight of the others"
    assert len(ids) == 3


def test_new_peer_joins_through_a_live_peer_and_switches_donor(story: Story) -> None:
    j = story.joiner
    sync = j.events("sync")
    assert sync, j.tail()
    assert sync[-1]["donor"] != story.donor_killed and sync[-1]["vv_total"] > 0
    # it dropped the dead donor mid-sync (after its manifest, before all chunks) and took another
    assert f"state sync donor dropped donor={story.donor_killed}" in j.output(), j.tail(60)
    assert sync[-1]["candidates"] >= 2
    jid = peer_id_of(j)
    for proc in _survivors(story):
        assert proc.state()[1]["version_vector"].get(jid, 0) == len(j.rounds())


def test_a_restarted_bootstrap_is_met_again_and_lets_new_peers_in(story: Story) -> None:
    k = story.late
    sync = k.events("sync")
    assert sync and sync[-1]["vv_total"] > 0, k.tail()  # it found the run and took a snapshot, not theta_0
    assert len(k.rounds()) >= 3
    kid = peer_id_of(k)
    for proc in _survivors(story):
        assert proc.state()[1]["version_vector"].get(kid, 0) == len(k.rounds()), proc.name


def test_replicas_agree_and_nothing_merged_twice(story: Story) -> None:
    survivors = _survivors(story)
    for proc in survivors:
        assert proc.returncode == 0, proc.tail()
        assert "swarm quiet" in proc.output(), proc.tail()
        assert proc.events("final")[-1]["rejected"] == 0
        assert_merged_once(proc)
    assert_replicas_agree(survivors, published_counts(survivors))


def test_vetting_refuses_no_honest_work(story: Story) -> None:
    # Once 1 run in 3 failed here: two peers whose ids hash to one data shard (with 4 peers and 16 shards, about
    # 1 run in 3) trained on the same batches and published one payload, a tie. Batches are salted by PeerID now.
    for proc in _survivors(story):
        assert set(proc.events("final")[-1]["vetting"]) <= {"probation"}, proc.name


def test_a_fresh_peer_is_not_told_its_identity_is_in_use(story: Story) -> None:
    # regression: sync_state announced our own record, then read it back and warned on every fresh peer
    for proc in story.main.values():
        assert "this identity already has a live record" not in proc.output(), proc.name
