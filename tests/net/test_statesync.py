"""State sync on real SwarmNodes (127.0.0.1, port 0): a joiner fetches a verified snapshot from donors.

Faults are injected by subclassing the server (hivemind's FaultyAverager style): a donor that corrupts a chunk,
signs with the wrong key, or skips its own checks and offers a model of another size. Each must be dropped
and the next donor used; the standard assertion is that the joiner ends with exactly the donor's (theta, V).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from enum import Enum
from typing import Any

import msgpack
import pytest
import torch

from p2p_diloco.config import preset
from p2p_diloco.net.statesync.client import StateSyncConfig, StateSyncError, fetch_snapshot
from p2p_diloco.net.statesync.manifest import MANIFEST_DOMAIN, DonorError, parse_manifest
from p2p_diloco.net.statesync.server import SnapshotServer
from p2p_diloco.net.transport import rpc
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.identity import Identity, sign_blob
from tests.helpers.net import LoopThread, Member

pytestmark = pytest.mark.timeout(120)

SPEC = dataclasses.replace(preset("test"), run_id="statesync-test")
SPEC_HASH = SPEC.spec_hash()
NUMEL = 10_003  # 40_012 bytes: 10 chunks of 4096 bytes, the last one short
CONFIG = StateSyncConfig(chunk_bytes=4096, parallel_chunks=3, timeout_s=5.0)


def _replica(seed: int, numel: int = NUMEL) -> Replica:
    """A donor's replica: some theta, and a vector that says it merged a few updates."""
    theta = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    senders = [Identity.generate().peer_id for _ in range(3)]
    vv = VersionVector({s: seed + i + 1 for i, s in enumerate(senders)})
    return Replica(theta, outer_lr=SPEC.outer.outer_lr, max_weight=SPEC.outer.max_weight,
                   codec=get_codec(SPEC.outer.codec, SPEC.outer.codec_block), version_vector=vv)


class Fault(Enum):
    NONE = "none"
    CORRUPT_CHUNK = "corrupt_chunk"  # flips one byte of chunk 1 (its digest no longer matches)
    BAD_SIGNATURE = "bad_signature"  # signs the manifest with a key that is not the donor's
    SKIP_CHECKS = "skip_checks"  # serves a joiner of another model size instead of refusing it
    NONFINITE = "nonfinite"  # a snapshot with a NaN in it, correctly signed and digested


