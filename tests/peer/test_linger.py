"""The linger rule (peer/linger.py): a peer leaves only when two fresh reads of the records say every other live
peer is done and holds its replica; a peer still syncing or training is never quiet."""

from __future__ import annotations

import threading
import time

import pytest

from p2p_diloco.peer import linger as linger_module
from p2p_diloco.peer.linger import linger

OURS = "0123456789abcdef"


class OurVector:
    def digest(self) -> bytes:
        return bytes.fromhex(OURS)


class LingeringLearner:
    peer_id = "me"

    def __init__(self) -> None:
        self.replica = type("R", (), {"version_vector": OurVector()})()


class LingeringNetwork:
    """`peers` replaced whole on each read of the records, as the peer's network does."""

    def __init__(self, peers: dict[str, dict]) -> None:
        self.local: dict = {"state": "training"}
        self.peers = peers
        self.reads = 0

    def request_announce(self) -> None:
        pass

    def settling(self) -> bool:
        return False

    def read(self, peers: dict[str, dict]) -> None:
        self.peers = dict(peers)
        self.reads += 1


class NoLog:
    def write(self, event: str, **fields: object) -> None:
        pass


@pytest.fixture(autouse=True)
def fast_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linger_module, "CHECK_INTERVAL_S", 0.02)


def _linger(network: LingeringNetwork, stop: threading.Event, lines: list[str],
            linger_s: float = 30.0) -> threading.Thread:
    thread = threading.Thread(target=linger, args=(network, LingeringLearner()), daemon=True,
                              kwargs=dict(stop=stop, linger_s=linger_s, at_round=2, out=lines.append, log=NoLog()))
    thread.start()
    return thread


def _reads(network: LingeringNetwork, peers: dict[str, dict], n: int) -> None:
    for _ in range(n):
        network.read(peers)
        time.sleep(0.1)


def test_a_peer_still_syncing_or_training_keeps_us_lingering() -> None:
    done = {"state": "done", "vv_digest": OURS}
    network, stop, lines = LingeringNetwork({"c": done}), threading.Event(), []
    thread = _linger(network, stop, lines)
    try:
        for state in ("syncing", "training"):
            _reads(network, {"c": done, "b": {"state": state}}, 5)
            assert thread.is_alive() and not lines[1:], lines
        _reads(network, {"c": done, "b": {"state": "done", "vv_digest": "ffff"}}, 5)  # done, other updates
        assert thread.is_alive() and not lines[1:], lines
        _reads(network, {"c": done, "b": done}, 3)
        thread.join(5)
        assert not thread.is_alive() and lines[-1].startswith("swarm quiet"), lines
    finally:
        stop.set()
    assert network.local["state"] == "done"


def test_quiet_needs_two_fresh_reads_of_the_records() -> None:
    network, stop, lines = LingeringNetwork({"c": {"state": "done", "vv_digest": OURS}}), threading.Event(), []
    thread = _linger(network, stop, lines)
    try:
        time.sleep(0.5)  # the records read before we lingered, judged again and again: not enough
        assert thread.is_alive(), lines
        network.read(network.peers)
        time.sleep(0.3)
        assert thread.is_alive(), lines  # one fresh read
        network.read(network.peers)
        thread.join(5)
        assert not thread.is_alive() and lines[-1].startswith("swarm quiet"), lines
    finally:
        stop.set()


def test_linger_time_runs_out() -> None:
    network, stop, lines = LingeringNetwork({"b": {"state": "training"}}), threading.Event(), []
    thread = _linger(network, stop, lines, linger_s=0.3)
    thread.join(5)
    assert not thread.is_alive() and lines[-1].startswith("linger time over"), lines


def test_a_replica_pulls_cannot_complete_is_re_synced_while_lingering() -> None:
    """Every other peer is done with a vector we cannot reach by pulls (their stores evicted what we lack): the
    round loop's re-sync, called at each check, brings our replica to theirs, and the swarm goes quiet."""
    theirs = "fedcba9876543210"
    network, stop, lines = LingeringNetwork({"c": {"state": "done", "vv_digest": theirs}}), threading.Event(), []
    learner = LingeringLearner()
    calls: list[float] = []

    def catch_up() -> None:  # what Resync.between_rounds does once its watch says we are stuck: adopt a state
        calls.append(time.monotonic())
        if len(calls) == 3:
            learner.replica.version_vector = type("V", (), {"digest": lambda self: bytes.fromhex(theirs)})()

    thread = threading.Thread(target=linger, args=(network, learner), daemon=True,
                              kwargs=dict(stop=stop, linger_s=30.0, at_round=2, out=lines.append, log=NoLog(),
                                          catch_up=catch_up))
    thread.start()
    try:
        _reads(network, network.peers, 4)
        thread.join(5)
        assert not thread.is_alive() and lines[-1].startswith("swarm quiet"), lines
        assert len(calls) >= 3
    finally:
        stop.set()
