"""Access and rate-limit policy (net/admission/) without a network: token buckets, the allow-list
file, the run-secret proof, the guard's admission decisions and counts, and what a peer record shows."""

from __future__ import annotations

import asyncio
import dataclasses

import msgpack
import pytest

from p2p_diloco.cli.swarm import with_allow_list
from p2p_diloco.config import ConfigError, preset
from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.admission.membership import REFUSED_PREFIX
from p2p_diloco.net.admission.policy import (
    MEMBER_PROOF_FIELD,
    AccessConfig,
    MembershipKey,
    RateLimitConfig,
    TokenBucket,
    allow_list_digest,
    load_allow_list,
    request_kind,
)
from p2p_diloco.net.admission.rejections import Rejections
from p2p_diloco.net.discovery.status import counts, fit_record
from p2p_diloco.view.table import rejection_details, rejection_summary
from p2p_diloco.wire.identity import Identity

RUN = "policy-test"
ANNOUNCE = f"p2p-diloco/{RUN}/announce"


def test_token_bucket_takes_refills_and_goes_into_debt() -> None:
    bucket = TokenBucket(rate=2.0, capacity=4.0, now=0.0)
    assert [bucket.take(now=0.0) for _ in range(5)] == [True] * 4 + [False]
    assert bucket.take(now=0.5) and not bucket.take(now=0.5)  # one token back after 0.5 s at 2/s
    assert bucket.take(now=100.0) and bucket.tokens == 3.0  # never more than the capacity
    bytes_bucket = TokenBucket(rate=10.0, capacity=10.0, now=0.0)
    bytes_bucket.charge(35.0, now=0.0)  # one large response passes...
    assert not bytes_bucket.ready(now=1.0)  # ...then the remote waits until the debt is paid
    assert bytes_bucket.ready(now=2.5)


def test_allow_list_file(tmp_path) -> None:
    a, b = Identity.generate().peer_id, Identity.generate().peer_id
    path = tmp_path / "allow.txt"
    path.write_text(f"# members\n\n{b}   # bob\n  {a}\n{a}\n")
    assert load_allow_list(str(path)) == tuple(sorted((a, b)))
    assert allow_list_digest((a, b)) == allow_list_digest(frozenset((b, a))) != allow_list_digest((a,))
    path.write_text(f"{a}\nnot-a-peer-id\n")
    with pytest.raises(ConfigError, match=r"allow.txt:2: 'not-a-peer-id' is not an Ed25519 PeerID"):
        load_allow_list(str(path))
    path.write_text("# nobody\n")
    with pytest.raises(ConfigError, match="names no PeerID"):
        load_allow_list(str(path))
    with pytest.raises(ConfigError, match="cannot read the allow list"):
        load_allow_list(str(tmp_path / "missing.txt"))


def test_the_allow_list_is_part_of_the_run_spec(tmp_path) -> None:
    a = Identity.generate().peer_id
    path = tmp_path / "allow.txt"
    path.write_text(a + "\n")
    spec = preset("test")
    closed = with_allow_list(spec, str(path))
    assert closed.defence.allowed_senders == (a,) and closed.spec_hash() != spec.spec_hash()
    assert with_allow_list(spec, "") is spec
    other = dataclasses.replace(spec, defence=dataclasses.replace(spec.defence,
                                                                   allowed_senders=(Identity.generate().peer_id,)))
    with pytest.raises(ConfigError, match="name different peers"):
        with_allow_list(other, str(path))


def test_run_secret_config(tmp_path) -> None:
    assert AccessConfig().secret() is None
    assert AccessConfig(run_secret="s3cret").secret() == b"s3cret"
    path = tmp_path / "secret"
    path.write_text("  from-a-file  \nignored second line\n")
    assert AccessConfig(run_secret_file=str(path)).secret() == b"from-a-file"
    path.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        AccessConfig(run_secret_file=str(path)).secret()
    with pytest.raises(ConfigError, match="not both"):
        AccessConfig(run_secret="a", run_secret_file=str(path)).validate()


def test_membership_proof_is_bound_to_peer_run_and_secret() -> None:
    key = MembershipKey(b"secret", RUN)
    me, other = Identity.generate().peer_id, Identity.generate().peer_id
    proof = key.proof(me)
    assert key.verify(me, proof)
    assert not key.verify(other, proof)  # copying a member's proof is useless: it names the member
    assert not MembershipKey(b"secret", "another-run").verify(me, proof)
    assert not MembershipKey(b"wrong", RUN).verify(me, proof)
    for junk in (None, 3, b"x" * 64, proof[:-1], proof.upper()):
        assert not key.verify(me, junk)
    with pytest.raises(ValueError):
        MembershipKey(b"", RUN)


def _guard(**kwargs) -> PeerGuard:
    limits = kwargs.pop("limits", RateLimitConfig(announces_per_s=1.0, burst_s=3.0, max_streams_per_peer=2))
    return PeerGuard(RUN, self_id=Identity.generate().peer_id, limits=limits, **kwargs)


def _admit(guard: PeerGuard, caller: str, handler: str = ANNOUNCE, nbytes: int = 10) -> str | None:
    return asyncio.run(guard.admit(caller, handler, nbytes))


