"""A run with founders as real processes on 127.0.0.1 (sync/sponsorship.py): peers A and B are the spec's sponsors
(`--spec.defence.sponsors A,B`, their keys made before the run with `p2p-diloco id`), volunteer V is not. All three
train a few rounds; V's updates merge at 0 everywhere and come into the model inside A's and B's updates, so the
three replicas end equal and A and B report V's work as relayed. A peer given a sponsor list with a typo is
refused at the flag, before it starts anything."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers.swarm import PACED, Launcher, cli, founder_key, max_relative_difference

pytestmark = pytest.mark.timeout(300)

START_S = 120



@pytest.mark.slow  # 3 processes for 30-45 s; the default suite keeps the relay's rules (tests/sync/test_sponsorship.py)
# and the founders' flags (the test below)
def test_founders_relay_a_volunteer_and_the_replicas_end_equal(tmp_path) -> None:
    a, b = founder_key(tmp_path, "A"), founder_key(tmp_path, "B")
    sponsors = ("--spec.defence.sponsors", f"{a},{b}")
    with Launcher(tmp_path) as launcher:
        _, bootstrap = launcher.bootstrap()
        # A relay needs a founder to end rounds after V's proposals came. With 5 rounds each, under load V once
        # started so late that both founders had ended first, and once so early that it made its 5 rounds before
        # the founders' first: nothing relayed either time. So the founders train from before V starts until they
        # have ended 2 rounds after V's last, then end.
        founders = [launcher.peer(name, bootstrap, *sponsors, *PACED, rounds=0, linger_s=60) for name in ("A", "B")]
        for proc in founders:
            proc.wait_rounds(1, START_S)
        volunteer = launcher.peer("V", bootstrap, *sponsors, rounds=5, linger_s=60)
        peers = [*founders, volunteer]
        volunteer.wait_rounds(5, START_S + 120)
        for proc in founders:
            proc.wait_rounds(len(proc.rounds()) + 2, 120)
            proc.finish()
        for proc in peers:
            assert proc.wait(START_S + 120) == 0, proc.tail()
        finals = {proc.name: proc.events("final")[0] for proc in peers}
        v = finals["V"]["peer_id"]
        assert {finals["A"]["peer_id"], finals["B"]["peer_id"]} == {a, b} and v not in (a, b)
        states = [proc.state() for proc in peers]
        assert len({vv["digest"] for _, vv in states}) == 1, [vv["version_vector"] for _, vv in states]
        for theta, _ in states[1:]:
            assert max_relative_difference(states[0][0], theta) < 1e-5
        for _, vv in states:
            assert vv["version_vector"].get(v) == 5  # every proposal merged everywhere (at 0)
        for name in ("A", "B"):
            assert finals[name]["vetting"].get("proposal", 0) >= 4, finals[name]
        # V's work entered through at least one sponsor's update (a late phase of V may go unrelayed)
        relayed = {n: f["relayed"] for n, f in finals.items()}
        assert max(relayed[n].get(v, 0.0) for n in ("A", "B")) > 0, relayed
        # V heralded its updates to both sponsors ahead of them (net/gossip/heralds.py; one may fail while a
        # sponsor's address is still being found: nothing retries a herald); sponsors herald nothing
        heralds = {n: f["heralds"] for n, f in finals.items()}
        assert heralds["V"]["sent"] >= 6 and heralds["A"]["sent"] == heralds["B"]["sent"] == 0, heralds
        assert all(heralds[n]["heard"] >= 3 and heralds[n]["refused"] == 0 for n in ("A", "B")), heralds


def test_a_sponsor_list_with_a_typo_is_refused_at_the_flag(tmp_path) -> None:
    out = subprocess.run(cli("join", "--spec.defence.sponsors", "12D3KooWnotakey"), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "is not an Ed25519 PeerID" in out.stderr, out.stderr[-500:]
