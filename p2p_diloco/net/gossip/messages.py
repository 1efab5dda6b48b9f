"""The gossip protocol's messages and bounds (the protocol itself: net/gossip/service.py).

Kept apart from the `Gossip` service so that fuzzers and tests exercise the request codec alone (the settings,
`GossipConfig`, live in config/network.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import msgpack

from p2p_diloco.config.network import GossipConfig  # noqa: F401 (defined in the light config; imported from here)
from p2p_diloco.net.gossip.digests import MAX_ID_DIGESTS
from p2p_diloco.net.transport import rpc
from p2p_diloco.sync.version_vector import MAX_HOLES, VersionVector
from p2p_diloco.wire.envelope import REJECT_REASONS

MAX_VECTOR_BYTES = 1 << 20
"""Bound on an encoded announce or pull request (~15k senders of 52-character PeerIDs)."""
_DIGEST = re.compile(r"[0-9a-f]{16}")
HOSTILE_OUTCOMES = frozenset(REJECT_REASONS) | {"bad_layout", "rejected_nonfinite", "rejected_invalid",
                                               "norm_bound", "not_allowed"}
"""Intake outcomes no honest peer ever relays: the pull ends and its remote is penalized. (Duplicates,
equivocation, a full buffer and banned senders can come from an honest relay.)"""
PULL_FAILURES = ((rpc.RpcSlowError, "slow_stream"), (rpc.RpcTimeoutError, "timeout"),
                 (rpc.RpcTooLargeError, "oversize"), (rpc.RpcRemoteError, "refused"),
                 (rpc.RpcConnectionError, "disconnect"))
"""How a failed pull is counted, by the kind of RpcError."""
LEDGER_FAILURES = {"slow_stream": "timeout", "timeout": "timeout", "oversize": "invalid", "refused": "refused",
                   "disconnect": "error"}
"""The contribution ledger's failure kind (net/admission/ledger.py) of each counted pull failure (others: error)."""


class InvalidPull(Exception):
    """A pull brought something no honest peer sends; `reason` is what is counted."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Request:
    """A decoded announce or pull request. `ids`: sender -> `ids_digest` of its `id_window` (pulls only; see
    net/gossip/digests.py)."""

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
