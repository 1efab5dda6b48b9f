"""Fuzz targets: one function per parser of untrusted bytes, each asserting that parser's contract.

Each target takes arbitrary bytes and returns a short outcome label ("accepted", or the rejection reason), for
the run statistics. It raises AssertionError when the contract is broken (an invalid message accepted, a valid
one refused, a wrong value decoded); any other exception escaping a target is a crash of the parser itself.
Shared by the coverage-guided harness (fuzz/harness.py, long runs) and tests/fuzzing/test_fuzz.py (hypothesis, CI).

Contracts checked:
  envelope         decode_update raises only WireError(reason in REJECT_REASONS); anything it accepts equals, field
                   for field and byte for byte, one of the updates the honest sender signed (Fixtures.updates).
  envelope_signed  a hostile *authenticated* sender: the harness signs whatever header the fuzzer made. Accepted
                   headers must satisfy every documented field rule, be canonical and match run, spec and payload.
  codec            decompress(payload, numel) raises only CodecError, and accepts exactly the payloads an
                   independent numpy reference decoder accepts, returning bit-identical, finite float32 values;
                   compress/decompress round trips of fuzzed floats stay within error_bound.
  manifest         parse_manifest raises only DonorError; what it accepts is one of the donor's valid manifests.
  manifest_signed  a hostile donor: the harness signs whatever manifest the fuzzer made; accepted manifests must
                   match run, spec, donor, numel, chunk layout, digests and a valid version vector.
  gossip_request   parse_request raises only RpcError and returns a valid VersionVector (holes too), limit and
                   ids digests.
  peer_record      decode_peer_record never raises, and PeerRecordValidator agrees with it; unsigned values are
                   accepted only if they are one of the owner's signed records.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
from collections.abc import Callable

import msgpack
import numpy as np
import torch
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord

from fuzz.seeds import MANIFEST_NUMEL, MAX_MANIFEST_BYTES, MAX_UPDATE_BYTES, RECORD_EXPIRATION, RUN, SPEC, fixtures
from p2p_diloco.net.discovery.records import PEER_RECORD_DOMAIN, PeerRecordValidator, decode_peer_record, peers_key
from p2p_diloco.net.gossip.digests import MAX_ID_DIGESTS
from p2p_diloco.net.gossip.messages import parse_request
from p2p_diloco.net.statesync.manifest import MANIFEST_DOMAIN, MAX_CHUNK_BYTES, DonorError, parse_manifest
from p2p_diloco.net.transport import rpc
from p2p_diloco.sync.version_vector import MAX_HOLES, MAX_SENDER_LEN, MAX_SEQ, VersionVector
from p2p_diloco.wire.codecs import CODEC_NAMES, BlockwiseCodec, Codec, CodecError, get_codec
from p2p_diloco.wire.envelope import (
    REJECT_REASONS,
    UPDATE_DOMAIN,
    WireError,
    decode_header,
    decode_update,
    sign_blob,
    verify_blob,
)
from p2p_diloco.wire.herald import decode_herald

Target = Callable[[bytes], str]


# ---------------------------------------------------------------------------------------------- envelope


def envelope(data: bytes) -> str:
    try:
        got = decode_update(data, max_bytes=MAX_UPDATE_BYTES, run_id=RUN, spec_hash=SPEC)
    except WireError as e:
        assert e.reason in REJECT_REASONS, e.reason
        return e.reason
    # A fuzzer cannot sign: an accepted message must be an honest one, re-framed at most (msgpack allows other
    # encodings of the outer map); its header bytes, signature, payload and parsed header are all the signed ones.
    known = fixtures().updates.get(got.header_bytes)
    assert known is not None, "accepted an update whose header the sender never signed"
    assert got == known, "accepted an update that differs from the signed one"
    return "accepted"


def herald(data: bytes) -> str:
    """A herald is an envelope without its payload (wire/herald.py): whatever it accepts is an honest update's
    signed header, with that update's id."""
    try:
        header, update_id = decode_herald(data, run_id=RUN, spec_hash=SPEC)
    except WireError as e:
        assert e.reason in REJECT_REASONS, e.reason
        return e.reason
    assert update_id in _signed_header_ids(), "accepted a herald whose header the sender never signed"
    return "accepted"


