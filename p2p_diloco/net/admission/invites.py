"""Runs that admit by invitation: operator keys, the invitations members check, the revocations they spread.

The tokens are wire/invite.py's. A run with operator keys (`--operators`) takes part with the operators' own
PeerIDs and the peers they invited; the gate sits beside the allow list and the run secret (net/admission/policy.py)
and is judged per PeerID from its signed peer record, like the run secret's proof:
  - `operators`: a digest of the operator keys this peer holds. Every member must hold the same ones: a peer
    with others would admit peers the run does not (and relay their updates), so it is refused. The keys are
    also in the spec (defence.operators, cli/swarm.py `with_operators`), so such a peer is usually stopped at
    start by the spec check; the digest holds for peers that skip it.
  - `invite`: the peer's invitation (the operator's signature binds its PeerID and the run; libp2p authenticates
    the PeerID of every stream, so a copied invitation admits nobody else).
  - `revoked`: the revocations this peer carries for the others. `p2p-diloco revoke --bootstrap` stores one in a
    short-lived record of its own; every member that reads it keeps it (at most MAX_REVOCATIONS) and carries
    the MAX_CARRIED most recent in its own record, re-announced every third of a record TTL, so a revocation
    reaches members that joined after its record expired, as long as one member carries it. Only tokens an
    operator of this run signed are kept, so a record cannot fill the book with junk.
A revoked peer is refused at its next request (every RPC asks the membership) and dropped from the live
members, so nobody pulls from it or announces to it: it is cut off within one read of the records.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from p2p_diloco.config import ConfigError
from p2p_diloco.config.admission import AccessConfig
from p2p_diloco.net.admission.policy import RECORD_NOT_SEEN, allow_list_digest
from p2p_diloco.wire.identity import IdentityError, public_key_from_peer_id
from p2p_diloco.wire.invite import MAX_TOKEN_BYTES, Token, TokenError, decode_token, token_from_text, utc

logger = logging.getLogger(__name__)

INVITE_FIELD = "invite"
"""The peer-record field that carries the peer's invitation (the token's bytes)."""
OPERATORS_FIELD = "operators"
"""The peer-record field that carries the digest of the operator keys the peer holds."""
REVOKED_FIELD = "revoked"
"""The peer-record field that carries revocations (a list of tokens' bytes) for the others."""
MAX_REVOCATIONS = 256
"""Revocations a member keeps (the latest per revoked PeerID; the soonest to expire dropped first)."""
MAX_CARRIED = 8
"""Revocations a member carries in its record (the most recently issued; ~300 bytes each)."""
MAX_READ_PER_RECORD = MAX_CARRIED
"""Revocations read from one record (each one an operator of the run names costs a signature check, once)."""
MAX_SEEN_TOKENS = 4096
NO_INVITATION = ("no invitation: this run admits the peers its operators invite; send your PeerID (`p2p-diloco id`) "
                 "to the run's operator and join with --invite FILE")


def load_invitation(path: str) -> Token:
    """The invitation in `path` (written by `p2p-diloco invite`); ConfigError says what is wrong with it."""
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the invitation {file}: {e}") from None
    if len(text) > 2 * MAX_TOKEN_BYTES:
        raise ConfigError(f"{file} is not an invitation (too long)")
    try:
        return token_from_text(text, "invite")
    except TokenError as e:
        raise ConfigError(f"--invite {file}: {e}") from None


class Invitations:
    """One peer's invitation gate (see the module docstring): its operators, its own invitation and the
    revocations it knows. Runs on the network loop; nothing here blocks."""

    def __init__(self, run_id: str, operators: tuple[str, ...], own: Token | None = None, *,
                 clock: Callable[[], float] = time.time) -> None:
        for pid in operators:
            try:
                public_key_from_peer_id(pid)
            except IdentityError as e:
                raise ConfigError(f"--operators: {e}") from None
        if not operators:
            raise ConfigError("a run that admits by invitation needs at least one operator key (--operators)")
        self.run_id = run_id
        self.operators = frozenset(operators)
        self.digest = allow_list_digest(self.operators)
        self.own = own
        self._clock = clock
        self._revoked: dict[str, Token] = {}  # revoked PeerID -> its latest revocation
        self._decoded: dict[tuple[str, bytes], Token | str] = {}  # (kind, bytes) -> the token or why it is none

    @classmethod
    def from_access(cls, access: AccessConfig, run_id: str, self_id: str,
                    operators: tuple[str, ...] = ()) -> Invitations | None:
        """The gate of a peer configured by `access` (None: the run has no operator keys); `operators`: the
        spec's (defence.operators), else --operators. ConfigError if this peer's own invitation would not admit
        it (other run, other PeerID, expired, other operators)."""
        operators = operators or access.operator_ids()
        own = load_invitation(access.invite) if access.invite else None
        if not operators and own is None:
            return None
        if not operators and own is not None:  # a volunteer need not know the keys: its invitation names one
            operators = (own.operator,)
        book = cls(run_id, operators, own)
        if own is not None:
            why = own.why_not(run_id=run_id, operators=book.operators, now=book._clock(), peer=self_id)
            if why:
                raise ConfigError(f"--invite {access.invite}: {why}" + (
                    " (join with the --identity it was made for)" if "another peer" in why else ""))
        elif self_id not in book.operators:
            raise ConfigError(f"{NO_INVITATION} (this peer is {self_id})")
        return book

    # ---- what members check --------------------------------------------------------------------------------

    def why_not(self, peer_id: str, record: Mapping[str, object] | None) -> str | None:
        """Why the peer of a (signature-checked) record may not take part, in one line; None if it may."""
        if record is None:
            return f"no invitation ({RECORD_NOT_SEEN})"
        token = record.get(INVITE_FIELD)
        if token is None and peer_id not in self.operators:
            return NO_INVITATION
        if record.get(OPERATORS_FIELD) != self.digest:
            return ("different operator keys from this run's: join with the run's --operators (or with the "
                    "invitation of one of its operators and no --operators)")
        if peer_id in self.operators:
            return None
        invitation = self._decode(token, "invite")
        if isinstance(invitation, str):
            return invitation
        why = invitation.why_not(run_id=self.run_id, operators=self.operators, now=self._clock(), peer=peer_id)
        if why:
            return why + ("; ask the run's operator for a new one" if "expired" in why else "")
        revocation = self._revoked.get(peer_id)
        return self.revoked_why(peer_id) if revocation and invitation.issued_at <= revocation.issued_at else None

    def revoked_why(self, peer_id: str) -> str | None:
        """The refusal of a revoked peer (None if it is not revoked; an operator never is)."""
        revocation = self._revoked.get(peer_id)
        if revocation is None or peer_id in self.operators:
            return None
        return f"invitation revoked by the run's operator ({revocation.operator[-8:]}) at {utc(revocation.issued_at)}"

    # ---- revocations ------------------------------------------------------------------------------------------

    def learn(self, record: Mapping[str, object]) -> list[str]:
        """Keep the revocations a record carries that an operator of this run signed; returns the PeerIDs
        newly revoked."""
        carried = record.get(REVOKED_FIELD)
        if not isinstance(carried, list):
            return []
        newly = []
        for data in carried[:MAX_READ_PER_RECORD]:
            token = self._decode(data, "revoke")
            if isinstance(token, Token) and self.add(token):  # False for one already held
                newly.append(token.peer)
        return newly

    def add(self, revocation: Token) -> bool:
        """Keep `revocation` if it counts in this run and is the latest for its peer; True if it was kept."""
        now = self._clock()
        if revocation.kind != "revoke" or revocation.why_not(run_id=self.run_id, operators=self.operators, now=now):
            return False
        held = self._revoked.get(revocation.peer)
        if held is not None and held.issued_at >= revocation.issued_at:
            return False
        self._revoked[revocation.peer] = revocation
        for pid in [p for p, t in self._revoked.items() if t.expires_at <= now]:
            del self._revoked[pid]
        while len(self._revoked) > MAX_REVOCATIONS:
            del self._revoked[min(self._revoked, key=lambda p: self._revoked[p].expires_at)]
        logger.info("revocation kept peer=%s operator=%s", revocation.peer[-8:], revocation.operator[-8:])
        return revocation.peer in self._revoked

    def _decode(self, data: object, kind: str) -> Token | str:
        """The `kind` token in untrusted `data`, or why it is none; each token's signature is checked once."""
        if not isinstance(data, bytes):
            return f"not {'an invitation' if kind == 'invite' else 'a revocation'} (malformed)"
        known = self._decoded.get((kind, data))
        if known is None:
            try:
                known = decode_token(data, kind, self.operators)
            except TokenError as e:
                known = str(e)
            self._decoded[(kind, data)] = known
            while len(self._decoded) > MAX_SEEN_TOKENS:
                del self._decoded[next(iter(self._decoded))]
        return known

    # ---- what our record carries -----------------------------------------------------------------------------

    def record_fields(self) -> dict[str, object]:
        """Our record's fields: the operators' digest, our invitation, the revocations we carry for the others."""
        now = self._clock()
        fields: dict[str, object] = {OPERATORS_FIELD: self.digest}
        if self.own is not None:
            fields[INVITE_FIELD] = self.own.encoded
        live = sorted((t for t in self._revoked.values() if t.expires_at > now), key=lambda t: -t.issued_at)
        if live:
            fields[REVOKED_FIELD] = [t.encoded for t in live[:MAX_CARRIED]]
        return fields
