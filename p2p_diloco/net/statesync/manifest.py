"""The state-sync protocol: its two RPCs and the signed manifest, and how a joiner verifies a manifest before it
fetches a single chunk (ARCHITECTURE.md, "The network").

Protocol: two RPCs per run on the donor's P2P replica (the donor's side: server.py; the joiner's: client.py).

  manifest  "p2p-diloco/<run_id>/manifest"
      request  = msgpack {"run_id", "spec_hash", "numel"}      the joiner's own (a mismatch is refused, saying so)
      response = msgpack {"m": manifest_bytes, "s": sign_blob(donor identity, MANIFEST_DOMAIN, manifest_bytes)}
      manifest = msgpack {run_id, spec_hash, donor, snapshot_id, created_at, numel, dtype: "float32",
                          chunk_bytes, version_vector: {sender: seq}, chunk_digests: [sha256 of each chunk],
                          version_vector_holes: {sender: [seq, ...]} (optional: the seqs below an entry that
                          the snapshot has not merged)}
  chunk     "p2p-diloco/<run_id>/chunk"
      request  = msgpack {"snapshot_id", "index"}
      response = bytes [index * chunk_bytes, (index + 1) * chunk_bytes) of theta as little-endian float32
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

from p2p_diloco.config.network import MAX_CHUNK_BYTES
from p2p_diloco.sync.authors import MAX_INHERITED
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.identity import verify_blob

MANIFEST_DOMAIN = b"p2p-diloco/manifest/v1"
MAX_REQUEST_BYTES = 1024
_DIGEST_BYTES = 32
_SIGNATURE_BYTES = 64
_MANIFEST_KEYS = {"run_id", "spec_hash", "donor", "snapshot_id", "created_at", "numel", "dtype", "chunk_bytes",
                  "version_vector", "chunk_digests"}
_OPTIONAL_KEYS = {"version_vector_holes", "standing"}


class DonorError(Exception):
    """One donor served something unverifiable; the joiner moves on to the next donor. `reason` is counted:
    bad_manifest, bad_chunk or nonfinite_chunk."""

    def __init__(self, message: str, reason: str = "bad_manifest") -> None:
        super().__init__(message)
        self.reason = reason


def manifest_name(run_id: str) -> str:
    return f"p2p-diloco/{run_id}/manifest"


def chunk_name(run_id: str) -> str:
    return f"p2p-diloco/{run_id}/chunk"


def unpack(data: bytes, what: str, **limits: int) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0, **limits)
    except Exception as e:  # msgpack raises a zoo of types on garbage
        raise ValueError(f"malformed {what}: {type(e).__name__}: {e}") from None


@dataclass(frozen=True)
class Manifest:
    """A verified manifest."""

    donor: str
    snapshot_id: str
    created_at: float
    chunk_bytes: int
    chunk_digests: tuple[bytes, ...]
    version_vector: VersionVector
    trusted: tuple[str, ...] = ()  # the donor's authors in good standing (sync/standing.py `inherit`)
    distrusted: tuple[str, ...] = ()


def parse_manifest(response: bytes, *, donor: str, run_id: str, spec_hash: str, numel: int,
                   max_manifest_bytes: int) -> Manifest:
    """Verify a manifest response from `donor`; DonorError saying what is wrong with it."""
    try:
        return _parse_manifest(response, donor=donor, run_id=run_id, spec_hash=spec_hash, numel=numel,
                               max_manifest_bytes=max_manifest_bytes)
    except RecursionError:  # ~1000 nested arrays where a scalar belongs: formatting or parsing it recurses
        raise DonorError("manifest refused: a field is nested too deeply") from None


def _signed_fields(response: bytes, *, donor: str, max_manifest_bytes: int) -> dict[str, Any]:
    """The manifest's fields, once its envelope, its signature by `donor` and its set of keys check out."""
    if len(response) > max_manifest_bytes:
        raise DonorError(f"manifest is {len(response)} bytes, limit {max_manifest_bytes}")
    try:
        outer = unpack(response, "manifest envelope", max_array_len=0, max_map_len=2)
        if not isinstance(outer, dict) or set(outer) != {"m", "s"} or not isinstance(outer["m"], bytes):
            raise ValueError("manifest envelope must be {m: bytes, s: bytes}")
    except ValueError as e:
        raise DonorError(str(e)) from None
    manifest_bytes, signature = outer["m"], outer["s"]
    if not (isinstance(signature, bytes) and len(signature) == _SIGNATURE_BYTES
            and verify_blob(donor, MANIFEST_DOMAIN, manifest_bytes, signature)):
        raise DonorError("bad manifest signature (not signed by the donor)")
    try:
        m = unpack(manifest_bytes, "manifest", max_bin_len=_DIGEST_BYTES)
        if not isinstance(m, dict) or not _MANIFEST_KEYS <= set(m) <= _MANIFEST_KEYS | _OPTIONAL_KEYS:
            raise ValueError(f"manifest keys must be {sorted(_MANIFEST_KEYS)} (and {sorted(_OPTIONAL_KEYS)})")
    except ValueError as e:
        raise DonorError(str(e)) from None
    return m


