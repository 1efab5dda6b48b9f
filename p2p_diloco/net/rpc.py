"""Bounded request/response over hivemind P2P binary streams.

Why not hivemind's protobuf handlers: its stream framing (`P2P.receive_raw_data`) trusts an 8-byte length from
the remote and allocates that much, its protobuf handlers log a traceback for every handler exception, and its
unary calls are capped by the 4 MiB persistent-connection message of the daemon client. Here every read is
bounded and timed out, and the handler task never leaks an exception.

Protocol on one libp2p stream (protocol id = the handler name, namespaced by run id by the caller):
    caller -> server   DATA(request)
    server -> caller   DATA(chunk)* END        or        DATA(chunk)* ERROR(utf-8 message)
Each frame is a 1-byte kind and a 4-byte big-endian length, then the payload. A unary response is one DATA
frame; a streamed response is one DATA frame per chunk the handler yields. The server checks the request size
against `max_request_bytes` before reading it (a refused request is then read and discarded, bounded by
`timeout_s`: closing with unread data makes p2pd reset the stream, and the caller would never see the refusal);
the caller checks every length before reading it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID

logger = logging.getLogger(__name__)

Handler = Callable[[bytes, str], "Awaitable[bytes | AsyncIterator[bytes]] | AsyncIterator[bytes]"]

DATA, END, ERROR = 0, 1, 2
_HEADER = struct.Struct(">BI")
MAX_ERROR_BYTES = 2048
"""Error messages longer than this are truncated (both when sent and when read)."""


class RpcError(Exception):
    """A call failed; subclasses say how. The message names the peer and the handler."""


class RpcRemoteError(RpcError):
    """The remote handler failed or refused the request; `remote_message` is what it said."""

    def __init__(self, message: str, remote_message: str):
        super().__init__(message)
        self.remote_message = remote_message


class RpcTimeoutError(RpcError, TimeoutError):
    """No answer (or no next chunk) within the timeout."""


class RpcTooLargeError(RpcError):
    """The response (or one chunk) is larger than the caller allows."""


class RpcConnectionError(RpcError):
    """The stream could not be opened or broke before the response ended."""


@dataclass
class RpcStats:
    """Counters of one served handler (read them for logs and benchmarks)."""

    requests: int = 0
    ok: int = 0
    handler_errors: int = 0
    timeouts: int = 0
    rejected_oversize: int = 0
    rejected_busy: int = 0
    rejected_malformed: int = 0
    disconnects: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


class _HandlerFailed(Exception):
    """Internal: the handler raised; the message goes to the caller."""


class _Reject(Exception):
    """Internal: refuse the request with this message (sent to the caller) and count it under `counter`."""

    def __init__(self, message: str, counter: str, unread_bytes: int = 0):
        super().__init__(message)
        self.counter = counter
        self.unread_bytes = unread_bytes


async def _write_frame(writer: asyncio.StreamWriter, kind: int, payload: bytes, timeout_s: float) -> None:
    writer.write(_HEADER.pack(kind, len(payload)))
    if payload:
        writer.write(payload)
    await asyncio.wait_for(writer.drain(), timeout_s)


async def _read_header(reader: asyncio.StreamReader, timeout_s: float) -> tuple[int, int]:
    header = await asyncio.wait_for(reader.readexactly(_HEADER.size), timeout_s)
    return _HEADER.unpack(header)


READ_SLICE_BYTES = 1 << 20


async def _read_payload(reader: asyncio.StreamReader, length: int, timeout_s: float) -> bytes:
    """Read `length` bytes in 1 MiB slices, each within `timeout_s`: a large frame on a slow link keeps
    making progress and is not cut off, while a stalled stream still times out after `timeout_s`."""
    parts = []
    while length > 0:
        part = await asyncio.wait_for(reader.readexactly(min(length, READ_SLICE_BYTES)), timeout_s)
        parts.append(part)
        length -= len(part)
    return b"".join(parts)


async def _discard(reader: asyncio.StreamReader, n_bytes: int) -> None:
    while n_bytes > 0:
        data = await reader.read(min(n_bytes, 1 << 16))
        if not data:
            return
        n_bytes -= len(data)


# ---------------------------------------------------------------------------------------------- server


async def serve(p2p: P2P, name: str, handler: Handler, *, max_request_bytes: int, timeout_s: float,
                max_concurrent: int = 16) -> RpcStats:
    """Serve `handler(request, caller_peer_id)` under protocol `name` on `p2p`; returns its live counters.

    The handler returns bytes, or an async iterator of byte chunks (it may also be an async generator function).
    Limits: requests over `max_request_bytes` are refused unread; reading the request, producing the response
    (each chunk), and sending each frame get `timeout_s` each; more than `max_concurrent` calls in flight are
    refused. A handler exception is sent to the caller as "<Type>: <message>" (raise RpcError for a clean message).
    """
    stats = RpcStats()
    slots = asyncio.Semaphore(max_concurrent)

    async def on_stream(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Called by hivemind's p2pclient for each incoming stream; nothing may escape from here.
        stats.requests += 1
        caller = "?"
        try:
            caller = stream_info.peer_id.to_base58()
            if slots.locked():
                raise _Reject(f"busy: {max_concurrent} calls in flight", "rejected_busy")
            async with slots:
                await _serve_one(reader, writer, caller)
        except _Reject as e:
            setattr(stats, e.counter, getattr(stats, e.counter) + 1)
            logger.info("rpc request refused handler=%s caller=%s reason=%s", name, caller, e)
            with suppress(Exception):
                await _write_frame(writer, ERROR, str(e).encode()[:MAX_ERROR_BYTES], timeout_s)
                # Closing with the request still unread makes p2pd reset the stream, and the caller would
                # see "connection reset" instead of our message: discard it (bounded by timeout_s) first.
                await asyncio.wait_for(_discard(reader, e.unread_bytes), timeout_s)
        except (ConnectionError, asyncio.IncompleteReadError, OSError) as e:
            stats.disconnects += 1
            logger.debug("rpc caller went away handler=%s caller=%s error=%r", name, caller, e)
        except asyncio.CancelledError:
            raise  # shutdown
        except Exception:  # a bug in this module: log it, never let it escape into hivemind's task
            logger.exception("rpc stream failed handler=%s caller=%s", name, caller)
        finally:
            writer.close()

    async def _serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, caller: str) -> None:
        request = await _read_request(reader)
        try:
            result = await _guarded(_invoke(request, caller))
            if isinstance(result, (bytes, bytearray, memoryview)):
                await _write_frame(writer, DATA, bytes(result), timeout_s)
                stats.bytes_out += len(result)
            else:
                await _send_chunks(result, writer)
        except _HandlerFailed as e:
            stats.handler_errors += 1
            logger.info("rpc handler failed handler=%s caller=%s error=%s", name, caller, e)
            await _write_frame(writer, ERROR, str(e).encode()[:MAX_ERROR_BYTES], timeout_s)
            return
        await _write_frame(writer, END, b"", timeout_s)
        stats.ok += 1
        # Closing right after the last frame lets p2pd cut off the response's tail now and then (19 in 10,500
        # 1 MiB streams measured here); waiting, bounded, for the caller to close first made that 0 in 10,500.
        with suppress(Exception):
            await asyncio.wait_for(reader.read(1), min(timeout_s, 5.0))

    async def _invoke(request: bytes, caller: str) -> bytes | AsyncIterator[bytes]:
        result = handler(request, caller)
        if inspect.isawaitable(result):
            result = await result
        if not isinstance(result, (bytes, bytearray, memoryview)) and not hasattr(result, "__aiter__"):
            raise TypeError(f"handler returned {type(result).__name__}, expected bytes or an async iterator")
        return result

    async def _guarded(step: Awaitable):
        """Run one step of the handler within timeout_s; its failures become _HandlerFailed."""
        try:
            return await asyncio.wait_for(step, timeout_s)
        except asyncio.TimeoutError:
            raise _Reject(f"handler timed out after {timeout_s:g}s", "timeouts") from None
        except StopAsyncIteration:
            raise
        except Exception as e:
            raise _HandlerFailed(str(e) if isinstance(e, RpcError) else f"{type(e).__name__}: {e}") from None

    async def _send_chunks(chunks: AsyncIterator[bytes], writer: asyncio.StreamWriter) -> None:
        iterator = chunks.__aiter__()
        try:
            while True:
                try:
                    chunk = await _guarded(iterator.__anext__())
                except StopAsyncIteration:
                    return
                if not isinstance(chunk, (bytes, bytearray, memoryview)):
                    raise _HandlerFailed(f"TypeError: handler yielded {type(chunk).__name__}, expected bytes")
                await _write_frame(writer, DATA, bytes(chunk), timeout_s)
                stats.bytes_out += len(chunk)
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with suppress(Exception):
                    await asyncio.wait_for(aclose(), timeout_s)

    async def _read_request(reader: asyncio.StreamReader) -> bytes:
        try:
            kind, length = await _read_header(reader, timeout_s)
            if kind != DATA:
                raise _Reject(f"malformed request: frame kind {kind}", "rejected_malformed")
            if length > max_request_bytes:
                raise _Reject(f"request too large: {length} > {max_request_bytes} bytes", "rejected_oversize",
                              unread_bytes=length)
            request = await _read_payload(reader, length, timeout_s)
        except asyncio.TimeoutError:
            raise _Reject(f"request not received within {timeout_s:g}s", "timeouts") from None
        stats.bytes_in += length
        return request

    await p2p.add_binary_stream_handler(name, on_stream)
    return stats


async def unserve(p2p: P2P, name: str) -> None:
    """Stop serving `name`."""
    await p2p.remove_binary_stream_handler(name)


# ---------------------------------------------------------------------------------------------- caller


async def _open(p2p: P2P, peer_id: str, name: str, request: bytes, timeout_s: float):
    try:
        target = PeerID.from_base58(peer_id)
    except Exception:
        raise RpcError(f"bad peer id {peer_id!r}") from None
    try:
        _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(target, name), timeout_s)
    except asyncio.TimeoutError:
        raise RpcTimeoutError(f"could not open '{name}' on peer {peer_id} within {timeout_s:g}s") from None
    except Exception as e:  # p2pd: "protocol not supported", "all dials failed", ...
        raise RpcConnectionError(f"could not open '{name}' on peer {peer_id}: {e}") from e
    try:
        await _write_frame(writer, DATA, request, timeout_s)
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
                       max_total_bytes: int, timeout_s: float) -> AsyncIterator[bytes]:
    """Yield DATA payloads until END; raise RpcError subclasses on ERROR, oversize, timeout or disconnect."""
    where = f"'{name}' on peer {peer_id}"
    total = 0
    try:
        while True:
            kind, length = await _read_header(reader, timeout_s)
            if kind == END:
                return
            if kind == ERROR:
                message = (await _read_payload(reader, min(length, MAX_ERROR_BYTES), timeout_s)).decode(
                    "utf-8", errors="replace")
                raise RpcRemoteError(f"{where} failed: {message}", message)
            if kind != DATA:
                raise RpcConnectionError(f"{where} sent a malformed frame (kind {kind})")
            if length > max_chunk_bytes or total + length > max_total_bytes:
                raise RpcTooLargeError(f"{where} sent {total + length}+ bytes (chunk {length}); the limit is "
                                       f"{max_chunk_bytes} per chunk and {max_total_bytes} in all")
            total += length
            yield await _read_payload(reader, length, timeout_s)
    except asyncio.TimeoutError:
        raise RpcTimeoutError(f"{where} did not answer within {timeout_s:g}s") from None
    except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
        raise RpcConnectionError(f"{where}: stream closed before the response ended ({e!r})") from None


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
                      max_total_bytes: int, timeout_s: float) -> AsyncIterator[bytes]:
    """Yield the response chunks as they arrive; each within `timeout_s`, each and all of them bounded.

    Iterate to the end, or close it (`contextlib.aclosing`) to release the stream early.
    """
    reader, writer = await _open(p2p, peer_id, name, request, timeout_s)
    try:
        async for chunk in _read_frames(reader, peer_id, name, max_chunk_bytes=max_chunk_bytes,
                                        max_total_bytes=max_total_bytes, timeout_s=timeout_s):
            yield chunk
    finally:
        writer.close()
