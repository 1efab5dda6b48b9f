"""Codecs for outer-update payloads: a flat float32 tensor in, bytes out, and back.

A small interface in the spirit of hivemind's `CompressionBase`, with two additions a receiver needs before it
touches untrusted bytes: `payload_bytes(numel)` gives the exact payload size, so a message whose length does not
match is rejected without decoding, and `error_bound(x)` states how far `decompress(compress(x))` may land from
`x`, which the sender's error feedback relies on and the tests check.

Codecs: "fp32" (raw), "fp16" (half precision), "int8" and "int4" (blockwise absmax quantization, as in
QSGD-style and bitsandbytes-style block quantizers). All byte layouts are little-endian.

Rule for every codec: `decompress` returns only finite values or raises `CodecError`, so nothing a remote peer
sends can put a NaN or an infinity into a replica (ARCHITECTURE.md "Invariants", 1).
"""

from __future__ import annotations

import math
from typing import TypeAlias

import numpy as np
import torch

from p2p_diloco.config.spec import CODECS

CODEC_NAMES = CODECS
"""The codec names in wire order: config's one list, the one `outer.codec` is checked against."""

Payload: TypeAlias = bytes | memoryview
"""A compressed payload: bytes, or a read-only view into a kept envelope (wire/envelope.py `retained`)."""

FP16_MAX = 65504.0
# Smallest normal float32. Block scales are floored here so that 1/scale stays finite and the scale keeps full
# precision; blocks whose absmax is below qmax * 2**-126 (about 1e-36) are quantized with this step instead.
_MIN_SCALE = 2.0**-126
# Slack on the blockwise bound for float32 rounding in x/scale and q*scale (a few ulps of qmax*scale, well
# under 2**-12 of one scale step).
_ROUNDING_SLACK = 2.0**-12
_CHUNK_VALUES = 1 << 22
"""Values quantized per chunk: the float temporary of `compress` stays 16 MB whatever the model's size."""


class CodecError(ValueError):
    """A payload that cannot be decoded (wrong length, non-finite values), or input a codec cannot encode."""


class Codec:
    """Compress a 1-D float32 tensor to bytes and back; subclasses set `name` and implement the four methods."""

    name: str = ""

    def compress(self, x: torch.Tensor) -> bytes:
        """Encode `x` (1-D float32, any length, finite values) to exactly `payload_bytes(x.numel())` bytes."""
        raise NotImplementedError

    def decompress(self, data: Payload, numel: int) -> torch.Tensor:
        """Decode a payload of `numel` values to a new 1-D float32 CPU tensor; `CodecError` if malformed."""
        raise NotImplementedError

    def decompress_range(self, data: Payload, numel: int, part: slice) -> torch.Tensor:
        """Decode only values `part` (a slice with start and stop within numel) of a payload of `numel` values: a
        sender's outer step decodes its own payload a chunk at a time (train/outer.py). Same values as
        `decompress(data, numel)[part]`; this default decodes everything, the codecs below only the part."""
        return self.decompress(data, numel)[part]

    def payload_bytes(self, numel: int) -> int:
        """The exact payload size for `numel` values."""
        raise NotImplementedError

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per-element bound on `|decompress(compress(x)) - x|`, same shape as `x`."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def _check_length(self, data: Payload, numel: int) -> None:
        # Checked before anything is allocated: the header's numel is untrusted and must agree with the bytes.
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise CodecError(f"{self.name}: numel must be a non-negative int, got {numel!r}")
        expected = self.payload_bytes(numel)
        if len(data) != expected:
            raise CodecError(f"{self.name}: payload is {len(data)} bytes, expected {expected} for numel={numel}")


def _check_input(x: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError(f"{name}: expected a 1-D float32 tensor, got {_describe(x)}")
    x = x.detach().contiguous()
    # A NaN or infinity in an outer update is a sender bug; refusing it here keeps it off the wire entirely.
    if not _all_finite(x):
        raise CodecError(f"{name}: input contains non-finite values")
    return x


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor(shape={tuple(x.shape)}, dtype={x.dtype})"
    return type(x).__name__


def _all_finite(x: torch.Tensor) -> bool:
    # aminmax propagates NaN and is ~30x faster than isfinite(x).all(), which materialises a bool tensor.
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def _finite_or_raise(out: torch.Tensor, name: str) -> torch.Tensor:
    if not _all_finite(out):
        raise CodecError(f"{name}: payload decodes to non-finite values")
    return out


def _frombuffer(data: Payload, dtype: str, count: int, offset: int = 0) -> np.ndarray:
    # np.frombuffer gives a read-only view; every caller converts it with a copy into a tensor it owns.
    return np.frombuffer(data, dtype=np.dtype(dtype), count=count, offset=offset)


class Fp32Codec(Codec):
    """Raw little-endian float32: lossless, 4 bytes per value."""

    name = "fp32"

    def compress(self, x: torch.Tensor) -> bytes:
        x = _check_input(x, self.name)
        return x.cpu().numpy().astype("<f4", copy=False).tobytes()

    def decompress(self, data: Payload, numel: int) -> torch.Tensor:
        self._check_length(data, numel)
        out = torch.from_numpy(_frombuffer(data, "<f4", numel).astype(np.float32))
        return _finite_or_raise(out, self.name)

    def decompress_range(self, data: Payload, numel: int, part: slice) -> torch.Tensor:
        self._check_length(data, numel)
        start, stop, _ = part.indices(numel)
        out = torch.from_numpy(_frombuffer(data, "<f4", stop - start, offset=4 * start).astype(np.float32))
        return _finite_or_raise(out, self.name)

    def payload_bytes(self, numel: int) -> int:
        return 4 * numel

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x, dtype=torch.float32)


