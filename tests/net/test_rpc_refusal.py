"""A refusal that reaches the caller just ahead of a reset (net/transport/rpc_client.py): the server refuses a
busy call before reading the request, closes with it unread, and p2pd resets the stream; the ERROR frame is in
the caller's buffer behind the reset. The caller must report the refusal, not "connection reset" (CI,
2026-12-03: an upload to a busy probe failed that way). A real StreamReader in the state the reset leaves it."""

from __future__ import annotations

import asyncio

import pytest

from p2p_diloco.net.transport.framing import DATA, END, ERROR, HEADER
from p2p_diloco.net.transport.rpc_client import _read_frames
from p2p_diloco.net.transport.rpc_errors import RpcConnectionError, RpcRemoteError


def _read_all(data: bytes, reset: bool = True) -> list[bytes]:
    async def run() -> list[bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        if reset:
            reader.set_exception(ConnectionResetError(104, "Connection reset by peer"))
        else:
            reader.feed_eof()
        return [part async for part in _read_frames(reader, "peer", "test/rpc", max_chunk_bytes=64,
                                                    max_total_bytes=64, timeout_s=5)]
    return asyncio.run(run())


def _frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


def test_an_error_frame_behind_a_reset_is_reported_as_the_refusal():
    with pytest.raises(RpcRemoteError, match="busy: 1 calls in flight") as caught:
        _read_all(_frame(ERROR, b"busy: 1 calls in flight"))
    assert caught.value.remote_message == "busy: 1 calls in flight"


def test_a_cut_error_frame_or_a_data_frame_behind_a_reset_is_a_connection_error():
    with pytest.raises(RpcConnectionError, match="reset"):
        _read_all(_frame(ERROR, b"busy: 1 calls in flight")[:-3])  # the message did not arrive whole
    with pytest.raises(RpcConnectionError, match="reset"):
        _read_all(_frame(DATA, b"x" * 8))  # a response cut by a reset is a failure, not a refusal
    with pytest.raises(RpcConnectionError, match="reset"):
        _read_all(b"")


def test_an_error_frame_without_a_reset_and_a_whole_response_read_as_before():
    with pytest.raises(RpcRemoteError, match="rate limited"):
        _read_all(_frame(ERROR, b"rate limited"), reset=False)
    assert _read_all(_frame(DATA, b"abc") + _frame(END, b""), reset=False) == [b"abc"]
