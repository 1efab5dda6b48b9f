"""Codecs: round trips stay within the stated error bound, payload sizes are exact, malformed payloads are refused."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_diloco.wire.codecs import CODEC_NAMES, CodecError, get_codec

FLT_MAX = float(np.finfo(np.float32).max)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _roundtrip_within_bound(name: str, x: torch.Tensor, block: int = 256) -> None:
    codec = get_codec(name, block)
    data = codec.compress(x)
    assert len(data) == codec.payload_bytes(x.numel())
    y = codec.decompress(data, x.numel())
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert bool(torch.isfinite(y).all())
    # Compare in float64 so that the check itself adds no rounding.
    err = (y.double() - x.double()).abs()
    bound = codec.error_bound(x).double()
    assert bound.shape == x.shape
    worst = int(torch.argmax(err - bound)) if x.numel() else 0
    assert bool((err <= bound).all()), f"{name}: x={x[worst].item()!r} y={y[worst].item()!r} bound={bound[worst]}"


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Random-shaped tensors: lengths around block edges, magnitudes from subnormal to near float32's max."""
    n = draw(st.one_of(st.integers(0, 4), st.sampled_from([255, 256, 257, 511, 513]), st.integers(0, 2000)))
    exponent = draw(st.integers(-45, 37))
    seed = draw(st.integers(0, 2**31 - 1))
    zero_fraction = draw(st.sampled_from([0.0, 0.0, 0.5, 1.0]))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 10.0**exponent
    x[torch.rand(n, generator=g) < zero_fraction] = 0.0
    return x.clamp(-FLT_MAX, FLT_MAX).to(torch.float32)


finite_f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@pytest.mark.parametrize("name", CODEC_NAMES)
@SETTINGS
@given(x=tensors(), block=st.sampled_from([2, 8, 64, 256]))
def test_roundtrip_error_within_bound(name: str, x: torch.Tensor, block: int) -> None:
    _roundtrip_within_bound(name, x, block)


@pytest.mark.parametrize("name", CODEC_NAMES)
@SETTINGS
@given(values=st.lists(finite_f32, max_size=40), block=st.sampled_from([2, 4, 16]))
def test_roundtrip_extreme_values(name: str, values: list[float], block: int) -> None:
    # Plain float lists reach the corners: subnormals, -0.0, float32's max, mixed magnitudes in one block.
    _roundtrip_within_bound(name, torch.tensor(values, dtype=torch.float32), block)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_near_float32_max_decodes_finite(name: str) -> None:
    x = torch.tensor([FLT_MAX, -FLT_MAX, FLT_MAX / 3, 1.0], dtype=torch.float32)
    _roundtrip_within_bound(name, x, block=4)


def test_exact_on_representable_values() -> None:
    x = torch.tensor([-127.0, 0.0, 1.0, 127.0, 64.0], dtype=torch.float32)
    assert torch.equal(get_codec("int8", 8).decompress(get_codec("int8", 8).compress(x), 5), x)
    x4 = torch.tensor([-7.0, 0.0, 3.0, 7.0, -1.0], dtype=torch.float32)
    assert torch.equal(get_codec("int4", 8).decompress(get_codec("int4", 8).compress(x4), 5), x4)
    half = torch.tensor([0.5, -2.0, 65504.0], dtype=torch.float32)
    assert torch.equal(get_codec("fp16").decompress(get_codec("fp16").compress(half), 3), half)


def test_byte_layouts() -> None:
    one = struct.pack("<f", 1.0)
    # int8: [scale][one int8 per value]; scale = absmax / 127.
    assert get_codec("int8", 4).compress(torch.tensor([127.0, -127.0, 1.0])) == one + bytes([127, 0x81, 1])
    # int4: [scale][two nibbles per byte, low first, zero-padded]; scale = absmax / 7.
    assert get_codec("int4", 4).compress(torch.tensor([7.0, -7.0, 1.0])) == one + bytes([0x97, 0x01])
    assert get_codec("fp16").compress(torch.tensor([1.0])) == bytes([0x00, 0x3C])
    assert get_codec("fp32").compress(torch.tensor([1.0])) == one