class Fp16Codec(Codec):
    """IEEE half precision, 2 bytes per value.

    Values beyond the fp16 range saturate to +-65504 instead of becoming infinite; the error bound includes the
    clipped amount. Outer updates live far inside that range, so saturation is a guard, not a working mode.
    """

    name = "fp16"

    def compress(self, x: torch.Tensor) -> bytes:
        x = _check_input(x, self.name)
        half = x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).cpu()
        return half.numpy().astype("<f2", copy=False).tobytes()

    def decompress(self, data: Payload, numel: int) -> torch.Tensor:
        self._check_length(data, numel)
        half = torch.from_numpy(_frombuffer(data, "<f2", numel).astype(np.float16))
        return _finite_or_raise(half.to(torch.float32), self.name)

    def decompress_range(self, data: Payload, numel: int, part: slice) -> torch.Tensor:
        self._check_length(data, numel)
        start, stop, _ = part.indices(numel)
        half = torch.from_numpy(_frombuffer(data, "<f2", stop - start, offset=2 * start).astype(np.float16))
        return _finite_or_raise(half.to(torch.float32), self.name)

    def payload_bytes(self, numel: int) -> int:
        return 2 * numel

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        a = x.detach().to(torch.float32).abs()
        # Round-to-nearest: half an ulp, i.e. 2**-11 relative for normal halves and 2**-25 absolute for
        # subnormals; plus whatever saturation cut off.
        return torch.maximum(a * 2.0**-11, torch.full_like(a, 2.0**-25)) + (a - FP16_MAX).clamp_min(0.0)


