"""Fixed keys and seed inputs for the fuzz targets: valid messages, and signed messages that must stay invalid.

Keys are derived from constant seeds, so a seed corpus written by one run is valid in the next. The fixtures
are built on first use (`fixtures()`), never at import time.

The "no acceptance of an invalid message" invariant needs the set of messages that *may* be accepted: it is
`Fixtures.updates` (for envelopes), `Fixtures.manifests` and `Fixtures.records`. A fuzzer cannot sign, so any
mutated input that a parser accepts must decode to exactly one of them.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2p_diloco.net.discovery.records import PEER_RECORD_DOMAIN, encode_peer_record
from p2p_diloco.net.gossip.messages import encode_request
from p2p_diloco.net.statesync.manifest import MANIFEST_DOMAIN, Manifest, parse_manifest
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import UPDATE_DOMAIN, OuterUpdate, encode_update, make_update, sign_blob
from p2p_diloco.wire.identity import Identity

RUN, SPEC = "fuzz-run", "5e" * 32
MAX_UPDATE_BYTES = 1 << 16
"""decode_update's max_bytes in the targets (larger than any fuzz input, so size is not what rejects)."""
MANIFEST_NUMEL = 10
"""The joiner's numel in the manifest targets: 40 bytes of theta, so 16-byte chunks make 3 digests."""
MAX_MANIFEST_BYTES = 1 << 16
RECORD_EXPIRATION = 1_700_000_000.0
"""Fixed signed expiration of peer records (in the past: decode_peer_record leaves expiry to the DHT)."""


def identity(n: int) -> Identity:
    """A fixed Ed25519 identity: the same key in every run."""
    return Identity(Ed25519PrivateKey.from_private_bytes(bytes([n]) * 32))


@dataclass(frozen=True)
class Fixtures:
    """Keys, the messages parsers may accept, and seed inputs for each target."""

    sender: Identity
    """Honest update sender and peer-record owner."""
    forger: Identity
    """Signs messages that claim to come from `sender`."""
    donor: Identity
    """Signs state-sync manifests."""
    updates: dict[bytes, OuterUpdate]
    """header_bytes -> the valid update: everything decode_update may accept."""
    manifests: frozenset[Manifest]
    """Everything parse_manifest may accept from an unsigned (mutated) response."""
    records: dict[bytes, dict]
    """record_bytes -> record: everything decode_peer_record may accept from an unsigned value."""
    seeds: dict[str, list[bytes]]
    """Seed inputs per target name."""


def header_list(sender: Identity, payload: bytes, **changes: Any) -> list[Any]:
    """An update header as the list that is msgpack-encoded and signed (fields in wire order)."""
    fields: dict[str, Any] = dict(run_id=RUN, spec_hash=SPEC, sender=sender.peer_id, seq=1, tau=0, samples=64,
                                  weight=0.5, codec="int8", numel=len(payload), payload_len=len(payload),
                                  payload_digest=hashlib.sha256(payload).digest(), created_at=1.7e9)
    fields.update(changes)
    return list(fields.values())


def envelope(header_bytes: bytes, signature: bytes, payload: bytes, **extra: Any) -> bytes:
    return msgpack.packb({"v": 1, "h": header_bytes, "s": signature, "p": payload, **extra}, use_bin_type=True)


def signed_header_input(header_bytes: bytes, payload: bytes) -> bytes:
    """Input of the `envelope_signed` target: header, payload, u16 payload length."""
    return header_bytes + payload + struct.pack("<H", len(payload))


def manifest_dict(donor: Identity, **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "run_id": RUN, "spec_hash": SPEC, "donor": donor.peer_id, "snapshot_id": "0f" * 16, "created_at": 1.7e9,
        "numel": MANIFEST_NUMEL, "dtype": "float32", "chunk_bytes": 16, "version_vector": {donor.peer_id: 3},
        "chunk_digests": [hashlib.sha256(bytes([i]) * 16).digest() for i in range(3)]}
    body.update(changes)
    return body


