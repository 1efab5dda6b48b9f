"""Bandwidth awareness (issue 12, "Over the internet"): the upload-rate estimator, the per-remote fair share of
the measured uplink (re-serves charged again), and the local settings that follow it (net/admission/meter.py,
uplink.py, gossip's fanout and serves); pure first, then one real swarm on 127.0.0.1 where a remote pulling
everything in a loop gets no more than its share while an honest peer keeps merging."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.config import preset
from p2p_diloco.config.admission import RateLimitConfig
from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.admission.meter import (
    MIN_SAMPLE_BYTES,
    SAMPLE_BUSY_S,
    FairShare,
    UplinkMeter,
    adapted,
)
from p2p_diloco.net.gossip.service import MIN_FANOUT, Gossip, GossipConfig
from p2p_diloco.peer.network_counters import uplink_counters

pytestmark = pytest.mark.timeout(120)

PULL = "p2p-diloco/r/pull"


def _send(meter: UplinkMeter, start: float, seconds: float, nbytes: int) -> float:
    meter.begin(start)
    meter.end(nbytes, start + seconds)
    return start + seconds


# ---------------------------------------------------------------------------------------------- the meter


def test_no_estimate_before_enough_was_sent() -> None:
    meter = UplinkMeter()
    assert meter.rate_bps(0.0) is None
    _send(meter, 0.0, 10.0, MIN_SAMPLE_BYTES - 1)  # long, but too few bytes
    _send(meter, 20.0, SAMPLE_BUSY_S / 10, 10 << 20)  # many bytes, too short: still one pending sample
    assert meter.samples == 1  # the two together make one


@settings(max_examples=50, deadline=None)
@given(rate=st.floats(1e4, 1e9), sizes=st.lists(st.integers(1 << 18, 1 << 24), min_size=3, max_size=30),
       gaps=st.lists(st.floats(0.0, 100.0), min_size=30, max_size=30))
def test_a_constant_link_reads_as_its_rate_whatever_the_idle_gaps(rate: float, sizes: list[int],
                                                                 gaps: list[float]) -> None:
    """Idle time between responses is not sending time: the estimate is the link's rate, not its use."""
    meter, now = UplinkMeter(), 0.0
    for size, gap in zip(sizes, gaps):
        now = _send(meter, now + gap, size / rate, size)
    if meter.samples:
        assert meter.rate_bps(now) == pytest.approx(rate, rel=1e-6)


def test_overlapping_responses_share_the_link_and_are_timed_once() -> None:
    """Two responses of 1 MB each, sent at once over 1 s on a 2 MB/s link: 2 MB/s, not 1 MB/s per stream."""
    meter = UplinkMeter()
    meter.begin(0.0)
    meter.begin(0.0)
    meter.end(1_000_000, 1.0)
    meter.end(1_000_000, 1.0)
    assert meter.rate_bps(1.0) == pytest.approx(2e6)
    assert meter.total_busy_s == pytest.approx(1.0) and meter.active == 0


def test_one_slow_reader_does_not_talk_the_estimate_down_at_once_and_a_faster_link_is_followed() -> None:
    meter, now = UplinkMeter(), 0.0
    for _ in range(5):
        now = _send(meter, now, 1.0, 2_500_000)  # 2.5 MB/s
    now = _send(meter, now, 10.0, 300_000)  # one remote reading at 30 kB/s
    assert meter.rate_bps(now) >= 2.4e6  # the best recent sample holds it up
    assert meter.rate_bps(now + 3600) < 2.0e6  # ... for a while only
    for _ in range(20):
        now = _send(meter, now, 1.0, 12_500_000)  # the link got faster (100 Mbit/s)
    assert meter.rate_bps(now) == pytest.approx(12.5e6, rel=0.01)


def test_an_end_without_a_begin_changes_nothing() -> None:
    meter = UplinkMeter()
    meter.end(10 << 20, 5.0)
    assert meter.total_bytes == 0 and meter.rate_bps(5.0) is None


# ---------------------------------------------------------------------------------------------- the share


@settings(max_examples=100, deadline=None)
@given(uplink=st.floats(1e4, 1e9), n=st.integers(1, 50), floor=st.floats(0, 1e6),
       demands=st.lists(st.floats(0.0, 2.0), min_size=50, max_size=50))
def test_the_share_is_max_min_fair_at_least_the_uplink_over_the_active_remotes(uplink, n, floor, demands) -> None:
    """Others that took little leave the rest to the asker; all taking as much as they can: uplink / n each;
    never under the floor, never over the whole uplink (or the floor)."""
    window = 10.0
    fair = FairShare(window_s=window, floor_bps=floor, reserve_charge=3.0)
    for i in range(1, n):
        fair.charge(f"p{i}", demands[i] * uplink / n * window, 1.0)
    taken = sum(min(demands[i], 1.0) * uplink / n for i in range(1, n))
    share = fair.share_bps("p0", uplink, 1.0)
    assert max(uplink / n, floor) * (1 - 1e-9) <= share <= max(uplink, floor) * (1 + 1e-9)
    if all(d >= 1.0 for d in demands[1:n]):
        assert share == pytest.approx(max(uplink / n, floor))
    if all(d <= 1.0 for d in demands[1:n]):
        assert share == pytest.approx(max(uplink - taken, floor), rel=1e-6)
    assert fair.share_bps("p1", uplink, 30.0) == pytest.approx(max(uplink, floor))  # all went quiet


