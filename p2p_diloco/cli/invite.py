"""`p2p-diloco invite` and `revoke`: an operator admits a volunteer to a running run, or withdraws it.

The operator key is an ordinary identity (`p2p-diloco keygen --identity operator.key`); the run names its PeerID
in `--operators`. `invite` writes a token the volunteer joins with (`join --invite FILE`); `revoke` writes a
revocation and, with --bootstrap, publishes it into the running swarm, whose members then carry it to each
other (net/admission/invites.py). Neither needs a running peer of the operator's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DAY_S = 86400.0
PUBLISHED_TTL_S = 3600.0
"""How long the record that carries a published revocation stays on the DHT (members carry it on after)."""


def add_invite_commands(sub: argparse._SubParsersAction) -> None:
    text = "admit a volunteer to a run with operator keys (a signed invitation)"
    p = sub.add_parser("invite", help=text, description=text + ". The volunteer joins with `--invite FILE` and the "
                       "--identity whose PeerID it was made for; no new spec, no restart of the run.")
    _common(p)
    p.add_argument("--ttl-days", type=float, default=30.0, help="how long the invitation admits (default: 30)")
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the invitation")
    p.set_defaults(func=cmd_invite)

    text = "withdraw a volunteer's invitations (a signed revocation)"
    p = sub.add_parser("revoke", help=text, description=text + ". With --bootstrap it is published into the running "
                       "swarm: every member refuses the peer within one read of the peer records, and carries the "
                       "revocation on to peers that join later. Invite the peer again later to re-admit it.")
    _common(p)
    p.add_argument("--out", metavar="FILE", help="also write the revocation to FILE")
    p.add_argument("--bootstrap", action="append", default=[], metavar="MADDR",
                   help="publish the revocation through this peer of the swarm (repeatable)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="DHT timeout when publishing (default: 30)")
    p.set_defaults(func=cmd_revoke)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--operator-key", required=True, metavar="FILE",
                   help="the operator's identity file (its PeerID is in the run's --operators)")
    p.add_argument("--peer", required=True, metavar="PEER_ID", help="the volunteer's PeerID (`p2p-diloco id`)")
    p.add_argument("--run-id", default="default", help="the run (default: %(default)s)")


def _fail(command: str, error: BaseException) -> int:
    print(f"p2p-diloco {command}: error: {error}", file=sys.stderr)
    return 2


def cmd_invite(args: argparse.Namespace) -> int:
    from p2p_diloco.wire.identity import Identity, IdentityError
    from p2p_diloco.wire.invite import TokenError, make_token, token_text, utc

    try:
        operator = Identity.load(Path(args.operator_key).expanduser())
        token = make_token("invite", operator, run_id=args.run_id, peer=args.peer, ttl_s=args.ttl_days * DAY_S)
        Path(args.out).expanduser().write_text(token_text(token))
    except (IdentityError, TokenError, OSError) as err:
        return _fail("invite", err)
    print(f"wrote {args.out}: invitation of {token.peer} to run '{token.run_id}' until {utc(token.expires_at)}, "
          f"signed by operator {operator.peer_id}\nthe volunteer joins with: --run-id {token.run_id} --invite "
          f"{Path(args.out).name} --identity <the key of {token.peer[-8:]}>")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    import asyncio

    from p2p_diloco.net.transport.node import NodeError
    from p2p_diloco.wire.identity import Identity, IdentityError
    from p2p_diloco.wire.invite import MAX_TTL_S, TokenError, make_token, token_text

    try:
        operator = Identity.load(Path(args.operator_key).expanduser())
        token = make_token("revoke", operator, run_id=args.run_id, peer=args.peer, ttl_s=MAX_TTL_S)
        if args.out:
            Path(args.out).expanduser().write_text(token_text(token))
            print(f"wrote {args.out}: revocation of {token.peer} in run '{token.run_id}'")
        if not args.bootstrap:
            if not args.out:
                return _fail("revoke", ValueError("give --bootstrap MADDR (publish) or --out FILE (or both)"))
            return 0
        stored = asyncio.run(publish_revocation(args.bootstrap, token.run_id, token.encoded, args.timeout_s))
    except (IdentityError, TokenError, OSError, NodeError, TimeoutError) as err:
        return _fail("revoke", err)
    if not stored:
        return _fail("revoke", RuntimeError("no DHT node stored the revocation; check --bootstrap and retry"))
    print(f"published the revocation of {token.peer} into run '{token.run_id}': members refuse it from their next "
          "read of the peer records")
    return 0


async def publish_revocation(bootstrap: list[str], run_id: str, revocation: bytes, timeout_s: float) -> bool:
    """Store a record that carries `revocation` under the run's peers (a throwaway identity signs it; the
    revocation is the operator's word, whoever carries it). It says "left": nobody takes it for a peer."""
    import tempfile

    from p2p_diloco.net.admission.invites import REVOKED_FIELD
    from p2p_diloco.net.discovery.records import PeerRecordValidator, announce_peer, list_peers
    from p2p_diloco.net.transport.node import NodeConfig, SwarmNode, parse_multiaddr
    from p2p_diloco.wire.identity import Identity

    with tempfile.TemporaryDirectory(prefix="p2p-diloco-revoke-") as tmp:
        carrier = Identity.generate()
        path = str(Path(tmp) / "carrier.key")
        carrier.save(path)
        config = NodeConfig(initial_peers=tuple(parse_multiaddr(b, require_peer_id=True) for b in bootstrap),
                            client_mode=True, start_timeout_s=timeout_s, start_retries=1)
        node = await SwarmNode.start(path, config, record_validators=[PeerRecordValidator([run_id])])
        try:
            await announce_peer(node, run_id, {"state": "left", REVOKED_FIELD: [revocation]}, carrier,
                                ttl_s=PUBLISHED_TTL_S, timeout_s=timeout_s)
            records = await list_peers(node, run_id, timeout_s=timeout_s)  # read back: was it stored?
            return revocation in (records.get(carrier.peer_id) or {}).get(REVOKED_FIELD, [])
        finally:
            await node.shutdown()
