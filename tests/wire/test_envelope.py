"""Envelope: signed updates round-trip, and every way a message can be wrong is rejected with its reason."""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_diloco.wire.envelope import (
    FORMAT_VERSION,
    REJECT_REASONS,
    UPDATE_DOMAIN,
    OuterUpdate,
    WireError,
    decode_update,
    encode_update,
    make_update,
    retained,
    sign_blob,
    verify_blob,
)
from p2p_diloco.wire.identity import Identity

RUN, SPEC = "run-1", "ab" * 32
MAX = 1 << 20
ALICE, MALLORY = Identity.generate(), Identity.generate()  # immutable keys, shared to keep tests fast


def _update(identity: Identity = ALICE, payload: bytes = b"\x01\x02\x03" * 10, **fields: Any) -> OuterUpdate:
    args: dict[str, Any] = dict(run_id=RUN, spec_hash=SPEC, seq=1, tau=2, samples=512, weight=0.25, codec="int8",
                                numel=26, created_at=1700000000.5)
    args.update(fields)
    return make_update(payload=payload, identity=identity, **args)


def _envelope(header: list[Any] | bytes, signer: Identity, payload: bytes, *, v: Any = FORMAT_VERSION,
              signature: bytes | None = None, **extra: Any) -> bytes:
    """An envelope around an arbitrary header, signed by `signer`: how a hostile peer would build one."""
    header_bytes = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    if signature is None:
        signature = sign_blob(signer, UPDATE_DOMAIN, header_bytes)
    return msgpack.packb({"v": v, "h": header_bytes, "s": signature, "p": payload, **extra}, use_bin_type=True)


def _reason(data: bytes, **kwargs: Any) -> str:
    with pytest.raises(WireError) as info:
        decode_update(data, max_bytes=kwargs.pop("max_bytes", MAX), **kwargs)
    return info.value.reason


def test_roundtrip() -> None:
    u = _update()
    data = encode_update(u)
    got = decode_update(data, max_bytes=len(data), run_id=RUN, spec_hash=SPEC)
    assert got == u
    assert got.update_id == hashlib.sha256(u.header_bytes).digest() == u.update_id
    assert (got.sender, got.seq) == (ALICE.peer_id, 1)
    h = got.header
    assert (h.tau, h.samples, h.weight, h.codec, h.numel, h.created_at) == (2, 512, 0.25, "int8", 26, 1700000000.5)
    assert h.payload_len == 30 and h.payload_digest == hashlib.sha256(u.payload).digest()
    # Without run/spec filters the update still authenticates.
    assert decode_update(data, max_bytes=MAX) == u


def test_empty_payload_and_extremes() -> None:
    u = _update(payload=b"", numel=0, tau=0, samples=0, weight=0.0, seq=2**63 - 1)
    assert decode_update(encode_update(u), max_bytes=MAX) == u


def test_equivocation_has_distinct_update_ids() -> None:
    a, b = _update(payload=b"one"), _update(payload=b"two")
    assert (a.sender, a.seq) == (b.sender, b.seq) and a.update_id != b.update_id
    assert _update(payload=b"one").update_id == a.update_id  # same content, same id


def test_oversize() -> None:
    data = encode_update(_update())
    assert _reason(data, max_bytes=len(data) - 1) == "oversize"


def test_malformed() -> None:
    u = _update()
    data = encode_update(u)
    cases = {
        "truncated": data[:-1],
        "trailing bytes": data + b"\x00",
        "empty": b"",
        "not a map": msgpack.packb([1, u.header_bytes, u.signature, u.payload]),
        "missing key": msgpack.packb({"v": 1, "h": u.header_bytes, "s": u.signature}),
        "extra key": _envelope(u.header_bytes, ALICE, u.payload, x=b""),
        "string payload": msgpack.packb({"v": 1, "h": u.header_bytes, "s": u.signature, "p": "text"}),
        "short signature": _envelope(u.header_bytes, ALICE, u.payload, signature=u.signature[:63]),
        "version not int": _envelope(u.header_bytes, ALICE, u.payload, v="1"),
        "bool version": _envelope(u.header_bytes, ALICE, u.payload, v=True),
        "ext type": msgpack.packb(msgpack.ExtType(1, b"x" * 10)),
        "random": bytes(range(256)),
    }
    for name, bad in cases.items():
        assert _reason(bad) == "malformed", name


def test_format_version() -> None:
    u = _update()
    assert _reason(_envelope(u.header_bytes, ALICE, u.payload, v=2)) == "format_version"
    # A future version may change the shape; it is still reported as a version mismatch.
    assert _reason(msgpack.packb({"v": 2, "anything": [1, 2]})) == "format_version"


