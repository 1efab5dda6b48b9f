"""The signed group sum: what an aggregator sends up its epoch's tree, and the total that comes back down
(ARCHITECTURE.md "Aggregation").

Wire format (msgpack): {"v": FORMAT_VERSION, "h": header_bytes, "s": signature, "p": payload}
    header  = [run_id, spec_hash, aggregator, epoch, parts, children, numel, root, created_at]
    parts   = the heralds (wire/herald.py: each author's own signed header) of every update the sum covers, its
              children's included, sorted by (sender, seq): one encoding per set
    children = [[sum_id, root], ...] of the child sums it adds in, sorted
    root    = the Merkle root of the payload's chunks (sync/exact_sum.py)
    payload = the exact integer sum of the parts' merge steps, int32 little-endian (sync/exact_sum.py); on the
              wire byte-shuffled (all first bytes, then all second bytes...) and deflated (`pack_payload`):
              grid values use about 2-3 of their 4 bytes, so the high byte planes deflate to almost nothing
    signature = Ed25519 over SUM_DOMAIN-tagged header_bytes, by the key inside `aggregator`

The sum names every part by its author's signature, so nobody can add a part its author did not sign, and the
weight each part merges with is not stated here: it is the merge rule's, from the part's own header (seq and
signed weight), computed by every receiver. What the aggregator alone could get wrong is the payload, and that is
checkable bit for bit by anyone holding the inputs, a chunk at a time (sync/sum_audit.py). `sum_id =
sha256(header_bytes)`.
"""

from __future__ import annotations

import functools
import hashlib
import time
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from p2p_diloco.wire.envelope import DIGEST_BYTES, FORMAT_VERSION, SIGNATURE_BYTES, UpdateHeader, WireError
from p2p_diloco.wire.herald import MAX_HERALD_BYTES, decode_herald
from p2p_diloco.wire.identity import Identity, sign_blob, verify_blob
from p2p_diloco.wire.merkle import merkle_root

SUM_DOMAIN = b"p2p-diloco/sum/v1"
MAX_PARTS = 4096
"""Parts one sum may name (a swarm of a thousand, four epochs' worth)."""
MAX_CHILDREN = 64
MAX_SUM_HEADER_BYTES = MAX_PARTS * (MAX_HERALD_BYTES + 8) + MAX_CHILDREN * 80 + 1024


@dataclass(frozen=True)
class Part:
    """One update a sum covers: its author's header, the herald bytes that prove it, its update_id."""

    header: UpdateHeader
    herald: bytes
    update_id: bytes

    @property
    def slot(self) -> tuple[str, int]:
        return self.header.sender, self.header.seq


@dataclass(frozen=True)
class SumHeader:
    run_id: str
    spec_hash: str
    aggregator: str
    epoch: int
    parts: tuple[Part, ...]
    children: tuple[tuple[bytes, bytes], ...]  # (sum_id, root) of each child sum
    numel: int
    root: bytes
    created_at: float

    def to_list(self) -> list[Any]:
        return [self.run_id, self.spec_hash, self.aggregator, self.epoch, [p.herald for p in self.parts],
                [list(c) for c in self.children], self.numel, self.root, self.created_at]

    @property
    def slots(self) -> list[tuple[str, int]]:
        return [p.slot for p in self.parts]


@dataclass(frozen=True)
class GroupSum:
    header: SumHeader
    header_bytes: bytes
    signature: bytes
    payload: bytes

    @property
    def aggregator(self) -> str:
        return self.header.aggregator

    @functools.cached_property
    def sum_id(self) -> bytes:
        return hashlib.sha256(self.header_bytes).digest()

    @functools.cached_property
    def encoded(self) -> bytes:
        data: bytes = msgpack.packb({"v": FORMAT_VERSION, "h": self.header_bytes, "s": self.signature,
                                     "p": pack_payload(self.payload)}, use_bin_type=True)
        return data


def pack_payload(payload: bytes) -> bytes:
    """A sum's int32 payload as it travels: byte planes, deflated (level 1: fast, and the planes do the work)."""
    planes = np.frombuffer(payload, dtype=np.uint8).reshape(-1, 4).T
    return zlib.compress(np.ascontiguousarray(planes).tobytes(), 1)


def unpack_payload(data: bytes, numel: int) -> bytes:
    """The int32 payload of `numel` values back from `pack_payload`'s bytes; WireError if it is not exactly that
    (never inflates more than the expected length: a deflate bomb costs at most 4 * numel bytes)."""
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(data, 4 * numel + 1)
    except zlib.error:
        raise WireError("malformed", "sum payload does not inflate") from None
    if len(raw) != 4 * numel or not inflater.eof or inflater.unconsumed_tail:
        raise WireError("bad_digest", "sum payload does not inflate to its signed length")
    return np.ascontiguousarray(np.frombuffer(raw, dtype=np.uint8).reshape(4, -1).T).tobytes()