def manifest_response(donor: Identity, body: bytes, signature: bytes | None = None) -> bytes:
    if signature is None:
        signature = sign_blob(donor, MANIFEST_DOMAIN, body)
    return msgpack.packb({"m": body, "s": signature}, use_bin_type=True)


def _payloads() -> list[tuple[str, int, bytes]]:
    """(codec, numel, payload) of real compressed tensors: fp32, fp16, int8 and int4, odd and empty lengths."""
    out = []
    for name, numel in (("fp32", 3), ("fp16", 5), ("int8", 7), ("int4", 9), ("int8", 0)):
        x = torch.linspace(-1.0, 2.0, numel, dtype=torch.float32)
        out.append((name, numel, get_codec(name, 4).compress(x)))
    return out


def _update_seeds(sender: Identity, forger: Identity) -> tuple[dict[bytes, OuterUpdate], list[bytes], list[bytes]]:
    updates: dict[bytes, OuterUpdate] = {}
    for i, (codec, numel, payload) in enumerate(_payloads()):
        u = make_update(run_id=RUN, spec_hash=SPEC, seq=i + 1, tau=i, samples=64 * i, weight=0.5, codec=codec,
                        numel=numel, payload=payload, identity=sender, created_at=1.7e9 + i)
        updates[u.header_bytes] = u
    valid = list(updates.values())
    u = valid[2]
    envelopes = [encode_update(v) for v in valid]
    signed_inputs = [signed_header_input(v.header_bytes, v.payload) for v in valid]
    bad_headers = [
        header_list(sender, u.payload, run_id="other-run"), header_list(sender, u.payload, spec_hash="00" * 32),
        header_list(sender, u.payload, seq=0), header_list(sender, u.payload, weight=float("nan")),
        header_list(sender, u.payload, codec="int3"), header_list(sender, u.payload, payload_len=len(u.payload) + 1),
        header_list(forger, u.payload)[:11],
    ]
    for fields in bad_headers:
        hb = msgpack.packb(fields, use_bin_type=True)
        envelopes.append(envelope(hb, sign_blob(sender, UPDATE_DOMAIN, hb), u.payload))
        signed_inputs.append(signed_header_input(hb, u.payload))
    # Non-canonical: the weight as a float32 (0xca) where make_update writes a float64.
    noncanonical = u.header_bytes.replace(msgpack.packb(0.5), b"\xca" + struct.pack(">f", 0.5), 1)
    signed_inputs.append(signed_header_input(noncanonical, u.payload))
    # Minimal headers: tiny fields leave room, under MAX_HEADER_BYTES, for deeply nested ones.
    signed_inputs += [signed_header_input(msgpack.packb([None] * 12), b""),
                      signed_header_input(msgpack.packb([0] * 12), b"")]
    envelopes += [
        envelope(noncanonical, sign_blob(sender, UPDATE_DOMAIN, noncanonical), u.payload),
        envelope(u.header_bytes, u.signature, u.payload + b"\x00"),  # bad digest
        envelope(u.header_bytes, bytes(64), u.payload),  # bad signature
        envelope(u.header_bytes, sign_blob(forger, UPDATE_DOMAIN, u.header_bytes), u.payload),  # forged
        envelope(u.header_bytes, u.signature, u.payload, x=1),  # extra key
        msgpack.packb({"v": 2, "h": u.header_bytes, "s": u.signature, "p": u.payload}, use_bin_type=True),
    ]
    return updates, envelopes, signed_inputs


def _heralds(envelopes: list[bytes]) -> list[bytes]:
    """Each envelope seed without its payload: the herald of the same header and signature (wire/herald.py)."""
    out = []
    for data in envelopes:
        fields = msgpack.unpackb(data, raw=False)
        fields.pop("p", None)
        out.append(msgpack.packb(fields, use_bin_type=True))
    return out


