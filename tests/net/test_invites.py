"""Invitations without a network: the token (wire/invite.py), the members' gate and its revocations
(net/admission/invites.py), the guard's refusals with their one-line reasons, and the operator keys' config."""

from __future__ import annotations

import asyncio

import pytest

from p2p_diloco.cli.main import main
from p2p_diloco.config import ConfigError
from p2p_diloco.config.admission import AccessConfig
from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.admission.invites import (
    INVITE_FIELD,
    MAX_CARRIED,
    NO_INVITATION,
    OPERATORS_FIELD,
    REVOKED_FIELD,
    Invitations,
)
from p2p_diloco.net.admission.membership import REFUSED_PREFIX
from p2p_diloco.net.admission.policy import RateLimitConfig
from p2p_diloco.wire.identity import Identity
from p2p_diloco.wire.invite import MAX_TTL_S, TokenError, decode_token, make_token, token_from_text, token_text

RUN = "invite-test"
DAY = 86400.0
NOW = 1.8e9


class Clock:
    def __init__(self) -> None:
        self.t = NOW

    def __call__(self) -> float:
        return self.t


def _book(operator: Identity, clock: Clock, **kwargs) -> Invitations:
    return Invitations(RUN, (operator.peer_id,), clock=clock, **kwargs)


def _record(book: Invitations, invitation: bytes | None = None, **fields) -> dict:
    record: dict[str, object] = {OPERATORS_FIELD: book.digest, **fields}
    if invitation is not None:
        record[INVITE_FIELD] = invitation
    return record


def test_token_signs_binds_and_expires() -> None:
    op, volunteer = Identity.generate(), Identity.generate().peer_id
    token = make_token("invite", op, run_id=RUN, peer=volunteer, ttl_s=DAY, now=NOW)
    ops = frozenset({op.peer_id})
    assert token.why_not(run_id=RUN, operators=ops, now=NOW + 10, peer=volunteer) is None
    assert token_from_text(token_text(token), "invite") == token  # the file's text form round-trips
    assert "another run" in token.why_not(run_id="other", operators=ops, now=NOW, peer=volunteer)
    assert "another peer" in token.why_not(run_id=RUN, operators=ops, now=NOW, peer=Identity.generate().peer_id)
    assert "not an operator key of this run" in token.why_not(run_id=RUN, operators=frozenset(), now=NOW)
    assert token.why_not(run_id=RUN, operators=ops, now=NOW + DAY).startswith("invitation expired at 2027-")
    # Tampering with any byte of the body, or taking the signature for another kind, fails.
    tampered = bytearray(token.encoded)
    tampered[token.encoded.index(RUN.encode())] ^= 1
    with pytest.raises(TokenError, match="bad invitation signature|malformed"):
        decode_token(bytes(tampered), "invite")
    with pytest.raises(TokenError, match="not a revocation"):
        decode_token(token.encoded, "revoke")
    with pytest.raises(TokenError, match="does not start with"):
        token_from_text(token_text(token), "revoke")
    for junk in (b"", b"\x93" * 10, b"x" * 4096, "text"):
        with pytest.raises(TokenError):
            decode_token(junk, "invite")
    with pytest.raises(TokenError, match="not an Ed25519"):
        make_token("invite", op, run_id=RUN, peer="12D3KooWnope", ttl_s=DAY)
    with pytest.raises(TokenError, match="lifetime"):
        make_token("invite", op, run_id=RUN, peer=volunteer, ttl_s=MAX_TTL_S * 2)


def test_members_admit_the_invited_and_say_why_not_the_others() -> None:
    op, rogue, clock = Identity.generate(), Identity.generate(), Clock()
    book = _book(op, clock)
    invitee, stranger = Identity.generate().peer_id, Identity.generate().peer_id
    invitation = make_token("invite", op, run_id=RUN, peer=invitee, ttl_s=DAY, now=NOW).encoded
    assert book.why_not(invitee, _record(book, invitation)) is None
    assert book.why_not(op.peer_id, _record(book)) is None  # an operator's own peers need no invitation
    assert book.why_not(stranger, _record(book)) == NO_INVITATION
    assert "another peer" in book.why_not(stranger, _record(book, invitation))  # a copied invitation
    other_run = make_token("invite", op, run_id="other", peer=invitee, ttl_s=DAY, now=NOW).encoded
    assert "another run" in book.why_not(invitee, _record(book, other_run))
    forged = make_token("invite", rogue, run_id=RUN, peer=invitee, ttl_s=DAY, now=NOW).encoded
    assert book.why_not(invitee, _record(book, forged)).startswith("bad invitation signature")
    assert "different operator keys" in book.why_not(invitee, {INVITE_FIELD: invitation, OPERATORS_FIELD: "x"})
    assert "no peer record" in book.why_not(invitee, None)
    clock.t = NOW + DAY
    assert book.why_not(invitee, _record(book, invitation)).startswith("invitation expired")


