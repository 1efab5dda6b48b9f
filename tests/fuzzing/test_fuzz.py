"""Fuzzing, CI size: hypothesis drives the fuzz targets of fuzz/targets.py (the long coverage-guided runs are
fuzz/run_all.sh). Every target asserts its parser's contract: only the documented error type, and no invalid
message accepted (anything accepted is exactly what the honest signer produced, or passes every field rule)."""

from __future__ import annotations

import contextlib
import functools
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz import harness, seeds, targets
from p2p_diloco.net.statesync.manifest import DonorError, parse_manifest
from p2p_diloco.wire import codecs, envelope
from p2p_diloco.wire.codecs import CODEC_NAMES
from p2p_diloco.wire.envelope import MAX_DETAIL_CHARS, UPDATE_DOMAIN, WireError, decode_update
from p2p_diloco.wire.identity import sign_blob

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
F = seeds.fixtures()

SCALARS = (st.none() | st.booleans() | st.integers(-2**64 + 1, 2**64 - 1) | st.floats() | st.text(max_size=140)
           | st.binary(max_size=40)
           | st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, -2**63, 0.0, -0.0, float("inf"), float("nan"), "", b""]))
VALUES = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                      max_leaves=12)


def _nested(depth: int) -> Any:
    value: Any = None
    for _ in range(depth):
        value = [value]
    return value


# Just under msgpack's 1024-level limit, where repr() of an untrusted value hits Python's recursion limit.
DEEP = st.integers(998, 1010).map(_nested)


def _mutated(name: str) -> st.SearchStrategy[bytes]:
    corpus = F.seeds[name]
    return st.builds(lambda seed, rng: harness.mutate(rng, seed, corpus), st.sampled_from(corpus),
                     st.randoms(use_true_random=False))


def _replace_some(base: list[Any] | dict[str, Any], draw: st.DrawFn) -> Any:
    """`base` with one to three fields replaced by arbitrary msgpack values (near-valid: the rest stays good),
    deeply nested ones included, which byte-level fuzzers practically never build."""
    out = list(base) if isinstance(base, list) else dict(base)
    keys = range(len(out)) if isinstance(out, list) else list(out)
    values = st.one_of(VALUES, DEEP)
    for key in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3)):
        out[key] = draw(values)
    return out


@contextlib.contextmanager
def _default_recursion_limit() -> Iterator[None]:
    """hypothesis raises the recursion limit while it runs a test, which hides RecursionErrors; peers parse
    with Python's default of 1000, under which msgpack's 1024 nesting levels are enough to overflow repr()."""
    saved = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        yield
    finally:
        sys.setrecursionlimit(saved)


def _pack(value: Any) -> bytes | None:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (OverflowError, ValueError):  # e.g. ints outside 64 bits: not a message anyone can send
        return None


def test_seeds_exercise_both_outcomes() -> None:
    """The oracles see valid and invalid inputs: each target accepts its valid seeds and refuses the others."""
    for name, target in targets.TARGETS.items():
        outcomes = [target(s) for s in F.seeds[name]]
        assert "accepted" in outcomes and any(o != "accepted" for o in outcomes), (name, outcomes)


# ---------------------------------------------------------------------------------------------- envelope


@FUZZ
@given(data=st.binary(max_size=512) | _mutated("envelope"))
def test_envelope_arbitrary_and_mutated(data: bytes) -> None:
    targets.envelope(data)


@FUZZ
@given(data=st.binary(max_size=512) | _mutated("herald"))
def test_herald_arbitrary_and_mutated(data: bytes) -> None:
    targets.herald(data)


@FUZZ
@given(data=st.data())
def test_envelope_hostile_sender(data: st.DataObject) -> None:
    """Headers a sender really signed, with fields of every type and range: rejected, or valid in every field."""
    update = data.draw(st.sampled_from(list(F.updates.values())))
    if data.draw(st.booleans()):
        fields = _replace_some(seeds.header_list(F.sender, update.payload), data.draw)
    else:  # tiny fields leave room for ~1000 levels of nesting in one of them, within the 1 KiB header limit
        fields = data.draw(st.lists(st.sampled_from([None, 0, -1, False]), min_size=12, max_size=12))
        fields[data.draw(st.just(0) | st.integers(0, 11))] = data.draw(DEEP)  # field 0 is checked first
    header = _pack(fields)
    if header is not None:
        payload = data.draw(st.just(update.payload) | st.binary(max_size=40))
        with _default_recursion_limit():
            targets.envelope_signed(seeds.signed_header_input(header, payload))


@FUZZ
@given(data=_mutated("envelope_signed"))
def test_envelope_hostile_sender_mutated(data: bytes) -> None:
    targets.envelope_signed(data)


def test_deeply_nested_header_field_is_a_wire_error() -> None:
    """Regression (found by this fuzzing): a 1 KiB header of ~1000 nested arrays made the rejection message's
    repr() raise RecursionError out of decode_update, before any signature check."""
    for depth in (990, 1000, 1011):
        header = b"\x9c" + b"\x91" * depth + b"\xc0" * 12
        data = msgpack.packb({"v": 1, "h": header, "s": bytes(64), "p": b""}, use_bin_type=True)
        with pytest.raises(WireError) as info:
            decode_update(data, max_bytes=1 << 20)
        assert info.value.reason == "bad_header" and len(str(info.value)) < 200


def test_wire_error_detail_is_bounded() -> None:
    """Rejection details quote the input and go to logs: a 100 kB binary map key must not make a 400 kB line."""
    data = msgpack.packb({b"k" * 100_000: 1, "v": 1}, use_bin_type=True)
    with pytest.raises(WireError) as info:
        decode_update(data, max_bytes=1 << 20)
    assert info.value.reason == "malformed" and len(info.value.detail) <= MAX_DETAIL_CHARS


