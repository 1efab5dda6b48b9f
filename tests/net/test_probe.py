"""The bootstrap's probes (net/transport/probe.py) between real SwarmNodes on 127.0.0.1: a dial-back says open for
a listening port and closed for a closed one, an upload is counted to the byte, and the bounds hold (a burst is
rate limited, an oversize or malformed request is refused)."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.probe import (
    REACH,
    UPLOAD,
    _Buckets,
    observed_ip,
    reach,
    serve_probe,
    unserve_probe,
    upload_rate,
)
from tests.helpers.net import closed_tcp_port
from tests.helpers.swarm import wait_until


@pytest.fixture(scope="module")
def server(loop, members):
    """members[0] serves the probes; members[1] and [2] call them (each its own rate limit)."""
    stats = loop.run(serve_probe(members[0].node))
    try:
        yield members[0].node, stats
    finally:
        loop.run(unserve_probe(members[0].node))


def test_reach_says_open_for_a_listening_port_and_closed_for_a_closed_one(loop, members, server):
    node, _ = server

    async def probe_with_a_listener() -> tuple:
        listener = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        try:
            open_port, closed_port = listener.sockets[0].getsockname()[1], closed_tcp_port()
            return open_port, closed_port, await reach(members[1].node, node.peer_id, [open_port, closed_port], 15)
        finally:
            listener.close()

    open_port, closed_port, result = loop.run(probe_with_a_listener())
    assert result.observed_ip == "127.0.0.1"
    assert result.open_ports == (open_port,), (open_port, closed_port, result)
    assert result.server_time is not None and result.rtt_s > 0


def test_reach_refuses_a_burst_and_bad_requests(loop, members, server):
    node, stats = server
    caller = members[2].node
    # The size bound comes before the rate limit: an oversize request is refused unread.
    with pytest.raises(rpc.RpcRemoteError, match="too large"):
        loop.run(rpc.call(caller.p2p, node.peer_id, REACH, msgpack.packb({"ports": [1] * 400}),
                          max_response_bytes=512, timeout_s=15))
    assert stats[REACH].rejected_oversize == 1
    with pytest.raises(rpc.RpcRemoteError, match="malformed"):  # ports out of range: nothing is dialed
        loop.run(rpc.call(caller.p2p, node.peer_id, REACH, msgpack.packb({"ports": [0, 70000]}),
                          max_response_bytes=512, timeout_s=15))
    with pytest.raises(rpc.RpcRemoteError, match="rate limited"):  # one request per caller per 5 s
        loop.run(reach(caller, node.peer_id, [closed_tcp_port()], 15))
    assert stats[REACH].rejected_policy >= 1


def test_upload_counts_the_bytes_and_a_burst_is_refused(loop, members, server):
    node, stats = server
    caller = members[1].node
    before = stats[UPLOAD].bytes_in

    def upload(size: int) -> tuple[float | None, str]:
        """(rate, "") or (None, the refusal); None while the refusal is "busy": the server had not yet left the
        last upload's one slot when this one came (it spends no token of the rate limit), so ask again."""
        try:
            return loop.run(upload_rate(caller, node.peer_id, size, 15)), ""
        except rpc.RpcRemoteError as e:
            return None if "busy" in str(e) else (None, str(e))

    rates = [wait_until(lambda: upload(256 << 10), 30, "an upload not refused as busy") for _ in range(2)]
    assert all(rate is not None and rate > 0 for rate, _ in rates)
    assert stats[UPLOAD].bytes_in - before == 2 * (256 << 10)
    def refusal() -> str | None:
        """The refusal of one more upload, or None to ask again: busy, or accepted because a token came back while a
        loaded machine was slow to send the uploads above (the bucket refills one every few seconds)."""
        got = upload(1024)
        return got[1] if got is not None and got[1] else None

    assert "rate limited" in wait_until(refusal, 30, "a refusal other than busy")
    with pytest.raises(ValueError):
        loop.run(upload_rate(caller, node.peer_id, (4 << 20) + 1, 15))  # the client's own bound


def test_an_oversize_upload_is_refused(loop, members, server):
    node, stats = server
    with pytest.raises(rpc.RpcError, match="too large"):
        loop.run(rpc.call(members[2].node.p2p, node.peer_id, UPLOAD, bytes((4 << 20) + 1), max_response_bytes=16,
                          timeout_s=30))
    assert stats[UPLOAD].rejected_oversize == 1


def test_observed_ip_never_names_a_relay():
    assert observed_ip("/ip4/203.0.113.5/tcp/4001") == "203.0.113.5"
    assert observed_ip("/ip6/::1/tcp/4001") == "::1"
    relayed = "/ip4/198.51.100.1/tcp/31337/p2p/12D3KooWNXBJGqQjDuk11fxCLJdxRyzdZAh9imdWksGX7ZHaAFaR/p2p-circuit"
    assert observed_ip(relayed) is None
    assert observed_ip("not a multiaddr") is None


def test_buckets_refill_and_stay_bounded():
    buckets = _Buckets(burst=2, every_s=5.0, max_keys=3)
    assert [buckets.take("a", 0.0), buckets.take("a", 0.0)] == [0.0, 0.0]
    assert buckets.take("a", 0.0) == pytest.approx(5.0)
    assert buckets.take("a", 5.0) == 0.0  # one token earned back
    for key in "bcde":
        buckets.take(key, 6.0)
    assert len(buckets._state) == 3