def test_bad_header() -> None:
    u = _update()
    good = u.header.to_list()

    def with_field(i: int, value: Any) -> bytes:
        fields = list(good)
        fields[i] = value
        return _envelope(fields, ALICE, u.payload)

    cases = {
        "too few fields": _envelope(good[:-1], ALICE, u.payload),
        "map header": _envelope({"run_id": RUN}, ALICE, u.payload),
        "not msgpack": _envelope(b"\xc1", ALICE, u.payload),
        "seq 0": with_field(3, 0),
        "bool seq": with_field(3, True),
        "negative tau": with_field(4, -1),
        "float samples": with_field(5, 5.0),
        "nan weight": with_field(6, float("nan")),
        "inf weight": with_field(6, float("inf")),
        "negative weight": with_field(6, -0.5),
        "int weight": with_field(6, 1),
        "unknown codec": with_field(7, "zstd"),
        "empty run": with_field(0, ""),
        "garbage sender": with_field(2, "QmNotAnEd25519Key"),
        "short digest": with_field(10, b"\x00" * 31),
        "huge numel": with_field(8, 2**64 - 1),
        "non-canonical": _envelope(msgpack.packb(good, use_single_float=True), ALICE, u.payload),
    }
    for name, bad in cases.items():
        assert _reason(bad) == "bad_header", name


def test_make_update_refuses_bad_fields() -> None:
    for bad in (dict(seq=0), dict(weight=float("nan")), dict(codec="gzip"), dict(run_id="x" * 200)):
        with pytest.raises(WireError) as info:
            _update(**bad)
        assert info.value.reason == "bad_header"


def test_make_update_sender_must_be_signer() -> None:
    assert _update(sender=ALICE.peer_id).sender == ALICE.peer_id
    with pytest.raises(ValueError):
        _update(sender=MALLORY.peer_id)


def test_wrong_run_and_spec() -> None:
    data = encode_update(_update())
    assert _reason(data, run_id="other-run") == "wrong_run"
    assert _reason(data, run_id=RUN, spec_hash="cd" * 32) == "wrong_spec"


def test_bad_signature() -> None:
    u = _update()
    header = u.header.to_list()
    tampered = list(header)
    tampered[6] = 1.0  # raise own weight after signing
    forged = list(header)  # Mallory signs a header that names Alice as sender
    cases = {
        "tampered header": _envelope(tampered, ALICE, u.payload, signature=u.signature),
        "other key": _envelope(forged, MALLORY, u.payload),
        "flipped signature bit": _envelope(u.header_bytes, ALICE, u.payload,
                                           signature=bytes([u.signature[0] ^ 1]) + u.signature[1:]),
        # A plain signature of the header bytes, made for some other purpose, must not count (domain separation).
        "untagged signature": _envelope(u.header_bytes, ALICE, u.payload, signature=ALICE.sign(u.header_bytes)),
        "other domain": _envelope(u.header_bytes, ALICE, u.payload,
                                  signature=sign_blob(ALICE, b"p2p-diloco/dht-record/v1", u.header_bytes)),
    }
    for name, bad in cases.items():
        assert _reason(bad) == "bad_signature", name


def test_bad_digest() -> None:
    u = _update()
    flipped = bytes([u.payload[0] ^ 0xFF]) + u.payload[1:]
    assert _reason(_envelope(u.header_bytes, ALICE, flipped, signature=u.signature)) == "bad_digest"
    assert _reason(_envelope(u.header_bytes, ALICE, u.payload + b"\x00", signature=u.signature)) == "bad_digest"
    assert _reason(_envelope(u.header_bytes, ALICE, b"", signature=u.signature)) == "bad_digest"


def test_check_order() -> None:
    # A message wrong in several ways is reported by its first failed check, so cheap checks run first.
    u = _update()
    bad_everything = _envelope(u.header_bytes, MALLORY, b"tampered")
    assert _reason(bad_everything, run_id="other") == "wrong_run"
    assert _reason(bad_everything) == "bad_signature"


def test_sign_blob_domains() -> None:
    sig = sign_blob(ALICE, b"a", b"bc")
    assert verify_blob(ALICE.peer_id, b"a", b"bc", sig)
    assert not verify_blob(ALICE.peer_id, b"ab", b"c", sig)  # no prefix ambiguity between domains
    assert not verify_blob(MALLORY.peer_id, b"a", b"bc", sig)
    assert not verify_blob(ALICE.peer_id, "a", b"bc", sig)  # type: ignore[arg-type]
    assert not verify_blob(ALICE.peer_id, b"", b"bc", sig)
    assert not verify_blob("garbage", b"a", b"bc", sig)
    assert not verify_blob(ALICE.peer_id, b"a", None, sig)  # type: ignore[arg-type]


def test_wire_error_reasons() -> None:
    assert WireError("oversize", "x").reason == "oversize"
    assert isinstance(WireError("malformed", "x"), ValueError)
    with pytest.raises(ValueError):
        WireError("nope", "x")
    assert len(set(REJECT_REASONS)) == 8
    copy = pickle.loads(pickle.dumps(WireError("bad_digest", "detail")))
    assert (copy.reason, str(copy)) == ("bad_digest", "bad_digest: detail")


FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(data=st.binary(max_size=600))
def test_arbitrary_bytes_raise_only_wire_error(data: bytes) -> None:
    with pytest.raises(WireError):
        decode_update(data, max_bytes=MAX, run_id=RUN, spec_hash=SPEC)


@FUZZ
@given(data=st.data())
def test_mutated_updates_raise_only_wire_error(data: st.DataObject) -> None:
    u = _update()
    original = bytearray(encode_update(u))
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        i = data.draw(st.integers(0, max(len(original) - 1, 0)))
        if op == "flip" and original:
            original[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del original[i: i + data.draw(st.integers(1, 8))]
        else:
            original[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        got = decode_update(bytes(original), max_bytes=MAX)
    except WireError as exc:
        assert exc.reason in REJECT_REASONS
    else:
        # A mutation can only get through if it changed nothing that is signed or digested.
        assert got == u


@FUZZ
@given(obj=st.recursive(st.none() | st.booleans() | st.integers(-2**64 + 1, 2**64 - 1) | st.floats() | st.text()
                        | st.binary(), lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(), c, max_size=5),
                        max_leaves=20))
def test_arbitrary_msgpack_raises_only_wire_error(obj: Any) -> None:
    try:
        data = msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, ValueError):
        return
    with pytest.raises(WireError):
        decode_update(data, max_bytes=MAX)


def test_retained_update_holds_its_envelope_once() -> None:
    u = _update()
    kept = retained(u)
    # the caller's object is left as it was: it keeps no copy of the envelope (a buffer holding it would then
    # hold the payload twice)
    assert "encoded" not in u.__dict__
    assert kept == u and kept.update_id == u.update_id and encode_update(kept) is kept.encoded
    assert encode_update(kept) == encode_update(u) and decode_update(kept.encoded, max_bytes=MAX) == u


def test_a_sponsors_verdicts_ride_in_the_signed_header_and_only_in_one_encoding() -> None:
    from p2p_diloco.wire.vouches import MAX_VOUCHES, VOUCH_BYTES, pack_vouches, unpack_vouches

    ids = [hashlib.sha256(b"%d" % i).digest() for i in range(MAX_VOUCHES)]
    vouches = pack_vouches([(i, k / (MAX_VOUCHES - 1)) for k, i in enumerate(ids)])
    u = _update(vouches=vouches)
    got = decode_update(encode_update(u), max_bytes=MAX, run_id=RUN, spec_hash=SPEC)
    assert got == u and len(got.header.vouches) == MAX_VOUCHES * VOUCH_BYTES
    values = unpack_vouches(got.header.vouches)
    assert [i for i, _ in values] == [i[:16] for i in ids] and values[0][1] == 0.0 and values[-1][1] == 1.0
    assert _update().header.to_list() == _update(vouches=b"").header.to_list()  # none: the 12-field header of old
    fields = _update().header.to_list()
    assert _reason(_envelope([*fields, b""], ALICE, b"\x01\x02\x03" * 10)) == "bad_header"  # empty but present
    assert _reason(_envelope([*fields, b"x" * 17], ALICE, b"\x01\x02\x03" * 10)) == "bad_header"  # not 18-byte rows
    assert _reason(_envelope([*fields, b"x" * VOUCH_BYTES * (MAX_VOUCHES + 1)], ALICE,
                             b"\x01\x02\x03" * 10)) == "bad_header"
    with pytest.raises(ValueError):
        pack_vouches([(ids[0], 1.5)])
    with pytest.raises(ValueError):
        pack_vouches([(i, 0.5) for i in ids] + [(ids[0], 0.5)])


def test_a_declared_data_position_rides_in_the_signed_header_and_is_checked() -> None:
    from p2p_diloco.wire.position import DataPosition

    where = DataPosition(first_step=40, steps=20, shard=2, num_shards=5, salted=1)
    u = _update(data=where)
    got = decode_update(encode_update(u), max_bytes=MAX, run_id=RUN, spec_hash=SPEC)
    assert got == u and got.header.position == where and got.header.vouches == b""
    assert _update().header.position is None and len(_update().header.to_list()) == 12  # undeclared: as before
    fields = _update().header.to_list()
    payload = b"\x01\x02\x03" * 10
    assert decode_update(_envelope([*fields, b"", list(where)], ALICE, payload), max_bytes=MAX).header.position == where
    for bad in ([], [40, 20, 2, 5], [40, 0, 2, 5, 1], [40, 20, 5, 5, 1], [40, 20, 2, 5, 2], [-1, 20, 2, 5, 1],
                [40, 20.0, 2, 5, 1], [40, 20, 2, 5, True], "x"):
        assert _reason(_envelope([*fields, b"", bad], ALICE, payload)) == "bad_header", bad
    assert _reason(_envelope([*fields, b"", list(where), 1], ALICE, payload)) == "bad_header"  # one field too many
