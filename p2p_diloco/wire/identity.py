"""Ed25519 peer identity, shared with libp2p so that the PeerID *is* the public key.

A peer's key is stored in libp2p's protobuf `PrivateKey` format, which hivemind's daemon (p2pd) accepts as
`identity_path`. Its PeerID is an identity multihash of the protobuf `PublicKey` ("12D3KooW..." in base58btc), so
a signature can be checked against the PeerID alone, with no PKI and no key exchange (ARCHITECTURE.md "The network").

The protobufs involved are fixed byte layouts for Ed25519 and are written by hand:
    PublicKey  = 08 01 12 20 <32-byte public key>                  (KeyType=Ed25519, Data)
    PrivateKey = 08 01 12 40 <32-byte seed><32-byte public key>
    PeerID     = 00 24 <PublicKey>                                 (identity multihash, 36-byte digest)
"""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

_PUBLIC_KEY_PREFIX = bytes([0x08, 0x01, 0x12, 0x20])
_PRIVATE_KEY_PREFIX = bytes([0x08, 0x01, 0x12, 0x40])
_PEER_ID_PREFIX = bytes([0x00, 0x24]) + _PUBLIC_KEY_PREFIX
_PEER_ID_LEN = len(_PEER_ID_PREFIX) + 32
# An Ed25519 PeerID is 52 base58 characters; anything much longer is rejected before decoding, because base58
# decoding is quadratic in the input length and peer ids arrive from the network.
_MAX_PEER_ID_CHARS = 64
_KEY_TYPES = {0: "RSA", 1: "Ed25519", 2: "Secp256k1", 3: "ECDSA"}


class IdentityError(ValueError):
    """An identity file or peer id that is missing, corrupt or not Ed25519; the message says what to do."""


class Identity:
    """One peer's Ed25519 key pair; `peer_id` is its libp2p PeerID."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self.public_key_bytes: bytes = private_key.public_key().public_bytes_raw()
        self.peer_id_bytes: bytes = _PEER_ID_PREFIX + self.public_key_bytes
        self.peer_id: str = base58.b58encode(self.peer_id_bytes).decode("ascii")

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id!r})"

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self._private_key.public_key()

    def sign(self, data: bytes) -> bytes:
        """A 64-byte Ed25519 signature of `data`."""
        return self._private_key.sign(data)

    def secret(self, purpose: bytes) -> int:
        """A 62-bit number only this key's holder can know, the same at every call and restart: a digest of the
        key's (deterministic, RFC 8032) signature of `purpose`. Nothing it signs is ever sent."""
        digest = hashlib.sha256(self.sign(b"p2p-diloco secret\0" + purpose)).digest()
        return int.from_bytes(digest[:8], "big") >> 2

    def to_protobuf(self) -> bytes:
        """The key in libp2p's protobuf PrivateKey format (what `save` writes)."""
        return _PRIVATE_KEY_PREFIX + self._private_key.private_bytes_raw() + self.public_key_bytes

    @classmethod
    def from_protobuf(cls, data: bytes, source: str = "key") -> Identity:
        """Parse libp2p's protobuf PrivateKey; `IdentityError` unless it is a consistent Ed25519 key."""
        if len(data) >= 2 and data[0] == 0x08 and data[1] != 0x01:
            kind = _KEY_TYPES.get(data[1], f"type {data[1]}")
            raise IdentityError(f"{source} holds a {kind} key; p2p-diloco needs Ed25519. Move it away and let "
                                "p2p-diloco create a new identity (or run `p2p-diloco keygen`).")
        if len(data) != len(_PRIVATE_KEY_PREFIX) + 64 or not data.startswith(_PRIVATE_KEY_PREFIX):
            raise IdentityError(f"{source} is not a libp2p Ed25519 private key ({len(data)} bytes, expected 68); "
                                "the file may be corrupt or of another format")
        seed, public = data[4:36], data[36:]
        identity = cls(Ed25519PrivateKey.from_private_bytes(seed))
        # The public half is redundant; a mismatch means the file was damaged or assembled by hand.
        if identity.public_key_bytes != public:
            raise IdentityError(f"{source} is corrupt: its public key does not match its private key")
        return identity

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise IdentityError(f"identity file {path} does not exist; create one with `p2p-diloco keygen`") from None
        except OSError as exc:
            raise IdentityError(f"cannot read identity file {path}: {exc}") from exc
        return cls.from_protobuf(data, source=f"identity file {path}")

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the key (mode 0600, parents created) atomically: readers see the old file or the new one."""
        _write_private(Path(path), self.to_protobuf(), overwrite=True)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load `path`, or generate and save a new identity there if it does not exist yet."""
        path = Path(path)
        if not path.exists():
            identity = cls.generate()
            # No-clobber create: if another process created the file meanwhile, everyone uses that one.
            if _write_private(path, identity.to_protobuf(), overwrite=False):
                return identity
        return cls.load(path)