class BlockwiseCodec(Codec):
    """Blockwise absmax quantization to signed integers in [-qmax, qmax].

    Per block of `block` consecutive values: scale = absmax / qmax, q = round(x / scale). Layout:
    `[scale float32 x nblocks][q]`, where q is one int8 per value (int8) or two signed nibbles per byte, low
    nibble first, with a zero nibble padding an odd count (int4). The last block may be partial. Each value
    decodes to q * scale, within scale / 2 (plus float32 rounding) of the input.
    """

    def __init__(self, name: str, qmax: int, bits: int, block: int) -> None:
        self.name, self.qmax, self.bits, self.block = name, qmax, bits, block

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, block={self.block})"

    def payload_bytes(self, numel: int) -> int:
        return 4 * math.ceil(numel / self.block) + math.ceil(numel * self.bits / 8)

    def _scales(self, x: torch.Tensor) -> torch.Tensor:
        """One float32 scale per block (0 for an all-zero block)."""
        n, b = x.numel(), self.block
        full = n // b
        parts = []
        if full:
            lo, hi = torch.aminmax(x[: full * b].view(full, b), dim=1)
            parts.append(torch.maximum(-lo, hi))
        if n > full * b:
            parts.append(x[full * b :].abs().amax().reshape(1))
        if not parts:
            return torch.zeros(0, dtype=torch.float32, device=x.device)
        absmax = torch.cat(parts)
        scale = torch.where(absmax > 0, (absmax / self.qmax).clamp_min(_MIN_SCALE), absmax)
        # Near float32's maximum, scale * qmax can round up to infinity; step such scales down by an ulp so
        # every q * scale the receiver computes is finite.
        for _ in range(2):
            scale = torch.where(torch.isinf(scale * self.qmax), torch.nextafter(scale, torch.zeros_like(scale)), scale)
        return scale

    def _expand(self, per_block: torch.Tensor, n: int) -> torch.Tensor:
        return per_block.repeat_interleave(self.block)[:n]

    def _quantize(self, x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Signed int8 codes for x (vectorised; full blocks as a 2-D view, the tail separately), into `out`
        (int8, x's size and device) when given."""
        n, b = x.numel(), self.block
        full = n // b
        inv = torch.where(scale > 0, 1.0 / scale.clamp_min(_MIN_SCALE), torch.zeros_like(scale))
        q = torch.empty(n, dtype=torch.int8, device=x.device) if out is None else out
        step = max(1, _CHUNK_VALUES // b)  # blocks per chunk: the float temporary stays chunk-sized
        for lo in range(0, full, step):
            hi = min(full, lo + step)
            y = x[lo * b: hi * b].view(hi - lo, b) * inv[lo:hi, None]
            q[lo * b: hi * b].view(hi - lo, b).copy_(y.round_().clamp_(-self.qmax, self.qmax))
        if n > full * b:
            q[full * b :].copy_((x[full * b :] * inv[-1]).round_().clamp_(-self.qmax, self.qmax))
        return q

    def _dequantize(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Multiply float32 codes by their block scales, in place."""
        n, b = values.numel(), self.block
        full = n // b
        if full:
            values[: full * b].view(full, b).mul_(scale[:full, None])
        if n > full * b:
            values[full * b :].mul_(scale[-1])
        return values

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        """int8 codes -> payload bytes (uint8 tensor)."""
        if self.bits == 8:
            return q.view(torch.uint8)
        if q.numel() % 2:
            q = torch.cat([q, q.new_zeros(1)])
        nib = q.to(torch.int16) & 0x0F  # two's-complement nibble
        return (nib[0::2] | (nib[1::2] << 4)).to(torch.uint8)

    def _unpack(self, packed: np.ndarray, numel: int) -> torch.Tensor:
        """Payload bytes -> float32 codes (a new tensor of numel values)."""
        if self.bits == 8:
            return torch.from_numpy(packed.view(np.int8).astype(np.float32))
        b = torch.from_numpy(packed.astype(np.int16))
        lo, hi = b & 0x0F, b >> 4
        # Sign-extend the 4-bit two's-complement nibbles: 8..15 -> -8..-1.
        codes = torch.stack([lo - ((lo >> 3) << 4), hi - ((hi >> 3) << 4)], dim=1).view(-1)[:numel]
        return codes.to(torch.float32)

    def compress(self, x: torch.Tensor) -> bytes:
        x = _check_input(x, self.name)
        scale = self._scales(x)
        head = 4 * scale.numel()
        if self.bits == 8 and x.device.type == "cpu":  # the codes straight into the payload: no second copy
            out = torch.empty(head + x.numel(), dtype=torch.uint8)
            self._quantize(x, scale, out=out[head:].view(torch.int8))
        else:
            q = self._pack(self._quantize(x, scale))
            out = torch.empty(head + q.numel(), dtype=torch.uint8)
            out[head:] = q.cpu()
        out[:head] = torch.from_numpy(scale.cpu().numpy().astype("<f4", copy=False).view(np.uint8))
        return out.numpy().tobytes()

    def decompress(self, data: Payload, numel: int) -> torch.Tensor:
        self._check_length(data, numel)
        nblocks = math.ceil(numel / self.block)
        scale = torch.from_numpy(_frombuffer(data, "<f4", nblocks).astype(np.float32))
        if nblocks and not (_all_finite(scale) and bool(scale.min() >= 0)):
            raise CodecError(f"{self.name}: block scales must be finite and non-negative")
        packed = _frombuffer(data, "u1", len(data) - 4 * nblocks, offset=4 * nblocks)
        # Finite scales can still overflow in q * scale (a crafted scale near float32's max), hence the check.
        return _finite_or_raise(self._dequantize(self._unpack(packed, numel), scale), self.name)

    def decompress_range(self, data: Payload, numel: int, part: slice) -> torch.Tensor:
        self._check_length(data, numel)
        start, stop, _ = part.indices(numel)
        b, nblocks = self.block, math.ceil(numel / self.block)
        first, last = start // b, math.ceil(stop / b)  # the blocks that hold the part
        scale = torch.from_numpy(_frombuffer(data, "<f4", last - first, offset=4 * first).astype(np.float32))
        if last > first and not (_all_finite(scale) and bool(scale.min() >= 0)):
            raise CodecError(f"{self.name}: block scales must be finite and non-negative")
        lo, hi = first * b, min(numel, last * b)  # whole blocks (the last one may be the payload's partial one)
        count = hi - lo if self.bits == 8 else math.ceil((hi - lo) / 2)
        packed = _frombuffer(data, "u1", count, offset=4 * nblocks + lo * self.bits // 8)
        values = self._dequantize(self._unpack(packed, hi - lo), scale)
        return _finite_or_raise(values[start - lo: stop - lo], self.name)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().to(torch.float32).contiguous()
        return self._expand(self._scales(x) * (0.5 + _ROUNDING_SLACK), x.numel())


def get_codec(name: str, block: int = 256) -> Codec:
    """The codec called `name`; `block` is the number of values per scale for "int8" and "int4"."""
    if name == "fp32":
        return Fp32Codec()
    if name == "fp16":
        return Fp16Codec()
    if name in ("int8", "int4"):
        if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
            raise ValueError(f"codec block must be a positive int, got {block!r}")
        if name == "int4" and block % 2:
            # Even blocks keep every block's nibbles byte-aligned (the RunSpec requires it for all codecs).
            raise ValueError(f"int4 codec needs an even block size, got {block}")
        return BlockwiseCodec(name, qmax=127, bits=8, block=block) if name == "int8" else \
            BlockwiseCodec(name, qmax=7, bits=4, block=block)
    raise ValueError(f"unknown codec {name!r}; valid codecs: {', '.join(CODEC_NAMES)}")
