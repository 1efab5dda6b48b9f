"""The errors of a bounded RPC call (net/transport/rpc.py): each subclass says how the call failed."""

from __future__ import annotations


class RpcError(Exception):
    """A call failed; subclasses say how. The message names the peer and the handler."""


class RpcRemoteError(RpcError):
    """The remote handler failed or refused the request; `remote_message` is what it said."""

    def __init__(self, message: str, remote_message: str):
        super().__init__(message)
        self.remote_message = remote_message


class RpcTimeoutError(RpcError, TimeoutError):
    """No answer (or no next chunk) within the timeout."""


class RpcSlowError(RpcTimeoutError):
    """The response came slower than the minimum pace (`min_bytes_per_s` after the grace period)."""


class RpcTooLargeError(RpcError):
    """The response (or one chunk) is larger than the caller allows."""


class RpcConnectionError(RpcError):
    """The stream could not be opened or broke before the response ended."""