@functools.cache
def _signed_header_ids() -> frozenset[bytes]:
    """The ids of every header the honest sender signed among the envelope seeds: the valid updates', and those
    whose only fault is the payload (a herald has none to check)."""
    f = fixtures()
    out = set()
    for data in f.seeds["envelope"]:
        fields = msgpack.unpackb(data, raw=False)
        h, sig = fields.get("h"), fields.get("s")
        if isinstance(h, bytes) and isinstance(sig, bytes) and verify_blob(f.sender.peer_id, UPDATE_DOMAIN, h, sig):
            out.add(hashlib.sha256(h).digest())
    return frozenset(out)


def envelope_signed(data: bytes) -> str:
    """Input: header bytes, payload, u16 payload length (last, so that insertions grow the header). The harness
    signs the header as the honest sender."""
    sender = fixtures().sender
    (n,) = struct.unpack("<H", data[-2:].rjust(2, b"\x00"))
    body = data[:-2]
    n = min(n, len(body))
    header_bytes, payload = body[:len(body) - n], body[len(body) - n:]
    signature = sign_blob(sender, UPDATE_DOMAIN, header_bytes)
    message = msgpack.packb({"v": 1, "h": header_bytes, "s": signature, "p": payload}, use_bin_type=True)
    try:
        got = decode_update(message, max_bytes=MAX_UPDATE_BYTES, run_id=RUN, spec_hash=SPEC)
    except WireError as e:
        assert e.reason in REJECT_REASONS, e.reason
        if e.reason == "bad_signature":  # only right if the header names another sender than the signer
            assert msgpack.unpackb(header_bytes)[2] != sender.peer_id, "refused a correctly signed header"
        return e.reason
    h = got.header
    assert got.header_bytes == header_bytes and got.payload == payload and got.signature == signature
    assert h.sender == sender.peer_id, "accepted a header naming a sender that did not sign it"
    assert (h.run_id, h.spec_hash) == (RUN, SPEC) and h.codec in CODEC_NAMES
    assert msgpack.packb(h.to_list(), use_bin_type=True) == header_bytes, "accepted a non-canonical header"
    for value, low in ((h.seq, 1), (h.tau, 0), (h.samples, 0), (h.numel, 0), (h.payload_len, 0)):
        assert type(value) is int and low <= value < 2**63
    assert type(h.weight) is float and math.isfinite(h.weight) and h.weight >= 0
    assert type(h.created_at) is float and math.isfinite(h.created_at)
    assert h.payload_len == len(payload) and h.payload_digest == hashlib.sha256(payload).digest()
    assert decode_header(header_bytes) == h  # parsing is a function of the bytes
    return "accepted"


# ---------------------------------------------------------------------------------------------- codecs


def _codec_from(data: bytes) -> tuple[Codec, int, int, bytes]:
    """Input layout: byte 0 = codec index (bits 0-1) and mode (bits 2-3); u16 block; u64 numel; payload."""
    head = data[:11].ljust(11, b"\x00")
    name, mode = CODEC_NAMES[head[0] & 3], (head[0] >> 2) & 3
    (block,) = struct.unpack_from("<H", head, 1)
    (numel,) = struct.unpack_from("<Q", head, 3)
    block = 1 + block % 1024 if name == "int8" else 2 + 2 * (block % 512)  # int4 needs even blocks
    return get_codec(name, block), mode, numel, data[11:]


