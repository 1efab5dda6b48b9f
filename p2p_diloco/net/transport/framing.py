"""Frames on a libp2p stream, read and written with bounds and deadlines (used by net/transport/rpc.py).

A frame is a 1-byte kind (DATA, END, ERROR) and a 4-byte big-endian length, then the payload. Every read and
write has a timeout; with a `Pace`, a stream must also keep up an average rate after a grace period, so a
never-ending trickle is cut by a total deadline that grows only with the bytes actually moved.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Awaitable

DATA, END, ERROR = 0, 1, 2
HEADER = struct.Struct(">BI")
MAX_ERROR_BYTES = 2048
"""Error messages longer than this are truncated (both when sent and when read)."""


class Pace:
    """A stream must average `min_bytes_per_s` after `grace_s`: moving the next n bytes is allowed until
    started + grace_s + (done + n) / min_bytes_per_s, and never longer than the per-read timeout."""

    def __init__(self, grace_s: float, min_bytes_per_s: float) -> None:
        self.started, self.grace_s, self.rate, self.done = time.monotonic(), grace_s, min_bytes_per_s, 0

    async def run(self, awaitable: Awaitable, nbytes: int, timeout_s: float):
        """Await `awaitable`, which moves `nbytes`, within its share of time; TooSlow if the pace is the limit."""
        budget_s = timeout_s
        if self.rate > 0:
            budget_s = min(timeout_s, self.started + self.grace_s + (self.done + nbytes) / self.rate - time.monotonic())
        try:
            result = await asyncio.wait_for(awaitable, max(budget_s, 0.0))
        except asyncio.TimeoutError:
            if budget_s < timeout_s:
                raise TooSlow(f"{self.done} bytes in {time.monotonic() - self.started:.1f}s, under the minimum "
                               f"pace of {self.rate:g} B/s") from None
            raise
        self.done += nbytes
        return result


class TooSlow(Exception):
    """Internal: a stream fell behind its `Pace`."""


async def write_frame(writer: asyncio.StreamWriter, kind: int, payload: bytes, timeout_s: float,
                       pace: Pace | None = None) -> None:
    """Write one frame; a large payload goes in READ_SLICE_BYTES slices, each drained within `timeout_s` (and
    its share of the pace): an 11 MB update on a 5 Mbit/s uplink takes ~18 s in all and must not be cut as
    "not read within 10s" while it moves (measured in namespaces with the small preset)."""
    writer.write(HEADER.pack(kind, len(payload)))
    view, pending = memoryview(payload), HEADER.size
    for start in range(0, len(payload), READ_SLICE_BYTES):
        piece = view[start:start + READ_SLICE_BYTES]
        writer.write(piece)
        await _drain(writer, pending + len(piece), timeout_s, pace)
        pending = 0
    if not payload:
        await _drain(writer, HEADER.size, timeout_s, pace)


async def _drain(writer: asyncio.StreamWriter, nbytes: int, timeout_s: float, pace: Pace | None) -> None:
    if pace is None:
        await asyncio.wait_for(writer.drain(), timeout_s)
    else:
        await pace.run(writer.drain(), nbytes, timeout_s)


async def read_header(reader: asyncio.StreamReader, timeout_s: float, pace: Pace | None = None) -> tuple[int, int]:
    read = reader.readexactly(HEADER.size)
    header = await (asyncio.wait_for(read, timeout_s) if pace is None else pace.run(read, HEADER.size, timeout_s))
    return HEADER.unpack(header)


READ_SLICE_BYTES = 1 << 20


async def read_payload(reader: asyncio.StreamReader, length: int, timeout_s: float,
                        pace: Pace | None = None) -> bytes:
    """Read `length` bytes in 1 MiB slices, each within `timeout_s` (and its share of the pace): a large frame
    on a slow link keeps making progress and is not cut off, while a stalled stream still times out after
    `timeout_s` and a trickle falls behind the pace."""
    parts = []
    while length > 0:
        size = min(length, READ_SLICE_BYTES)
        read = reader.readexactly(size)
        part = await (asyncio.wait_for(read, timeout_s) if pace is None else pace.run(read, size, timeout_s))
        parts.append(part)
        length -= len(part)
    return b"".join(parts)


async def discard(reader: asyncio.StreamReader, n_bytes: int) -> None:
    while n_bytes > 0:
        data = await reader.read(min(n_bytes, 1 << 16))
        if not data:
            return
        n_bytes -= len(data)
