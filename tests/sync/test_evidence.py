"""Equivocation evidence: made from what a peer saw, re-verified by any other peer before it bans too."""

from __future__ import annotations

import pickle

import msgpack
import pytest
import torch

from p2p_diloco.config import preset
from p2p_diloco.sync.evidence import (
    EvidenceError,
    check_evidence,
    decode_evidence,
    encode_evidence,
    evidence_pair,
)
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import OuterUpdate, WireError, encode_update, make_update
from p2p_diloco.wire.identity import Identity

SPEC = preset("test")
NUMEL = 64
CODEC = get_codec(SPEC.outer.codec, SPEC.outer.codec_block)
KEYS = [Identity.generate() for _ in range(2)]


def update(identity: Identity, seq: int, seed: int = 0, run_id: str | None = None) -> OuterUpdate:
    d = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * 0.01
    return make_update(run_id=run_id or SPEC.run_id, spec_hash=SPEC.spec_hash(), seq=seq, tau=0, samples=8,
                       weight=0.25, codec=SPEC.outer.codec, numel=NUMEL, payload=CODEC.compress(d), identity=identity)


def intake(store: UpdateStore | None = None) -> Intake:
    result = Intake(SPEC, NUMEL, Replica.from_spec(SPEC, torch.zeros(NUMEL), codec=CODEC))
    if store is not None:
        result.attach_store(store)
    return result


def check(first: bytes, second: bytes) -> str:
    return check_evidence(first, second, run_id=SPEC.run_id, spec_hash=SPEC.spec_hash(), max_bytes=1 << 20)


def test_a_real_equivocation_is_evidence_in_either_order() -> None:
    a, b = update(KEYS[0], 3, seed=1), update(KEYS[0], 3, seed=2)
    first, second = evidence_pair(a, b)
    assert check(first, second) == check(second, first) == KEYS[0].peer_id
    assert evidence_pair(b, a) == (first, second)  # canonical order
    assert decode_evidence(encode_evidence((first, second)), max_bytes=1 << 20) == (first, second)


@pytest.mark.parametrize("make_pair, reason", [
    (lambda: (lambda u: (u, u))(update(KEYS[0], 3, 1)), "bad_evidence"),  # one update twice
    (lambda: (update(KEYS[0], 3, 1), update(KEYS[0], 4, 2)), "bad_evidence"),  # two slots
    (lambda: (update(KEYS[0], 3, 1), update(KEYS[1], 3, 2)), "bad_evidence"),  # two senders
    (lambda: (update(KEYS[0], 3, 1), update(KEYS[0], 3, 2, run_id="other")), "wrong_run"),
])
def test_what_is_not_evidence_is_refused(make_pair, reason: str) -> None:  # noqa: ANN001
    a, b = make_pair()
    with pytest.raises(WireError) as err:
        check(encode_update(a), encode_update(b))
    assert err.value.reason == reason


def test_a_forged_second_update_is_refused() -> None:
    a, b = update(KEYS[0], 3, seed=1), update(KEYS[1], 3, seed=2)
    # KEYS[1]'s signature over a header that names KEYS[0]: anyone could frame anyone this way; they cannot.
    forged = OuterUpdate(header=a.header, header_bytes=b.header_bytes, signature=b.signature, payload=b.payload)
    with pytest.raises(WireError) as err:
        check(encode_update(a), msgpack.packb({"v": 1, "h": a.header_bytes, "s": b.signature, "p": a.payload}))
    assert err.value.reason == "bad_signature"
    with pytest.raises(WireError):
        check(encode_update(a), encode_update(forged))


def test_evidence_errors_pickle_and_malformed_containers() -> None:
    err = pickle.loads(pickle.dumps(EvidenceError("nope")))
    assert isinstance(err, WireError) and err.reason == "bad_evidence"
    for bad in (b"\x00", msgpack.packb([b"x"]), msgpack.packb([b"a", "b"]), msgpack.packb([b"a"] * 3), b"x" * 100):
        with pytest.raises(EvidenceError):
            decode_evidence(bad, max_bytes=16)


