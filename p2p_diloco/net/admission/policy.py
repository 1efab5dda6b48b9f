"""Who may talk to this peer, and how much of its time a remote may take (hostile input).

Anyone on the internet can reach a peer. What a remote sends is checked (wire/, sync/); this module bounds what
it can *make us do*, and who may take part at all.

Access (a closed run): independent gates; a run may use any of them, or none.
  - Allow list: the PeerIDs that may take part, from `--allow-peers FILE` (one PeerID per line, `#` comments).
    It lives in the RunSpec (`defence.allowed_senders`), so it is part of the spec hash: every peer merges
    exactly the same senders' updates, which invariant 3 (equal merged sets give equal replicas) needs. A
    peer with another list is refused at the spec handshake with the differing field named. Changing the list
    means a new spec, i.e. a new run.
  - Run secret: per-peer config (`--run-secret-file`), never published: the RunSpec sits on the DHT in clear.
    A member proves it knows the secret without revealing it: its signed DHT peer record carries
    `member_proof = HMAC-SHA256(K, run_id || PeerID)` with `K = scrypt(secret, run_id)`. The record is signed
    by the PeerID's key and libp2p authenticates the PeerID of every stream, so a copied proof is useless to
    anyone else; scrypt makes guessing a weak secret from a published proof slow (use a long random one).
  - Invitations: a run with operator keys (`--operators`) admits the operators' PeerIDs and the peers they
    invite, without a new spec; revocations spread through the peer records (net/admission/invites.py).
Every gate applies to every RPC (announce, pull, evidence, snapshot, hello): a refused caller gets the reason
("not allowed in this run: ..."), and a refused `join` prints it and exits non-zero.

Rate limits: token buckets per remote PeerID and per kind of request, plus bytes in and out, kept for at most
`max_tracked_peers` remotes (least recently seen dropped first). Byte buckets may go into debt: one large
response (an update, a snapshot chunk) always passes, then the remote waits until the debt is paid. Streams
must keep up an average of `min_stream_bytes_per_s` after a grace period, so a never-ending trickle is cut
by a total deadline, not only by the per-read timeout.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass, field
from pathlib import Path

from p2p_diloco.config import ConfigError
from p2p_diloco.config.admission import MAX_SECRET_BYTES, AccessConfig, RateLimitConfig  # noqa: F401
from p2p_diloco.wire.identity import IdentityError, public_key_from_peer_id

MEMBER_PROOF_FIELD = "member_proof"
"""The peer-record field that carries a member's proof of the run secret (hex)."""
RECORD_NOT_SEEN = "no peer record of yours is on the DHT yet; announce, then retry"
"""Part of a refusal when the caller's record was not found: a joiner that just announced asks again
(net/admission/hello.py)."""
_PROOF_DOMAIN = b"p2p-diloco/member-proof/v1"
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 1 << 14, 8, 1  # ~50 ms and 16 MiB once per start; per guess for an attacker
MAX_ALLOW_LIST_PEERS = 100_000


def request_kind(handler_name: str) -> str:
    """The rate-limit bucket of an RPC, from its protocol name (`p2p-diloco/<run>/<what>`)."""
    what = handler_name.rsplit("/", 1)[-1]
    return "snapshot" if what in ("manifest", "chunk") else what


# ---------------------------------------------------------------------------------------------- allow list


def load_allow_list(path: str) -> tuple[str, ...]:
    """PeerIDs from an allow-list file: one per line, blank lines and `#` comments ignored; sorted, unique.

    ConfigError names the file and line of anything that is not an Ed25519 PeerID.
    """
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the allow list {file}: {e}") from None
    peers: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            public_key_from_peer_id(entry)
        except IdentityError:
            raise ConfigError(f"{file}:{number}: '{entry[:60]}' is not an Ed25519 PeerID (12D3KooW...); "
                              "`p2p-diloco id` prints a peer's") from None
        peers.add(entry)
    if not peers:
        raise ConfigError(f"the allow list {file} names no PeerID")
    if len(peers) > MAX_ALLOW_LIST_PEERS:
        raise ConfigError(f"the allow list {file} names more than {MAX_ALLOW_LIST_PEERS} peers")
    return tuple(sorted(peers))


def allow_list_digest(peers: tuple[str, ...] | frozenset[str]) -> str:
    """A short digest of an allow list (peers announce it, so differing lists are easy to spot)."""
    return hashlib.sha256("\n".join(sorted(peers)).encode()).hexdigest()[:16] if peers else ""


# ---------------------------------------------------------------------------------------------- run secret


class MembershipKey:
    """Proves and checks knowledge of the run secret, bound to a run and a PeerID (see the module docstring)."""

    def __init__(self, secret: bytes, run_id: str) -> None:
        if not secret:
            raise ValueError("the run secret is empty")
        self.run_id = run_id
        self._key = hashlib.scrypt(secret, salt=_PROOF_DOMAIN + run_id.encode(), n=_SCRYPT_N, r=_SCRYPT_R,
                                   p=_SCRYPT_P, dklen=32)

    def proof(self, peer_id: str) -> str:
        """The hex proof `peer_id` puts in its signed peer record."""
        message = _PROOF_DOMAIN + b"\x00" + self.run_id.encode() + b"\x00" + peer_id.encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def verify(self, peer_id: str, proof: object) -> bool:
        """True iff `proof` is `peer_id`'s proof for this run and secret (constant-time; never raises)."""
        if not isinstance(proof, str) or len(proof) != 64 or not isinstance(peer_id, str):
            return False
        return hmac.compare_digest(self.proof(peer_id), proof)


# ---------------------------------------------------------------------------------------------- buckets


class TokenBucket:
    """`rate` tokens per second, at most `capacity` saved. `take` refuses when short; `charge` may overdraw
    (for bytes: the cost of a response is known only once it is sent), and `ready` is then False until the
    debt is paid back."""

    __slots__ = ("rate", "capacity", "tokens", "updated")

    def __init__(self, rate: float, capacity: float, now: float | None = None) -> None:
        self.rate, self.capacity = float(rate), max(float(capacity), 1.0)
        self.tokens = self.capacity
        self.updated = time.monotonic() if now is None else now

    def _refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, cost: float = 1.0, now: float | None = None) -> bool:
        self._refill(time.monotonic() if now is None else now)
        if self.tokens < cost:
            return False
        self.tokens -= cost
        return True

    def charge(self, cost: float, now: float | None = None) -> None:
        self._refill(time.monotonic() if now is None else now)
        self.tokens -= cost

    def ready(self, now: float | None = None) -> bool:
        self._refill(time.monotonic() if now is None else now)
        return self.tokens >= 0


@dataclass(frozen=True)
class NetPolicy:
    """Access and rate limits of one peer, as handed from the CLI (`join`) to its network (PeerNetwork)."""

    access: AccessConfig = field(default_factory=AccessConfig)
    """Closed runs: the allow-list file, the run secret, operator keys and this peer's invitation."""
    limits: RateLimitConfig = field(default_factory=RateLimitConfig)
    """Per-remote rate limits, stream pace and penalties."""
