"""Streams to peers nobody can dial: forwarded by a relay both sides reach (a bootstrap), at once.

Why not libp2p's circuit relay alone: it works (p2pd's relay service is on at a bootstrap started with public
reachability, with limits of 4 GiB and 30 min per circuit), but a NATed peer is reachable through it only after
its reservation, and hivemind's p2pd makes that **about 3 minutes** after start even with the bootstrap as a
trusted relay (measured in namespaces, tests/helpers/netns.py; go-libp2p's autorelay boot delay, not configurable
through hivemind). Two NATed volunteers would train alone for those minutes. So p2p-diloco forwards its own
streams, which needs nothing but what a NATed peer always has: its own outbound connection to the bootstrap,
which is two-way.

    caller --(stream "p2p-diloco/relay")--> relay --(stream NAME, over the target's own connection)--> target
    caller: DATA({"t": target, "p": NAME}), then the RPC's frames as if the stream went straight to target
    relay:  opens NAME on target, writes FORWARDED(caller's PeerID), then copies bytes both ways
            (bounded: bytes per stream, idle time, streams in flight in all and per caller); a target it
            cannot reach gets the caller an ERROR frame that says so
    target: the RPC server takes FORWARDED only from a relay it trusts (its bootstraps) and then serves the
            request as the caller's: admission, rate limits and ledgers see who really asked

A relay learns nothing it could forge: the caller's PeerID is the one libp2p authenticated on its stream to the
relay, and the updates themselves are signed end to end. `Routes` (one per P2P instance) is the calling side's
memory: which relays to try, which peers are only reachable through one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import msgpack
from hivemind.p2p import P2P, PeerID

from p2p_diloco.net.transport.framing import (
    DATA,
    ERROR,
    MAX_ERROR_BYTES,
    read_header,
    read_payload,
    write_frame,
)

logger = logging.getLogger(__name__)

RELAY_PROTOCOL = "p2p-diloco/relay"
FORWARDED = 3
"""Frame kind: the relay tells the target who the caller is (payload: the caller's PeerID, base58)."""
MAX_FORWARD_REQUEST_BYTES = 512
MAX_PEER_ID_BYTES = 128
RELAY_IDLE_S = 60.0
"""A forwarded stream that moves no byte for this long is closed."""
RELAY_MAX_STREAM_BYTES = 256 << 20
"""Bytes one forwarded stream may move in each direction (a state-sync chunk stream is a few tens of MiB)."""
RELAY_MAX_STREAMS = 512
RELAY_MAX_STREAMS_PER_CALLER = 64
PRIVATE_MEMORY_S = 300.0
"""A peer whose record says nobody can dial it: through a relay first for this long (refreshed with the record)."""
FALLBACK_MEMORY_S = 60.0
"""A direct dial failed (or was slow) and a relay worked: through the relay first for this long, then direct
again (a public peer under load must not stay on the bootstrap's relay)."""
DIRECT_FIRST_S = 5.0
"""With relays to fall back on, a direct dial to a peer not known to need one gets at most this long."""
_COPY_BYTES = 1 << 16


@dataclass
class RelayStats:
    """The relay's counters (the bootstrap's report and tests read them)."""

    forwarded: int = 0
    refused_busy: int = 0
    unreachable: int = 0
    bytes: int = 0
    active: int = 0


@dataclass
class Routes:
    """The calling side's routes of one P2P instance: relays to try, targets known to need one."""

    relays: list[str] = field(default_factory=list)
    """PeerIDs of relays (bootstraps), in the order to try them."""
    private: OrderedDict = field(default_factory=OrderedDict)
    """target -> (relay that worked, until when): go through it first."""
    relayed_opens: int = 0

    def via(self, target: str) -> str | None:
        entry = self.private.get(target)
        if entry is None or entry[1] < time.monotonic():
            self.private.pop(target, None)
            return None
        return entry[0]

    def remember(self, target: str, relay: str, for_s: float = PRIVATE_MEMORY_S) -> None:
        self.private[target] = (relay, time.monotonic() + for_s)
        self.private.move_to_end(target)
        while len(self.private) > 4096:
            self.private.popitem(last=False)


_ROUTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TRUSTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def routes(p2p: P2P) -> Routes | None:
    """The routes installed on `p2p` (None: only direct dials)."""
    return _ROUTES.get(p2p)


def install(p2p: P2P, relays: list[str]) -> Routes:
    """Try `relays` (PeerIDs) when a direct dial from `p2p` fails, and accept FORWARDED frames from them."""
    table = _ROUTES.setdefault(p2p, Routes())
    table.relays = [r for r in dict.fromkeys(relays) if r != p2p.peer_id.to_base58()]
    _TRUSTED[p2p] = frozenset(table.relays)
    return table


def trusted_forwarders(p2p: P2P) -> frozenset:
    return _TRUSTED.get(p2p, frozenset())


def mark_private(p2p: P2P, target: str, relay: str | None = None) -> None:
    """`target` said it cannot be dialed (its record): go through a relay first."""
    table = _ROUTES.get(p2p)
    if table is not None and table.relays and table.via(target) is None:
        table.remember(target, relay or table.relays[0])


async def open_stream(p2p: P2P, target: str, name: str, timeout_s: float):
    """(reader, writer) of a stream to `target`'s handler `name`: direct, else through a relay; raises the
    direct dial's error when no relay brings it either."""
    peer = PeerID.from_base58(target)
    table = _ROUTES.get(p2p)
    if table is None or not table.relays:
        _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(peer, name), timeout_s)
        return reader, writer
    deadline = asyncio.get_running_loop().time() + timeout_s
    first = table.via(target)
    if first is not None:
        try:  # half the time: a relay that stopped answering must leave the direct dial the other half
            return await _through(p2p, first, target, name, timeout_s / 2)
        except Exception:
            # The relay that worked does not now (gone, or cut off by a partition while the target is still in
            # reach): forget it, so neither this call nor the next ones spend their time on it. A target that
            # is really private is marked again by its next record (`mark_private`).
            table.private.pop(target, None)
    try:
        _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(peer, name),
                                                   min(timeout_s, DIRECT_FIRST_S) if first is None else timeout_s / 2)
        return reader, writer
    except Exception as e:
        if "protocol not supported" in str(e).lower():
            raise
        direct_error = e
    for relay in table.relays:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0.2:
            break
        try:
            stream = await _through(p2p, relay, target, name, left)
        except Exception as e:
            logger.debug("relay did not reach peer relay=%s target=%s error=%r", relay, target, e)
            continue
        table.remember(target, relay, FALLBACK_MEMORY_S)
        return stream
    raise direct_error