def test_equivocation_against_a_merged_update_keeps_provable_evidence() -> None:
    store = UpdateStore(1 << 20)
    node = intake(store)
    good, evil = update(KEYS[0], 1, seed=1), update(KEYS[0], 1, seed=2)
    later = update(KEYS[0], 3, seed=3)
    assert node.receive(encode_update(good))[0] == "merged"
    store.add(good)  # as gossip does after a merge
    assert node.receive(encode_update(later))[0] == "buffered"
    store.add(later)
    assert node.receive(encode_update(evil))[0] == "equivocation"
    assert check(*node.evidence[KEYS[0].peer_id]) == KEYS[0].peer_id
    assert node.events["evidence_kept"] == 1 and node.counts["equivocation"] == 1
    assert KEYS[0].peer_id in node.replica.banned and store.senders() == []  # purged: never re-served
    assert not store.add(update(KEYS[0], 2)) and store.is_banned(KEYS[0].peer_id)


def test_equivocation_against_a_buffered_update_needs_no_store() -> None:
    node = intake()
    node.receive(encode_update(update(KEYS[0], 5, seed=1)))
    assert node.receive(encode_update(update(KEYS[0], 5, seed=2)))[0] == "equivocation"
    assert check(*node.evidence[KEYS[0].peer_id]) == KEYS[0].peer_id


def test_evidence_without_the_earlier_message_bans_locally_only() -> None:
    node = intake()  # no store: the merged update is gone
    node.receive(encode_update(update(KEYS[0], 1, seed=1)))
    assert node.receive(encode_update(update(KEYS[0], 1, seed=2)))[0] == "equivocation"
    assert KEYS[0].peer_id in node.replica.banned and KEYS[0].peer_id not in node.evidence
    assert node.events["evidence_incomplete"] == 1


def test_another_peer_verifies_then_bans_and_purges() -> None:
    witness = intake()
    witness.receive(encode_update(update(KEYS[0], 2, seed=1)))
    witness.receive(encode_update(update(KEYS[0], 2, seed=2)))
    proof = encode_evidence(witness.evidence[KEYS[0].peer_id])

    store = UpdateStore(1 << 20)
    peer = intake(store)
    honest_so_far = update(KEYS[0], 1, seed=7)
    assert peer.receive(encode_update(honest_so_far))[0] == "merged"
    store.add(honest_so_far)
    with pytest.raises(WireError):  # a bogus proof changes nothing
        peer.accept_evidence(encode_update(honest_so_far), encode_update(honest_so_far))
    assert KEYS[0].peer_id not in peer.replica.banned and peer.events["evidence_rejected"] == 1
    assert peer.accept_evidence(*decode_evidence(proof, max_bytes=peer.max_bytes)) == KEYS[0].peer_id
    assert KEYS[0].peer_id in peer.replica.banned and store.senders() == []
    assert peer.evidence[KEYS[0].peer_id] == witness.evidence[KEYS[0].peer_id]  # kept, to pass on
    assert peer.receive(encode_update(update(KEYS[0], 2, seed=1)))[0] == "rejected_banned"
    assert not peer.replica.ban(KEYS[0].peer_id, "again")  # already banned


