"""Equivocation evidence: two signed updates from one sender for one slot, checkable by anyone.

A sender that signs two different updates for the same `(sender, seq)` splits the swarm: peers that merged
one can never merge the other (ARCHITECTURE.md "The merge rule"). The pair of raw envelopes is a proof nobody can forge,
because both signatures are the sender's: a peer that holds it bans the sender (`Replica.ban`), keeps it
(`Intake.evidence`) and gossips it; a peer that receives it re-verifies it with `check_evidence` and only then
bans too (`Intake.accept_evidence`). No peer has to trust another's word.

Wire format of a gossiped proof (`encode_evidence`): msgpack `[first_envelope, second_envelope]`, each an
`encode_update` envelope, in canonical order (by update id) so that one proof has one encoding.
"""

from __future__ import annotations

import msgpack

from p2p_diloco.wire.envelope import OuterUpdate, WireError, decode_update, encode_update

EVIDENCE_REASON = "bad_evidence"


class EvidenceError(WireError):
    """Two envelopes that are not a proof of equivocation (a WireError, so callers counting rejections by
    `reason` need no new branch); `reason` is "bad_evidence"."""

    def __init__(self, message: str) -> None:  # WireError only knows the envelope's reasons
        ValueError.__init__(self, f"{EVIDENCE_REASON}: {message}")
        self.reason = EVIDENCE_REASON
        self.detail = message

    # Pickled with its one argument; WireError's stub says two (reason, message), hence the ignore.
    def __reduce__(self) -> tuple[type[EvidenceError], tuple[str]]:  # type: ignore[override]
        return EvidenceError, (self.detail,)


def check_evidence(first: bytes, second: bytes, *, run_id: str, spec_hash: str, max_bytes: int) -> str:
    """Re-verify a proof of equivocation and return the guilty sender's PeerID.

    Both envelopes must decode and verify as updates of this run (`decode_update`: size, format, run, spec,
    signature, digest; its WireError propagates), name the same sender and seq, and differ in content
    (`update_id`). Anything else raises: EvidenceError (reason "bad_evidence") or the WireError of the
    envelope that failed. Cost: two signature checks and two hashes of at most `max_bytes` each.
    """
    return verified_pair(first, second, run_id=run_id, spec_hash=spec_hash, max_bytes=max_bytes)[0]


def verified_pair(first: bytes, second: bytes, *, run_id: str, spec_hash: str,
                  max_bytes: int) -> tuple[str, tuple[bytes, bytes]]:
    """`check_evidence`, also returning the two envelopes in canonical order (smaller update id first)."""
    a = decode_update(first, max_bytes=max_bytes, run_id=run_id, spec_hash=spec_hash)
    b = decode_update(second, max_bytes=max_bytes, run_id=run_id, spec_hash=spec_hash)
    if a.sender != b.sender:
        raise EvidenceError(f"the two updates have different senders ({a.sender[:16]}, {b.sender[:16]})")
    if a.seq != b.seq:
        raise EvidenceError(f"the two updates have different seqs ({a.seq}, {b.seq}) from {a.sender[:16]}")
    if a.update_id == b.update_id:
        raise EvidenceError(f"the two envelopes carry the same update (sender {a.sender[:16]}, seq {a.seq})")
    return a.sender, ((bytes(first), bytes(second)) if a.update_id < b.update_id else (bytes(second), bytes(first)))


def evidence_pair(first: OuterUpdate, second: OuterUpdate) -> tuple[bytes, bytes]:
    """The raw envelopes of two conflicting updates, in canonical order (smaller update id first)."""
    if second.update_id < first.update_id:
        first, second = second, first
    return encode_update(first), encode_update(second)


def encode_evidence(pair: tuple[bytes, bytes]) -> bytes:
    """One proof as bytes for gossip."""
    packed: bytes = msgpack.packb(list(pair), use_bin_type=True)  # msgpack is untyped; packb returns bytes
    return packed


def decode_evidence(data: bytes, *, max_bytes: int) -> tuple[bytes, bytes]:
    """Parse `encode_evidence` output (not yet verified: pass the result to `check_evidence`). `max_bytes` is
    the bound on one envelope; EvidenceError if the container is malformed or too large."""
    if not isinstance(data, (bytes, bytearray)) or len(data) > 2 * max_bytes + 64:
        raise EvidenceError(f"evidence is not bytes of at most {2 * max_bytes + 64}")
    try:
        pair = msgpack.unpackb(data, raw=False, max_bin_len=max_bytes, max_str_len=0, max_array_len=2,
                               max_map_len=0, max_ext_len=0)
    except Exception as exc:  # any failure of the parser on untrusted bytes is a rejection
        raise EvidenceError(f"cannot parse evidence: {type(exc).__name__}") from None
    if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, bytes) for p in pair)):
        raise EvidenceError("evidence must be an array of two binary envelopes")
    return pair[0], pair[1]