def test_re_serves_count_against_the_looper_not_as_the_others_use() -> None:
    fair = FairShare(window_s=1.0, floor_bps=0, reserve_charge=3.0)
    fair.charge("looper", 100, 0.0)
    fair.charge("looper", 100, 0.0, again=True)
    assert fair.used("looper", 0.0) == 300  # against its own share
    assert fair.share_bps("honest", 1000, 0.1) == pytest.approx(900)  # the others see the 100 bytes it took


@settings(max_examples=100, deadline=None)
@given(chunks=st.lists(st.tuples(st.floats(0.0, 3.0), st.integers(1, 1 << 20)), min_size=1, max_size=60))
def test_a_looper_never_gets_more_than_its_share_per_window_plus_one_response(chunks) -> None:
    """Served only while under its share (as the guard asks before each update), a remote alone on a link of
    `uplink` B/s gets at most share * (window + elapsed) + one response over any run."""
    uplink, window = 1e6, 2.0
    fair, now, served, largest = FairShare(window_s=window, floor_bps=0, reserve_charge=3.0), 0.0, 0.0, 0
    for gap, size in chunks:
        now += gap
        if fair.over("looper", uplink, now) is None:
            fair.charge("looper", size, now)
            served += size
            largest = max(largest, size)
    assert served <= uplink * (window + now) + largest


def test_serving_the_same_again_is_charged_reserve_charge_times() -> None:
    fair = FairShare(window_s=10.0, floor_bps=0, reserve_charge=3.0)
    fair.charge("a", 100, 0.0)
    fair.charge("b", 100, 0.0)
    fair.charge("b", 100, 0.0, again=True)
    assert fair.used("a", 0.0) == 100 and fair.used("b", 0.0) == 300
    assert fair.used("b", 15.0) == pytest.approx(150)  # half of the older bucket still in the window
    assert fair.used("b", 25.0) == 0


def test_the_table_is_bounded() -> None:
    fair = FairShare(window_s=10.0, floor_bps=0, reserve_charge=3.0, max_remotes=8)
    for i in range(100):
        fair.charge(f"p{i}", 1, float(i) / 100)
    assert len(fair._remotes) == 8 and fair.used("p0", 1.0) == 0


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(1, 64), rate=st.one_of(st.none(), st.floats(0, 1e10)), per=st.floats(1, 1e7),
       minimum=st.integers(1, 8))
def test_adapted_settings_stay_within_their_bounds_and_grow_with_the_rate(limit, rate, per, minimum) -> None:
    value = adapted(limit, rate, per, minimum)
    assert min(minimum, limit) <= value <= limit
    if rate is None:
        assert value == limit
    else:
        assert adapted(limit, 2 * rate + per, per, minimum) >= value


# ---------------------------------------------------------------------------------------------- the guard


def _guard(**kw) -> PeerGuard:
    limits = RateLimitConfig(pulls_per_s=1e6, burst_s=1.0, fair_share_window_s=1.0, fair_share_floor_bytes_per_s=0,
                             **kw)
    return PeerGuard("r", self_id="me", limits=limits)


def _admit(guard: PeerGuard, caller: str, nbytes: int) -> str | None:
    async def go() -> str | None:
        why = await guard.admit(caller, PULL, 10)
        if why is None:
            end = guard.sending(caller, PULL)
            guard.charge_out(caller, nbytes)
            end(nbytes)
            guard.release(caller)
        return why
    return asyncio.run(go())


def test_the_guard_refuses_a_remote_over_its_fair_share_even_an_unchoked_contributor() -> None:
    guard = _guard(uplink_bytes_per_s=1e6, unchoked_contributors=4)
    for peer in ("looper", "honest"):
        guard.ledger.gave(peer, 1, 10**7)  # both contributors, both unchoked
    assert _admit(guard, "honest", 100_000) is None
    assert _admit(guard, "looper", 950_000) is None  # its share: the 900 kB/s the honest one left, 1 s window
    why = _admit(guard, "looper", 1)
    assert why is not None and why.startswith("busy: you took your fair share"), why
    assert guard.rejections.totals["uplink_fair_share"] == 1
    assert _admit(guard, "honest", 100_000) is None  # the honest one is still served
    guard.uplink.served_again("honest", 200_000)  # what it had from us already counts twice more
    assert guard.uplink.fair.used("honest", time.monotonic()) == pytest.approx(600_000, rel=0.01)


