"""Invitations over a real DHT and real streams on 127.0.0.1 (in-process nodes; the fast representative of
tests/net/test_invites_swarm.py): a member's `hello` admits an invited peer, refuses an uninvited one with the
reason, and refuses the invited one too once `p2p-diloco revoke --bootstrap` published its revocation."""

from __future__ import annotations

import pytest

from p2p_diloco.cli.invite import publish_revocation
from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.admission.hello import AccessDenied, ask_admission, serve_hello
from p2p_diloco.net.admission.invites import OPERATORS_FIELD, REVOKED_FIELD, Invitations
from p2p_diloco.net.admission.policy import RateLimitConfig
from p2p_diloco.net.discovery.records import announce_peer, list_peers
from p2p_diloco.wire.identity import Identity
from p2p_diloco.wire.invite import make_token
from tests.helpers.swarm import wait_until

pytestmark = pytest.mark.timeout(180)

RUN = "invite-loopback"
DAY = 86400.0


def test_hello_admits_the_invited_refuses_the_others_and_the_revoked(loop, members) -> None:
    a, b, c = members
    operator = Identity.generate()

    def book(member) -> Invitations:
        invitation = make_token("invite", operator, run_id=RUN, peer=member.identity.peer_id, ttl_s=DAY)
        return Invitations(RUN, (operator.peer_id,), invitation)

    async def refresh() -> None:  # what Presence does every few seconds, and on an unknown caller
        for pid, record in (await list_peers(a.node, RUN, timeout_s=10)).items():
            guard.check_record(pid, record)

    guard = PeerGuard(RUN, self_id=a.identity.peer_id, limits=RateLimitConfig(), invites=book(a),
                      refresh_members=refresh)
    loop.run(serve_hello(a.node.p2p, RUN, guard, timeout_s=5))
    invited = book(b)
    loop.run(announce_peer(b.node, RUN, {"state": "training", **invited.record_fields()}, b.identity))
    loop.run(announce_peer(c.node, RUN, {"state": "training", OPERATORS_FIELD: invited.digest}, c.identity))

    assert loop.run(ask_admission(b.node.p2p, RUN, [a.node.peer_id], timeout_s=10)) == {a.node.peer_id: "ok"}
    with pytest.raises(AccessDenied, match=r"^not allowed in this run: no invitation: .* --invite FILE \(refused"):
        loop.run(ask_admission(c.node.p2p, RUN, [a.node.peer_id], timeout_s=10))

    revocation = make_token("revoke", operator, run_id=RUN, peer=b.identity.peer_id, ttl_s=DAY).encoded
    assert loop.run(publish_revocation(list(map(str, a.node.visible_maddrs())), RUN, revocation, 30), timeout_s=90)

    def cut_off() -> bool:
        loop.run(refresh())
        return not guard.is_member(b.identity.peer_id)

    wait_until(cut_off, 30, "A to read the revocation and cut B off")
    with pytest.raises(AccessDenied, match="^not allowed in this run: invitation revoked by the run's operator"):
        loop.run(ask_admission(b.node.p2p, RUN, [a.node.peer_id], timeout_s=10))
    assert guard.membership.record_fields()[REVOKED_FIELD] == [revocation]  # A carries it to the others
    assert guard.rejections.of(b.identity.peer_id) == {"not_allowed": 1}
