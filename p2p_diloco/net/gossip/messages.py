"""The gossip protocol's messages, bounds and configuration (the protocol itself: net/gossip/service.py).

Kept apart from the `Gossip` service: the CLI reads `GossipConfig`'s fields from this module's source, and
fuzzers and tests exercise the request codec alone.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from p2p_diloco.net.transport import rpc
from p2p_diloco.sync.version_vector import MAX_HOLES, VersionVector
from p2p_diloco.wire.envelope import REJECT_REASONS

MAX_VECTOR_BYTES = 1 << 20
"""Bound on an encoded announce or pull request (~15k senders of 52-character PeerIDs)."""
ID_WINDOW = 8
"""Seqs per sender whose update ids a pull request summarizes (its newest merged ones): the slots where two
replicas could hold different versions of one (sender, seq) without their vectors showing it."""
MAX_ID_DIGESTS = 64
"""Senders summarized in one pull request; with more, a random subset each time (anti-entropy covers all)."""
_DIGEST = re.compile(r"[0-9a-f]{16}")
HOSTILE_OUTCOMES = frozenset(REJECT_REASONS) | {"bad_layout", "rejected_nonfinite", "rejected_invalid",
                                               "norm_bound", "not_allowed"}
"""Intake outcomes no honest peer ever relays: the pull ends and its remote is penalized. (Duplicates,
equivocation, a full buffer and banned senders can come from an honest relay.)"""
PULL_FAILURES = ((rpc.RpcSlowError, "slow_stream"), (rpc.RpcTimeoutError, "timeout"),
                 (rpc.RpcTooLargeError, "oversize"), (rpc.RpcRemoteError, "refused"),
                 (rpc.RpcConnectionError, "disconnect"))
"""How a failed pull is counted, by the kind of RpcError."""


@dataclass(frozen=True)
class GossipConfig:
    """How updates spread: fanout, anti-entropy period, pull sizes and timeouts."""

    fanout: int = 3
    """Random peers to announce to after publishing, and after a pull that brought anything new."""
    anti_entropy_s: float = 5.0
    """Mean seconds between anti-entropy pulls from one random peer (jittered +-50%)."""
    pull_max_updates: int = 32
    """Most updates in one pull response (asked for and served); a full batch makes the requester pull again."""
    rpc_timeout_s: float = 10.0
    """Timeout of each call, and of each chunk of a pull response, in seconds."""
    retained_bytes: int = 512 << 20
    """Bytes of recent updates kept to serve pulls: build the store as `UpdateStore(config.retained_bytes)`."""
    max_concurrent_pulls: int = 4
    """Pulls in flight at once, at most one per remote."""
    max_concurrent_serves: int = 8
    """Pull requests served at once; more are refused as busy (the requester tries again later)."""
    log_interval_s: float = 30.0
    """A failing peer is logged at most once per this many seconds (every failure is counted in `stats`)."""

    def validate(self) -> GossipConfig:
        if self.fanout < 1 or self.pull_max_updates < 1 or self.max_concurrent_pulls < 1 \
                or self.max_concurrent_serves < 1:
            raise ValueError("fanout, pull_max_updates, max_concurrent_pulls and max_concurrent_serves must be >= 1")
        if not (self.anti_entropy_s > 0 and self.rpc_timeout_s > 0 and self.log_interval_s >= 0):
            raise ValueError("anti_entropy_s and rpc_timeout_s must be > 0, log_interval_s >= 0")
        if self.retained_bytes < 0:
            raise ValueError(f"retained_bytes must be >= 0, got {self.retained_bytes}")
        return self


class InvalidPull(Exception):
    """A pull brought something no honest peer sends; `reason` is what is counted."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def id_window(vv: VersionVector, sender: str) -> list[int]:
    """The seqs of `sender` whose ids a request with vector `vv` summarizes: its newest ID_WINDOW merged."""
    top = vv.get(sender)
    return [seq for seq in range(max(1, top - ID_WINDOW + 1), top + 1) if vv.has(sender, seq)]


