"""The hivemind-facing network layer on real nodes (127.0.0.1, port 0): SwarmNode, discovery records, RPC.

Nodes are started once per module on one event loop that runs in a background thread (no pytest-asyncio);
every node and the stock `hivemind-dht` process are shut down in `finally` blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import msgpack
import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from p2p_diloco.net.discovery.records import (
    PEER_RECORD_DOMAIN,
    PeerRecordValidator,
    _key_id,
    announce_peer,
    encode_peer_record,
    fetch_run_spec,
    list_peers,
    peers_key,
    publish_run_spec,
    spec_key,
)
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import NodeConfig, NodeError, SwarmNode, parse_multiaddr
from p2p_diloco.wire.identity import Identity, sign_blob

pytestmark = pytest.mark.timeout(120)

RUN = "test-run"
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
MiB = 1024 * 1024


def _identity(tmp_path_factory, name: str) -> tuple[Identity, str]:
    path = str(tmp_path_factory.mktemp("keys") / f"{name}.key")
    identity = Identity.generate()
    identity.save(path)
    return identity, path


async def _start(path: str, initial_peers: tuple[str, ...] = (), **overrides: Any) -> SwarmNode:
    config = NodeConfig(**{"host_maddrs": LOOPBACK, "initial_peers": initial_peers, "start_timeout_s": 30,
                           **overrides})
    return await SwarmNode.start(path, config, record_validators=[PeerRecordValidator([RUN])])


class Swarm:
    def __init__(self) -> None:
        self.nodes: list[SwarmNode] = []
        self.identities: list[Identity] = []
        self.stats: dict[str, rpc.RpcStats] = {}


@pytest.fixture(scope="module")
def swarm(loop, tmp_path_factory):
    """Three nodes: A (first), B and C bootstrapped from A. A serves the test RPC handlers."""
    s = Swarm()
    try:
        for name in "abc":
            identity, path = _identity(tmp_path_factory, name)
            peers = tuple(s.nodes[0].visible_maddrs()) if s.nodes else ()
            s.nodes.append(loop.run(_start(path, peers)))
            s.identities.append(identity)
        loop.run(_serve_test_handlers(s))
        yield s
    finally:
        for node in s.nodes:
            loop.run(node.shutdown(), timeout_s=30)


# ---------------------------------------------------------------------------------------------- nodes


def test_peer_ids_are_identities_and_maddrs_are_dialable(swarm: Swarm) -> None:
    for node, identity in zip(swarm.nodes, swarm.identities, strict=True):
        assert node.peer_id == identity.peer_id
        assert node.peer_id.startswith("12D3KooW")
        maddrs = node.visible_maddrs()
        assert maddrs and all(m.startswith("/ip4/127.0.0.1/tcp/") and m.endswith(f"/p2p/{node.peer_id}")
                              for m in maddrs)
        assert parse_multiaddr(maddrs[0], require_peer_id=True) == maddrs[0]


def test_shutdown_is_idempotent_and_bounded(loop, tmp_path_factory) -> None:
    _, path = _identity(tmp_path_factory, "short-lived")
    node = loop.run(_start(path))
    started = time.monotonic()
    loop.run(node.shutdown())
    loop.run(node.shutdown())
    assert time.monotonic() - started < node.config.shutdown_timeout_s
    assert not node.dht.is_alive()
    with pytest.raises(NodeError, match="shut down"):
        loop.run(node.dht_get("anything", timeout_s=1))


async def _routing_table_peers(_dht: Any, node: Any) -> list[str]:  # runs in the DHT process
    return [peer_id.to_base58() for peer_id in node.protocol.routing_table.peer_id_to_uid]


def _table(loop, node: SwarmNode) -> list[str]:
    async def read() -> list[str]:
        return await asyncio.wrap_future(node.dht.run_coroutine(_routing_table_peers, return_future=True))

    return loop.run(read())


def test_a_restarted_bootstrap_is_met_again(loop, tmp_path_factory) -> None:
    # Kademlia never looks for a node again once it forgot it, and a restarted node knows nobody: without
    # meet_again, a bootstrap that restarts stays empty, and a new peer sent to it finds no run.
    _, boot_path = _identity(tmp_path_factory, "boot")
    _, peer_path = _identity(tmp_path_factory, "peer")
    boot = loop.run(_start(boot_path))
    maddr = boot.visible_maddrs()[0]
    peer = loop.run(_start(peer_path, (maddr,)))
    again = None
    try:
        assert peer.peer_id in _table(loop, boot)
        loop.run(boot.shutdown(), timeout_s=30)
        port = re.search(r"/tcp/(\d+)/", maddr).group(1)
        again = loop.run(_start(boot_path, host_maddrs=(f"/ip4/127.0.0.1/tcp/{port}",)))
        assert again.peer_id == boot.peer_id and _table(loop, again) == []
        met = loop.run(peer.meet_again({boot.peer_id: [maddr]}, timeout_s=10))
        assert met in ([], [boot.peer_id])  # [] if our table still listed it (no request to it failed yet)
        deadline = time.monotonic() + 10
        while peer.peer_id not in _table(loop, again):  # it adds the pinger in a task of its own
            assert time.monotonic() < deadline, "the restarted bootstrap never added the peer that pinged it"
            time.sleep(0.2)
        assert boot.peer_id in _table(loop, peer)
        assert loop.run(peer.meet_again({boot.peer_id: [maddr], peer.peer_id: []}, timeout_s=10)) == []
    finally:
        for node in (peer, again):
            if node is not None:
                loop.run(node.shutdown(), timeout_s=30)


def test_dial_reaches_a_peer_known_only_by_the_addresses_its_record_announces(loop, tmp_path_factory) -> None:
    # A joiner whose entry point died knows the other members only from their DHT records: its daemon holds no
    # address for them ('failed to find any peer in table') until it dials where the records say.
    a = b = None
    try:
        a = loop.run(_start(_identity(tmp_path_factory, "dialler")[1]))
        b = loop.run(_start(_identity(tmp_path_factory, "dialled")[1]))

        def connected() -> set[str]:
            return {info.peer_id.to_base58() for info in loop.run(a.p2p.list_peers())}

        assert b.peer_id not in connected()
        hostile = {b.peer_id: [f"/ip4/127.0.0.1/tcp/{_free_port()}", "not a multiaddr"]}
        assert loop.run(a.dial(hostile, timeout_s=5)) == [] and b.peer_id not in connected()
        assert loop.run(a.dial({b.peer_id: b.visible_maddrs(), a.peer_id: a.visible_maddrs()}, timeout_s=10)) == [
            b.peer_id]
        assert b.peer_id in connected()
    finally:
        for node in (a, b):
            if node is not None:
                loop.run(node.shutdown(), timeout_s=30)


@pytest.mark.parametrize("addr, why", [
    ("ip4/1.2.3.4/tcp/1", "must start with '/'"),
    ("/ip4/1.2.3.4/tcp/99999/p2p/12D3KooWGnTpqbfX2NJGtHVg8BE1L3m8rRmZf1oK7DfFrCqH8ZkF", "not in range"),
    ("/ip4/1.2.3/tcp/1/p2p/12D3KooWGnTpqbfX2NJGtHVg8BE1L3m8rRmZf1oK7DfFrCqH8ZkF", "1.2.3"),
    ("/ip4/1.2.3.4/tcp/31337", "must end with /p2p/<peer id>"),
    ("/ip4/1.2.3.4/tcp/31337/p2p/notapeer", "notapeer"),
    ("", "empty"),
])
def test_bad_bootstrap_multiaddr_says_why(loop, tmp_path_factory, addr: str, why: str) -> None:
    _, path = _identity(tmp_path_factory, "bad-maddr")
    config = NodeConfig(initial_peers=(addr,))
    with pytest.raises(NodeError) as info:
        loop.run(SwarmNode.start(path, config))
    message = str(info.value)
    assert f"bad multiaddr '{addr}'" in message and why in message and "expected e.g. /ip4/" in message


def test_bad_config_and_missing_identity(loop, tmp_path) -> None:
    with pytest.raises(NodeError, match="port 0"):
        NodeConfig(announce_maddrs=("/ip4/1.2.3.4/tcp/0",)).validate()
    with pytest.raises(NodeError, match="must not contain /p2p/"):
        NodeConfig(host_maddrs=("/ip4/0.0.0.0/tcp/0/p2p/12D3KooWGnTpqbfX2NJGtHVg8BE1L3m8rRmZf1oK7DfFrCqH8ZkF",)
                   ).validate()
    with pytest.raises(NodeError, match="force_reachability"):
        NodeConfig(force_reachability="sometimes").validate()
    missing = tmp_path / "nope.key"
    with pytest.raises(NodeError, match="identity file .* not found"):
        loop.run(SwarmNode.start(str(missing), NodeConfig()))
    assert not missing.exists()  # hivemind would have written an RSA key there


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_bootstrap_fails_within_timeout(loop, tmp_path_factory) -> None:
    _, path = _identity(tmp_path_factory, "lonely")
    nobody = Identity.generate().peer_id
    config = NodeConfig(host_maddrs=LOOPBACK, initial_peers=(f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{nobody}",),
                        start_timeout_s=8, start_retries=1)
    started = time.monotonic()
    with pytest.raises(NodeError) as info:
        loop.run(SwarmNode.start(path, config))
    elapsed = time.monotonic() - started
    assert elapsed < config.start_timeout_s + 2
    message = str(info.value)
    assert "could not reach bootstrap peer(s)" in message and "after 2 attempt(s)" in message
    assert "check the address and that the node is running" in message


# ---------------------------------------------------------------------------------------------- discovery


def test_run_spec_publish_and_fetch(loop, swarm: Swarm) -> None:
    a, b, c = swarm.nodes
    spec = {"model": {"n_layer": 2, "n_embd": 64}, "outer_lr": 0.7, "codec": "int8"}
    assert loop.run(fetch_run_spec(c, RUN, timeout_s=10)) is None
    assert loop.run(publish_run_spec(a, RUN, spec, "hash-1", timeout_s=10))
    assert loop.run(fetch_run_spec(b, RUN, timeout_s=10)) == (spec, "hash-1")
    assert loop.run(fetch_run_spec(c, RUN, timeout_s=10)) == (spec, "hash-1")
    # a malformed spec is refused by the validator (regular value that is not {"spec", "spec_hash"})
    assert not loop.run(b.dht_store(spec_key(RUN), b"\x01garbage", get_dht_time() + 1e6, timeout_s=10))
    assert loop.run(fetch_run_spec(c, RUN, timeout_s=10)) == (spec, "hash-1")


def _record(node: SwarmNode, seq: int) -> dict:
    return {"maddrs": node.visible_maddrs(), "version_vector_total": 3 * seq, "seq": seq,
            "samples_per_s": 123.5, "loss": 2.25, "gpu": "none"}


def test_peer_records_announce_and_list(loop, swarm: Swarm) -> None:
    a, b, c = swarm.nodes
    ia, ib, _ = swarm.identities
    assert loop.run(announce_peer(a, RUN, _record(a, 1), ia, ttl_s=60, timeout_s=10))
    assert loop.run(announce_peer(b, RUN, _record(b, 4), ib, ttl_s=60, timeout_s=10))
    peers = loop.run(list_peers(c, RUN, timeout_s=10))
    assert set(peers) == {a.peer_id, b.peer_id}
    rb = peers[b.peer_id]
    assert rb["peer_id"] == b.peer_id and rb["run_id"] == RUN and rb["seq"] == 4 and rb["gpu"] == "none"
    assert rb["maddrs"] == b.visible_maddrs()
    assert rb["expiration_time"] > get_dht_time() + 50
    # a refresh replaces the record (newer expiration wins)
    assert loop.run(announce_peer(b, RUN, _record(b, 5), ib, ttl_s=60, timeout_s=10))
    assert loop.run(list_peers(a, RUN, timeout_s=10))[b.peer_id]["seq"] == 5
    # another run's records are separate
    assert loop.run(list_peers(c, "another-run", timeout_s=10)) == {}
    with pytest.raises(ValueError, match="not this node's"):
        loop.run(announce_peer(a, RUN, _record(a, 1), ib, timeout_s=10))


def _forged_value(signer: Identity, claimed: str, expiration_time: float, **fields: Any) -> list[bytes]:
    record = {"peer_id": claimed, "run_id": RUN, "expiration_time": expiration_time, "seq": 999, **fields}
    record_bytes = msgpack.packb(record, use_bin_type=True)
    return [record_bytes, sign_blob(signer, PEER_RECORD_DOMAIN, record_bytes)]


def test_forged_records_are_rejected_by_the_dht(loop, swarm: Swarm) -> None:
    a, b, c = swarm.nodes
    ia, ib, _ = swarm.identities
    assert loop.run(announce_peer(b, RUN, _record(b, 7), ib, ttl_s=60, timeout_s=10))
    expiration = get_dht_time() + 120  # later than B's own record: it would win if accepted
    # A signs a record claiming to be B, under B's subkey
    forged = _forged_value(ia, b.peer_id, expiration)
    assert not loop.run(a.dht_store(peers_key(RUN), forged, expiration, subkey=b.peer_id, timeout_s=10))
    # A's own valid record, but with the signature tampered with
    good = encode_peer_record(RUN, _record(a, 2), ia, expiration)
    tampered = [good[0], bytes([good[1][0] ^ 1]) + good[1][1:]]
    assert not loop.run(a.dht_store(peers_key(RUN), tampered, expiration, subkey=a.peer_id, timeout_s=10))
    # a validly signed record whose expiration was pushed later than the signed one (replay to stay "alive")
    assert not loop.run(a.dht_store(peers_key(RUN), good, expiration + 30, subkey=a.peer_id, timeout_s=10))
    peers = loop.run(list_peers(c, RUN, timeout_s=10))
    assert peers[b.peer_id]["seq"] == 7 and peers[b.peer_id]["peer_id"] == b.peer_id


def _dht_record(run_id: str, subkey: Any, value: Any, expiration_time: float) -> DHTRecord:
    """A record exactly as hivemind hands it to validators: hashed key, msgpack subkey and value."""
    return DHTRecord(_key_id(peers_key(run_id)), DHTProtocol.serializer.dumps(subkey),
                     MSGPackSerializer.dumps(value), expiration_time)


def test_validator_sees_hashed_keys_and_checks_signer() -> None:
    ia, ib = Identity.generate(), Identity.generate()
    validator = PeerRecordValidator([RUN])
    exp = get_dht_time() + 60
    good = encode_peer_record(RUN, {"seq": 1}, ia, exp)
    assert validator.validate(_dht_record(RUN, ia.peer_id, good, exp))
    assert not validator.validate(_dht_record(RUN, ib.peer_id, good, exp))  # under someone else's subkey
    assert not validator.validate(_dht_record(RUN, ib.peer_id, _forged_value(ia, ib.peer_id, exp), exp))
    assert not validator.validate(_dht_record(RUN, ia.peer_id, good, exp + 1))  # expiration not the signed one
    assert not validator.validate(_dht_record(RUN, None, good, exp))  # a plain value under the peers key
    assert not validator.validate(_dht_record(RUN, ia.peer_id, [b"\xff" * 10, b"x"], exp))
    assert not validator.validate(_dht_record(RUN, ia.peer_id, b"\x00" * 100_000, exp))
    far = get_dht_time() + 10 * 3600
    assert not validator.validate(_dht_record(RUN, ia.peer_id, encode_peer_record(RUN, {}, ia, far), far))
    # the same record replayed into another protected run fails; unprotected keys pass untouched
    other = PeerRecordValidator(["other"])
    assert validator.merge_with(other) and validator.run_ids == {RUN, "other"}
    assert not validator.validate(_dht_record("other", ia.peer_id, good, exp))
    assert PeerRecordValidator([]).validate(_dht_record(RUN, ib.peer_id, good, exp))


# ---------------------------------------------------------------------------------------------- rpc


async def _serve_test_handlers(s: Swarm) -> None:
    p2p = s.nodes[0].p2p

    async def echo(request: bytes, caller: str) -> bytes:
        return caller.encode() + b"|" + request

    async def chunks(request: bytes, caller: str):
        count, size = msgpack.unpackb(request)
        for i in range(count):
            yield bytes([i % 256]) * size

    async def hang(request: bytes, caller: str) -> bytes:
        await asyncio.sleep(3600)
        return b""

    async def boom(request: bytes, caller: str) -> bytes:
        raise ValueError("kaput: " + request.decode())

    for name, handler in [("echo", echo), ("chunks", chunks), ("hang", hang), ("boom", boom)]:
        s.stats[name] = await rpc.serve(p2p, f"{RUN}/{name}", handler, max_request_bytes=MiB, timeout_s=20)


def test_rpc_round_trip_and_remote_error(loop, swarm: Swarm) -> None:
    a, b, _ = swarm.nodes
    reply = loop.run(rpc.call(b.p2p, a.peer_id, f"{RUN}/echo", b"hello", max_response_bytes=1024, timeout_s=10))
    assert reply == b.peer_id.encode() + b"|hello"
    assert loop.run(rpc.call(b.p2p, a.peer_id, f"{RUN}/echo", b"", max_response_bytes=1024, timeout_s=10)) \
        == b.peer_id.encode() + b"|"
    with pytest.raises(rpc.RpcRemoteError) as info:
        loop.run(rpc.call(b.p2p, a.peer_id, f"{RUN}/boom", b"disk full", max_response_bytes=1024, timeout_s=10))
    assert info.value.remote_message == "ValueError: kaput: disk full"
    assert a.peer_id in str(info.value) and "boom" in str(info.value)
    assert swarm.stats["boom"].handler_errors >= 1
    with pytest.raises(rpc.RpcConnectionError, match="could not open"):
        loop.run(rpc.call(b.p2p, a.peer_id, f"{RUN}/missing", b"", max_response_bytes=1024, timeout_s=10))
    with pytest.raises(rpc.RpcError, match="bad peer id"):
        loop.run(rpc.call(b.p2p, "not-a-peer", f"{RUN}/echo", b"", max_response_bytes=1024, timeout_s=10))


def test_rpc_stream_several_megabytes(loop, swarm: Swarm) -> None:
    a, _, c = swarm.nodes
    count, size = 8, MiB

    async def pull() -> list[bytes]:
        stream = rpc.call_stream(c.p2p, a.peer_id, f"{RUN}/chunks", msgpack.packb([count, size]),
                                 max_chunk_bytes=size, max_total_bytes=count * size, timeout_s=10)
        return [chunk async for chunk in stream]

    started = time.monotonic()
    got = loop.run(pull())
    elapsed = time.monotonic() - started
    assert [len(x) for x in got] == [size] * count
    assert all(chunk == bytes([i]) * size for i, chunk in enumerate(got))
    print(f"streamed {count * size / MiB:.0f} MiB in {elapsed:.2f}s ({count * size / MiB / elapsed:.0f} MiB/s)")


def test_rpc_refuses_oversize(loop, swarm: Swarm) -> None:
    a, b, _ = swarm.nodes
    request = msgpack.packb([3, 1000])
    with pytest.raises(rpc.RpcTooLargeError, match="limit is 2000 per chunk"):
        loop.run(rpc.call(b.p2p, a.peer_id, f"{RUN}/chunks", request, max_response_bytes=2000, timeout_s=10))
    with pytest.raises(rpc.RpcTooLargeError):
        loop.run(_drain(rpc.call_stream(b.p2p, a.peer_id, f"{RUN}/chunks", msgpack.packb([2, 5000]),
                                        max_chunk_bytes=4096, max_total_bytes=MiB, timeout_s=10)))
    before = swarm.stats["echo"].rejected_oversize
    with pytest.raises(rpc.RpcRemoteError, match="request too large"):
        loop.run(rpc.call(b.p2p, a.peer_id, f"{RUN}/echo", b"x" * (MiB + 1), max_response_bytes=1024, timeout_s=10))
    assert swarm.stats["echo"].rejected_oversize == before + 1


async def _drain(stream) -> int:
    return sum([len(chunk) async for chunk in stream])


def test_rpc_hanging_handler_times_out_on_the_caller(loop, swarm: Swarm) -> None:
    a, b, _ = swarm.nodes
    started = time.monotonic()
    with pytest.raises(rpc.RpcTimeoutError):
        loop.run(rpc.call(b.p2p, a.peer_id, f"{RUN}/hang", b"", max_response_bytes=1024, timeout_s=1.0))
    assert 0.9 < time.monotonic() - started < 2.0
    # the server is still fine afterwards
    assert loop.run(rpc.call(b.p2p, a.peer_id, f"{RUN}/echo", b"ok", max_response_bytes=1024, timeout_s=10)) \
        .endswith(b"|ok")


# ---------------------------------------------------------------------------------------------- stock bootstrap


@contextlib.contextmanager
def stock_hivemind_dht():
    """A stock `hivemind-dht` process on loopback; yields its printed multiaddr; killed in finally."""
    cli = os.path.join(os.path.dirname(sys.executable), "hivemind-dht")
    proc = subprocess.Popen([cli, "--host_maddrs", "/ip4/127.0.0.1/tcp/0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        maddr = None
        deadline = time.monotonic() + 60
        while maddr is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            found = re.search(r"--initial_peers (\S+)", line)
            maddr = found.group(1) if found else None
        assert maddr, "hivemind-dht did not print its multiaddr"
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe from filling up
        yield maddr
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_stock_hivemind_dht_as_bootstrap(loop, tmp_path_factory) -> None:
    with stock_hivemind_dht() as bootstrap:
        nodes: list[SwarmNode] = []
        try:
            (id_d, path_d), (_, path_e) = _identity(tmp_path_factory, "d"), _identity(tmp_path_factory, "e")
            config = NodeConfig(host_maddrs=LOOPBACK, initial_peers=(bootstrap,), start_timeout_s=30)
            nodes.append(d := loop.run(SwarmNode.start(path_d, config)))  # validator added below, after start
            nodes.append(e := loop.run(_start(path_e, (bootstrap,), client_mode=True)))
            loop.run(d.add_record_validators([PeerRecordValidator([RUN])]))
            assert loop.run(announce_peer(d, RUN, _record(d, 1), id_d, timeout_s=10))
            assert loop.run(publish_run_spec(d, RUN, {"x": 1}, "h", timeout_s=10))
            assert set(loop.run(list_peers(e, RUN, timeout_s=10))) == {d.peer_id}
            assert loop.run(fetch_run_spec(e, RUN, timeout_s=10)) == ({"x": 1}, "h")
            # The stock node has no validator: it keeps a forged record that D's own storage refuses. Readers
            # with the validator reject it when they read it back; list_peers would drop it anyway.
            exp = get_dht_time() + 120
            loop.run(d.dht_store(peers_key(RUN), _forged_value(id_d, e.peer_id, exp), exp, subkey=e.peer_id,
                                 timeout_s=10))
            for reader in (d, e):
                # Whether the raw read still shows the forged subkey depends on which node answers first (the
                # stock node keeps it): the guarantees are that the real record stays readable and that
                # list_peers never returns the forged one.
                found = loop.run(reader.dht_get(peers_key(RUN), timeout_s=10))
                assert found is not None and d.peer_id in found.value
                assert set(loop.run(list_peers(reader, RUN, timeout_s=10))) == {d.peer_id}
            # a client-mode node serves no DHT requests but still serves our streams
            loop.run(rpc.serve(e.p2p, f"{RUN}/ping", _pong, max_request_bytes=16, timeout_s=5))
            assert loop.run(rpc.call(d.p2p, e.peer_id, f"{RUN}/ping", b"", max_response_bytes=16, timeout_s=10)) \
                == b"pong"
        finally:
            for node in nodes:
                loop.run(node.shutdown(), timeout_s=30)


async def _pong(request: bytes, caller: str) -> bytes:
    return b"pong"


# ---------------------------------------------------------------------------------------------- hostile streams


async def _trickle(request: bytes, caller: str):
    """A handler that never ends: 100 bytes every 0.4 s, each step well within the per-read timeout."""
    while True:
        await asyncio.sleep(0.4)
        yield b"x" * 100


def test_rpc_never_ending_slow_stream_is_cut_by_the_pace(loop, swarm: Swarm) -> None:
    a, b, _ = swarm.nodes
    loop.run(rpc.serve(a.p2p, f"{RUN}/trickle", _trickle, max_request_bytes=16, timeout_s=1.0))

    async def read(min_bytes_per_s: float, stop_after_s: float) -> tuple[int, float]:
        started, received = time.monotonic(), 0
        stream = rpc.call_stream(b.p2p, a.peer_id, f"{RUN}/trickle", b"", max_chunk_bytes=1000,
                                 max_total_bytes=1 << 20, timeout_s=1.0, min_bytes_per_s=min_bytes_per_s)
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                received += len(chunk)
                if time.monotonic() - started > stop_after_s:
                    break
        return received, time.monotonic() - started

    # Without a pace, no read ever times out: the stream would go on for as long as we listen.
    received, elapsed = loop.run(read(0.0, stop_after_s=2.5))
    assert elapsed >= 2.5 and received >= 500
    # With one, it is cut soon after the grace (one timeout): 250 B/s is under the 1000 B/s asked for.
    started = time.monotonic()
    with pytest.raises(rpc.RpcSlowError, match="sent too slowly"):
        loop.run(read(1000.0, stop_after_s=60))
    assert time.monotonic() - started < 2.5


class _RefusingGuard:
    """A guard that refuses one caller and records what the RPC layer reports."""

    def __init__(self, refused: str) -> None:
        self.refused, self.rejects, self.admitted, self.released = refused, [], 0, 0

    async def admit(self, caller: str, handler: str, request_bytes: int) -> str | None:
        if caller == self.refused:
            return "not allowed in this run: PeerID not in allow list"
        self.admitted += 1
        return None

    def release(self, caller: str) -> None:
        self.released += 1

    def charge_out(self, caller: str, nbytes: int) -> None:
        pass

    def on_reject(self, caller: str, counter: str) -> None:
        self.rejects.append(counter)

    def is_contributor(self, caller: str) -> bool:
        return True


def test_rpc_guard_refuses_before_reading_and_hears_every_refusal(loop, swarm: Swarm) -> None:
    a, b, c = swarm.nodes
    guard = _RefusingGuard(refused=c.peer_id)
    stats = loop.run(rpc.serve(a.p2p, f"{RUN}/guarded", _pong, max_request_bytes=64, timeout_s=5, guard=guard))
    with pytest.raises(rpc.RpcRemoteError, match="not allowed in this run: PeerID not in allow list"):
        loop.run(rpc.call(c.p2p, a.peer_id, f"{RUN}/guarded", b"x" * 60, max_response_bytes=16, timeout_s=10))
    assert loop.run(rpc.call(b.p2p, a.peer_id, f"{RUN}/guarded", b"", max_response_bytes=16, timeout_s=10)) \
        == b"pong"
    with pytest.raises(rpc.RpcRemoteError, match="request too large"):
        loop.run(rpc.call(b.p2p, a.peer_id, f"{RUN}/guarded", b"x" * 65, max_response_bytes=16, timeout_s=10))
    assert stats.rejected_policy == 1 and stats.rejected_oversize == 1 and stats.ok == 1
    assert guard.rejects == ["rejected_oversize"]  # its own refusal it counts itself
    assert guard.admitted == guard.released == 1
