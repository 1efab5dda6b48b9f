"""The streamed checkpoint file reads back bit for bit with safetensors' own reader."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from p2p_diloco.train.state.tensorfile import save_tensors

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8, torch.bool,
          torch.float64]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3)), min_size=1,
                max_size=6), st.integers(0, 2**31 - 1))
def test_streamed_file_reads_back_exactly(tmp_path_factory, specs, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}": (torch.randn(shape, generator=g) * 100).to(dtype) for i, (dtype, shape) in enumerate(specs)}
    path = tmp_path_factory.mktemp("tf") / "state.safetensors"
    save_tensors(tensors, path)
    back = load_file(str(path))
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert torch.equal(back[name], tensor)


def test_a_view_is_written_as_its_values(tmp_path) -> None:
    base = torch.arange(12, dtype=torch.float32).view(3, 4)
    save_tensors({"col": base[:, 1], "scalar": torch.tensor(3.5)}, tmp_path / "s.safetensors")
    back = load_file(str(tmp_path / "s.safetensors"))
    assert torch.equal(back["col"], torch.tensor([1.0, 5.0, 9.0])) and back["scalar"].item() == 3.5