def ids_digest(seqs: Sequence[int], ids: Sequence[bytes]) -> str:
    """16 hex digits naming which update was merged for each of `seqs` (equal iff the same updates, whp)."""
    h = hashlib.blake2b(digest_size=8)
    for seq, update_id in zip(seqs, ids, strict=True):
        h.update(seq.to_bytes(8, "big") + update_id)
    return h.hexdigest()


def summarize_ids(vv: VersionVector, ids_of: Callable[[str, list[int]], list[bytes] | None],
                  senders: Sequence[str]) -> dict[str, str]:
    """Per sender in `senders` (at most MAX_ID_DIGESTS), the digest of the ids merged in its window;
    `ids_of(sender, seqs)` gives them, or None if some are no longer known (that sender is left out)."""
    out: dict[str, str] = {}
    for sender in senders[:MAX_ID_DIGESTS]:
        seqs = id_window(vv, sender)
        ids = ids_of(sender, seqs) if seqs else None
        if ids is not None:
            out[sender] = ids_digest(seqs, ids)
    return out


@dataclass(frozen=True)
class Request:
    """A decoded announce or pull request. `ids`: sender -> `ids_digest` of its `id_window` (pulls only)."""

    vv: VersionVector
    limit: int = 0
    ids: dict[str, str] = field(default_factory=dict)


def encode_request(vv: VersionVector, limit: int | None = None, ids: dict[str, str] | None = None) -> bytes:
    """An announce (no limit) or a pull request (with the most updates we want back, and optionally the
    digests of the update ids we merged lately, so the responder can tell us where it holds other ones).
    Either carries the vector's holes when it has any."""
    message: dict[str, Any] = {"vv": vv.to_dict()}
    if vv.n_holes:  # the seqs it skipped: a responder that holds one serves it, one that cannot may repair
        message["holes"] = vv.holes_dict()
    if limit is not None:
        message["limit"] = limit
    if ids:
        message["ids"] = dict(ids)
    return msgpack.packb(message, use_bin_type=True)


def parse_request(data: bytes, *, pull: bool) -> Request:
    """Parse an announce or pull request from a remote; rpc.RpcError (sent back to it) if malformed."""
    try:
        if len(data) > MAX_VECTOR_BYTES:
            raise ValueError(f"{len(data)} bytes, limit {MAX_VECTOR_BYTES}")
        message = msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0, max_bin_len=0,
                                  max_array_len=MAX_HOLES)  # arrays: the holes' seq lists only
        required = {"vv", "limit"} if pull else {"vv"}
        optional = {"holes", "ids"} if pull else {"holes"}
        if not isinstance(message, dict) or not required <= set(message) <= required | optional:
            raise ValueError("expected a map with keys " + ("vv, limit" if pull else "vv") + " (and holes"
                             + (", ids)" if pull else ")"))
        vv = VersionVector.from_dict(message["vv"], holes=message.get("holes"))
        limit = message.get("limit", 0)
        if type(limit) is not int or (pull and limit < 1):
            raise ValueError(f"limit must be an int >= 1, got {limit!r:.40}")
        ids = message.get("ids", {})
        if not isinstance(ids, dict) or len(ids) > MAX_ID_DIGESTS:
            raise ValueError(f"ids must be a map of at most {MAX_ID_DIGESTS} senders")
        for sender, digest in ids.items():
            if sender not in vv or type(digest) is not str or not _DIGEST.fullmatch(digest):
                raise ValueError("ids must map senders of vv to 16 hex digits")
    except Exception as e:  # msgpack raises a zoo of types on garbage; a remote must never crash us
        raise rpc.RpcError(f"malformed {'pull' if pull else 'announce'} request: {e}") from None
    return Request(vv, limit, ids)


def decode_request(data: bytes, *, pull: bool) -> tuple[VersionVector, int]:
    """`parse_request`, without the ids."""
    request = parse_request(data, pull=pull)
    return request.vv, request.limit