def _parse_manifest(response: bytes, *, donor: str, run_id: str, spec_hash: str, numel: int,
                    max_manifest_bytes: int) -> Manifest:
    m = _signed_fields(response, donor=donor, max_manifest_bytes=max_manifest_bytes)

    def expect(ok: bool, why: str) -> None:
        if not ok:
            raise DonorError(f"manifest refused: {why}")

    expect(m["run_id"] == run_id, f"run {str(m['run_id'])[:64]!r}, ours is {run_id!r}")
    expect(m["spec_hash"] == spec_hash, f"spec hash {str(m['spec_hash'])[:16]}, ours is {spec_hash[:16]}")
    expect(m["donor"] == donor, "it names another donor")
    expect(type(m["numel"]) is int and m["numel"] == numel, f"numel {str(m['numel'])[:24]}, ours is {numel}")
    expect(m["dtype"] == "float32", f"dtype {str(m['dtype'])[:16]!r}, expected 'float32'")
    chunk_bytes = m["chunk_bytes"]
    expect(type(chunk_bytes) is int and 0 < chunk_bytes <= MAX_CHUNK_BYTES and chunk_bytes % 4 == 0,
           f"chunk_bytes must be a multiple of 4 in (0, {MAX_CHUNK_BYTES}]")
    digests = m["chunk_digests"]
    n_chunks = math.ceil(numel * 4 / chunk_bytes)
    expect(isinstance(digests, list) and len(digests) == n_chunks,
           f"{len(digests) if isinstance(digests, list) else '?'} chunk digests, {n_chunks} expected")
    expect(all(isinstance(d, bytes) and len(d) == _DIGEST_BYTES for d in digests), "chunk digests must be sha256")
    snapshot_id = m["snapshot_id"]
    expect(isinstance(snapshot_id, str) and 0 < len(snapshot_id) <= 64, "bad snapshot_id")
    expect(type(m["created_at"]) in (int, float) and math.isfinite(m["created_at"]), "bad created_at")
    try:
        vv = VersionVector.from_dict(m["version_vector"], holes=m.get("version_vector_holes"))
    except ValueError as e:
        raise DonorError(f"manifest refused: bad version vector: {e}") from None
    standing = m.get("standing", {})
    expect(isinstance(standing, dict) and set(standing) <= {"good", "distrusted"}
           and all(isinstance(v, list) and len(v) <= MAX_INHERITED and all(isinstance(p, str) and 0 < len(p) <= 128
                                                                          for p in v) for v in standing.values()),
           f"standing must be {{good, distrusted}}: lists of at most {MAX_INHERITED} PeerIDs")
    return Manifest(donor, snapshot_id, float(m["created_at"]), chunk_bytes, tuple(digests), vv,
                    tuple(standing.get("good", ())), tuple(standing.get("distrusted", ())))