def test_the_budget_follows_the_measured_uplink_and_the_buckets_rescale() -> None:
    guard = _guard(uplink_bytes_per_s=128e6)
    assert guard.uplink_rate_bps is None and guard.uplink.budget_bps() == 128e6
    now = time.monotonic()
    for i in range(4):
        _send(guard.uplink.meter, now - 10 + i, 1.0, 2_500_000)  # a 20 Mbit/s home uplink
    assert guard.uplink_rate_bps == pytest.approx(2.5e6)
    assert guard.uplink.budget_bps() == pytest.approx(2.5e6)
    guard.uplink.refusal("x")  # asking rescales the buckets
    assert guard.uplink.newcomers.rate == pytest.approx(0.25 * 2.5e6)
    counters = uplink_counters(guard)
    assert counters["uplink_bps"] == 2_500_000 and counters["uplink_samples"] == 4


def test_without_a_budget_or_a_measurement_nothing_is_refused_and_the_meter_can_be_off() -> None:
    guard = _guard(uplink_bytes_per_s=0)
    assert all(_admit(guard, "looper", 10**7) is None for _ in range(5))  # no budget known: no share
    off = _guard(uplink_bytes_per_s=0, measure_uplink=False)
    _send(off.uplink.meter, 0.0, 1.0, 10**7)
    assert off.uplink_rate_bps is None
    assert guard.sending("c", "p2p-diloco/r/announce") is None  # small responses are not timed


def test_gossip_fanout_and_serves_shrink_on_a_slow_uplink_and_grow_back() -> None:
    guard = SimpleNamespace(uplink_budget_bps=None)
    gossip = Gossip.__new__(Gossip)
    gossip.config, gossip.guard = GossipConfig(fanout=6, max_concurrent_serves=8, stream_bytes_per_s=512e3), guard
    for bps, fanout, serves in ((None, 6, 8), (100e3, MIN_FANOUT, 2), (2.5e6, 4, 4), (12.5e6, 6, 8)):
        guard.uplink_budget_bps = bps
        assert (gossip.fanout(), gossip.max_serves()) == (fanout, serves), bps
    gossip.config = dataclasses.replace(gossip.config, stream_bytes_per_s=0)  # 0: never adapt
    guard.uplink_budget_bps = 100e3
    assert (gossip.fanout(), gossip.max_serves()) == (6, 8)
    real = _guard(uplink_bytes_per_s=2.5e6)  # the operator's budget alone adapts them too
    assert real.uplink_budget_bps == 2.5e6 and real.uplink_rate_bps is None


# ---------------------------------------------------------------------------------------------- loopback

LOOP_SPEC = dataclasses.replace(preset("test"), run_id="fair-share-test")
LOOP_NUMEL = 250_000  # int8: ~250 KB per update
BUDGET = 2e6  # A's uplink as its operator set it (a 16 Mbit/s home link): loopback itself is far faster
WINDOW_S = 2.0
ATTACK_S = 4.0


def test_a_looping_puller_gets_no_more_than_its_share_while_an_honest_peer_keeps_merging(loop, tmp_path) -> None:
    """A and B publish an update every 0.5 s; one more identity pulls everything from A in a loop. It is made a
    contributor in A's ledger (it gave A something once, so A unchokes it: only the fair share holds it). It
    must get at most A's budget over the window and the attack (alone, its share is the whole budget; with B
    active half) plus one update, and B must keep merging A's updates."""
    from tests.helpers.crowd.crowd import Crowd
    from tests.helpers.crowd.group import leftover_daemons
    from tests.helpers.crowd.honest import start_honest, stop_honest
    from tests.helpers.crowd.scenarios import disengage, engage, measure

    limits = RateLimitConfig(uplink_bytes_per_s=BUDGET, burst_s=1.0, fair_share_window_s=WINDOW_S)

    async def run() -> dict:
        crowd = Crowd(1, tmp_path, run_id=LOOP_SPEC.run_id)
        honest = await start_honest(tmp_path, 2, spec=LOOP_SPEC, numel=LOOP_NUMEL, gossip=GossipConfig(),
                                    limits=limits)
        try:
            await crowd.start()
            tasks = await engage(honest, crowd, spec=LOOP_SPEC, numel=LOOP_NUMEL, publish_s=0.5)
            honest[0].guard.ledger.gave(crowd.peer_ids[0], 1, 10**7)
            try:
                return await measure(honest, crowd, "flood", base_s=2.0, attack_s=ATTACK_S)
            finally:
                await disengage(tasks)
        finally:
            await crowd.close()
            await stop_honest(honest)

    result = loop.run(run(), timeout_s=240)
    print(result)
    assert leftover_daemons(tmp_path) == []
    update_bytes = 260_000
    assert result["crowd"].get("updates_received", 0) > 0  # it was served, within its share
    assert result["crowd_bytes"] <= BUDGET * (WINDOW_S + result["seconds"]) + update_bytes, result
    base, attack = result["base"], result["attack"]
    assert attack["lag_worst"] <= 2 * base["lag_worst"] + 3, result
    assert attack["merged"] > 0