def test_replicas_that_merged_different_versions_meet_again_after_the_ban() -> None:
    """The equivocation repair (Replica rule 7): A merged one version of the slot, B the other; with the same
    honest updates around it their thetas differ although their vectors are equal. A detects it (B's version
    reaches it), bans and takes its version back; B takes its own back on A's proof. Then theta_A == theta_B,
    V_A == V_B, and both equal a replica that never saw the slot."""
    evil, honest = KEYS
    one, two = update(evil, 2, seed=21), update(evil, 2, seed=22)
    common = [update(evil, 1, seed=20), update(honest, 1, seed=23), update(honest, 2, seed=24)]
    a, b, clean = intake(UpdateStore(1 << 20)), intake(UpdateStore(1 << 20)), intake()
    for node, version in ((a, one), (b, two), (clean, None)):
        for u in [common[0], version, *common[1:]] if version else common:
            assert node.receive(encode_update(u))[0] == "merged"
            if node.store is not None:
                node.store.add(u)
    assert a.replica.version_vector == b.replica.version_vector
    assert not torch.allclose(a.replica.theta, b.replica.theta)
    assert a.receive(encode_update(two))[0] == "equivocation"  # A sees the other version
    assert a.events["taken_back"] == 1 and a.replica.stats["unmerged"] == 1
    assert b.accept_evidence(*a.evidence[evil.peer_id]) == evil.peer_id
    assert b.events["taken_back"] == 1
    for node in (a, b):
        assert node.replica.version_vector == clean.replica.version_vector
        assert not node.replica.version_vector.has(evil.peer_id, 2) and node.replica.version_vector.has(evil.peer_id, 1)
        torch.testing.assert_close(node.replica.theta, clean.replica.theta, rtol=0, atol=1e-6)
    # the proof again changes nothing (nothing left to take back)
    b.replica.unmerge(one), b.replica.unmerge(two)
    torch.testing.assert_close(b.replica.theta, clean.replica.theta, rtol=0, atol=1e-6)


def _stored(node: Intake, *updates: OuterUpdate) -> None:
    for u in updates:
        assert node.receive(encode_update(u))[0] == "merged"
        node.store.add(u)


def test_a_split_over_several_slots_is_taken_back_from_the_proven_slot_on() -> None:
    evil, honest = KEYS
    first, h1 = update(evil, 1, seed=30), update(honest, 1, seed=31)
    a_two, a_three = update(evil, 2, seed=32), update(evil, 3, seed=33)
    b_two, b_three = update(evil, 2, seed=34), update(evil, 3, seed=35)
    a, b, clean = intake(UpdateStore(1 << 20)), intake(UpdateStore(1 << 20)), intake()
    _stored(a, first, a_two, a_three, h1)
    _stored(b, first, b_two, b_three, h1)
    for u in (first, h1):
        clean.receive(encode_update(u))
    assert a.receive(encode_update(b_two))[0] == "equivocation"
    assert b.accept_evidence(*a.evidence[evil.peer_id]) == evil.peer_id
    for node in (a, b):
        assert node.events["taken_back"] == 2  # seq 3, then the proven seq 2
        assert node.replica.version_vector == clean.replica.version_vector
        torch.testing.assert_close(node.replica.theta, clean.replica.theta, rtol=0, atol=1e-6)


def test_evidence_against_a_sender_banned_for_something_else_still_repairs() -> None:
    evil = KEYS[0]
    first, mine, theirs = update(evil, 1, seed=40), update(evil, 2, seed=41), update(evil, 2, seed=42)
    node, clean = intake(UpdateStore(1 << 20)), intake()
    _stored(node, first, mine)
    clean.receive(encode_update(first))
    assert node.replica.ban(evil.peer_id, "a later update failed a check")  # banned, nothing taken back
    assert node.replica.version_vector.has(evil.peer_id, 2)
    witness = intake()
    witness.receive(encode_update(mine)), witness.receive(encode_update(theirs))
    node.accept_evidence(*witness.evidence[evil.peer_id])
    assert node.events["taken_back"] == 1 and node.replica.version_vector == clean.replica.version_vector
    torch.testing.assert_close(node.replica.theta, clean.replica.theta, rtol=0, atol=1e-6)


def test_no_id_is_trusted_after_a_load() -> None:
    # after a state sync or an adopt, theta holds the donor's version of a slot, whatever we merged before
    node = intake()
    mine = update(KEYS[0], 1, seed=50)
    node.receive(encode_update(mine))
    assert node.replica.recent_ids(KEYS[0].peer_id, [1]) == [mine.update_id]
    theta, vv = node.replica.snapshot()
    node.replica.load(theta, vv)
    assert node.replica.recent_ids(KEYS[0].peer_id, [1]) is None and not node.replica.unmerge(mine)
