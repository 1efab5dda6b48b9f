"""The herald: an outer update's signed header, sent to the sponsors ahead of its payload (sync/heralds.py: it
orders near copies by when each was first heard, so a copy cannot win a race its copier could only join after
holding the original).

Wire format (msgpack): {"v": FORMAT_VERSION, "h": header_bytes, "s": signature}: the update's own header bytes
and signature (wire/envelope.py), without "p". It names the slot (sender, seq) and, through `payload_digest`, the
content: the update that arrives later must have the same `update_id` for the herald to count. A few hundred bytes;
the same checks as an update's, in the same order, the payload's digest aside.
"""

from __future__ import annotations

import hashlib

import msgpack

from p2p_diloco.wire.envelope import (
    FORMAT_VERSION,
    MAX_HEADER_BYTES,
    SIGNATURE_BYTES,
    UPDATE_DOMAIN,
    OuterUpdate,
    UpdateHeader,
    WireError,
    decode_header,
)
from p2p_diloco.wire.identity import verify_blob

MAX_HERALD_BYTES = MAX_HEADER_BYTES + SIGNATURE_BYTES + 64
"""The largest herald a receiver reads (the envelope's framing is a few bytes)."""


def encode_herald(update: OuterUpdate) -> bytes:
    data: bytes = msgpack.packb({"v": FORMAT_VERSION, "h": update.header_bytes, "s": update.signature},
                                use_bin_type=True)
    return data


def decode_herald(data: bytes, *, run_id: str, spec_hash: str) -> tuple[UpdateHeader, bytes]:
    """Parse and authenticate a herald: (its header, the update_id the update must have); WireError otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) > MAX_HERALD_BYTES:
        raise WireError("oversize", f"herald is over {MAX_HERALD_BYTES} bytes or not bytes")
    try:
        envelope = msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0, max_bin_len=len(data),
                                   max_str_len=64, max_array_len=16, max_map_len=8)
    except Exception as exc:  # untrusted bytes: any parser failure is a rejection
        raise WireError("malformed", f"cannot parse msgpack: {type(exc).__name__}") from None
    if not isinstance(envelope, dict) or set(envelope) != {"v", "h", "s"}:
        raise WireError("malformed", "a herald is a map of v, h, s")
    if envelope["v"] != FORMAT_VERSION:
        raise WireError("format_version", f"format version {envelope['v']!r}, this peer speaks {FORMAT_VERSION}")
    header_bytes, signature = envelope["h"], envelope["s"]
    if not isinstance(header_bytes, bytes) or not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        raise WireError("malformed", "herald fields h, s must be binary, s of 64 bytes")
    header = decode_header(header_bytes)
    if header.run_id != run_id:
        raise WireError("wrong_run", f"herald is for run {header.run_id!r}, this peer runs {run_id!r}")
    if header.spec_hash != spec_hash:
        raise WireError("wrong_spec", f"herald has spec hash {header.spec_hash!r}, this run has {spec_hash!r}")
    if not verify_blob(header.sender, UPDATE_DOMAIN, header_bytes, signature):
        raise WireError("bad_signature", f"herald not signed by its sender {header.sender}")
    return header, hashlib.sha256(header_bytes).digest()
