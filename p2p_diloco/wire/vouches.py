"""A sponsor's verdicts as they ride in its signed update header (wire/envelope.py `UpdateHeader.vouches`,
sync/sponsorship.py): VOUCH_BYTES per verdict, the judged update's slot key (`slot_key`, VOUCH_ID_BYTES), then its
value in [0, 1] in 1/65535ths, big-endian."""

from __future__ import annotations

import hashlib

MAX_VOUCHES = 64
"""Most verdicts one update carries (a sponsor judges what it merged in one phase; the rest it leaves out)."""
VOUCH_ID_BYTES = 16
VOUCH_BYTES = VOUCH_ID_BYTES + 2


def slot_key(run_id: str, sender: str, seq: int) -> bytes:
    """What a vouch names: the slot (run, author, seq), not the update's id, so that a graduate proves its record
    with the sponsors' headers alone (sync/graduation.py). Two updates in one slot are equivocation, evidence
    against their author anyway."""
    digest = hashlib.sha256(b"p2p-diloco/slot/v1\x00" + run_id.encode() + b"\x00" + sender.encode() + b"\x00"
                            + seq.to_bytes(8, "big"))
    return digest.digest()[:VOUCH_ID_BYTES]


def pack_vouches(verdicts: list[tuple[bytes, float]]) -> bytes:
    """(slot key, value in [0, 1]) verdicts, in the order given (at most MAX_VOUCHES), as a header carries them."""
    if len(verdicts) > MAX_VOUCHES:
        raise ValueError(f"at most {MAX_VOUCHES} vouches per update, got {len(verdicts)}")
    out = bytearray()
    for update_id, value in verdicts:
        if len(update_id) < VOUCH_ID_BYTES or not 0.0 <= value <= 1.0:
            raise ValueError(f"a vouch needs a slot key and a value in [0, 1], got {update_id!r}, {value}")
        out += update_id[:VOUCH_ID_BYTES] + round(value * 65535).to_bytes(2, "big")
    return bytes(out)


def unpack_vouches(blob: bytes) -> list[tuple[bytes, float]]:
    """(update_id prefix, value) per verdict of a header's `vouches` (checked by the envelope: whole rows)."""
    return [(blob[i:i + VOUCH_ID_BYTES], int.from_bytes(blob[i + VOUCH_ID_BYTES:i + VOUCH_BYTES], "big") / 65535)
            for i in range(0, len(blob), VOUCH_BYTES)]
