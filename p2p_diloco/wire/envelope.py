"""The signed outer update: what one learner unit publishes after an inner phase (ARCHITECTURE.md,
"One outer update's life").

Wire format (msgpack):
    envelope = {"v": FORMAT_VERSION, "h": header_bytes, "s": signature, "p": payload}
    header   = [run_id, spec_hash, sender, seq, tau, samples, weight, codec, numel, payload_len,
                payload_digest, created_at(, vouches(, data))]     (a msgpack array in this fixed order)
    vouches  = a sponsor's verdicts on others' updates (sync/sponsorship.py), present only when not empty (or
               when `data` follows): VOUCH_BYTES per verdict, the judged slot's key (wire/vouches.py) then its
               value in 1/65535ths
    data     = where the update's phase read its data, present only when declared: [first_step, steps, shard,
               num_shards, salted] (`DataPosition`), so that a judge can redraw the batches it was trained on
               (train/fit.py)
    signature = Ed25519 over UPDATE_DOMAIN-tagged header_bytes, by the key inside `sender` (a PeerID)

The signature covers the header and, through `payload_digest` (sha256), the payload. `decode_update` checks size,
shape, version, header, run, spec, signature and digest, in that order and before any payload is decompressed, so
a receiver spends at most one hash and one signature check on a message it will reject (ARCHITECTURE.md "Invariants").

Protocol rule: `(sender, seq)` names a slot, `update_id = sha256(header_bytes)` names its content. Two valid
updates with the same slot and different ids are equivocation, evidence against the sender.
"""

from __future__ import annotations

import functools
import hashlib
import math
import reprlib
import time
from dataclasses import dataclass
from typing import Any

import msgpack

from p2p_diloco.wire.codecs import CODEC_NAMES, Payload
from p2p_diloco.wire.identity import Identity, IdentityError, public_key_from_peer_id, sign_blob, verify_blob
from p2p_diloco.wire.position import DataPosition, position_error
from p2p_diloco.wire.vouches import MAX_VOUCHES, VOUCH_BYTES

FORMAT_VERSION = 1
UPDATE_DOMAIN = b"p2p-diloco/update/v1"
REJECT_REASONS = ("oversize", "malformed", "format_version", "wrong_run", "wrong_spec", "bad_signature",
                  "bad_digest", "bad_header")
SIGNATURE_BYTES = 64
DIGEST_BYTES = 32
# Generous bounds on header fields: a real header is ~250 bytes. They cap what a hostile header can make us hold.
MAX_HEADER_BYTES = 1024 + MAX_VOUCHES * VOUCH_BYTES
MAX_NAME_CHARS = 128
MAX_DETAIL_CHARS = 300
"""Longest rejection detail kept: details quote untrusted input and end up in logs."""
_MAX_INT = 2**63 - 1  # fits an int64 tensor or database column downstream


class WireError(ValueError):
    """A received message was rejected; `reason` is one of REJECT_REASONS (counted and logged by receivers)."""

    def __init__(self, reason: str, message: str) -> None:
        if reason not in REJECT_REASONS:
            raise ValueError(f"unknown reject reason {reason!r}")
        message = message[:MAX_DETAIL_CHARS]
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.detail = message

    def __reduce__(self) -> tuple[type[WireError], tuple[str, str]]:
        return WireError, (self.reason, self.detail)  # picklable despite the two-argument constructor


@dataclass(frozen=True)
class UpdateHeader:
    """The signed description of one outer update; every field is fixed by the sender."""

    run_id: str
    """The run this update belongs to."""
    spec_hash: str
    """Content hash of the RunSpec the sender trains with (pins model, codec and codec block)."""
    sender: str
    """The sender's PeerID (base58); its public key checks the signature."""
    seq: int
    """The sender's update counter, from 1; merged in order, one slot per seq."""
    tau: int
    """Staleness: updates from others merged into the sender's replica during this inner phase."""
    samples: int
    """Training samples behind this update."""
    weight: float
    """Merge weight w, set by the sender; receivers apply theta -= outer_lr * w * decompress(payload)."""
    codec: str
    """Payload codec name (see codecs.CODEC_NAMES)."""
    numel: int
    """Number of float32 values the payload decodes to."""
    payload_len: int
    """Payload size in bytes."""
    payload_digest: bytes
    """sha256 of the payload."""
    created_at: float
    """Sender's wall clock at signing, seconds since the epoch (informational; never trusted for ordering)."""
    vouches: bytes = b""
    """A sponsor's verdicts (wire/vouches.py); empty for everyone else, and then absent from the encoding."""
    data: tuple[int, ...] = ()
    """Where the phase read its data (`DataPosition`), if the author declares it (a proposer in a run with
    sponsors); empty otherwise, and then absent from the encoding."""

    def to_list(self) -> list[Any]:
        fields = [self.run_id, self.spec_hash, self.sender, self.seq, self.tau, self.samples, self.weight,
                  self.codec, self.numel, self.payload_len, self.payload_digest, self.created_at]
        if self.data:
            return [*fields, self.vouches, list(self.data)]
        return [*fields, self.vouches] if self.vouches else fields

    @property
    def position(self) -> DataPosition | None:
        """The declared data position, or None."""
        return DataPosition(*self.data) if self.data else None