class FaultySnapshotServer(SnapshotServer):
    def __init__(self, *args: Any, fault: Fault, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fault = fault

    def _read_chunk(self, snapshot, index: int) -> bytes:
        chunk = super()._read_chunk(snapshot, index)
        if self.fault is Fault.CORRUPT_CHUNK and index == 1:
            chunk = bytes([chunk[0] ^ 0x40]) + chunk[1:]
        return chunk

    def _sign(self, manifest_bytes: bytes) -> bytes:
        if self.fault is Fault.BAD_SIGNATURE:
            return sign_blob(Identity.generate(), MANIFEST_DOMAIN, manifest_bytes)
        return super()._sign(manifest_bytes)

    def _state(self) -> tuple[torch.Tensor, VersionVector]:
        theta, vv = super()._state()
        if self.fault is Fault.NONFINITE:
            theta[NUMEL - 1] = float("nan")  # in the last, short chunk
        return theta, vv

    def _check_request(self, message: Any) -> None:
        if self.fault is not Fault.SKIP_CHECKS:
            super()._check_request(message)


@contextlib.contextmanager
def serving(loop: LoopThread, member: Member, replica: Replica, fault: Fault = Fault.NONE,
            config: StateSyncConfig = CONFIG) -> Iterator[SnapshotServer]:
    server = FaultySnapshotServer(member.node, SPEC.run_id, SPEC_HASH, replica, member.identity, config, fault=fault)
    loop.run(server.start())
    try:
        yield server
    finally:
        loop.run(server.stop())


def fetch(loop: LoopThread, joiner: Member, donors: list[Member], numel: int = NUMEL):
    return loop.run(fetch_snapshot(joiner.node, SPEC.run_id, SPEC_HASH, [d.node.peer_id for d in donors], numel,
                                   CONFIG))


def assert_same_state(theta: torch.Tensor, vv: VersionVector, replica: Replica) -> None:
    assert torch.equal(theta, replica.theta) and vv == replica.version_vector


# ---------------------------------------------------------------------------------------------- tests


def test_a_fresh_node_fetches_the_donors_state(loop, members) -> None:
    joiner, a, _ = members
    donor_replica = _replica(seed=1)
    with serving(loop, a, donor_replica) as server:
        theta, vv, donor = fetch(loop, joiner, [a])
        assert donor == a.node.peer_id
        assert_same_state(theta, vv, donor_replica)
        assert server.stats["chunks_served"] == 10 and server.stats["snapshots_taken"] == 1
        # The joiner loads it; its replica now equals the donor's.
        mine = _replica(seed=99)
        mine.load(theta, vv)
        assert_same_state(mine.theta, mine.version_vector, donor_replica)
        # A second joiner soon after shares the same snapshot (no second copy and hash of theta).
        fetch(loop, joiner, [a])
        assert server.stats["snapshots_taken"] == 1 and server.stats["manifests_served"] == 2


@pytest.mark.parametrize("fault, why", [
    (Fault.CORRUPT_CHUNK, "chunk 1 does not match its digest"),
    (Fault.BAD_SIGNATURE, "bad manifest signature"),
    (Fault.SKIP_CHECKS, "numel 10007, ours is 10003"),
    (Fault.NONFINITE, "chunk 9 has non-finite values"),
])
def test_a_faulty_donor_is_dropped_and_the_next_one_used(loop, members, fault: Fault, why: str) -> None:
    joiner, a, b = members
    good = _replica(seed=2)
    bad = _replica(seed=3, numel=NUMEL + 4) if fault is Fault.SKIP_CHECKS else _replica(seed=3)
    with serving(loop, a, bad, fault), serving(loop, b, good):
        theta, vv, donor = fetch(loop, joiner, [a, b])
        assert donor == b.node.peer_id
        assert_same_state(theta, vv, good)
        with pytest.raises(StateSyncError, match=why) as info:
            fetch(loop, joiner, [a])
        assert a.node.peer_id in str(info.value)


def test_an_honest_donor_refuses_another_model_and_says_why(loop, members) -> None:
    joiner, a, _ = members
    with serving(loop, a, _replica(seed=4)):
        with pytest.raises(StateSyncError, match="this donor's model has 10003 parameters, you asked for 10000"):
            fetch(loop, joiner, [a], numel=10_000)
        with pytest.raises(StateSyncError, match="no donor to fetch"):
            fetch(loop, joiner, [joiner])  # ourselves only
        with pytest.raises(StateSyncError, match="could not open"):
            loop.run(fetch_snapshot(joiner.node, "another-run", SPEC_HASH, [a.node.peer_id], NUMEL, CONFIG))


def test_snapshots_stay_consistent_and_the_cache_is_bounded(loop, members) -> None:
    joiner, a, _ = members
    replica = _replica(seed=5)
    config = dataclasses.replace(CONFIG, snapshot_reuse_s=0.0, snapshot_ttl_s=0.5)
    request = msgpack.packb({"run_id": SPEC.run_id, "spec_hash": SPEC_HASH, "numel": NUMEL})

    def manifest(server: SnapshotServer):
        response = loop.run(server.rpc_manifest(request, joiner.node.peer_id))
        return parse_manifest(response, donor=a.node.peer_id, run_id=SPEC.run_id, spec_hash=SPEC_HASH,
                              numel=NUMEL, max_manifest_bytes=config.max_manifest_bytes)

    def chunk(server: SnapshotServer, snapshot_id: str, index: int) -> bytes:
        return loop.run(server.rpc_chunk(msgpack.packb({"snapshot_id": snapshot_id, "index": index}), "j"))

    with serving(loop, a, replica, config=config) as server:
        first = manifest(server)
        old_theta = replica.theta.clone()
        assert manifest(server).snapshot_id == first.snapshot_id  # replica unchanged: same snapshot
        # The replica moves on; chunks of the first manifest still come from the first snapshot.
        replica.load(old_theta + 1.0, replica.version_vector.advanced(Identity.generate().peer_id, 1))
        second = manifest(server)
        assert second.snapshot_id != first.snapshot_id and second.version_vector == replica.version_vector
        assert chunk(server, first.snapshot_id, 0) == old_theta.numpy().tobytes()[:4096]
        assert chunk(server, second.snapshot_id, 0) == replica.theta.numpy().tobytes()[:4096]
        # At most two snapshots: a third evicts the first.
        replica.load(old_theta - 1.0, replica.version_vector.advanced(Identity.generate().peer_id, 1))
        manifest(server)
        with pytest.raises(rpc.RpcError, match="expired or unknown"):
            chunk(server, first.snapshot_id, 0)
        chunk(server, second.snapshot_id, 9)
        with pytest.raises(rpc.RpcError, match="out of range"):
            chunk(server, second.snapshot_id, 10)
        time.sleep(0.6)  # snapshot_ttl_s after their last use, all are dropped
        with pytest.raises(rpc.RpcError, match="expired or unknown"):
            chunk(server, second.snapshot_id, 0)


def test_parse_manifest_refuses_what_does_not_add_up() -> None:
    donor = Identity.generate()
    base = {"run_id": SPEC.run_id, "spec_hash": SPEC_HASH, "donor": donor.peer_id, "snapshot_id": "s1",
            "created_at": 1.0, "numel": 10, "dtype": "float32", "chunk_bytes": 16, "version_vector": {},
            "chunk_digests": [b"\x00" * 32] * 3}

    def signed(**changes: Any) -> bytes:
        m = msgpack.packb({**base, **changes}, use_bin_type=True)
        return msgpack.packb({"m": m, "s": sign_blob(donor, MANIFEST_DOMAIN, m)}, use_bin_type=True)

    def parse(response: bytes, numel: int = 10) -> Any:
        return parse_manifest(response, donor=donor.peer_id, run_id=SPEC.run_id, spec_hash=SPEC_HASH, numel=numel,
                              max_manifest_bytes=4096)

    assert parse(signed()).chunk_bytes == 16
    for changes, why in [({"chunk_digests": [b"\x00" * 32] * 2}, "2 chunk digests, 3 expected"),
                         ({"chunk_bytes": 0}, "chunk_bytes"), ({"chunk_bytes": 1 << 40}, "chunk_bytes"),
                         ({"dtype": "float16"}, "dtype"), ({"run_id": "other"}, "run"),
                         ({"spec_hash": "0" * 64}, "spec hash"), ({"donor": Identity.generate().peer_id}, "donor"),
                         ({"version_vector": {"x": -1}}, "version vector"), ({"numel": 10.0}, "numel")]:
        with pytest.raises(DonorError, match=why):
            parse(signed(**changes))
    with pytest.raises(DonorError, match="numel 10, ours is 11"):
        parse(signed(), numel=11)
    with pytest.raises(DonorError, match="bad manifest signature"):
        parse(msgpack.packb({"m": msgpack.packb(base), "s": b"\x00" * 64}))
    for garbage in (b"\xc1", b"", msgpack.packb([1, 2]), b"\x00" * 5000):
        with pytest.raises(DonorError):
            parse(garbage)


def test_a_donor_that_serves_a_bad_chunk_is_counted_penalized_and_skipped(loop, members) -> None:
    """With the peer's guard: the hostile donor's bad chunk is counted against it (bad_chunk) and it is
    penalized, so the next sync does not even ask it; the honest donor serves both times."""
    from p2p_diloco.net.admission.guard import PeerGuard
    from p2p_diloco.net.admission.policy import RateLimitConfig

    joiner, a, b = members
    guard = PeerGuard(SPEC.run_id, self_id=joiner.node.peer_id, limits=RateLimitConfig(penalty_s=60))
    good = _replica(seed=6)
    with serving(loop, a, _replica(seed=7), Fault.CORRUPT_CHUNK) as hostile, serving(loop, b, good):
        for _ in range(2):
            theta, vv, donor = loop.run(fetch_snapshot(joiner.node, SPEC.run_id, SPEC_HASH,
                                                       [a.node.peer_id, b.node.peer_id], NUMEL, CONFIG, guard=guard))
            assert donor == b.node.peer_id
            assert_same_state(theta, vv, good)
        assert guard.rejections.of(a.node.peer_id) == {"bad_chunk": 1} and guard.is_penalized(a.node.peer_id)
        assert hostile.stats["manifests_served"] == 1  # asked once, then skipped
        with pytest.raises(StateSyncError, match="skipped \\(penalized\\)"):
            loop.run(fetch_snapshot(joiner.node, SPEC.run_id, SPEC_HASH, [a.node.peer_id], NUMEL, CONFIG,
                                    guard=guard))


def test_a_busy_donor_is_waited_for_and_another_refusal_is_not(loop, members, monkeypatch) -> None:
    """A joiner is a newcomer to every donor: a chunk refused as busy (the newcomers' uplink share is spent) is
    asked again with backoff; any other refusal drops the donor at once."""
    import p2p_diloco.net.statesync.client as client

    joiner, a, _ = members
    calls = {"busy": 0, "no": 0}

    async def busy_twice(request: bytes, caller: str) -> bytes:
        calls["busy"] += 1
        if calls["busy"] <= 2:
            raise rpc.RpcError("busy: the newcomers' share of this peer's uplink is in use")
        return b"chunk"

    async def refuse(request: bytes, caller: str) -> bytes:
        calls["no"] += 1
        raise rpc.RpcError("refused: not a member")

    loop.run(rpc.serve(a.node.p2p, "p2p-diloco/test/busy-chunk", busy_twice, max_request_bytes=64, timeout_s=5))
    loop.run(rpc.serve(a.node.p2p, "p2p-diloco/test/refused-chunk", refuse, max_request_bytes=64, timeout_s=5))
    config = StateSyncConfig(timeout_s=5)
    got = loop.run(client._call_with_retries(joiner.node, a.node.peer_id, "p2p-diloco/test/busy-chunk", b"", 64,
                                             config))
    assert got == b"chunk" and calls["busy"] == 3
    with pytest.raises(rpc.RpcRemoteError, match="not a member"):
        loop.run(client._call_with_retries(joiner.node, a.node.peer_id, "p2p-diloco/test/refused-chunk", b"", 64,
                                           config))
    assert calls["no"] == 1
    monkeypatch.setattr(client, "BUSY_WAIT_S", 0.0)  # past the wait, busy drops the donor too
    calls["busy"] = 0
    with pytest.raises(rpc.RpcRemoteError, match="busy"):
        loop.run(client._call_with_retries(joiner.node, a.node.peer_id, "p2p-diloco/test/busy-chunk", b"", 64,
                                           config))