def _manifest_seeds(donor: Identity) -> tuple[frozenset[Manifest], list[bytes], list[bytes]]:
    bodies = [msgpack.packb(manifest_dict(donor), use_bin_type=True),
              msgpack.packb(manifest_dict(donor, chunk_bytes=40, version_vector={},
                                          chunk_digests=[bytes(32)], created_at=5), use_bin_type=True)]
    valid = [manifest_response(donor, b) for b in bodies]
    manifests = frozenset(parse_manifest(r, donor=donor.peer_id, run_id=RUN, spec_hash=SPEC, numel=MANIFEST_NUMEL,
                                         max_manifest_bytes=MAX_MANIFEST_BYTES) for r in valid)
    bad = [manifest_dict(donor, run_id="x"), manifest_dict(donor, numel=11), manifest_dict(donor, chunk_bytes=6),
           manifest_dict(donor, chunk_digests=[bytes(32)] * 2), manifest_dict(donor, created_at=float("inf")),
           manifest_dict(donor, version_vector={"a": -1}), manifest_dict(donor, dtype="float16")]
    bodies += [msgpack.packb(b, use_bin_type=True) for b in bad]
    responses = valid + [manifest_response(donor, b) for b in bodies[2:]]
    responses.append(manifest_response(donor, bodies[0], bytes(64)))
    return manifests, responses, bodies


def _record_seeds(owner: Identity) -> tuple[dict[bytes, dict], list[bytes]]:
    records: dict[bytes, dict] = {}
    seeds: list[bytes] = []
    for record in ({"maddrs": ["/ip4/127.0.0.1/tcp/4001"], "seq": 3, "samples_per_s": 12.5},
                   {"maddrs": [], "updated_at": 1.0}):
        record_bytes, signature = encode_peer_record(RUN, record, owner, RECORD_EXPIRATION)
        records[record_bytes] = msgpack.unpackb(record_bytes)
        seeds += [b"\x00" + record_bytes, b"\x01" + msgpack.packb([record_bytes, signature], use_bin_type=True)]
    other = msgpack.packb({"peer_id": owner.peer_id, "run_id": "other", "expiration_time": RECORD_EXPIRATION})
    seeds += [b"\x00" + other, b"\x01" + msgpack.packb([other, sign_blob(owner, PEER_RECORD_DOMAIN, other)])]
    return records, seeds


def _codec_seeds() -> list[bytes]:
    """Inputs of the `codec` target (see targets.codec for the layout)."""
    seeds = []
    x = np.linspace(-3, 3, 37, dtype="<f4").tobytes()
    for index, name in enumerate(("fp32", "fp16", "int8", "int4")):
        for mode in range(3):
            data = get_codec(name, 8).compress(torch.from_numpy(np.frombuffer(x, "<f4").copy()))
            body = x if mode == 2 else data
            seeds.append(bytes([index | mode << 2]) + struct.pack("<H", 3) + struct.pack("<Q", 37) + body)
    return seeds


@functools.cache
def fixtures() -> Fixtures:
    sender, forger, donor = identity(1), identity(2), identity(3)
    updates, envelopes, signed_inputs = _update_seeds(sender, forger)
    manifests, responses, bodies = _manifest_seeds(donor)
    records, record_seeds = _record_seeds(sender)
    vectors = [VersionVector(), VersionVector({sender.peer_id: 4, donor.peer_id: 1}),
               VersionVector({sender.peer_id: 6}, holes={sender.peer_id: [2, 3]})]
    requests = [b"\x01" + encode_request(v, 8) for v in vectors] + [b"\x00" + encode_request(v) for v in vectors]
    requests += [b"\x01" + encode_request(vectors[1], 8, ids={sender.peer_id: "0123456789abcdef"}),
                 b"\x01" + encode_request(vectors[1], 8, ids={donor.peer_id: "not hex digits!!"}),
                 b"\x01" + encode_request(vectors[1]), b"\x01" + encode_request(vectors[1], 0),
                 b"\x00" + msgpack.packb({"vv": {sender.peer_id: -1}}),
                 b"\x00" + msgpack.packb({"vv": {sender.peer_id: 3}, "holes": {sender.peer_id: [3]}})]
    seeds = {"envelope": envelopes, "envelope_signed": signed_inputs, "herald": _heralds(envelopes),
             "codec": _codec_seeds(),
             "manifest": responses, "manifest_signed": bodies, "gossip_request": requests,
             "peer_record": record_seeds}
    return Fixtures(sender, forger, donor, updates, manifests, records, seeds)