_HEADER_FIELDS = len(UpdateHeader.__dataclass_fields__)  # with vouches and data; one or two less without


@dataclass(frozen=True)
class OuterUpdate:
    """A header, its exact encoded bytes, the sender's signature over them, and the compressed payload (bytes; a
    read-only memoryview of the envelope in a `retained` update)."""

    header: UpdateHeader
    header_bytes: bytes
    signature: bytes
    payload: Payload

    @property
    def sender(self) -> str:
        return self.header.sender

    @property
    def seq(self) -> int:
        return self.header.seq

    @property
    def weight(self) -> float:
        return self.header.weight

    @property
    def nbytes(self) -> int:
        """Size on the wire, for retention budgets (the msgpack framing adds a few bytes more)."""
        return len(self.header_bytes) + len(self.signature) + len(self.payload)

    @functools.cached_property
    def update_id(self) -> bytes:
        """sha256 of the signed header bytes: equal ids mean the same update."""
        return hashlib.sha256(self.header_bytes).digest()

    @functools.cached_property
    def encoded(self) -> bytes:
        """The envelope as sent (see the module docstring), built once per update: `encode_update`."""
        return _pack(self)


def _pack(u: OuterUpdate) -> bytes:
    envelope: bytes = msgpack.packb({"v": FORMAT_VERSION, "h": u.header_bytes, "s": u.signature, "p": u.payload},
                                    use_bin_type=True)  # msgpack is untyped; packb returns bytes
    return envelope


def retained(u: OuterUpdate) -> OuterUpdate:
    """`u` for a long stay (the update store): it keeps its encoded envelope, served as it is, and holds its
    bytes once: the payload becomes a read-only view into the envelope, which ends with it (msgpack writes the
    map in order, "p" last)."""
    # Not `u.encoded`: that would cache the envelope on `u`, which the caller may keep (the replica's buffer
    # holds the same object), and `u` would then hold its payload twice.
    data = u.__dict__.get("encoded") or _pack(u)
    if not data.endswith(u.payload):  # cannot happen with the encoding above; keep both copies if it does
        return u
    kept = OuterUpdate(u.header, u.header_bytes, u.signature, memoryview(data)[len(data) - len(u.payload):])
    kept.__dict__["encoded"] = data  # the cached_property's slot: a frozen dataclass still has a __dict__
    return kept


def make_update(*, run_id: str, spec_hash: str, seq: int, tau: int, samples: int, weight: float, codec: str,
                numel: int, payload: bytes, identity: Identity, sender: str | None = None,
                created_at: float | None = None, vouches: bytes = b"",
                data: DataPosition | None = None) -> OuterUpdate:
    """Build and sign an update from `identity`; the sender, payload length and digest are filled in here.

    `sender` is optional and, if given, must be `identity.peer_id` (a guard for callers that track it apart).
    """
    if sender is not None and sender != identity.peer_id:
        raise ValueError(f"sender {sender!r} is not the signing identity {identity.peer_id!r}")
    header = UpdateHeader(
        run_id=run_id, spec_hash=spec_hash, sender=identity.peer_id, seq=seq, tau=tau, samples=samples,
        weight=float(weight), codec=codec, numel=numel, payload_len=len(payload),
        payload_digest=hashlib.sha256(payload).digest(),
        created_at=float(time.time() if created_at is None else created_at), vouches=vouches,
        data=tuple(data) if data is not None else (),
    )
    _check_header(header)  # a local bug surfaces here, not as every receiver's rejection
    header_bytes = msgpack.packb(header.to_list(), use_bin_type=True)
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise WireError("bad_header", f"header is {len(header_bytes)} bytes, limit {MAX_HEADER_BYTES}")
    signature = sign_blob(identity, UPDATE_DOMAIN, header_bytes)
    return OuterUpdate(header=header, header_bytes=header_bytes, signature=signature, payload=bytes(payload))


