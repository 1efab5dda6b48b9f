"""A hostile peer for the tests (README "Hostile peers and closed runs"). It speaks the real protocol over
loopback: a hivemind node with its own Ed25519 identity, serving the run's `pull` (and `manifest`/`chunk`) streams
with hand-made frames, calling honest peers' `announce` and `hello`, and writing DHT records, valid and forged.

What it can send is everything an attacker on the internet can: crafted envelopes (`forged_signature`,
`wrong_peer_id`, `equivocation`, `wrong_run`, `wrong_shape`, `nonfinite`, `huge_norm`, `oversized`,
`truncated`, `malformed`, `bomb`), replays of honest updates, a never-ending slow stream, floods of
announces, a poisoned snapshot, and forged peer records. Updates are signed by throwaway identities (`signer`)
so that a ban of one signer does not hide the next attack; the transport identity (`peer_id`) stays the same.

Delivery of updates: `push(frames, peers)` makes the next pull from us answer `frames` and announces to
`peers` a vector naming a sender they lack, so each of them pulls from us at once (gossip's own rule).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import struct
import time
from typing import Any

import msgpack
import torch

from p2p_diloco.config import RunSpec
from p2p_diloco.net.admission.hello import hello_name
from p2p_diloco.net.discovery.records import (
    PEER_RECORD_DOMAIN,
    announce_peer,
    fetch_run_spec,
    peers_key,
)
from p2p_diloco.net.gossip.service import encode_request
from p2p_diloco.net.statesync.client import StateSyncConfig
from p2p_diloco.net.statesync.server import SnapshotServer
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import SwarmNode
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import (
    UPDATE_DOMAIN,
    OuterUpdate,
    UpdateHeader,
    encode_update,
    make_update,
    sign_blob,
)
from p2p_diloco.wire.identity import Identity

FRAME = struct.Struct(">BI")  # net/transport/rpc.py's framing: kind, length
DATA, END = 0, 1
SLOW_STREAM_MAX_S = 120.0


class PoisonedSnapshotServer(SnapshotServer):
    """A donor with a correctly signed manifest whose chunk 0 does not match its digest."""

    def _read_chunk(self, snapshot: Any, index: int) -> bytes:
        chunk = super()._read_chunk(snapshot, index)
        return bytes([chunk[0] ^ 0xFF]) + chunk[1:] if index == 0 else chunk


class HostilePeer:
    """See the module docstring. Create with `await HostilePeer.start(node, identity, run_id)`; `await stop()`."""

    def __init__(self, node: SwarmNode, identity: Identity, spec: RunSpec, numel: int) -> None:
        self.node, self.identity, self.spec, self.numel = node, identity, spec, numel
        self.peer_id = node.peer_id
        self.spec_hash = spec.spec_hash()
        self.codec = get_codec(spec.outer.codec, spec.outer.codec_block)
        self.pull_name = f"p2p-diloco/{spec.run_id}/pull"
        self.announce_name = f"p2p-diloco/{spec.run_id}/announce"
        self.frames: list[bytes] = []  # what the next pull from us gets
        self.slow_interval_s: float | None = None  # set: repeat `frames` forever, one per interval
        self.streams: list[dict] = []  # one entry per pull served: caller, frames sent, seconds, how it ended
        self.snapshot_server: SnapshotServer | None = None
        self._generator = torch.Generator().manual_seed(1234)

    @classmethod
    async def start(cls, node: SwarmNode, identity: Identity, run_id: str, timeout_s: float = 30.0) -> HostilePeer:
        """Read the run's spec from the DHT (as any joiner does; waiting until the first peer published it) and
        serve our hand-made pull and announce handlers."""
        deadline = time.monotonic() + timeout_s
        while (found := await fetch_run_spec(node, run_id, timeout_s=timeout_s)) is None:
            assert time.monotonic() < deadline, f"no spec for run {run_id!r} on the DHT after {timeout_s:g}s"
            await asyncio.sleep(0.5)
        spec = RunSpec.from_dict(found[0])
        assert spec.spec_hash() == found[1]
        from p2p_diloco.train.models.build import build_model, flat_params

        numel = flat_params(build_model(spec.model, spec.seed)).numel()
        peer = cls(node, identity, spec, numel)
        await node.p2p.add_binary_stream_handler(peer.pull_name, peer._on_pull)
        await node.p2p.add_binary_stream_handler(peer.announce_name, peer._on_announce)
        return peer

    async def stop(self) -> None:
        for name in (self.pull_name, self.announce_name):
            try:
                await rpc.unserve(self.node.p2p, name)
            except Exception:  # the node may be down already
                pass
        if self.snapshot_server is not None:
            await self.snapshot_server.stop()

    # ---- crafted updates ----------------------------------------------------------------------------------

    @staticmethod
    def signer() -> Identity:
        return Identity.generate()

    def update(self, signer: Identity | None = None, *, seq: int = 1, scale: float = 1e-4, numel: int | None = None,
               run_id: str | None = None, payload: bytes | None = None) -> OuterUpdate:
        """A correctly signed update (by a fresh signer unless given) of small random values."""
        numel = self.numel if numel is None else numel
        if payload is None:
            payload = self.codec.compress(scale * torch.randn(numel, generator=self._generator))
        return make_update(run_id=run_id or self.spec.run_id, spec_hash=self.spec_hash, seq=seq, tau=0, samples=8,
                           weight=0.5, codec=self.codec.name, numel=numel, payload=payload,
                           identity=signer or self.signer())

    def forged_signature(self) -> bytes:
        u = self.update()
        return encode_update(dataclasses.replace(u, signature=bytes([u.signature[0] ^ 1]) + u.signature[1:]))

    def wrong_peer_id(self, victim: str) -> bytes:
        """A header naming `victim` as sender, validly signed by a key that is not the victim's."""
        u = self.update()
        header = dataclasses.replace(u.header, sender=victim)
        header_bytes = msgpack.packb(header.to_list(), use_bin_type=True)
        signed = OuterUpdate(header, header_bytes, sign_blob(self.signer(), UPDATE_DOMAIN, header_bytes), u.payload)
        return encode_update(signed)

    def equivocation(self, seq: int = 2) -> tuple[bytes, bytes, str]:
        """Two different updates of one signer for one seq (above 1: both wait in the buffer, none merges)."""
        signer = self.signer()
        first, second = self.update(signer, seq=seq), self.update(signer, seq=seq)
        return encode_update(first), encode_update(second), signer.peer_id

    def wrong_run(self) -> bytes:
        return encode_update(self.update(run_id=self.spec.run_id + "-other"))

    def wrong_shape(self) -> bytes:
        return encode_update(self.update(numel=self.numel + 7))

    def nonfinite(self) -> bytes:
        """A signed payload whose first block scale is NaN (it decodes to NaN)."""
        payload = bytearray(self.codec.compress(1e-4 * torch.randn(self.numel, generator=self._generator)))
        payload[:4] = struct.pack("<f", math.nan)
        return encode_update(self.update(payload=bytes(payload)))

    def huge_norm(self) -> bytes:
        """Finite, correctly signed and shaped, a billion times larger than any honest update."""
        return encode_update(self.update(scale=1e6))

    def oversized(self, max_bytes: int) -> bytes:
        return b"\x00" * (max_bytes + 4096)

    def truncated(self) -> bytes:
        data = encode_update(self.update())
        return data[: len(data) // 2]

    @staticmethod
    def malformed() -> bytes:
        return hashlib.sha256(b"garbage").digest() * 8

    def bomb(self) -> bytes:
        """A tiny, validly signed update declaring 2**40 values: nothing may be allocated from that number."""
        signer = self.signer()
        payload = b"\x00" * 64
        header = UpdateHeader(run_id=self.spec.run_id, spec_hash=self.spec_hash, sender=signer.peer_id, seq=1, tau=0,
                              samples=8, weight=0.5, codec=self.codec.name, numel=1 << 40, payload_len=len(payload),
                              payload_digest=hashlib.sha256(payload).digest(), created_at=time.time())
        header_bytes = msgpack.packb(header.to_list(), use_bin_type=True)
        return encode_update(OuterUpdate(header, header_bytes, sign_blob(signer, UPDATE_DOMAIN, header_bytes),
                                         payload))

    # ---- delivery -----------------------------------------------------------------------------------------

    async def push(self, frames: list[bytes], peers: list[str], *, slow_interval_s: float | None = None) -> list:
        """Serve `frames` to the next pulls and announce to `peers`, so that each pulls from us now."""
        self.frames, self.slow_interval_s = list(frames), slow_interval_s
        claim = VersionVector({self.signer().peer_id: 1})  # a sender they lack: they pull at once
        return await asyncio.gather(*(self.announce(p, claim) for p in peers))

    def quiet(self) -> None:
        """Answer pulls with nothing from now on."""
        self.frames, self.slow_interval_s = [], None

    async def announce(self, peer: str, vv: VersionVector) -> str:
        """One announce; "ok" or the error the peer answered with."""
        try:
            await rpc.call(self.node.p2p, peer, self.announce_name, encode_request(vv), max_response_bytes=16,
                           timeout_s=10)
            return "ok"
        except rpc.RpcError as e:
            return str(getattr(e, "remote_message", e))

    async def flood(self, peer: str, n: int, concurrency: int = 4) -> list[str]:
        """`n` announces as fast as `concurrency` streams at a time allow."""
        claim = VersionVector({self.signer().peer_id: 1})
        answers: list[str] = []
        for start in range(0, n, concurrency):
            answers += await asyncio.gather(*(self.announce(peer, claim) for _ in range(min(concurrency, n - start))))
        return answers

    async def hello(self, peer: str, run_id: str | None = None) -> str:
        """Ask `peer` for admission to `run_id` (ours by default): its answer, or its refusal."""
        try:
            return (await rpc.call(self.node.p2p, peer, hello_name(run_id or self.spec.run_id), b"",
                                   max_response_bytes=64, timeout_s=10)).decode()
        except rpc.RpcError as e:
            return str(getattr(e, "remote_message", e))

    async def pull_from(self, peer: str, limit: int = 8) -> list[bytes]:
        """A real pull with an empty vector: honest updates, to replay."""
        stream = rpc.call_stream(self.node.p2p, peer, self.pull_name, encode_request(VersionVector(), limit),
                                 max_chunk_bytes=1 << 24, max_total_bytes=1 << 28, timeout_s=10)
        return [chunk async for chunk in stream]

    async def _on_announce(self, stream_info: Any, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> None:
        try:  # ack whatever it is (we never pull back)
            _, length = FRAME.unpack(await asyncio.wait_for(reader.readexactly(FRAME.size), 10))
            await asyncio.wait_for(reader.readexactly(length), 10)
            writer.write(FRAME.pack(DATA, 0) + FRAME.pack(END, 0))
            await asyncio.wait_for(writer.drain(), 10)
        except Exception:
            pass
        finally:
            writer.close()

    async def _on_pull(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        entry = {"caller": stream_info.peer_id.to_base58(), "frames": 0, "ended": "end", "slow": False}
        started = time.monotonic()
        try:
            _, length = FRAME.unpack(await asyncio.wait_for(reader.readexactly(FRAME.size), 10))
            await asyncio.wait_for(reader.readexactly(length), 10)
            frames, interval_s = list(self.frames), self.slow_interval_s
            entry["slow"] = interval_s is not None
            if interval_s is None:
                for frame in frames:
                    await self._write(writer, DATA, frame)
                    entry["frames"] += 1
                await self._write(writer, END, b"")
            else:  # never-ending: the same frames again and again, each well within any per-read timeout
                while time.monotonic() - started < SLOW_STREAM_MAX_S:
                    await self._write(writer, DATA, frames[entry["frames"] % len(frames)])
                    entry["frames"] += 1
                    await asyncio.sleep(interval_s)
                entry["ended"] = "gave up"
        except Exception as e:  # the honest side cut us off
            entry["ended"] = f"cut: {type(e).__name__}"
        finally:
            entry["seconds"] = time.monotonic() - started
            self.streams.append(entry)
            writer.close()

    @staticmethod
    async def _write(writer: asyncio.StreamWriter, kind: int, payload: bytes) -> None:
        writer.write(FRAME.pack(kind, len(payload)) + payload)
        await asyncio.wait_for(writer.drain(), 10)

    # ---- state sync and DHT records -----------------------------------------------------------------------

    async def serve_poisoned_snapshot(self) -> None:
        """Serve a signed manifest of a plausible theta whose chunk 0 is corrupted."""
        theta = 0.01 * torch.randn(self.numel, generator=self._generator)
        fake_vv = VersionVector({self.signer().peer_id: 1_000_000})
        replica = Replica(theta, outer_lr=self.spec.outer.outer_lr, max_weight=self.spec.outer.max_weight,
                          codec=self.codec, version_vector=fake_vv)
        self.snapshot_server = PoisonedSnapshotServer(self.node, self.spec.run_id, self.spec_hash, replica,
                                                      self.identity, StateSyncConfig(chunk_bytes=64 << 10))
        await self.snapshot_server.start()

    async def advertise(self, version_vector_total: int, state: str = "training") -> bool:
        """Our own, valid record, claiming a public address and the freshest replica of the run, so that joiners
        try us first (donors rank by reachability, then freshness: peer/reach.py donor_rank)."""
        record = {"maddrs": self.node.visible_maddrs(), "state": state, "reach": "public",
                  "version_vector_total": version_vector_total, "seq": 0, "vv_digest": "0" * 16}
        return await announce_peer(self.node, self.spec.run_id, record, self.identity, ttl_s=300, timeout_s=10)

    async def forge_record(self, victim: str) -> bool:
        """A record under `victim`'s subkey, signed by us, expiring later than the victim's own."""
        from hivemind.utils import get_dht_time

        expiration = get_dht_time() + 600
        record = {"peer_id": victim, "run_id": self.spec.run_id, "expiration_time": expiration, "state": "training",
                  "maddrs": self.node.visible_maddrs(), "version_vector_total": 10**9, "seq": 10**9}
        record_bytes = msgpack.packb(record, use_bin_type=True)
        value = [record_bytes, sign_blob(self.identity, PEER_RECORD_DOMAIN, record_bytes)]
        return await self.node.dht_store(peers_key(self.spec.run_id), value, expiration, subkey=victim, timeout_s=10)