def test_envelope_target_catches_a_forgery(monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle has teeth: with signature checks switched off, a forged update is reported as accepted."""
    u = next(iter(F.updates.values()))
    forged = seeds.envelope(u.header_bytes, sign_blob(F.forger, UPDATE_DOMAIN, u.header_bytes), u.payload)
    assert targets.envelope(forged) == "bad_signature"
    monkeypatch.setattr(envelope, "verify_blob", lambda *args: True)
    with pytest.raises(AssertionError, match="differs from the signed one"):
        targets.envelope(forged)


# ---------------------------------------------------------------------------------------------- codecs


@FUZZ
@given(data=st.data())
def test_codec_payloads_of_exact_size(data: st.DataObject) -> None:
    """Random payloads of exactly the right size: refused iff the reference decoder refuses, else bit-identical."""
    index = data.draw(st.integers(0, len(CODEC_NAMES) - 1))
    block, numel = data.draw(st.integers(0, 70)), data.draw(st.integers(0, 300))
    head = bytes([index]) + block.to_bytes(2, "little") + numel.to_bytes(8, "little")
    codec, _, _, _ = targets._codec_from(head)
    body = data.draw(st.binary(min_size=codec.payload_bytes(numel), max_size=codec.payload_bytes(numel)))
    targets.codec(head + body)


@FUZZ
@given(data=st.binary(max_size=600) | _mutated("codec"))
def test_codec_arbitrary_and_mutated(data: bytes) -> None:
    targets.codec(data)


def test_codec_target_catches_a_non_finite_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle has teeth: if int8 stopped refusing overflowing q * scale, the target reports it."""
    head = bytes([CODEC_NAMES.index("int8")]) + (3).to_bytes(2, "little") + (4).to_bytes(8, "little")
    payload = bytes.fromhex("ffff7f7f") + bytes([127] * 4)  # one block: scale = FLT_MAX, q = 127 -> inf
    assert targets.codec(head + payload) == "refused"
    monkeypatch.setattr(codecs, "_finite_or_raise", lambda out, name: out)
    with pytest.raises(AssertionError, match="accepted an invalid payload"):
        targets.codec(head + payload)


# ---------------------------------------------------------------------------------------------- state sync


@FUZZ
@given(data=st.binary(max_size=512) | _mutated("manifest"))
def test_manifest_arbitrary_and_mutated(data: bytes) -> None:
    targets.manifest(data)


@FUZZ
@given(data=st.data())
def test_manifest_hostile_donor(data: st.DataObject) -> None:
    """Manifests the donor really signed, with fields of every type: DonorError, or valid in every field."""
    body = _pack(_replace_some(seeds.manifest_dict(F.donor), data.draw))
    if body is not None:
        with _default_recursion_limit():
            targets.manifest_signed(body)


@FUZZ
@given(data=_mutated("manifest_signed"))
def test_manifest_hostile_donor_mutated(data: bytes) -> None:
    targets.manifest_signed(data)


@pytest.mark.parametrize("field", ["run_id", "version_vector"])
def test_manifest_deeply_nested_field_is_a_donor_error(field: str) -> None:
    """A signed manifest (hostile donor) with a deeply nested value where a scalar belongs."""
    value = _nested(1000) if field == "run_id" else {"sender": _nested(1000)}
    body = msgpack.packb(seeds.manifest_dict(F.donor, **{field: value}), use_bin_type=True)
    with pytest.raises(DonorError):
        parse_manifest(seeds.manifest_response(F.donor, body), donor=F.donor.peer_id, run_id=seeds.RUN,
                       spec_hash=seeds.SPEC, numel=seeds.MANIFEST_NUMEL, max_manifest_bytes=1 << 20)


# ---------------------------------------------------------------------------------------------- gossip, discovery


@FUZZ
@given(data=st.binary(max_size=256) | _mutated("gossip_request")
       | st.builds(lambda pull, v: bytes([pull]) + (_pack(v) or b""), st.integers(0, 1),
                   st.fixed_dictionaries({"vv": VALUES}, optional={"limit": VALUES})))
def test_gossip_request(data: bytes) -> None:
    targets.gossip_request(data)


@FUZZ
@given(data=_mutated("peer_record") | st.builds(lambda v: b"\x00" + (_pack(v) or b""),
                                               st.dictionaries(st.sampled_from(["peer_id", "run_id",
                                                                                "expiration_time", "maddrs"]),
                                                               VALUES | st.just(seeds.RUN), max_size=4)))
def test_peer_record(data: bytes) -> None:
    targets.peer_record(data)


# ---------------------------------------------------------------------------------------------- harness


def test_mutate_engine_runs_and_reports_crashes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert harness._run_mutate("envelope", targets.envelope, F.seeds["envelope"], 300, tmp_path, seed=1) == 0
    assert "fuzz-summary target=envelope engine=mutate runs=300" in capsys.readouterr().out

    def broken(data: bytes) -> str:
        if len(data) > 100:
            raise AssertionError("boom")
        return "ok"

    assert harness._run_mutate("broken", broken, F.seeds["envelope"], 300, tmp_path, seed=1) == 1
    assert "crashes=1" in capsys.readouterr().out and list(tmp_path.glob("broken-crash-*"))


def test_mutate_is_deterministic() -> None:
    corpus = F.seeds["envelope"]
    run = functools.partial(harness.mutate, corpus=corpus)
    assert [run(random.Random(7), s) for s in corpus] == [run(random.Random(7), s) for s in corpus]