def encode_update(u: OuterUpdate) -> bytes:
    """The envelope's bytes (cached on the update: encoding it again costs nothing)."""
    return u.encoded


def decode_update(data: bytes, *, max_bytes: int, run_id: str | None = None,
                  spec_hash: str | None = None) -> OuterUpdate:
    """Parse and authenticate a received update; `WireError(reason)` on the first failed check.

    Checks, in order: size, envelope shape, format version, header fields, run, spec, signature, digest. The
    payload is returned still compressed; decompressing it (with the codec the RunSpec names) is the caller's.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError("malformed", f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise WireError("oversize", f"message is {len(data)} bytes, limit {max_bytes}")
    # Small container limits, yet loose enough to read the version of a (future) differently shaped envelope.
    envelope = _unpack(data, "malformed", max_bin_len=len(data), max_str_len=64, max_array_len=64, max_map_len=16)
    if not isinstance(envelope, dict):
        raise WireError("malformed", f"envelope is a {type(envelope).__name__}, expected a map")
    # The version is read before the shape is enforced, so a future format is reported as such, not as garbage.
    version = envelope.get("v")
    if type(version) is int and version != FORMAT_VERSION:
        raise WireError("format_version", f"format version {version}, this peer speaks {FORMAT_VERSION}")
    if set(envelope) != {"v", "h", "s", "p"} or type(version) is not int:
        raise WireError("malformed", f"envelope keys {sorted(map(str, envelope))}, expected h, p, s, v")
    header_bytes, signature, payload = envelope["h"], envelope["s"], envelope["p"]
    if not all(isinstance(b, bytes) for b in (header_bytes, signature, payload)):
        raise WireError("malformed", "envelope fields h, s, p must be binary")
    if len(signature) != SIGNATURE_BYTES:
        raise WireError("malformed", f"signature is {len(signature)} bytes, expected {SIGNATURE_BYTES}")

    header = decode_header(header_bytes)
    if run_id is not None and header.run_id != run_id:
        raise WireError("wrong_run", f"update is for run {header.run_id!r}, this peer runs {run_id!r}")
    if spec_hash is not None and header.spec_hash != spec_hash:
        raise WireError("wrong_spec", f"update has spec hash {header.spec_hash!r}, this run has {spec_hash!r}")
    if not verify_blob(header.sender, UPDATE_DOMAIN, header_bytes, signature):
        raise WireError("bad_signature", f"header not signed by its sender {header.sender}")
    if len(payload) != header.payload_len or hashlib.sha256(payload).digest() != header.payload_digest:
        raise WireError("bad_digest", f"payload ({len(payload)} bytes) does not match the signed length/digest")
    return OuterUpdate(header=header, header_bytes=header_bytes, signature=signature, payload=payload)


def claimed_sender(data: bytes, run_id: str, spec_hash: str) -> str | None:
    """The sender an envelope's header names for this run, UNAUTHENTICATED: read without verifying the signature
    or hashing the payload (which is skipped, not parsed), so that a receiver can drop a banned sender's flood
    for the price of its header; None if it cannot be read that way (`decode_update` then says why)."""
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(1, len(data)), strict_map_key=True,
                                    max_ext_len=0)
        unpacker.feed(data)
        for _ in range(min(unpacker.read_map_header(), 4)):
            if unpacker.unpack() != "h":
                unpacker.skip()
                continue
            header = unpacker.unpack()
            if not isinstance(header, bytes) or len(header) > MAX_HEADER_BYTES:
                return None
            fields = msgpack.unpackb(header, raw=False, max_bin_len=64, max_str_len=256, max_array_len=16,
                                     max_map_len=0, max_ext_len=0)
            if isinstance(fields, list) and len(fields) > 2 and fields[:2] == [run_id, spec_hash] \
                    and isinstance(fields[2], str):
                return fields[2]
            return None
    except Exception:  # untrusted bytes: anything the parser raises means "not this way"
        return None
    return None


def _unpack(data: bytes, reason: str, **limits: int) -> Any:
    try:
        # Limits stop a small message from declaring huge containers; max_ext_len=0 refuses extension types.
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, max_ext_len=0, **limits)
    except Exception as exc:  # any failure of the third-party parser on untrusted bytes is a rejection, not a crash
        raise WireError(reason, f"cannot parse msgpack: {type(exc).__name__}: {exc}") from None


def decode_header(header_bytes: bytes) -> UpdateHeader:
    """A header's fields, checked and canonically encoded; WireError("bad_header") otherwise (its signature is
    the caller's to check)."""
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise WireError("bad_header", f"header is {len(header_bytes)} bytes, limit {MAX_HEADER_BYTES}")
    fields = _unpack(header_bytes, "bad_header", max_bin_len=MAX_VOUCHES * VOUCH_BYTES, max_str_len=MAX_NAME_CHARS,
                     max_array_len=_HEADER_FIELDS, max_map_len=0)
    if not isinstance(fields, list) or not _HEADER_FIELDS - 2 <= len(fields) <= _HEADER_FIELDS:
        raise WireError("bad_header", f"header must be an array of {_HEADER_FIELDS - 2} to {_HEADER_FIELDS} fields")
    if len(fields) == _HEADER_FIELDS:  # the data position: an array of ints, kept as a tuple (hashable, frozen)
        if not isinstance(fields[-1], list) or not fields[-1]:
            raise WireError("bad_header", "data must be a non-empty array")
        fields[-1] = tuple(fields[-1])
    header = UpdateHeader(*fields)
    _check_header(header)
    # One encoding per header: update_id then depends only on the header's content.
    if msgpack.packb(header.to_list(), use_bin_type=True) != header_bytes:
        raise WireError("bad_header", "header is not canonically encoded")
    return header