def test_revocations_are_kept_carried_bounded_and_undone_by_a_new_invitation() -> None:
    op, rogue, clock = Identity.generate(), Identity.generate(), Clock()
    book, other = _book(op, clock), _book(op, clock)
    invitee = Identity.generate().peer_id
    invitation = make_token("invite", op, run_id=RUN, peer=invitee, ttl_s=DAY, now=NOW).encoded
    revocation = make_token("revoke", op, run_id=RUN, peer=invitee, ttl_s=DAY, now=NOW + 1).encoded
    # Junk and a revocation the run's operators did not sign are read and dropped.
    fake = make_token("revoke", rogue, run_id=RUN, peer=invitee, ttl_s=DAY, now=NOW + 1).encoded
    assert book.learn({REVOKED_FIELD: [b"junk", fake, 7]}) == []
    assert "not an invitation" in book.why_not(invitee, _record(book, revocation))  # nor learnt as one, below
    assert book.learn({REVOKED_FIELD: [revocation]}) == [invitee]
    assert book.learn({REVOKED_FIELD: [revocation]}) == []  # seen: not checked again
    assert book.why_not(invitee, _record(book, invitation)).startswith("invitation revoked by the run's operator")
    # Spread: our record carries it; a member that never saw it published learns it from us.
    assert other.learn(book.record_fields()) == [invitee]
    assert other.why_not(invitee, _record(other, invitation)).startswith("invitation revoked")
    # Invited again after the revocation: admitted again.
    again = make_token("invite", op, run_id=RUN, peer=invitee, ttl_s=DAY, now=NOW + 2).encoded
    assert book.why_not(invitee, _record(book, again)) is None
    # Carried: the most recent MAX_CARRIED, however many are known.
    for i in range(MAX_CARRIED + 5):
        peer = Identity.generate().peer_id
        book.learn({REVOKED_FIELD: [make_token("revoke", op, run_id=RUN, peer=peer, ttl_s=DAY, now=NOW + 10 + i)
                                    .encoded]})
    carried = book.record_fields()[REVOKED_FIELD]
    assert len(carried) == MAX_CARRIED and revocation not in carried
    clock.t = NOW + 2 * DAY  # expired revocations are neither kept nor carried
    assert REVOKED_FIELD not in book.record_fields()


def test_guard_refuses_with_the_reason_and_cuts_off_a_revoked_member() -> None:
    op, clock = Identity.generate(), Clock()
    book = _book(op, clock)
    guard = PeerGuard(RUN, self_id=op.peer_id, limits=RateLimitConfig(), invites=book)
    invitee, stranger = Identity.generate().peer_id, Identity.generate().peer_id
    invitation = make_token("invite", op, run_id=RUN, peer=invitee, ttl_s=DAY, now=NOW).encoded
    assert guard.closed and guard.check_record(invitee, _record(book, invitation)) is None
    assert guard.check_record(stranger, _record(book)) == NO_INVITATION
    admit = lambda pid: asyncio.run(guard.admit(pid, f"p2p-diloco/{RUN}/hello", 0))  # noqa: E731
    assert admit(invitee) is None
    assert admit(stranger) == REFUSED_PREFIX + NO_INVITATION
    # A revocation carried by anyone's record (here a carrier that is no member) cuts the invitee off at once.
    revocation = make_token("revoke", op, run_id=RUN, peer=invitee, ttl_s=DAY, now=NOW + 1).encoded
    assert guard.check_record(Identity.generate().peer_id, {"state": "left", REVOKED_FIELD: [revocation]})
    assert not guard.is_member(invitee) and guard.may_pull_from(invitee) == "not_allowed"
    guard.release(invitee)
    assert admit(invitee).startswith(REFUSED_PREFIX + "invitation revoked by the run's operator")
    assert guard.membership.record_fields()[REVOKED_FIELD] == [revocation]


