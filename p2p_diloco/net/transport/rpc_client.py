"""The calling side of the bounded RPC (protocol: net/transport/rpc.py): `call` for one response, `call_stream`
for a stream of chunks; every length is checked before it is read, every read is timed out.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

from hivemind.p2p import P2P, PeerID

from p2p_diloco.net.transport import relay
from p2p_diloco.net.transport.framing import (
    DATA,
    END,
    ERROR,
    HEADER,
    MAX_ERROR_BYTES,
    Pace,
    TooSlow,
    read_header,
    read_payload,
    write_frame,
)
from p2p_diloco.net.transport.rpc_errors import (
    RpcConnectionError,
    RpcError,
    RpcRemoteError,
    RpcSlowError,
    RpcTimeoutError,
    RpcTooLargeError,
)


async def _open(p2p: P2P, peer_id: str, name: str, request: bytes, timeout_s: float):
    try:
        PeerID.from_base58(peer_id)
    except Exception:
        raise RpcError(f"bad peer id {peer_id!r}") from None
    try:
        reader, writer = await relay.open_stream(p2p, peer_id, name, timeout_s)  # direct, else through a relay
    except asyncio.TimeoutError:
        raise RpcTimeoutError(f"could not open '{name}' on peer {peer_id} within {timeout_s:g}s") from None
    except Exception as e:  # p2pd: "protocol not supported", "all dials failed", ...
        raise RpcConnectionError(f"could not open '{name}' on peer {peer_id}: {e}") from e
    try:
        await write_frame(writer, DATA, request, timeout_s)
    except (ConnectionError, OSError) as e:
        # The server may have refused the request before reading it all (e.g. too large) and closed the
        # stream; its ERROR frame is then already waiting in our socket. Report that rather than the reset.
        try:
            async for _ in _read_frames(reader, peer_id, name, max_chunk_bytes=0, max_total_bytes=0,
                                        timeout_s=min(timeout_s, 1.0)):
                pass
        except RpcRemoteError:
            raise
        except RpcError:
            pass
        finally:
            writer.close()
        raise RpcConnectionError(f"sending the request to '{name}' on peer {peer_id} failed: {e}") from e
    except BaseException as e:
        writer.close()
        if isinstance(e, asyncio.TimeoutError):
            raise RpcTimeoutError(f"sending the request to '{name}' on peer {peer_id} timed out") from None
        raise
    return reader, writer


async def _read_frames(reader: asyncio.StreamReader, peer_id: str, name: str, *, max_chunk_bytes: int,
                       max_total_bytes: int, timeout_s: float, pace: Pace | None = None) -> AsyncIterator[bytes]:
    """Yield DATA payloads until END; raise RpcError subclasses on ERROR, oversize, timeout, slowness or
    disconnect."""
    where = f"'{name}' on peer {peer_id}"
    total, error_length = 0, None
    try:
        while True:
            kind, length = await read_header(reader, timeout_s, pace)
            if kind == END:
                return
            if kind == ERROR:
                error_length = length
                message = (await read_payload(reader, min(length, MAX_ERROR_BYTES), timeout_s)).decode(
                    "utf-8", errors="replace")
                raise RpcRemoteError(f"{where} failed: {message}", message)
            if kind != DATA:
                raise RpcConnectionError(f"{where} sent a malformed frame (kind {kind})")
            if length > max_chunk_bytes or total + length > max_total_bytes:
                raise RpcTooLargeError(f"{where} sent {total + length}+ bytes (chunk {length}); the limit is "
                                       f"{max_chunk_bytes} per chunk and {max_total_bytes} in all")
            total += length
            yield await read_payload(reader, length, timeout_s, pace)
    except TooSlow as e:
        raise RpcSlowError(f"{where} sent too slowly: {e}") from None
    except asyncio.TimeoutError:
        raise RpcTimeoutError(f"{where} did not answer within {timeout_s:g}s") from None
    except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
        refusal = _refusal_before_reset(reader, error_length)
        if refusal is not None:
            raise RpcRemoteError(f"{where} failed: {refusal}", refusal) from None
        raise RpcConnectionError(f"{where}: stream closed before the response ended ({e!r})") from None


def _refusal_before_reset(reader: asyncio.StreamReader, error_length: int | None) -> str | None:
    """The server's ERROR message if it reached us whole just ahead of a reset, else None.

    A server that refuses before reading the request (busy: net/transport/rpc_server.py) closes with the
    request unread, and p2pd then resets the stream. The ERROR frame is already in our buffer, but StreamReader
    raises the stored reset before handing buffered bytes out: without this, the caller sees "connection reset"
    for a plain "busy" and cannot tell it may ask again (CI, 2026-12-03: 23 bytes buffered behind the reset).
    `_buffer` is CPython's; another reader has none, and nothing is salvaged. `error_length` is the length of an
    ERROR header already read, if any."""
    data = bytes(getattr(reader, "_buffer", b""))
    if error_length is None:
        if len(data) < HEADER.size:
            return None
        kind, error_length = HEADER.unpack(data[:HEADER.size])
        if kind != ERROR:
            return None
        data = data[HEADER.size:]
    wanted = min(error_length, MAX_ERROR_BYTES)
    return data[:wanted].decode("utf-8", errors="replace") if len(data) >= wanted else None


async def call(p2p: P2P, peer_id: str, name: str, request: bytes, *, max_response_bytes: int,
               timeout_s: float) -> bytes:
    """One request, one response (all DATA frames joined), within `timeout_s` in all; RpcError on any failure."""
    async def _call() -> bytes:
        reader, writer = await _open(p2p, peer_id, name, request, timeout_s)
        try:
            parts = [part async for part in _read_frames(
                reader, peer_id, name, max_chunk_bytes=max_response_bytes, max_total_bytes=max_response_bytes,
                timeout_s=timeout_s)]
        finally:
            writer.close()
        return b"".join(parts)

    try:
        return await asyncio.wait_for(_call(), timeout_s)
    except asyncio.TimeoutError:
        raise RpcTimeoutError(f"'{name}' on peer {peer_id} did not answer within {timeout_s:g}s") from None


async def call_stream(p2p: P2P, peer_id: str, name: str, request: bytes, *, max_chunk_bytes: int,
                      max_total_bytes: int, timeout_s: float,
                      min_bytes_per_s: float = 0.0) -> AsyncGenerator[bytes, None]:
    """Yield the response chunks as they arrive; each within `timeout_s`, each and all of them bounded.

    With `min_bytes_per_s`, the whole response must keep that average pace after a grace of `timeout_s` (the
    time the caller spends between chunks counts too: keep it small), else RpcSlowError: a remote that sends
    forever, however slowly, is cut. Iterate to the end, or close it (`contextlib.aclosing`) to release the
    stream early.
    """
    reader, writer = await _open(p2p, peer_id, name, request, timeout_s)
    pace = Pace(timeout_s, min_bytes_per_s) if min_bytes_per_s > 0 else None
    try:
        async for chunk in _read_frames(reader, peer_id, name, max_chunk_bytes=max_chunk_bytes,
                                        max_total_bytes=max_total_bytes, timeout_s=timeout_s, pace=pace):
            yield chunk
    finally:
        writer.close()
