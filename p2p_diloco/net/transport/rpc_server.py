"""The serving side of the bounded RPC (protocol: net/transport/rpc.py): `serve` a handler under a protocol
name; every read is bounded and timed out, a `Guard` may refuse a caller before its request is read, and the
handler's exceptions never escape into hivemind's stream task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Protocol

from hivemind.p2p import P2P

from p2p_diloco.net.transport import relay
from p2p_diloco.net.transport.framing import (
    DATA,
    END,
    ERROR,
    MAX_ERROR_BYTES,
    Pace,
    TooSlow,
    discard,
    read_header,
    read_payload,
    write_frame,
)
from p2p_diloco.net.transport.rpc_errors import RpcError

logger = logging.getLogger(__name__)

Handler = Callable[..., "Awaitable[bytes | AsyncIterator[bytes]] | AsyncIterator[bytes]"]
"""`handler(request, caller_peer_id)`, or `handler(request, caller_peer_id, remote_maddr)` when served with
`pass_remote_addr` (the stream's remote multiaddr as our daemon sees it: the caller's observed address, or a
relay's `/p2p-circuit` address)."""


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
    rejected_policy: int = 0
    slow_streams: int = 0
    disconnects: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


class Guard(Protocol):
    """What `serve` asks before serving a request (implemented by net/admission/guard.PeerGuard)."""

    async def admit(self, caller: str, handler: str, request_bytes: int) -> str | None:
        """None to serve the request (then `release(caller)` follows), else the refusal sent to the caller."""

    def release(self, caller: str) -> None: ...

    def charge_out(self, caller: str, nbytes: int) -> None: ...

    def on_reject(self, caller: str, counter: str) -> None:
        """The RPC layer refused or cut a stream by itself; `counter` is the RpcStats field it counted."""

    def is_contributor(self, caller: str) -> bool:
        """True if `caller` has given us something (half of each handler's slots are kept for such callers)."""



class _HandlerFailed(Exception):
    """Internal: the handler raised; the message goes to the caller."""


class _Reject(Exception):
    """Internal: refuse the request with this message (sent to the caller) and count it under `counter`."""

    def __init__(self, message: str, counter: str, unread_bytes: int = 0):
        super().__init__(message)
        self.counter = counter
        self.unread_bytes = unread_bytes



class _Server:
    """One served handler: the stream callback and its steps (see `serve`)."""

    def __init__(self, p2p: P2P, name: str, handler: Handler, *, max_request_bytes: int, timeout_s: float,
                 max_concurrent: int, guard: Guard | None, min_bytes_per_s: float,
                 pass_remote_addr: bool = False) -> None:
        self.p2p, self.name, self.handler, self.guard = p2p, name, handler, guard
        self.pass_remote_addr = pass_remote_addr
        self.max_request_bytes, self.timeout_s, self.max_concurrent = max_request_bytes, timeout_s, max_concurrent
        self.min_bytes_per_s = min_bytes_per_s
        self.stats = RpcStats()
        self.slots = asyncio.Semaphore(max_concurrent)
        # Callers that never gave us anything hold at most half the slots together (open runs): a crowd of fresh
        # identities that keeps every slot busy must not turn away the peers we trade with.
        self.max_newcomers, self.newcomers = max(1, max_concurrent // 2), 0

    async def on_stream(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Called by hivemind's p2pclient for each incoming stream; nothing may escape from here.
        self.stats.requests += 1
        caller, remote = "?", ""
        try:
            caller = stream_info.peer_id.to_base58()
            remote = str(getattr(stream_info, "addr", "") or "")
            header = None
            if caller in relay.trusted_forwarders(self.p2p):  # a relay's stream names the caller first
                header = await self._read_header(reader, None)
                if header[0] == relay.FORWARDED:
                    caller, remote, header = await relay.read_forwarded(reader, header[1], self.timeout_s), "", None
            if self.slots.locked():
                raise _Reject(f"busy: {self.max_concurrent} calls in flight", "rejected_busy")
            newcomer = self.guard is not None and not self.guard.is_contributor(caller)
            if newcomer and self.newcomers >= self.max_newcomers:
                raise _Reject(f"busy: {self.newcomers} calls of peers we have no record of in flight", "rejected_busy")
            self.newcomers += newcomer
            try:
                async with self.slots:
                    await self._serve_one(reader, writer, caller, Pace(self.timeout_s, self.min_bytes_per_s), remote,
                                          header)
            finally:
                self.newcomers -= newcomer
        except _Reject as e:
            setattr(self.stats, e.counter, getattr(self.stats, e.counter) + 1)
            if self.guard is not None and e.counter != "rejected_policy":  # the guard counted its own refusal
                self.guard.on_reject(caller, e.counter)
            logger.info("rpc request refused handler=%s caller=%s reason=%s", self.name, caller, e)
            with suppress(Exception):
                await write_frame(writer, ERROR, str(e).encode()[:MAX_ERROR_BYTES], self.timeout_s)
                # Closing with the request still unread makes p2pd reset the stream, and the caller would
                # see "connection reset" instead of our message: discard it (bounded by timeout_s) first.
                await asyncio.wait_for(discard(reader, e.unread_bytes), self.timeout_s)
        except (ConnectionError, asyncio.IncompleteReadError, OSError) as e:
            self.stats.disconnects += 1
            logger.debug("rpc caller went away handler=%s caller=%s error=%r", self.name, caller, e)
        except asyncio.CancelledError:
            raise  # shutdown
        except Exception:  # a bug in this module: log it, never let it escape into hivemind's task
            logger.exception("rpc stream failed handler=%s caller=%s", self.name, caller)
        finally:
            writer.close()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, caller: str,
                         pace: Pace, remote: str = "", header: tuple[int, int] | None = None) -> None:
        length = await self._read_request_header(reader, pace, header)
        if self.guard is not None:
            refusal = await self._admit(self.guard, caller, length)
            if refusal:
                raise _Reject(refusal, "rejected_policy", unread_bytes=length)
        try:
            await self._respond(reader, writer, caller, await self._read_request(reader, length, pace), pace, remote)
        finally:
            if self.guard is not None:
                self.guard.release(caller)

    @contextmanager
    def _metered(self, caller: str, pace: Pace) -> Iterator[None]:
        """The response's sending, its first frame to our END frame drained, for the guard's uplink meter (its
        optional `sending(caller, handler)` returns `end(bytes_written)` or None: net/admission/guard.py)."""
        sending = getattr(self.guard, "sending", None)
        end, before = (sending(caller, self.name) if sending is not None else None), pace.done
        try:
            yield
        finally:
            if end is not None:
                end(pace.done - before)

    async def _admit(self, guard: Guard, caller: str, length: int) -> str | None:
        try:
            return await asyncio.wait_for(guard.admit(caller, self.name, length), self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug in the guard must refuse, not crash or serve
            logger.exception("rpc guard failed handler=%s caller=%s", self.name, caller)
            return f"refused: {type(e).__name__}"

    async def _respond(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, caller: str, request: bytes,
                       pace: Pace, remote: str = "") -> None:
        try:
            result = await self._guarded(self._invoke(request, caller, remote))
            with self._metered(caller, pace):
                if isinstance(result, (bytes, bytearray, memoryview)):
                    await self._send(writer, bytes(result), caller, pace)
                else:
                    await self._send_chunks(result, writer, caller, pace)
                await write_frame(writer, END, b"", self.timeout_s)
        except _HandlerFailed as e:
            self.stats.handler_errors += 1
            logger.info("rpc handler failed handler=%s caller=%s error=%s", self.name, caller, e)
            await write_frame(writer, ERROR, str(e).encode()[:MAX_ERROR_BYTES], self.timeout_s)
            return
        self.stats.ok += 1
        # Closing right after the last frame lets p2pd cut off the response's tail now and then (19 in 10,500
        # 1 MiB streams measured here); waiting, bounded, for the caller to close first made that 0 in 10,500.
        with suppress(Exception):
            await asyncio.wait_for(reader.read(1), min(self.timeout_s, 5.0))

    async def _send(self, writer: asyncio.StreamWriter, data: bytes, caller: str, pace: Pace) -> None:
        if self.guard is not None:
            self.guard.charge_out(caller, len(data))
        try:
            await write_frame(writer, DATA, data, self.timeout_s, pace)
        except TooSlow as e:
            raise _Reject(f"response not read fast enough: {e}", "slow_streams") from None
        except asyncio.TimeoutError:
            raise _Reject(f"response not read within {self.timeout_s:g}s", "timeouts") from None
        self.stats.bytes_out += len(data)

    async def _invoke(self, request: bytes, caller: str, remote: str = "") -> bytes | AsyncIterator[bytes]:
        produced = self.handler(request, caller, remote) if self.pass_remote_addr else self.handler(request, caller)
        result = await produced if isinstance(produced, Awaitable) else produced  # async def, or async generator
        if not isinstance(result, (bytes, bytearray, memoryview)) and not hasattr(result, "__aiter__"):
            raise TypeError(f"handler returned {type(result).__name__}, expected bytes or an async iterator")
        return result

    async def _guarded(self, step: Awaitable):
        """Run one step of the handler within timeout_s; its failures become _HandlerFailed."""
        try:
            return await asyncio.wait_for(step, self.timeout_s)
        except asyncio.TimeoutError:
            raise _Reject(f"handler timed out after {self.timeout_s:g}s", "timeouts") from None
        except StopAsyncIteration:
            raise
        except Exception as e:
            raise _HandlerFailed(str(e) if isinstance(e, RpcError) else f"{type(e).__name__}: {e}") from None

    async def _send_chunks(self, chunks: AsyncIterator[bytes], writer: asyncio.StreamWriter, caller: str,
                           pace: Pace) -> None:
        iterator = chunks.__aiter__()
        try:
            while True:
                try:
                    chunk = await self._guarded(iterator.__anext__())
                except StopAsyncIteration:
                    return
                if not isinstance(chunk, (bytes, bytearray, memoryview)):
                    raise _HandlerFailed(f"TypeError: handler yielded {type(chunk).__name__}, expected bytes")
                await self._send(writer, bytes(chunk), caller, pace)
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with suppress(Exception):
                    await asyncio.wait_for(aclose(), self.timeout_s)

    async def _read_header(self, reader: asyncio.StreamReader, pace: Pace | None) -> tuple[int, int]:
        try:
            return await read_header(reader, self.timeout_s, pace)
        except asyncio.TimeoutError:
            raise _Reject(f"request not received within {self.timeout_s:g}s", "timeouts") from None
        except TooSlow as e:
            raise _Reject(f"request too slow: {e}", "slow_streams") from None

    async def _read_request_header(self, reader: asyncio.StreamReader, pace: Pace,
                                   header: tuple[int, int] | None = None) -> int:
        kind, length = header or await self._read_header(reader, pace)
        if kind != DATA:
            raise _Reject(f"malformed request: frame kind {kind}", "rejected_malformed")
        if length > self.max_request_bytes:
            raise _Reject(f"request too large: {length} > {self.max_request_bytes} bytes", "rejected_oversize",
                          unread_bytes=length)
        return length

    async def _read_request(self, reader: asyncio.StreamReader, length: int, pace: Pace) -> bytes:
        try:
            request = await read_payload(reader, length, self.timeout_s, pace)
        except asyncio.TimeoutError:
            raise _Reject(f"request not received within {self.timeout_s:g}s", "timeouts") from None
        except TooSlow as e:
            raise _Reject(f"request too slow: {e}", "slow_streams") from None
        self.stats.bytes_in += length
        return request


async def serve(p2p: P2P, name: str, handler: Handler, *, max_request_bytes: int, timeout_s: float,
                max_concurrent: int = 16, guard: Guard | None = None, min_bytes_per_s: float = 0.0,
                pass_remote_addr: bool = False) -> RpcStats:
    """Serve `handler(request, caller_peer_id)` under protocol `name` on `p2p`; returns its live counters.

    The handler returns bytes, or an async iterator of byte chunks (it may also be an async generator function).
    Limits: requests over `max_request_bytes` are refused unread; reading the request, producing the response
    (each chunk), and sending each frame get `timeout_s` each; more than `max_concurrent` calls in flight are
    refused; with `min_bytes_per_s`, reading the request and sending the response must keep that pace after a
    grace of `timeout_s`; a `guard` may refuse the caller before the request is read. A handler exception is
    sent to the caller as "<Type>: <message>" (raise RpcError for a clean message). With `pass_remote_addr`,
    the handler also gets the stream's remote multiaddr (`handler(request, caller, remote_maddr)`).
    """
    server = _Server(p2p, name, handler, max_request_bytes=max_request_bytes, timeout_s=timeout_s,
                     max_concurrent=max_concurrent, guard=guard, min_bytes_per_s=min_bytes_per_s,
                     pass_remote_addr=pass_remote_addr)
    await p2p.add_binary_stream_handler(name, server.on_stream)
    return server.stats


async def unserve(p2p: P2P, name: str, *, timeout_s: float | None = None) -> None:
    """Stop serving `name`. With `timeout_s`: within it, and a failure (e.g. the node is already shut down) is
    logged, never raised: what a service's `stop` wants."""
    if timeout_s is None:
        await p2p.remove_binary_stream_handler(name)
        return
    try:
        await asyncio.wait_for(p2p.remove_binary_stream_handler(name), timeout_s)
    except Exception as e:
        logger.debug("unserve failed name=%s error=%r", name, e)

