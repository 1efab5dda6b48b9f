"""Who may talk to this peer, and how much of its time a remote may take (issue 5: hostile input).

Anyone on the internet can reach a peer. What a remote sends is checked (wire/, sync/); this module bounds what
it can *make us do*, and who may take part at all.

Access (a closed run): two independent gates; a run may use either, both or none.
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
Both gates apply to every RPC (announce, pull, evidence, snapshot, hello): a refused caller gets the reason
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
from p2p_diloco.wire.identity import IdentityError, public_key_from_peer_id

MEMBER_PROOF_FIELD = "member_proof"
"""The peer-record field that carries a member's proof of the run secret (hex)."""
_PROOF_DOMAIN = b"p2p-diloco/member-proof/v1"
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 1 << 14, 8, 1  # ~50 ms and 16 MiB once per start; per guess for an attacker
MAX_SECRET_BYTES = 4096
MAX_ALLOW_LIST_PEERS = 100_000


@dataclass(frozen=True)
class AccessConfig:
    """Closed runs: who may take part (`--allow-peers`, shared in the RunSpec) and the run secret (this peer's)."""

    allow_peers: str = ""
    """File of PeerIDs allowed in this run, one per line (# comments); loaded into the RunSpec's
    defence.allowed_senders, so every peer of the run must use the same list (empty: anyone may join)."""
    run_secret: str = ""
    """A secret every member of the run knows (visible in `ps`: prefer --run-secret-file); empty: none."""
    run_secret_file: str = ""
    """File holding the run secret (its first line); members prove they know it, non-members are refused."""

    def validate(self) -> AccessConfig:
        if self.run_secret and self.run_secret_file:
            raise ConfigError("give the run secret once: --run-secret or --run-secret-file, not both")
        return self

    def secret(self) -> bytes | None:
        """The run secret as bytes, or None for a run without one; ConfigError if the file is unusable."""
        self.validate()
        if self.run_secret_file:
            path = Path(self.run_secret_file).expanduser()
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"cannot read the run secret file {path}: {e}") from None
            lines = text.splitlines()
            secret = lines[0].strip() if lines else ""
            if not secret:
                raise ConfigError(f"the run secret file {path} is empty; put the secret on its first line")
        else:
            secret = self.run_secret
        if not secret:
            return None
        if len(secret.encode()) > MAX_SECRET_BYTES:
            raise ConfigError(f"the run secret is longer than {MAX_SECRET_BYTES} bytes")
        return secret.encode()


@dataclass(frozen=True)
class RateLimitConfig:
    """Per-remote limits on requests and bytes, so one remote cannot take a peer's time from the others."""

    announces_per_s: float = 30.0
    """Announces accepted per remote per second (sustained); more are refused as rate limited. An honest peer
    sends one per update it publishes or pulls, so a few per second even with H=2 on a small model."""
    pulls_per_s: float = 20.0
    """Pull requests served per remote per second (sustained; a catching-up peer pulls back to back)."""
    snapshot_requests_per_s: float = 100.0
    """State-sync manifest and chunk requests served per remote per second (sustained)."""
    evidence_per_s: float = 2.0
    """Equivocation evidence messages accepted per remote per second (each costs two signature checks)."""
    hellos_per_s: float = 1.0
    """Admission checks (`hello`) answered per remote per second."""
    bytes_out_per_s: float = 256e6
    """Bytes served to one remote per second (sustained; one response may overdraw, then it waits)."""
    bytes_in_per_s: float = 256e6
    """Bytes accepted from one remote per second (its requests, and the pull responses we read from it)."""
    burst_s: float = 10.0
    """Each bucket holds this many seconds of its rate: short bursts pass, floods do not."""
    max_streams_per_peer: int = 16
    """Streams one remote may have open on this peer at once (all handlers together)."""
    min_stream_bytes_per_s: float = 16384.0
    """After a grace of one timeout, a stream must average at least this many bytes per second, or it is cut."""
    penalty_s: float = 30.0
    """A remote that sent an invalid update (bad signature, garbage, wrong run or shape, non-finite...) is
    neither pulled from nor listened to for this many seconds (0: never)."""
    max_tracked_peers: int = 1024
    """Remotes whose buckets and counters are kept (least recently seen forgotten first)."""

    def validate(self) -> RateLimitConfig:
        rates = (self.announces_per_s, self.pulls_per_s, self.snapshot_requests_per_s, self.evidence_per_s,
                 self.hellos_per_s, self.bytes_out_per_s, self.bytes_in_per_s)
        if not all(r > 0 for r in rates) or self.burst_s <= 0:
            raise ConfigError("rate limits (the ..._per_s options) and burst_s must be > 0")
        if self.max_streams_per_peer < 1 or self.max_tracked_peers < 1:
            raise ConfigError("max_streams_per_peer and max_tracked_peers must be >= 1")
        if self.min_stream_bytes_per_s < 0 or self.penalty_s < 0:
            raise ConfigError("min_stream_bytes_per_s and penalty_s must be >= 0")
        return self

    def rate_of(self, kind: str) -> float:
        """Requests per second allowed for a kind of request (see `request_kind`)."""
        return {"announce": self.announces_per_s, "pull": self.pulls_per_s, "evidence": self.evidence_per_s,
                "snapshot": self.snapshot_requests_per_s, "hello": self.hellos_per_s}.get(kind, self.pulls_per_s)


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
    """Closed runs: the allow-list file and the run secret."""
    limits: RateLimitConfig = field(default_factory=RateLimitConfig)
    """Per-remote rate limits, stream pace and penalties."""