def test_open_run_rate_limits_per_remote_and_kind() -> None:
    guard = _guard()
    x, y = Identity.generate().peer_id, Identity.generate().peer_id
    answers = []
    for _ in range(3):
        answers.append(_admit(guard, x))
        guard.release(x)
    assert answers == [None, None, None]  # a burst of rate x burst_s = 3
    refused = _admit(guard, x)
    assert refused is not None and refused.startswith("rate limited: over 1 announce requests/s")
    assert _admit(guard, y) is None  # other remotes have their own buckets
    assert _admit(guard, x, f"p2p-diloco/{RUN}/pull") is None  # and other kinds of request too
    assert guard.rejections.totals == {"rate_limited": 1} and guard.rejections.of(x) == {"rate_limited": 1}
    assert request_kind(f"p2p-diloco/{RUN}/chunk") == request_kind(f"p2p-diloco/{RUN}/manifest") == "snapshot"


def test_streams_per_remote_are_bounded_and_released() -> None:
    guard = _guard(limits=RateLimitConfig(max_streams_per_peer=2))
    x = Identity.generate().peer_id
    assert _admit(guard, x) is None and _admit(guard, x) is None
    assert _admit(guard, x).startswith("too many streams")
    guard.release(x)
    assert _admit(guard, x) is None


def test_bytes_out_debt_refuses_until_paid() -> None:
    guard = _guard(limits=RateLimitConfig(bytes_out_per_s=1000.0, burst_s=1.0))
    x = Identity.generate().peer_id
    assert _admit(guard, x, f"p2p-diloco/{RUN}/pull") is None
    guard.release(x)
    guard.charge_out(x, 50_000)  # one large response went out
    assert _admit(guard, x, f"p2p-diloco/{RUN}/pull").startswith("rate limited: over the bytes/s")


def test_penalty_refuses_and_stops_pulls() -> None:
    guard = _guard(limits=RateLimitConfig(penalty_s=60.0))
    x = Identity.generate().peer_id
    assert guard.may_pull_from(x) is None
    guard.penalize(x, "bad_signature")
    assert guard.is_penalized(x) and guard.may_pull_from(x) == "penalized"
    assert _admit(guard, x).startswith("refused for 60s more: you sent invalid updates")
    no_penalty = _guard(limits=RateLimitConfig(penalty_s=0.0))
    no_penalty.penalize(x, "bad_signature")
    assert not no_penalty.is_penalized(x)


def test_allow_list_refuses_others_with_the_reason() -> None:
    member, outsider = Identity.generate().peer_id, Identity.generate().peer_id
    guard = _guard(allowed=[member])
    assert guard.closed and guard.is_member(member) and not guard.is_member(outsider)
    assert _admit(guard, member) is None
    assert _admit(guard, outsider) == REFUSED_PREFIX + "PeerID not in allow list"
    assert guard.may_pull_from(outsider) == "not_allowed"
    assert guard.rejections.of(outsider) == {"not_allowed": 1}


def test_run_secret_refuses_without_a_valid_proof_and_rereads_records() -> None:
    key = MembershipKey(b"secret", RUN)
    member, stranger, liar = (Identity.generate().peer_id for _ in range(3))
    records = {member: {MEMBER_PROOF_FIELD: key.proof(member)}, stranger: {},
               liar: {MEMBER_PROOF_FIELD: key.proof(member)}}  # a copied proof
    reads = []

    async def refresh() -> None:
        reads.append(1)
        for pid, record in records.items():
            guard.check_record(pid, record)

    guard = _guard(key=key, refresh_members=refresh)
    assert _admit(guard, member) is None and len(reads) == 1  # unknown: the records are read, then admitted
    assert _admit(guard, stranger) == REFUSED_PREFIX + "run secret required (your peer record carries no " \
                                                       "membership proof: join with --run-secret-file)"
    assert _admit(guard, liar).startswith(REFUSED_PREFIX + "wrong run secret")
    assert len(reads) == 1  # re-read at most once per second, however many strangers call
    nobody = Identity.generate().peer_id
    assert "no peer record of yours" in _admit(guard, nobody)


def test_rejections_rank_offenders_and_are_bounded() -> None:
    r = Rejections(max_peers=3)
    r.count("honest", "duplicate", 50)
    r.count("hostile", "bad_signature", 2)
    r.count("hostile", "duplicate", 7)
    r.count("intake", "norm_bound", in_totals=False)
    assert r.totals == {"duplicate": 57, "bad_signature": 2}
    assert r.offenders(4) == {"hostile": {"duplicate": 7, "bad_signature": 2}, "intake": {"norm_bound": 1}}
    for i in range(5):
        r.count(f"p{i}", "malformed")
    assert len(r.offenders(10)) == 3  # only the last max_peers remotes are kept


def test_records_fit_and_are_shown_safely() -> None:
    big = {"state": "training", "vv": {f"12D3KooW{i:044d}": i for i in range(200)}, "rejected_by": {"bad_signature": 3},
           "offenders": {"x" * 52: {"bad_signature": 3}}, "dht_rejected": {"record_forged": 1}}
    fitted = fit_record(big, 8192)
    assert "vv" not in fitted and fitted["rejected_by"] == {"bad_signature": 3}
    assert len(msgpack.packb(fitted)) < 8192 - 256
    hostile = {"rejected": 3, "refused": 40,
               "rejected_by": {"bad_signature": 3, "rate_limited": 40, "evil": -1, 5: 5, "x": True},
               "offenders": {"12D3KooWhostile": {"rate_limited": 40}, 7: "junk"},
               "dht_rejected": "not a map"}
    assert counts(hostile, "rejected_by") == {"rate_limited": 40, "bad_signature": 3}
    assert rejection_summary(hostile) == "3 (rate_limited 40, bad_signature 3)"
    assert rejection_summary({}) == "-" and rejection_summary({"rejected": 0}) == "0"
    details = rejection_details({"12D3KooWpeer1234": hostile})
    assert "peer1234: rate_limited 40, bad_signature 3" in details and "from Whostile: rate_limited 40" in details
