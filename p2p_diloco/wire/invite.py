"""Invitations and revocations: an operator's signed word that a PeerID may (or may no longer) take part in a run.

A run may name operator keys (Ed25519 identities, named by their PeerIDs: `p2p-diloco keygen` makes one). An
operator admits a volunteer to a running run, without a new spec, by signing an invitation for the volunteer's
PeerID; the volunteer's signed peer record carries it, and members check it (net/admission/invites.py).

Both kinds are one token: msgpack [body, signature], the body msgpack of
    {kind: "invite" | "revoke", run_id, peer, operator, issued_at, expires_at, nonce}
signed by `operator` under the kind's own domain, so an invitation never verifies as a revocation or as
anything else the operator's key signs. `peer` is the invitee (or the revoked PeerID); the signature binds it, so
a copied invitation is useless to any other PeerID (libp2p authenticates the PeerID of every stream).

A revocation withdraws every invitation of its `peer` issued at or before its own `issued_at`: the operator can
invite the same peer again later. It is kept until its `expires_at`, which should outlive the invitations it
withdraws (the default does: a revocation lasts MAX_TTL_S, an invitation at most that).

Pure: no clock of its own (callers pass `now`), no I/O but the token files' text form.
"""

from __future__ import annotations

import base64
import secrets
import time
from dataclasses import dataclass

import msgpack

from p2p_diloco.wire.identity import Identity, IdentityError, public_key_from_peer_id, sign_blob, verify_blob

INVITE_DOMAIN = b"p2p-diloco/invitation/v1"
REVOKE_DOMAIN = b"p2p-diloco/revocation/v1"
_DOMAINS = {"invite": INVITE_DOMAIN, "revoke": REVOKE_DOMAIN}
MAX_TOKEN_BYTES = 512
"""An encoded token is ~330 bytes; anything longer is refused before it is decoded."""
MAX_TTL_S = 365 * 24 * 3600.0
"""The longest an invitation may last, and how long a revocation lasts by default."""
_NAMES = {"invite": "invitation", "revoke": "revocation"}
_A_NAME = {"invite": "an invitation", "revoke": "a revocation"}
_TEXT_PREFIX = {"invite": "p2p-diloco-invitation:", "revoke": "p2p-diloco-revocation:"}
_SIGNATURE_BYTES = 64


class TokenError(ValueError):
    """A token that cannot be read or is not signed by its operator; the message says what is wrong."""


@dataclass(frozen=True)
class Token:
    """A decoded token whose signature verified against its `operator` (whether that operator counts in a run,
    and whether it has expired, is the caller's question: `why_not`)."""

    kind: str
    """"invite" or "revoke"."""
    run_id: str
    peer: str
    """The invitee's (or the revoked) PeerID."""
    operator: str
    """The signer's PeerID."""
    issued_at: float
    expires_at: float
    nonce: str
    encoded: bytes
    """The token as signed: what a peer record carries."""

    def why_not(self, *, run_id: str, operators: frozenset[str], now: float, peer: str | None = None) -> str | None:
        """Why this token does not count in run `run_id` (for `peer`, if given) at `now`, in one line; else None."""
        name = _NAMES[self.kind]
        if self.run_id != run_id:
            return f"{name} is for another run ('{self.run_id[:64]}', this is '{run_id}')"
        if peer is not None and self.peer != peer:
            return f"{name} is for another peer ({self.peer}, not {peer})"
        if self.operator not in operators:
            return f"bad {name} signature: signed by {self.operator}, not an operator key of this run"
        if now >= self.expires_at:
            return f"{name} expired at {utc(self.expires_at)}"
        return None


def make_token(kind: str, operator: Identity, *, run_id: str, peer: str, ttl_s: float,
               now: float | None = None) -> Token:
    """Sign a `kind` token ("invite" or "revoke") for `peer` in `run_id`, valid for `ttl_s` seconds from `now`."""
    if kind not in _DOMAINS:
        raise ValueError(f"token kind must be invite or revoke, got {kind!r}")
    try:
        public_key_from_peer_id(peer)
    except IdentityError as e:
        raise TokenError(f"--peer: {e}") from None
    if not 0 < ttl_s <= MAX_TTL_S:
        raise TokenError(f"the token's lifetime must be in (0, {MAX_TTL_S / 86400:g}] days, got {ttl_s / 86400:g}")
    issued_at = time.time() if now is None else now
    body = msgpack.packb({"kind": kind, "run_id": run_id, "peer": peer, "operator": operator.peer_id,
                          "issued_at": float(issued_at), "expires_at": float(issued_at + ttl_s),
                          "nonce": secrets.token_hex(8)}, use_bin_type=True)
    encoded = msgpack.packb([body, sign_blob(operator, _DOMAINS[kind], body)], use_bin_type=True)
    return decode_token(encoded, kind)


def decode_token(data: object, kind: str, operators: frozenset[str] | None = None) -> Token:
    """The `kind` token in `data` (untrusted bytes), its signature checked against its operator; TokenError if
    it is malformed, of another kind, or not signed by the operator it names (or, given `operators`, by one
    outside them: refused before the signature is checked, so junk costs no signature check)."""
    if not isinstance(data, bytes) or len(data) > MAX_TOKEN_BYTES:
        raise TokenError(f"not a token (bytes, at most {MAX_TOKEN_BYTES})")
    try:
        body, signature = msgpack.unpackb(data, raw=False, strict_map_key=True)
        fields = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception:  # msgpack raises a zoo of exception types on garbage; a wrong shape fails the unpacking
        raise TokenError("not a token (malformed)") from None
    if not (isinstance(body, bytes) and isinstance(signature, bytes) and len(signature) == _SIGNATURE_BYTES
            and isinstance(fields, dict)):
        raise TokenError("not a token (malformed)")
    strings = ("kind", "run_id", "peer", "operator", "nonce")
    if not (all(isinstance(fields.get(k), str) for k in strings)
            and all(isinstance(fields.get(k), float) for k in ("issued_at", "expires_at"))):
        raise TokenError("not a token (fields missing or of the wrong type)")
    if fields["kind"] != kind:
        raise TokenError(f"not {_A_NAME[kind]} (a token of kind '{fields['kind'][:16]}')")
    if operators is not None and fields["operator"] not in operators:
        raise TokenError(f"bad {_NAMES[kind]} signature: signed by {fields['operator'][:60]}, not an operator key "
                         "of this run")
    if not verify_blob(fields["operator"], _DOMAINS[kind], body, signature):
        raise TokenError(f"bad {_NAMES[kind]} signature (not signed by the operator key it names)")
    return Token(kind, fields["run_id"], fields["peer"], fields["operator"], fields["issued_at"],
                 fields["expires_at"], fields["nonce"], data)


def token_text(token: Token) -> str:
    """The token as one line of text (what `invite --out` and `revoke --out` write)."""
    return _TEXT_PREFIX[token.kind] + base64.urlsafe_b64encode(token.encoded).decode("ascii") + "\n"


def token_from_text(text: str, kind: str) -> Token:
    """The `kind` token written by `token_text`; TokenError says what is wrong."""
    line = text.strip()
    prefix = _TEXT_PREFIX[kind]
    if not line.startswith(prefix):
        raise TokenError(f"not {_A_NAME[kind]} file (its line does not start with '{prefix}')")
    try:
        data = base64.urlsafe_b64decode(line[len(prefix):].encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        raise TokenError("the token is not valid base64 (was it cut when copied?)") from None
    return decode_token(data, kind)


def utc(t: float) -> str:
    """`t` (seconds since the epoch) as a date a person reads."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))