async def _through(p2p: P2P, relay: str, target: str, name: str, timeout_s: float):
    _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(PeerID.from_base58(relay),
                                                                              RELAY_PROTOCOL), timeout_s)
    try:
        await write_frame(writer, DATA, msgpack.packb({"t": target, "p": name}), timeout_s)
    except BaseException:
        writer.close()
        raise
    table = _ROUTES.get(p2p)
    if table is not None:
        table.relayed_opens += 1
    return reader, writer


async def read_forwarded(reader: asyncio.StreamReader, length: int, timeout_s: float) -> str:
    """The target's side, after a FORWARDED header from a trusted relay: the caller's PeerID it names."""
    if not 0 < length <= MAX_PEER_ID_BYTES:
        raise ValueError(f"FORWARDED frame of {length} bytes")
    caller = (await read_payload(reader, length, timeout_s)).decode("ascii")
    PeerID.from_base58(caller)  # raises on garbage
    return caller


class RelayServer:
    """Forwards streams for callers to peers connected to us (run by `p2p-diloco bootstrap`)."""

    def __init__(self, p2p: P2P, *, timeout_s: float = 10.0, max_streams: int = RELAY_MAX_STREAMS,
                 max_per_caller: int = RELAY_MAX_STREAMS_PER_CALLER) -> None:
        self.p2p, self.timeout_s = p2p, timeout_s
        self.max_streams, self.max_per_caller = max_streams, max_per_caller
        self.stats = RelayStats()
        self._per_caller: dict[str, int] = defaultdict(int)

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(RELAY_PROTOCOL, self._on_stream)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.p2p.remove_binary_stream_handler(RELAY_PROTOCOL)

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        caller = "?"
        try:
            caller = info.peer_id.to_base58()
            if self.stats.active >= self.max_streams or self._per_caller[caller] >= self.max_per_caller:
                self.stats.refused_busy += 1
                await _error(writer, f"relay busy: {self.stats.active} streams forwarded", self.timeout_s)
                return
            self.stats.active += 1
            self._per_caller[caller] += 1
            try:
                await self._forward(caller, reader, writer)
            finally:
                self.stats.active -= 1
                self._per_caller[caller] -= 1
                if self._per_caller[caller] <= 0:
                    del self._per_caller[caller]
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.debug("relay stream failed caller=%s error=%r", caller, e)
        finally:
            writer.close()

    async def _forward(self, caller: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        kind, length = await read_header(reader, self.timeout_s)
        if kind != DATA or length > MAX_FORWARD_REQUEST_BYTES:
            await _error(writer, "relay: malformed request", self.timeout_s)
            return
        request = msgpack.unpackb(await read_payload(reader, length, self.timeout_s))
        target, name = request.get("t"), request.get("p")
        if not (isinstance(target, str) and isinstance(name, str) and name.startswith("p2p-diloco/")
                and name != RELAY_PROTOCOL and target not in (caller, self.p2p.peer_id.to_base58())):
            await _error(writer, "relay: bad target or protocol", self.timeout_s)
            return
        try:
            _, t_reader, t_writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(target), name), self.timeout_s)
        except Exception as e:
            self.stats.unreachable += 1
            await _error(writer, f"relay could not reach {target}: {str(e)[:200]}", self.timeout_s)
            return
        try:
            await write_frame(t_writer, FORWARDED, caller.encode("ascii"), self.timeout_s)
            self.stats.forwarded += 1
            await _pipe_both(reader, writer, t_reader, t_writer, self.stats)
        finally:
            t_writer.close()