def test_fp16_saturates() -> None:
    codec = get_codec("fp16")
    y = codec.decompress(codec.compress(torch.tensor([1e6, -1e30, 70000.0])), 3)
    assert y.tolist() == [65504.0, -65504.0, 65504.0]


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_compress_refuses_non_finite_and_bad_input(name: str) -> None:
    codec = get_codec(name)
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(CodecError):
            codec.compress(torch.tensor([1.0, bad, 2.0]))
    with pytest.raises(ValueError):
        codec.compress(torch.zeros(2, 2))
    with pytest.raises(ValueError):
        codec.compress(torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("numel", [0, 1, 7, 300])
def test_wrong_length_and_numel_rejected(name: str, numel: int) -> None:
    codec = get_codec(name, 16)
    data = codec.compress(torch.randn(numel))
    for wrong in (data + b"\x00", data[:-1] if data else b"\x00"):
        with pytest.raises(CodecError):
            codec.decompress(wrong, numel)
    # numel + 2, not + 1: int4 packs an odd count with a pad nibble, so n and n + 1 can share a payload size.
    for bad_numel in (-1, numel + 2, True, 1.0):
        with pytest.raises(CodecError):
            codec.decompress(data, bad_numel)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0, FLT_MAX])
def test_bad_scales_rejected(name: str, scale: float) -> None:
    # FLT_MAX is finite but q * scale overflows: the codec must still never return an infinity.
    codec = get_codec(name, 4)
    data = bytearray(codec.compress(torch.tensor([1.0, -2.0, 3.0, 4.0, 5.0])))
    data[4:8] = struct.pack("<f", scale)
    with pytest.raises(CodecError):
        codec.decompress(bytes(data), 5)


@pytest.mark.parametrize("name,pattern", [("fp32", struct.pack("<f", float("nan"))), ("fp16", b"\x00\x7c")])
def test_non_finite_float_payload_rejected(name: str, pattern: bytes) -> None:
    codec = get_codec(name)
    data = codec.compress(torch.ones(3))
    with pytest.raises(CodecError):
        codec.decompress(pattern + data[len(pattern):], 3)


@pytest.mark.parametrize("name,ratio", [("fp32", 1.0), ("fp16", 2.0), ("int8", 4 / (1 + 4 / 256)),
                                        ("int4", 4 / (0.5 + 4 / 256))])
def test_compression_ratios(name: str, ratio: float) -> None:
    n = 1 << 16
    codec = get_codec(name)
    assert len(codec.compress(torch.randn(n))) == codec.payload_bytes(n)
    assert math.isclose(4 * n / codec.payload_bytes(n), ratio, rel_tol=1e-9)
    assert ratio >= {"fp32": 1, "fp16": 2, "int8": 3.9, "int4": 7.7}[name]


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_deterministic_and_fresh_output(name: str) -> None:
    # The sender merges its own decompressed payload, so encoding must be a pure function of x.
    codec = get_codec(name, 64)
    x = torch.randn(1000)
    data = codec.compress(x)
    assert codec.compress(x.clone()) == data
    y = codec.decompress(data, 1000)
    y.add_(1.0)  # writable, and owned: the payload bytes are untouched
    assert codec.decompress(data, 1000).add(1.0).equal(y)


def test_strided_input() -> None:
    x = torch.randn(200, 2)[:, 0]
    assert get_codec("int8", 16).compress(x) == get_codec("int8", 16).compress(x.contiguous())


def test_get_codec_errors() -> None:
    with pytest.raises(ValueError, match="fp32, fp16, int8, int4"):
        get_codec("zstd")
    with pytest.raises(ValueError, match="even"):
        get_codec("int4", 255)
    with pytest.raises(ValueError):
        get_codec("int8", 0)
    assert get_codec("int8", 255).payload_bytes(256) == 4 * 2 + 256


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["fp32", "fp16", "int8", "int4"]), st.sampled_from([2, 6, 64, 256]), st.integers(1, 3000),
       st.data())
def test_decompress_range_is_that_part_of_decompress(name, block, numel, data) -> None:
    codec = get_codec(name, block)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    payload = codec.compress(x)
    start = data.draw(st.integers(0, numel - 1))
    stop = data.draw(st.integers(start + 1, numel))
    assert torch.equal(codec.decompress_range(payload, numel, slice(start, stop)),
                       codec.decompress(payload, numel)[start:stop])