def make_sum(*, identity: Identity, run_id: str, spec_hash: str, epoch: int, heralds: list[bytes],
             children: list[GroupSum], payload: bytes, numel: int, created_at: float | None = None) -> GroupSum:
    """Sign a sum over `heralds` (every part covered, children's included) and `children`; the caller computed
    `payload` (sync/exact_sum.py). Parts are parsed here, so a local bug fails here, not at every receiver."""
    parts = tuple(sorted((_part(h, run_id, spec_hash) for h in heralds), key=lambda p: p.slot))
    header = SumHeader(run_id, spec_hash, identity.peer_id, int(epoch), parts,
                       tuple(sorted((c.sum_id, c.header.root) for c in children)), int(numel),
                       merkle_root(payload, numel), float(time.time() if created_at is None else created_at))
    _check(header, run_id=run_id, spec_hash=spec_hash, numel=numel)
    header_bytes: bytes = msgpack.packb(header.to_list(), use_bin_type=True)
    return GroupSum(header, header_bytes, sign_blob(identity, SUM_DOMAIN, header_bytes), bytes(payload))


def decode_sum(data: bytes, *, run_id: str, spec_hash: str, numel: int) -> GroupSum:
    """Parse and authenticate a received sum: size, shape, version, every part's signature, the aggregator's
    signature, the payload's length and Merkle root; WireError on the first failure."""
    limit = MAX_SUM_HEADER_BYTES + 4 * numel + 256
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) > limit:
        raise WireError("oversize", f"sum is over {limit} bytes or not bytes")
    envelope = _unpack(data, max_bin_len=len(data), max_array_len=8, max_map_len=8, max_str_len=16)
    if not isinstance(envelope, dict) or set(envelope) != {"v", "h", "s", "p"}:
        raise WireError("malformed", "a sum is a map of v, h, s, p")
    if envelope["v"] != FORMAT_VERSION:
        raise WireError("format_version", f"format version {envelope['v']!r}, this peer speaks {FORMAT_VERSION}")
    header_bytes, signature, payload = envelope["h"], envelope["s"], envelope["p"]
    if not isinstance(payload, bytes):
        raise WireError("malformed", "sum field p must be binary")
    header = decode_sum_header(header_bytes, signature, run_id=run_id, spec_hash=spec_hash, numel=numel)
    payload = unpack_payload(payload, numel)
    if len(payload) != 4 * numel or merkle_root(payload, numel) != header.root:
        raise WireError("bad_digest", "sum payload does not match its signed length and Merkle root")
    return GroupSum(header, header_bytes, signature, payload)


def decode_sum_header(header_bytes: object, signature: object, *, run_id: str, spec_hash: str,
                      numel: int) -> SumHeader:
    """A sum's signed header alone (evidence carries headers and chunks, not payloads): shape, run, the
    aggregator's signature, every part's; WireError on the first failure."""
    if not isinstance(header_bytes, bytes) or not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        raise WireError("malformed", "sum fields h, s must be binary, s of 64 bytes")
    if len(header_bytes) > MAX_SUM_HEADER_BYTES:
        raise WireError("oversize", "sum header is over its bound")
    fields = _unpack(header_bytes, max_bin_len=MAX_HERALD_BYTES, max_array_len=MAX_PARTS, max_map_len=0,
                     max_str_len=128)
    if not isinstance(fields, list) or len(fields) != 9:
        raise WireError("bad_header", "a sum header is an array of 9 fields")
    run, spec, aggregator, epoch, heralds, children, n, root, created = fields
    if run != run_id or spec != spec_hash:
        raise WireError("wrong_run" if run != run_id else "wrong_spec", "sum is for another run or spec")
    if not (isinstance(heralds, list) and isinstance(children, list) and isinstance(aggregator, str)
            and all(isinstance(c, list) and len(c) == 2 and all(isinstance(x, bytes) and len(x) == DIGEST_BYTES
                                                                 for x in c) for c in children)
            and isinstance(root, bytes) and isinstance(created, float) and type(epoch) is int and type(n) is int):
        raise WireError("bad_header", "sum header fields have the wrong types")
    if not verify_blob(aggregator, SUM_DOMAIN, header_bytes, signature):
        raise WireError("bad_signature", f"sum not signed by its aggregator {aggregator[:60]}")
    parts = tuple(_part(h, run_id, spec_hash) for h in heralds)
    header = SumHeader(run, spec, aggregator, epoch, parts, tuple((c[0], c[1]) for c in children), n, root, created)
    _check(header, run_id=run_id, spec_hash=spec_hash, numel=numel)
    return header


def _part(herald: object, run_id: str, spec_hash: str) -> Part:
    if not isinstance(herald, bytes):
        raise WireError("bad_header", "a sum's part is a herald's bytes")
    header, update_id = decode_herald(herald, run_id=run_id, spec_hash=spec_hash)
    return Part(header, herald, update_id)


def _check(h: SumHeader, *, run_id: str, spec_hash: str, numel: int) -> None:
    slots = h.slots
    if h.epoch < 0 or h.numel != numel or not 0 < len(h.parts) <= MAX_PARTS or len(h.children) > MAX_CHILDREN:
        raise WireError("bad_header", "sum epoch, numel, part or child count out of bounds")
    if slots != sorted(set(slots)) or list(h.children) != sorted(set(h.children)):
        raise WireError("bad_header", "a sum's parts and children are sorted and each named once")
    if any(p.header.numel != numel for p in h.parts):
        raise WireError("bad_header", "a part's numel is not the run's")


def _unpack(data: bytes, **limits: int) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0, **limits)
    except Exception as exc:  # untrusted bytes
        raise WireError("malformed", f"cannot parse msgpack: {type(exc).__name__}") from None
