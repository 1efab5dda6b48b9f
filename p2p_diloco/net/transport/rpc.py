"""Bounded request/response over hivemind P2P binary streams.

Why not hivemind's protobuf handlers: its stream framing (`P2P.receive_raw_data`) trusts an 8-byte length from
the remote and allocates that much, its protobuf handlers log a traceback for every handler exception, and its
unary calls are capped by the 4 MiB persistent-connection message of the daemon client. Here every read is
bounded and timed out, and the handler task never leaks an exception.

Protocol on one libp2p stream (protocol id = the handler name, namespaced by run id by the caller):
    caller -> server   DATA(request)
    server -> caller   DATA(chunk)* END        or        DATA(chunk)* ERROR(utf-8 message)
Each frame (framing.py) is a 1-byte kind and a 4-byte big-endian length, then the payload. A unary response
is one DATA frame; a streamed response is one DATA frame per chunk the handler yields. The server checks the
request size against `max_request_bytes` before reading it (a refused request is then read and discarded,
bounded by `timeout_s`: closing with unread data makes p2pd reset the stream, and the caller would never see
the refusal); the caller checks every length before reading it.

Hostile remotes: besides the per-read `timeout_s`, a stream must keep up an average pace of
`min_bytes_per_s` after a grace of `timeout_s` (`Pace`), on both sides, so a never-ending trickle (a byte a
second, or empty frames just inside the timeout) is cut by a total deadline that grows only with the bytes
actually moved. A server may be given a `guard` (net/admission/guard.py): after the 5-byte request header, and before
the request is read, it decides whether this caller may be served now (access, rate limits, open streams);
its refusal message goes back to the caller, and every refusal of the RPC layer is reported to it.

The calling side lives in rpc_client.py, the serving side in rpc_server.py, the errors in rpc_errors.py; this
module is the one the rest of the package imports (`from p2p_diloco.net.transport import rpc`).
"""

from __future__ import annotations

from p2p_diloco.net.transport.rpc_client import call, call_stream
from p2p_diloco.net.transport.rpc_errors import (
    RpcConnectionError,
    RpcError,
    RpcRemoteError,
    RpcSlowError,
    RpcTimeoutError,
    RpcTooLargeError,
)
from p2p_diloco.net.transport.rpc_server import Guard, Handler, RpcStats, serve, unserve

__all__ = ["Guard", "Handler", "RpcConnectionError", "RpcError", "RpcRemoteError", "RpcSlowError", "RpcStats",
           "RpcTimeoutError", "RpcTooLargeError", "call", "call_stream", "serve", "unserve"]