def _check_header(h: UpdateHeader) -> None:
    """Types and ranges of every field; `WireError("bad_header")` naming the first bad one."""
    def bad(field: str, why: str) -> WireError:
        return WireError("bad_header", f"{field} {why}, got {_short_repr(getattr(h, field))}")

    for field in ("run_id", "spec_hash", "codec"):
        value = getattr(h, field)
        if type(value) is not str or not 0 < len(value) <= MAX_NAME_CHARS:
            raise bad(field, f"must be a string of 1..{MAX_NAME_CHARS} characters")
    if h.codec not in CODEC_NAMES:
        raise bad("codec", f"must be one of {', '.join(CODEC_NAMES)}")
    if type(h.sender) is not str:
        raise bad("sender", "must be a PeerID string")
    try:
        public_key_from_peer_id(h.sender)
    except IdentityError:
        raise bad("sender", "must be an Ed25519 PeerID") from None
    for field, low in (("seq", 1), ("tau", 0), ("samples", 0), ("numel", 0), ("payload_len", 0)):
        value = getattr(h, field)
        # `type(...) is int` also refuses bools, which msgpack would hand us as ints otherwise.
        if type(value) is not int or not low <= value <= _MAX_INT:
            raise bad(field, f"must be an int in [{low}, 2**63)")
    for field in ("weight", "created_at"):
        if type(getattr(h, field)) is not float or not math.isfinite(getattr(h, field)):
            raise bad(field, "must be a finite float")
    if h.weight < 0:
        raise bad("weight", "must be >= 0")
    if type(h.payload_digest) is not bytes or len(h.payload_digest) != DIGEST_BYTES:
        raise bad("payload_digest", f"must be {DIGEST_BYTES} bytes (sha256)")
    if type(h.vouches) is not bytes or len(h.vouches) % VOUCH_BYTES or len(h.vouches) > MAX_VOUCHES * VOUCH_BYTES:
        raise bad("vouches", f"must be up to {MAX_VOUCHES} x {VOUCH_BYTES} bytes")
    why = position_error(h.data) if h.data else ""
    if why:
        raise bad("data", why)


def _short_repr(value: Any) -> str:
    """A bounded repr of an untrusted value. Plain repr recurses once per nesting level, and a 1 KiB header of
    nested msgpack arrays is deep enough to raise RecursionError instead of a rejection; reprlib stops early."""
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother, short.maxlong = 3, 80, 80, 40
    return short.repr(value)
