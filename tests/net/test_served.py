"""net/gossip/served.py: no remote gets one update more than twice in a window, unless it proves it lost it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.net.gossip.served import SERVE_WINDOW_S, ServedLog


def _serve_all(log: ServedLog, remote: str, keys: list[tuple[str, int]], now: float) -> list[tuple[str, int]]:
    """One batch as GossipServer serves it: the allowed updates are sent and recorded, the others skipped."""
    sent = [k for k in keys if log.allowed(remote, *k, now=now)]
    for k in sent:
        log.record(remote, *k, now=now)
    log.skip(remote, len(keys) - len(sent))
    return sent


def test_a_looping_puller_gets_each_update_twice_per_window() -> None:
    log = ServedLog()
    keys = [("a", 1), ("a", 2), ("b", 1)]
    got = [_serve_all(log, "free", keys, now=float(t)) for t in range(100)]
    assert got[0] == keys and got[1] == keys and all(batch == [] for batch in got[2:])
    assert log.summary("free") == {"marked": 3, "skipped": 98 * 3, "resets": 0}
    # The window is counted from the serves: once the older one is past it, one more serve is allowed.
    assert _serve_all(log, "free", keys, now=SERVE_WINDOW_S + 0.5) == keys
    assert _serve_all(log, "free", keys, now=SERVE_WINDOW_S + 0.6) == []
    assert _serve_all(log, "free", keys, now=SERVE_WINDOW_S + 1.5) == keys


def test_remotes_are_counted_apart_and_a_zero_window_serves_everything() -> None:
    log = ServedLog()
    for _ in range(3):
        log.record("x", "a", 1, now=0.0)
    assert not log.allowed("x", "a", 1, now=1.0) and log.allowed("y", "a", 1, now=1.0)
    assert log.allowed("x", "a", 2, now=1.0)
    open_log = ServedLog(window_s=0)
    for _ in range(5):
        open_log.record("x", "a", 1, now=0.0)
    assert open_log.allowed("x", "a", 1, now=0.0) and len(open_log) == 0


def test_a_proven_loss_clears_the_record_once_per_window() -> None:
    log = ServedLog()
    log.record("r", "a", 1, now=0.0)
    log.record("r", "a", 1, now=1.0)
    assert not log.allowed("r", "a", 1, now=2.0)
    assert log.lost("r", now=2.0)  # a restart from an older checkpoint: served again
    assert log.allowed("r", "a", 1, now=2.0) and len(log) == 0
    log.record("r", "a", 1, now=3.0)
    log.record("r", "a", 1, now=4.0)
    assert not log.lost("r", now=5.0)  # a second fall within the window buys nothing
    assert not log.allowed("r", "a", 1, now=5.0)
    assert log.lost("r", now=2.0 + SERVE_WINDOW_S)
    assert log.summary("r")["resets"] == 2
    assert not ServedLog().lost("never-served", now=0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 3), st.integers(1, 6), st.integers(0, 3)),
                max_size=400),
       st.integers(1, 6), st.integers(1, 40))
def test_bounds_and_at_most_max_serves_per_window(ops: list[tuple[int, int, int, int]], max_remotes: int,
                                                   max_entries: int) -> None:
    """Whatever the requests: the tables stay within their bounds, and while a remote's record is neither
    forgotten nor reset, no update reaches it more than max_serves times within any window."""
    window = 10.0
    log = ServedLog(window_s=window, max_remotes=max_remotes, max_entries=max_entries)
    sent: dict[tuple[str, str, int], list[float]] = {}
    now = 0.0
    for dt, remote_i, seq, sender_i in ops:
        now += dt / 4
        remote, sender = f"r{remote_i}", f"s{sender_i}"
        if log.allowed(remote, sender, seq, now=now):
            log.record(remote, sender, seq, now=now)
            sent.setdefault((remote, sender, seq), []).append(now)
        assert len(log) <= max_entries and len(log._remotes) <= max_remotes
        assert len(log) == sum(len(r.marks) for r in log._remotes.values())
    if log.evicted == 0:  # nothing forgotten: the rule held exactly
        for times in sent.values():
            for i, t in enumerate(times):
                assert sum(1 for u in times[i:] if u - t < window) <= log.max_serves


def test_the_least_recently_served_remote_is_forgotten_first() -> None:
    log = ServedLog(max_remotes=2, max_entries=4)
    for remote in ("old", "loop", "new"):
        log.record(remote, "a", 1, now=0.0)
    assert log.summary("old")["marked"] == 0 and log.summary("loop")["marked"] == 1
    for seq in range(1, 5):  # the looping puller fills the entry bound: the other remote's marks go first
        log.record("loop", "a", seq, now=1.0)
    assert log.summary("new")["marked"] == 0 and log.summary("loop")["marked"] == 4
