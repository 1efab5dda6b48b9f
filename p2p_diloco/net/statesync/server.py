"""State sync, the donor's side: serve signed, consistent snapshots of one replica (protocol: net/statesync/client.py).

The donor takes `replica.snapshot()` when a manifest is asked for: a copy of theta and the vector naming
exactly the updates summed into it. It keeps the snapshot (at most MAX_CACHED_SNAPSHOTS, each dropped
`snapshot_ttl_s` after its last request) so that all chunks of one manifest come from one consistent state; a
chunk of a snapshot no longer held is refused, and the joiner moves on. Requests within `snapshot_reuse_s` of
the last snapshot, or while the replica has not changed, share it.

Both RPCs are served behind the peer's guard (access, per-peer rate limits on requests and bytes, a minimum
pace), so a joiner that asks for chunk after chunk cannot take the donor's uplink from everyone else. Each
request is also admitted only within the uplink's share its caller draws from (net/admission/uplink.py): a
joiner has given nothing yet, so all joiners together share the newcomers' part ("busy: ..." when spent). What
is served goes into the guard's ledger: a chunk index the same remote had from us before (of any snapshot:
a remote fetching snapshots in a loop) is a re-serve and costs it more, in the ledger and against its fair
share of the uplink (`reserve_charge`). Chunk responses are timed by the guard to measure the uplink.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from p2p_diloco.config.network import StateSyncConfig
from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.statesync.client import check_host
from p2p_diloco.net.statesync.manifest import MANIFEST_DOMAIN, MAX_REQUEST_BYTES, chunk_name, manifest_name, unpack
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import SwarmNode
from p2p_diloco.sync.authors import MAX_INHERITED
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.identity import Identity, sign_blob

logger = logging.getLogger(__name__)

MAX_CACHED_SNAPSHOTS = 2
"""Snapshots a donor holds at once (each is a full fp32 copy of theta); the oldest goes first."""


@dataclass
class _Snapshot:
    snapshot_id: str
    theta: torch.Tensor  # the copy the chunks are cut from (kept alive with `data`)
    data: memoryview  # theta's bytes
    version_vector: VersionVector
    taken_at: float  # monotonic
    used_at: float  # monotonic, last manifest or chunk request
    response: bytes  # the signed manifest message


class SnapshotServer:
    """Serves signed snapshots of one replica. `await start()`; always `await stop()`.

    RPC handlers are `rpc_manifest` and `rpc_chunk`; `_check_request`, `_state`, `_read_chunk` and `_sign` are
    the seams tests override to inject faults.
    """

    def __init__(self, node: SwarmNode, run_id: str, spec_hash: str, replica: Replica, identity: Identity,
                 config: StateSyncConfig, *, guard: PeerGuard | None = None):
        """`guard` (a PeerGuard) decides who is served, how often and how much."""
        if identity.peer_id != node.peer_id:
            raise ValueError(f"identity {identity.peer_id} is not this node's ({node.peer_id})")
        check_host()
        self.node = node
        self.run_id = run_id
        self.spec_hash = spec_hash
        self.replica = replica
        self.identity = identity
        self.config = config.validate()
        self.guard = guard
        self.numel = replica.theta.numel()
        self.stats: dict[str, int] = dict.fromkeys(
            ("manifests_served", "snapshots_taken", "chunks_served", "bytes_sent", "refused"), 0)
        self.rpc_stats: dict[str, rpc.RpcStats] = {}
        self._cache: OrderedDict[str, _Snapshot] = OrderedDict()
        self._snapshot_lock: asyncio.Lock | None = None
        self._serving: list[str] = []

    async def start(self) -> None:
        """Serve the manifest and chunk RPCs."""
        self._snapshot_lock = asyncio.Lock()
        p2p, timeout_s = self.node.p2p, self.config.timeout_s
        for name, handler, concurrent in ((manifest_name(self.run_id), self.rpc_manifest, 4),
                                          (chunk_name(self.run_id), self.rpc_chunk,
                                           self.config.max_concurrent_chunks)):
            self.rpc_stats[name.rsplit("/", 1)[-1]] = await rpc.serve(
                p2p, name, handler, max_request_bytes=MAX_REQUEST_BYTES, timeout_s=timeout_s,
                max_concurrent=concurrent, guard=self.guard,
                min_bytes_per_s=self.guard.limits.min_stream_bytes_per_s if self.guard is not None else 0.0)
            self._serving.append(name)

    async def stop(self) -> None:
        """Stop serving and drop the cached snapshots. Idempotent; bounded by timeout_s."""
        for name in self._serving:
            try:
                await asyncio.wait_for(rpc.unserve(self.node.p2p, name), self.config.timeout_s / 2)
            except Exception as e:  # e.g. the node is already shut down
                logger.debug("state sync unserve failed name=%s error=%r", name, e)
        self._serving.clear()
        self._cache.clear()

    # ---- handlers -----------------------------------------------------------------------------------------

    async def rpc_manifest(self, request: bytes, caller: str) -> bytes:
        try:
            self._check_request(unpack(request, "manifest request", max_bin_len=0, max_array_len=0))
        except (ValueError, rpc.RpcError) as e:
            self.stats["refused"] += 1
            raise rpc.RpcError(str(e)) from None
        assert self._snapshot_lock is not None, "SnapshotServer.start was not called"
        async with self._snapshot_lock:  # one snapshot at a time, however many joiners ask
            snapshot = self._reusable() or await self._take_snapshot()
        self.stats["manifests_served"] += 1
        if self.guard is not None:
            self.guard.ledger.served(caller, len(snapshot.response))
        logger.info("state sync manifest served joiner=%s snapshot_id=%s numel=%d", caller, snapshot.snapshot_id,
                    self.numel)
        return snapshot.response

    async def rpc_chunk(self, request: bytes, caller: str) -> bytes:
        try:
            message = unpack(request, "chunk request", max_bin_len=0, max_array_len=0)
            snapshot_id, index = message["snapshot_id"], message["index"]
            if not isinstance(snapshot_id, str) or type(index) is not int:
                raise ValueError("snapshot_id must be a str and index an int")
        except (ValueError, KeyError, TypeError) as e:
            self.stats["refused"] += 1
            raise rpc.RpcError(f"malformed chunk request: {e}") from None
        self._expire()
        snapshot = self._cache.get(snapshot_id)
        if snapshot is None:
            self.stats["refused"] += 1
            raise rpc.RpcError(f"snapshot {snapshot_id[:32]!r} expired or unknown; ask for a new manifest")
        n_chunks = math.ceil(len(snapshot.data) / self.config.chunk_bytes)
        if not 0 <= index < n_chunks:
            self.stats["refused"] += 1
            raise rpc.RpcError(f"chunk index {index} out of range [0, {n_chunks})")
        snapshot.used_at = time.monotonic()
        chunk = self._read_chunk(snapshot, index)
        self.stats["chunks_served"] += 1
        self.stats["bytes_sent"] += len(chunk)
        if self.guard is not None and self.guard.ledger.served_chunk(caller, index, len(chunk)):
            self.guard.uplink.served_again(caller, len(chunk))  # it had this chunk from us: its fair share pays more
        return chunk

    # ---- seams (overridden by fault-injecting tests) --------------------------------------------------------

    def _check_request(self, message: Any) -> None:
        """Refuse a joiner of another run, spec or model size, telling it what differs."""
        if not isinstance(message, dict):
            raise ValueError("manifest request must be a map")
        if message.get("run_id") != self.run_id or message.get("spec_hash") != self.spec_hash:
            raise rpc.RpcError(f"this donor serves run {self.run_id!r} spec {self.spec_hash[:16]}; you asked for "
                               f"run {str(message.get('run_id'))[:64]!r} spec {str(message.get('spec_hash'))[:16]}")
        if message.get("numel") != self.numel:
            raise rpc.RpcError(f"this donor's model has {self.numel} parameters, you asked for "
                               f"{str(message.get('numel'))[:24]}")

    def _read_chunk(self, snapshot: _Snapshot, index: int) -> bytes:
        size = self.config.chunk_bytes
        return bytes(snapshot.data[index * size:(index + 1) * size])

    def _sign(self, manifest_bytes: bytes) -> bytes:
        return sign_blob(self.identity, MANIFEST_DOMAIN, manifest_bytes)

    def _state(self) -> tuple[torch.Tensor, VersionVector]:
        """A consistent copy of (theta, V) as float32 on the CPU; runs in a worker thread."""
        theta, vv = self.replica.snapshot()
        return theta.detach().to("cpu", torch.float32).contiguous(), vv

    # ---- snapshots ----------------------------------------------------------------------------------------

    def _expire(self) -> None:
        now = time.monotonic()
        for snapshot_id in [k for k, s in self._cache.items() if now - s.used_at > self.config.snapshot_ttl_s]:
            del self._cache[snapshot_id]

    def _reusable(self) -> _Snapshot | None:
        self._expire()
        if not self._cache:
            return None
        newest = next(reversed(self._cache.values()))
        now = time.monotonic()
        if newest.version_vector == self.replica.version_vector or now - newest.taken_at < self.config.snapshot_reuse_s:
            newest.used_at = now
            return newest
        return None

    async def _take_snapshot(self) -> _Snapshot:
        # Copying and hashing theta is CPU work (about a second for 100M parameters): off the loop.
        snapshot = await asyncio.to_thread(self._build_snapshot)
        self._cache[snapshot.snapshot_id] = snapshot
        while len(self._cache) > MAX_CACHED_SNAPSHOTS:
            self._cache.popitem(last=False)
        self.stats["snapshots_taken"] += 1
        return snapshot

    def _standing(self) -> dict[str, list[str]]:
        """Whom this replica trusts (sync/standing.py): a joiner vets nothing until its own first update, so it
        merges only these authors meanwhile, and never the distrusted ones (the newest MAX_INHERITED of each)."""
        standing = getattr(self.replica, "standing", None)
        if standing is None:
            return {"good": [], "distrusted": []}
        with self.replica.lock:
            good, distrusted = standing.inheritance(MAX_INHERITED)
        return {"good": good, "distrusted": distrusted}

    def _build_snapshot(self) -> _Snapshot:
        theta, vv = self._state()
        data = theta.numpy().data.cast("B")
        size = self.config.chunk_bytes
        digests = [hashlib.sha256(data[i:i + size]).digest() for i in range(0, len(data), size)]
        snapshot_id = secrets.token_hex(16)
        manifest = msgpack.packb({
            "run_id": self.run_id, "spec_hash": self.spec_hash, "donor": self.node.peer_id,
            "snapshot_id": snapshot_id, "created_at": time.time(), "numel": theta.numel(), "dtype": "float32",
            "chunk_bytes": size, "version_vector": vv.to_dict(), "chunk_digests": digests,
            "version_vector_holes": vv.holes_dict(), "standing": self._standing(),
        }, use_bin_type=True)
        response = msgpack.packb({"m": manifest, "s": self._sign(manifest)}, use_bin_type=True)
        if len(response) > self.config.max_manifest_bytes:
            raise rpc.RpcError(f"manifest is {len(response)} bytes, over max_manifest_bytes="
                               f"{self.config.max_manifest_bytes}: raise chunk_bytes")
        now = time.monotonic()
        return _Snapshot(snapshot_id, theta, data, vv, now, now, response)