def _write_private(path: Path, data: bytes, *, overwrite: bool) -> bool:
    """Write `data` to `path` via a 0600 temp file; returns False if `overwrite` is off and `path` exists."""
    try:
        return _write_private_unchecked(path, data, overwrite=overwrite)
    except OSError as exc:
        raise IdentityError(f"cannot write identity file {path}: {exc}") from exc


def _write_private_unchecked(path: Path, data: bytes, *, overwrite: bool) -> bool:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # the umask could have removed bits; make the mode exact
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)  # atomic create-if-absent
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: plain rename, last writer wins
            os.replace(tmp, path)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def public_key_from_peer_id(peer_id: str | bytes) -> Ed25519PublicKey:
    """The Ed25519 public key inside a PeerID (base58 string or raw multihash bytes); `IdentityError` if none."""
    if isinstance(peer_id, (bytearray, memoryview)):
        peer_id = bytes(peer_id)
    if not isinstance(peer_id, (str, bytes)):
        raise IdentityError(f"peer id must be str or bytes, got {type(peer_id).__name__}")
    return _public_key(peer_id)


# Bounded: peer ids come from the network, and every received message is verified against one.
@functools.lru_cache(maxsize=4096)
def _public_key(peer_id: str | bytes) -> Ed25519PublicKey:
    if isinstance(peer_id, str):
        if not 0 < len(peer_id) <= _MAX_PEER_ID_CHARS:
            raise IdentityError(f"peer id has {len(peer_id)} characters; an Ed25519 PeerID has 52")
        try:
            raw = base58.b58decode(peer_id)
        except ValueError:  # includes non-ASCII input (UnicodeEncodeError)
            raise IdentityError(f"peer id {peer_id!r} is not valid base58") from None
    else:
        raw = peer_id
    if len(raw) != _PEER_ID_LEN or not raw.startswith(_PEER_ID_PREFIX):
        raise IdentityError(f"peer id {repr(peer_id)[:80]} is not an Ed25519 identity multihash (12D3KooW...)")
    try:
        return Ed25519PublicKey.from_public_bytes(raw[len(_PEER_ID_PREFIX):])
    except ValueError as exc:
        raise IdentityError(f"peer id {repr(peer_id)[:80]} holds an invalid Ed25519 key: {exc}") from None


def verify(peer_id: str | bytes, data: bytes, signature: bytes) -> bool:
    """True iff `signature` is `peer_id`'s Ed25519 signature of `data`; never raises, whatever the inputs."""
    try:
        public_key_from_peer_id(peer_id).verify(signature, data)
        return True
    except (InvalidSignature, ValueError, TypeError):  # IdentityError is a ValueError
        return False


def sign_blob(identity: Identity, domain: bytes, blob: bytes) -> bytes:
    """Sign `blob` under a domain-separation tag, so a signature made for one kind of object never verifies as
    another (an update header replayed as a DHT record or a state-sync manifest)."""
    return identity.sign(_tagged(domain, blob))


def verify_blob(peer_id: str | bytes, domain: bytes, blob: bytes, signature: bytes) -> bool:
    """True iff `signature` is `sign_blob(<peer_id's identity>, domain, blob)`; never raises."""
    try:
        message = _tagged(domain, blob)
    except (TypeError, ValueError):
        return False
    return verify(peer_id, message, signature)


def _tagged(domain: bytes, blob: bytes) -> bytes:
    # Length-prefixed, so no (domain, blob) pair can collide with another whose domain is a prefix of it.
    if not isinstance(domain, bytes) or not 0 < len(domain) < 256:
        raise ValueError("domain must be 1..255 bytes")
    return bytes([len(domain)]) + domain + bytes(blob)
