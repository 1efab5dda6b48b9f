"""A safetensors file written tensor by tensor, straight from each tensor's own memory.

safetensors' `save_file` first turns every tensor into a `bytes` object and only then writes: for a checkpoint
that is a second copy of the whole state (theta, m, e and the AdamW moments: 20 bytes per parameter) at the
moment a unit's memory is fullest. The format is simple enough to write as a stream (an 8-byte little-endian
header length, a JSON header of dtype, shape and byte offsets, then the raw little-endian bytes), and
`safetensors.torch.load_file` reads the result like any other file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write `tensors` to `path` as safetensors, one tensor at a time, with no copy of a CPU contiguous tensor."""
    items = sorted(tensors.items())
    header: dict[str, dict] = {}
    offset = 0
    for name, tensor in items:
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"tensor {name}: dtype {tensor.dtype} has no safetensors name")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, tensor in items:
            flat = tensor.detach().cpu().contiguous().reshape(-1)  # a view for a CPU contiguous tensor
            if flat.numel():
                f.write(flat.view(torch.uint8).numpy().data)  # the tensor's memory, not a copy
