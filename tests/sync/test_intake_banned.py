"""A banned sender's update costs its header (sync/intake.py, with wire/envelope.py `claimed_sender`): refused
before the signature and the payload digest, counted as rejected_banned; anything else still meets every check."""

from __future__ import annotations

import msgpack
import torch

from p2p_diloco.config import preset
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.replica import Replica
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import OuterUpdate, claimed_sender, encode_update, make_update
from p2p_diloco.wire.identity import Identity

SPEC = preset("test")
NUMEL = 64
CODEC = get_codec(SPEC.outer.codec, SPEC.outer.codec_block)


def _signed(who: Identity, seq: int) -> OuterUpdate:
    d = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seq)) * 0.01
    return make_update(run_id=SPEC.run_id, spec_hash=SPEC.spec_hash(), seq=seq, tau=0, samples=8, weight=0.25,
                       codec=SPEC.outer.codec, numel=NUMEL, payload=CODEC.compress(d), identity=who)


def _forged(u: OuterUpdate) -> bytes:
    """`u`'s header under a zero signature and a payload that matches no digest."""
    return msgpack.packb({"v": 1, "h": u.header_bytes, "s": b"\0" * 64, "p": b"\xff" + bytes(u.payload)[1:]},
                         use_bin_type=True)


def test_a_banned_senders_update_is_refused_from_its_header() -> None:
    alice, bob = Identity.generate(), Identity.generate()
    intake = Intake(SPEC, NUMEL, Replica.from_spec(SPEC, torch.zeros(NUMEL), codec=CODEC))
    assert claimed_sender(encode_update(_signed(alice, 1)), SPEC.run_id, SPEC.spec_hash()) == alice.peer_id
    assert claimed_sender(b"\x93garbage", SPEC.run_id, SPEC.spec_hash()) is None
    assert claimed_sender(encode_update(_signed(alice, 1)), "another-run", SPEC.spec_hash()) is None
    assert intake.receive(_forged(_signed(alice, 1)))[0] == "bad_signature"  # not banned: every check
    intake.replica.ban(alice.peer_id, "test")
    # Refused before the signature (zeros) and the digest (tampered) are looked at: a header's cost.
    assert intake.receive(_forged(_signed(alice, 2))) == ("rejected_banned", None)
    assert intake.receive(encode_update(_signed(alice, 3))) == ("rejected_banned", None)
    assert intake.counts["rejected_banned"] == 2 and intake.counts["bad_signature"] == 1
    # Others are untouched: bob's forgery is still a bad signature, his honest update merges.
    assert intake.receive(_forged(_signed(bob, 1)))[0] == "bad_signature"
    assert intake.receive(encode_update(_signed(bob, 1)))[0] == "merged"