async def _error(writer: asyncio.StreamWriter, message: str, timeout_s: float) -> None:
    with contextlib.suppress(Exception):
        await write_frame(writer, ERROR, message.encode()[:MAX_ERROR_BYTES], timeout_s)


async def _pipe_both(a_reader, a_writer, b_reader, b_writer, stats: RelayStats) -> None:
    """Copy a->b and b->a until either side ends, idles RELAY_IDLE_S, or moves RELAY_MAX_STREAM_BYTES."""
    async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        moved = 0
        while moved < RELAY_MAX_STREAM_BYTES:
            data = await asyncio.wait_for(src.read(_COPY_BYTES), RELAY_IDLE_S)
            if not data:
                break
            moved += len(data)
            stats.bytes += len(data)
            dst.write(data)
            await asyncio.wait_for(dst.drain(), RELAY_IDLE_S)
        with contextlib.suppress(Exception):
            if dst.can_write_eof():
                dst.write_eof()

    tasks = [asyncio.ensure_future(copy(a_reader, b_writer)), asyncio.ensure_future(copy(b_reader, a_writer))]
    try:
        # each direction ends at its EOF (the caller closes after the response's END); a failure ends both
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            with contextlib.suppress(Exception):
                task.result()
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["FORWARDED", "RELAY_PROTOCOL", "RelayServer", "Routes", "install", "mark_private",
           "open_stream", "read_forwarded", "routes", "trusted_forwarders"]