def test_operator_config_and_the_joiners_own_invitation(tmp_path) -> None:
    op, me = Identity.generate(), Identity.generate()
    with pytest.raises(ConfigError, match="not an Ed25519 PeerID"):
        AccessConfig(operators="12D3KooWtypo").validate()
    with pytest.raises(ConfigError, match="not both"):
        AccessConfig(operators=op.peer_id, allow_peers="allow.txt").validate()
    assert AccessConfig(operators=f" {op.peer_id}, {op.peer_id} ").operator_ids() == (op.peer_id,)
    with pytest.raises(ConfigError, match="no such file"):
        AccessConfig(invite=str(tmp_path / "missing.invite")).validate()
    assert Invitations.from_access(AccessConfig(), RUN, me.peer_id) is None  # no operators: no gate
    with pytest.raises(ConfigError, match="no invitation"):
        Invitations.from_access(AccessConfig(operators=op.peer_id), RUN, me.peer_id)
    path = tmp_path / "me.invite"
    path.write_text(token_text(make_token("invite", op, run_id=RUN, peer=me.peer_id, ttl_s=DAY)))
    book = Invitations.from_access(AccessConfig(invite=str(path)), RUN, me.peer_id)
    assert book is not None and book.operators == {op.peer_id}  # a volunteer need not know the keys
    assert book.record_fields()[INVITE_FIELD] == book.own.encoded
    with pytest.raises(ConfigError, match="another peer .* --identity"):
        Invitations.from_access(AccessConfig(invite=str(path)), RUN, Identity.generate().peer_id)
    with pytest.raises(ConfigError, match="another run"):
        Invitations.from_access(AccessConfig(invite=str(path)), "other", me.peer_id)
    with pytest.raises(ConfigError, match="not an operator key"):
        Invitations.from_access(AccessConfig(invite=str(path), operators=me.peer_id), RUN, me.peer_id)
    (tmp_path / "junk").write_text("hello")
    with pytest.raises(ConfigError, match="not an invitation file"):
        Invitations.from_access(AccessConfig(invite=str(tmp_path / "junk")), RUN, me.peer_id)


def test_invite_and_revoke_commands_write_tokens(tmp_path, capsys) -> None:
    op, volunteer = Identity.generate(), Identity.generate().peer_id
    op.save(tmp_path / "op.key")
    out = tmp_path / "v.invite"
    assert main(["invite", "--operator-key", str(tmp_path / "op.key"), "--peer", volunteer, "--run-id", RUN,
                 "--ttl-days", "2", "--out", str(out)]) == 0
    token = token_from_text(out.read_text(), "invite")
    assert (token.peer, token.run_id, token.operator) == (volunteer, RUN, op.peer_id)
    assert main(["revoke", "--operator-key", str(tmp_path / "op.key"), "--peer", volunteer, "--run-id", RUN,
                 "--out", str(tmp_path / "v.revoke")]) == 0
    assert token_from_text((tmp_path / "v.revoke").read_text(), "revoke").peer == volunteer
    assert main(["invite", "--operator-key", str(tmp_path / "none.key"), "--peer", volunteer,
                 "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_operator_keys_are_in_the_spec_and_a_joiner_without_an_invitation_is_told_so(tmp_path) -> None:
    """--operators (or the signer of --invite) goes into spec.defence.operators, so the keys are part of the
    run's spec hash; a joiner with no invitation meets that difference at start and is told to get one."""
    import dataclasses

    from p2p_diloco.cli.swarm import with_operators
    from p2p_diloco.config import preset
    from p2p_diloco.net.admission.hello import AccessDenied
    from p2p_diloco.peer.startup import SpecMismatchError, check_spec

    operator, volunteer = Identity.generate(), Identity.generate()
    token = make_token("invite", operator, run_id="default", peer=volunteer.peer_id, ttl_s=3600)
    (tmp_path / "v.invite").write_text(token_text(token))
    spec = preset("test")
    run = with_operators(spec, AccessConfig(operators=operator.peer_id))
    assert run.defence.operators == (operator.peer_id,) and run.spec_hash() != spec.spec_hash()
    assert with_operators(spec, AccessConfig(invite=str(tmp_path / "v.invite"))).spec_hash() == run.spec_hash()
    with pytest.raises(ConfigError, match="name different keys"):
        with_operators(run, AccessConfig(operators=Identity.generate().peer_id))
    with pytest.raises(AccessDenied, match="no invitation"):
        check_spec((run.to_dict(), run.spec_hash()), spec)
    other = dataclasses.replace(spec, defence=dataclasses.replace(spec.defence, probation=0.5))
    with pytest.raises(SpecMismatchError, match="defence.probation"):  # any other difference: as before
        check_spec((run.to_dict(), run.spec_hash()), other)