def _reference_decode(codec: Codec, data: bytes, numel: int) -> np.ndarray | None:
    """Independent decoder (numpy, integer size arithmetic) following the codecs' documented layout; None where
    the payload must be refused: wrong length, negative or non-finite scales, or any non-finite value."""
    if isinstance(codec, BlockwiseCodec):
        nblocks = -(-numel // codec.block)
        expected = 4 * nblocks + -(-numel * codec.bits // 8)
    else:
        expected = numel * (4 if codec.name == "fp32" else 2)
    if len(data) != expected:
        return None
    with np.errstate(all="ignore"):
        if not isinstance(codec, BlockwiseCodec):
            out = np.frombuffer(data, "<f4" if codec.name == "fp32" else "<f2").astype(np.float32)
        else:
            scales = np.frombuffer(data, "<f4", nblocks).astype(np.float32)
            if not (np.isfinite(scales).all() and (scales >= 0).all()):
                return None
            raw = np.frombuffer(data, np.uint8, offset=4 * nblocks)
            if codec.bits == 8:
                q = raw.view(np.int8)
            else:
                nibbles = np.stack([raw & 15, raw >> 4], axis=1).reshape(-1)[:numel].astype(np.int8)
                q = np.where(nibbles > 7, nibbles - 16, nibbles).astype(np.int8)
            out = q.astype(np.float32) * np.repeat(scales, codec.block)[:numel]
    return out if np.isfinite(out).all() else None


def codec(data: bytes) -> str:
    """Modes: 0 payload fitted to numel % 4096, 1 raw payload and any numel, 2/3 round trip of fuzzed floats."""
    c, mode, numel, body = _codec_from(data)
    if mode >= 2:
        return _roundtrip(c, body, keep_non_finite=mode == 3)
    if mode == 0:
        numel %= 4096
        body = body[:c.payload_bytes(numel)].ljust(c.payload_bytes(numel), b"\x00")
    expected = _reference_decode(c, body, numel)
    try:
        out = c.decompress(body, numel)
    except CodecError:
        assert expected is None, f"{c!r} refused a valid payload (numel={numel}, {len(body)} bytes)"
        return "refused"
    assert expected is not None, f"{c!r} accepted an invalid payload (numel={numel}, {len(body)} bytes)"
    assert out.dtype == torch.float32 and out.shape == (numel,) and out.device.type == "cpu"
    assert out.numpy().tobytes() == expected.tobytes(), f"{c!r} decoded other values than the reference"
    return "accepted"


def _roundtrip(c: Codec, body: bytes, *, keep_non_finite: bool) -> str:
    values = np.frombuffer(body[:len(body) // 4 * 4], "<f4").astype(np.float32)
    if not keep_non_finite:
        values = np.where(np.isfinite(values), values, np.float32(0))
    x = torch.from_numpy(values)
    try:
        payload = c.compress(x)
    except CodecError:
        assert not np.isfinite(values).all(), f"{c!r} refused to compress finite values"
        return "refused_non_finite"
    assert np.isfinite(values).all(), f"{c!r} compressed non-finite values"
    assert len(payload) == c.payload_bytes(x.numel())
    y = c.decompress(payload, x.numel())
    err = (y.double() - x.double()).abs()
    assert bool(torch.isfinite(y).all()) and bool((err <= c.error_bound(x).double()).all()), \
        f"{c!r} round trip outside its error bound"
    return "roundtrip"


# ---------------------------------------------------------------------------------------------- state sync


def _parse(response: bytes) -> object:
    return parse_manifest(response, donor=fixtures().donor.peer_id, run_id=RUN, spec_hash=SPEC,
                          numel=MANIFEST_NUMEL, max_manifest_bytes=MAX_MANIFEST_BYTES)


def manifest(data: bytes) -> str:
    try:
        got = _parse(data)
    except DonorError:
        return "refused"
    assert got in fixtures().manifests, "accepted a manifest the donor never signed as valid"
    return "accepted"


def manifest_signed(data: bytes) -> str:
    """The harness signs the fuzzed manifest body as the donor."""
    donor = fixtures().donor
    response = msgpack.packb({"m": data, "s": sign_blob(donor, MANIFEST_DOMAIN, data)}, use_bin_type=True)
    try:
        got = _parse(response)
    except DonorError:
        return "refused"
    m = msgpack.unpackb(data, raw=False, strict_map_key=True)
    assert (m["run_id"], m["spec_hash"], m["donor"], m["numel"], m["dtype"]) == \
        (RUN, SPEC, donor.peer_id, MANIFEST_NUMEL, "float32")
    assert got.donor == donor.peer_id and type(m["numel"]) is int
    size = got.chunk_bytes
    assert type(size) is int and 0 < size <= MAX_CHUNK_BYTES and size % 4 == 0
    assert len(got.chunk_digests) == -(-MANIFEST_NUMEL * 4 // size)
    assert all(type(d) is bytes and len(d) == 32 for d in got.chunk_digests)
    assert isinstance(got.snapshot_id, str) and 0 < len(got.snapshot_id) <= 64
    assert type(got.created_at) is float and math.isfinite(got.created_at)
    _check_vector(got.version_vector)
    return "accepted"


# ---------------------------------------------------------------------------------------------- gossip, discovery


def _check_vector(vv: VersionVector) -> None:
    assert isinstance(vv, VersionVector)
    for sender, seq in vv.items():
        assert type(sender) is str and 0 < len(sender) <= MAX_SENDER_LEN
        assert type(seq) is int and 0 < seq <= MAX_SEQ
        assert all(type(h) is int and 1 <= h < seq for h in vv.holes(sender))
    assert set(vv.holes_dict()) <= set(vv) and vv.n_holes <= MAX_HOLES


def gossip_request(data: bytes) -> str:
    """Byte 0 bit 0: a pull request (1) or an announce (0); the rest is the request."""
    pull = bool(data[:1]) and bool(data[0] & 1)
    try:
        request = parse_request(data[1:], pull=pull)
    except rpc.RpcError:
        return "refused"
    _check_vector(request.vv)
    limit, ids = request.limit, request.ids
    assert type(limit) is int and (limit >= 1 if pull else limit == 0)
    assert (pull or not ids) and len(ids) <= MAX_ID_DIGESTS
    for sender, digest in ids.items():
        assert sender in request.vv and type(digest) is str and len(digest) == 16 and int(digest, 16) >= 0
    return "accepted"


def peer_record(data: bytes) -> str:
    """Byte 0 bit 0: 0 = the rest is a record body that the harness signs as the owner; 1 = the rest is the
    DHT value [record_bytes, signature] as a peer would store it (unsigned by the harness)."""
    f = fixtures()
    owner = f.sender.peer_id
    unsigned = bool(data[:1]) and bool(data[0] & 1)
    if unsigned:
        value_bytes = data[1:]
    else:
        value_bytes = msgpack.packb([data[1:], sign_blob(f.sender, PEER_RECORD_DOMAIN, data[1:])], use_bin_type=True)
    try:
        value = msgpack.unpackb(value_bytes, raw=False, strict_map_key=True)
    except Exception:  # the DHT would never hand us this value; the validator still must not crash on it
        value = None
    record, why = decode_peer_record(RUN, owner, value, RECORD_EXPIRATION)
    dht_record = DHTRecord(key=DHTID.generate(source=peers_key(RUN)).to_bytes(),
                           subkey=msgpack.packb(owner), value=value_bytes, expiration_time=RECORD_EXPIRATION)
    valid = PeerRecordValidator([RUN]).validate(dht_record)
    assert valid is (record is not None), f"validator says {valid}, decode_peer_record says {why!r}"
    if record is None:
        assert isinstance(why, str) and why
        return "refused"
    record_bytes, signature = value
    assert verify_blob(owner, PEER_RECORD_DOMAIN, record_bytes, signature)
    assert (record["peer_id"], record["run_id"], record["expiration_time"]) == (owner, RUN, RECORD_EXPIRATION)
    if unsigned:
        assert f.records.get(record_bytes) == record, "accepted a peer record the owner never signed"
    return "accepted"


TARGETS: dict[str, Target] = {
    "envelope": envelope, "envelope_signed": envelope_signed, "herald": herald, "codec": codec, "manifest": manifest,
    "manifest_signed": manifest_signed, "gossip_request": gossip_request, "peer_record": peer_record,
}
