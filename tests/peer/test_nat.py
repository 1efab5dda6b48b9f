"""Over the internet, in network namespaces (tests/helpers/netns.py): a public bootstrap, two peers each behind its
own NAT (unsolicited inbound dropped), one peer with a public address, a NATed peer joining late; every peer's
uplink capped at 20 Mbit/s. All peers run the README's plain `join --bootstrap ADDR` (reachability auto).

Needs root, `ip`, `iptables` and `tc` (skipped with the reason otherwise). Not in the default suite (about 2-3
minutes on 2 cores): `python -m pytest -m netns`. tests/net/test_relay.py is its fast twin on loopback.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers.faults import assert_replicas_agree, incarnations, of
from tests.helpers.netns import NatTopology, nat_unavailable
from tests.helpers.swarm import Launcher, Proc, wait_until

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(900)]

ARGS = ("--preset", "test", "--inner-steps", "10", "--torch-threads", "1", "--eval-every", "5",
        "--eval-batches", "2", "--record-ttl-s", "12", "--gossip-anti-entropy-s", "2")
ROUNDS = 200
START_S = 120.0
MEMBERS = {"boot": "public", "a": "nat", "b": "nat", "p": "public", "j": "nat"}
CAP_MBIT = 20


@dataclass
class Run:
    peers: dict[str, Proc]
    boot: Proc
    ids: dict[str, str] = field(default_factory=dict)
    marks: dict[str, float] = field(default_factory=dict)


def _public_bootstrap(boot: Proc, topo: NatTopology) -> str:
    prefix = f"/ip4/{topo.host('boot')}/"
    return wait_until(lambda: next((line for line in boot.output().splitlines() if line.startswith(prefix)), None),
                      30, "the bootstrap's public address", procs=[boot])


def _peer_id(proc: Proc) -> str:
    return wait_until(lambda: proc.events("start") and proc.events("start")[0]["peer_id"], START_S,
                      f"{proc.name}'s start", procs=[proc])


def _vector(proc: Proc) -> dict[str, int]:
    rounds = proc.rounds()
    return rounds[-1].get("vv", {}) if rounds else {}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    if reason := nat_unavailable():
        pytest.skip(reason)
    workdir: Path = tmp_path_factory.mktemp("nat")
    with NatTopology(MEMBERS, {m: CAP_MBIT for m in MEMBERS if m != "boot"}) as topo, Launcher(workdir) as launcher:
        boot, _ = launcher.bootstrap(host="0.0.0.0", prefix=topo.prefix("boot"), extra=("--report-s", "2"))
        address = _public_bootstrap(boot, topo)

        def join(name: str, rounds: int) -> Proc:
            return launcher.peer(name, address, rounds=rounds, linger_s=240, base=ARGS, prefix=topo.prefix(name))

        r = Run({n: join(n, ROUNDS) for n in ("a", "b", "p")}, boot)
        r.ids = {n: _peer_id(p) for n, p in r.peers.items()}
        everyone = list(r.peers.values())
        wait_until(lambda: all(len(p.rounds()) >= 3 for p in everyone), START_S, "3 peers to train", procs=everyone)
        r.marks["trained"] = time.monotonic()
        # the two NATed peers hold each other's updates soon: through the bootstrap's relay, or via p
        a, b = r.peers["a"], r.peers["b"]
        wait_until(lambda: _held(a, r.ids["b"]) >= 3 and _held(b, r.ids["a"]) >= 3, 60,
                   "the NATed peers to merge 3 updates of each other", procs=[a, b])
        r.marks["nat_to_nat_s"] = time.monotonic() - r.marks["trained"]

        # a NATed late joiner state-syncs and contributes
        j = r.peers["j"] = join("j", 15)
        r.ids["j"] = _peer_id(j)
        j.wait_rounds(3, START_S)

        # a NATed peer killed mid-run, restarted with the same identity and state
        b.kill_group()
        b.wait(30)
        r.marks["b_killed"] = time.time()
        wait_until(lambda: len([x for x in a.rounds() if x["time"] > r.marks["b_killed"]]) >= 3, START_S,
                   "a to train on while b is down", procs=[a])
        b2 = r.peers["b"] = launcher.restart(b, "b2")
        wait_until(lambda: len(incarnations(b2)) >= 2 and len(of(incarnations(b2)[-1], "round")) >= 3, START_S,
                   "the restarted b to train again", procs=[b2])

        final = list(r.peers.values())
        wait_until(lambda: all(p.returncode is not None for p in final), 420, "every peer to finish and linger",
                   procs=[], interval_s=1.0)
        yield r


def _held(proc: Proc, sender: str) -> int:
    return int(_vector(proc).get(sender, 0))


def test_nated_peers_merge_each_others_updates_within_a_minute(run: Run) -> None:
    assert run.marks["nat_to_nat_s"] < 60


def test_every_peer_ends_cleanly(run: Run) -> None:
    assert {n: p.returncode for n, p in run.peers.items()} == dict.fromkeys(run.peers, 0), \
        "\n".join(p.tail() for p in run.peers.values())


def test_nated_peers_found_themselves_private_and_the_public_one_public(run: Run) -> None:
    reach = {n: of(incarnations(p)[-1], "reach")[0]["reach"] for n, p in run.peers.items()}
    assert reach == {"a": "private", "b": "private", "p": "public", "j": "private"}, reach


def test_the_bootstrap_relayed_streams(run: Run) -> None:
    counts = [int(m) for m in re.findall(r"relayed streams (\d+)", run.boot.output())]
    assert counts and max(counts) > 0, run.boot.tail()


def test_late_nated_joiner_state_synced_and_contributed(run: Run) -> None:
    j = run.peers["j"]
    sync = j.events("sync")
    assert sync and sync[-1]["vv_total"] > 0, "the late joiner did not state-sync"
    assert sync[-1].get("donor") != run.ids["a"] and sync[-1].get("donor") != run.ids["b"], \
        "a NATed donor was chosen although a public one exists"


def test_replicas_agree_with_equal_version_vectors(run: Run) -> None:
    assert_replicas_agree(list(run.peers.values()))
