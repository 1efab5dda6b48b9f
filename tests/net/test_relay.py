"""Streams forwarded by a relay (net/transport/relay.py), on loopback: three real nodes, the first the relay
(the others' bootstrap). On loopback every peer can be dialed, so the caller is told that the target cannot
(`mark_private`), as a NATed target's record tells it; tests/peer/test_nat.py runs the real thing behind NATs."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from hivemind.p2p import PeerID

from p2p_diloco.net.transport import relay, rpc
from p2p_diloco.net.transport.framing import DATA, ERROR, read_header, read_payload, write_frame
from p2p_diloco.net.transport.relay import RelayServer

ECHO = "p2p-diloco/test/echo-caller"


@pytest.fixture(scope="module")
def relayed(loop, members):
    boot, caller, target = members
    server = RelayServer(boot.node.p2p)

    async def echo_caller(request: bytes, who: str) -> bytes:
        return who.encode() + b"|" + request

    async def big(request: bytes, who: str):
        for _ in range(8):
            yield b"x" * (1 << 20)

    async def setup() -> None:
        await server.start()
        await rpc.serve(target.node.p2p, ECHO, echo_caller, max_request_bytes=1 << 16, timeout_s=10)
        await rpc.serve(target.node.p2p, ECHO + "/big", big, max_request_bytes=64, timeout_s=10)

    loop.run(setup())
    yield boot, caller, target, server
    loop.run(server.stop())


def test_relay_is_the_callers_bootstrap(members) -> None:
    boot, caller, target = members
    assert relay.routes(caller.node.p2p).relays == [boot.node.peer_id]
    assert relay.trusted_forwarders(target.node.p2p) == frozenset({boot.node.peer_id})


def test_a_call_to_a_private_peer_goes_through_the_relay_and_names_the_real_caller(loop, relayed) -> None:
    boot, caller, target, server = relayed
    relay.mark_private(caller.node.p2p, target.node.peer_id)
    before, opens = server.stats.forwarded, relay.routes(caller.node.p2p).relayed_opens
    answer = loop.run(rpc.call(caller.node.p2p, target.node.peer_id, ECHO, b"hello", max_response_bytes=256,
                               timeout_s=10))
    assert answer == caller.node.peer_id.encode() + b"|hello"  # the target saw the caller, not the relay
    assert server.stats.forwarded == before + 1
    assert relay.routes(caller.node.p2p).relayed_opens == opens + 1


def test_a_streamed_response_of_megabytes_comes_through_whole(loop, relayed) -> None:
    boot, caller, target, server = relayed
    relay.mark_private(caller.node.p2p, target.node.peer_id)

    async def pull() -> int:
        total = 0
        async for chunk in rpc.call_stream(caller.node.p2p, target.node.peer_id, ECHO + "/big", b"",
                                           max_chunk_bytes=2 << 20, max_total_bytes=16 << 20, timeout_s=10):
            total += len(chunk)
        return total

    assert loop.run(pull()) == 8 << 20
    assert loop.run(_wait_idle(server)) == 0  # both directions closed after the response


async def _wait_idle(server: RelayServer) -> int:
    for _ in range(100):
        if server.stats.active == 0:
            break
        await asyncio.sleep(0.05)
    return server.stats.active


def test_the_relay_says_when_it_cannot_reach_the_target(loop, relayed) -> None:
    boot, caller, target, server = relayed
    unknown = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"

    async def ask() -> tuple[int, bytes]:
        reader, writer = await relay._through(caller.node.p2p, boot.node.peer_id, unknown, ECHO, 10)
        try:
            kind, length = await read_header(reader, 10)
            return kind, await read_payload(reader, length, 10)
        finally:
            writer.close()

    kind, message = loop.run(ask(), timeout_s=30)
    assert kind == ERROR and b"could not reach" in message


@pytest.mark.parametrize("request_", [{"t": "x", "p": "other/proto"}, {"t": "x", "p": relay.RELAY_PROTOCOL}])
def test_the_relay_forwards_only_our_protocols_and_never_to_itself(loop, relayed, request_) -> None:
    boot, caller, target, server = relayed

    request = msgpack.packb({**request_, "t": target.node.peer_id})
    kind, message = loop.run(_one_frame(caller, boot.node.peer_id, relay.RELAY_PROTOCOL, DATA, request))
    assert kind == ERROR and b"bad target or protocol" in message


def test_a_forwarded_frame_from_a_peer_that_is_no_relay_is_refused(loop, relayed) -> None:
    """Only the target's bootstraps may name another caller: anyone else sending FORWARDED is malformed."""
    boot, caller, target, server = relayed

    kind, message = loop.run(_one_frame(caller, target.node.peer_id, ECHO, relay.FORWARDED,
                                        boot.node.peer_id.encode()))
    assert kind == ERROR and b"malformed request" in message


async def _one_frame(member, peer_id: str, protocol: str, kind: int, payload: bytes) -> tuple[int, bytes]:
    """Open `protocol` on `peer_id` straight (no relay), send one raw frame, return the first frame back."""
    _, reader, writer = await member.node.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), protocol)
    try:
        await write_frame(writer, kind, payload, 10)
        got, length = await read_header(reader, 10)
        return got, await read_payload(reader, length, 10)
    finally:
        writer.close()
