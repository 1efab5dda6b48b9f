"""The gossip protocol's messages, bounds and configuration (the protocol itself: net/gossip.py).

Kept apart from the `Gossip` service: the CLI reads `GossipConfig`'s fields from this module's source, and
fuzzers and tests exercise the request codec alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from p2p_diloco.net import rpc
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.envelope import REJECT_REASONS

MAX_VECTOR_BYTES = 1 << 20
"""Bound on an encoded announce or pull request (~15k senders of 52-character PeerIDs)."""
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


def encode_request(vv: VersionVector, limit: int | None = None) -> bytes:
    """An announce (no limit) or a pull request (with the most updates we want back)."""
    message: dict[str, Any] = {"vv": vv.to_dict()}
    if limit is not None:
        message["limit"] = limit
    return msgpack.packb(message, use_bin_type=True)


def decode_request(data: bytes, *, pull: bool) -> tuple[VersionVector, int]:
    """Parse an announce or pull request from a remote; rpc.RpcError (sent back to it) if malformed."""
    try:
        if len(data) > MAX_VECTOR_BYTES:
            raise ValueError(f"{len(data)} bytes, limit {MAX_VECTOR_BYTES}")
        message = msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0, max_bin_len=0,
                                  max_array_len=0)
        if not isinstance(message, dict) or set(message) != ({"vv", "limit"} if pull else {"vv"}):
            raise ValueError("expected a map with keys " + ("vv, limit" if pull else "vv"))
        vv = VersionVector.from_dict(message["vv"])
        limit = message.get("limit", 0)
        if type(limit) is not int or (pull and limit < 1):
            raise ValueError(f"limit must be an int >= 1, got {limit!r:.40}")
    except Exception as e:  # msgpack raises a zoo of types on garbage; a remote must never crash us
        raise rpc.RpcError(f"malformed {'pull' if pull else 'announce'} request: {e}") from None
    return vv, limit
