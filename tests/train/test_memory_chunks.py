"""The end of a phase and a merge work a chunk at a time (ARCHITECTURE.md "Memory"): the same numbers, bit for bit,
as the whole-vector arithmetic they replace, with no full-size temporary."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import p2p_diloco.sync.accumulator as accumulator
import p2p_diloco.train.outer as outer
from p2p_diloco.config import OuterConfig
from p2p_diloco.sync.accumulator import Accumulator
from p2p_diloco.sync.reference import REFERENCE_SAMPLE, Reference
from p2p_diloco.train.outer import OuterState, outer_update
from p2p_diloco.wire.codecs import get_codec


def whole_vector_update(delta, state, cfg, codec):
    """The outer step as it was written before chunking: the reference these tests hold the chunks to."""
    mu = cfg.momentum
    state.momentum.mul_(mu).add_(delta)
    d = delta + mu * state.momentum if cfg.nesterov else state.momentum.clone()
    if cfg.error_feedback:
        d.add_(state.error)
    payload = codec.compress(d)
    decoded = codec.decompress(payload, d.numel())
    if cfg.error_feedback:
        state.error.copy_(d - decoded)
    return payload, decoded


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3000), st.sampled_from(["int8", "int4", "fp16", "fp32"]), st.booleans(), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_chunked_outer_step_is_the_whole_vector_step(numel, codec_name, nesterov, error_feedback, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    cfg = dataclasses.replace(OuterConfig(), nesterov=nesterov, error_feedback=error_feedback)
    codec = get_codec(codec_name, 64)
    ours, theirs = OuterState.zeros(numel), OuterState.zeros(numel)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(outer, "CHUNK", 97)  # many chunks, none aligned with the codec's blocks
        for _ in range(3):
            delta = torch.randn(numel, generator=g)
            payload, decoded = outer_update(delta.clone(), ours, cfg, codec, consume=True)
            want_payload, want_decoded = whole_vector_update(delta, theirs, cfg, codec)
            assert payload == want_payload and torch.equal(decoded, want_decoded)
            assert torch.equal(ours.momentum, theirs.momentum) and torch.equal(ours.error, theirs.error)


def test_consume_works_in_the_pseudo_gradients_own_buffer() -> None:
    delta = torch.randn(5000)
    kept = delta.clone()
    _, decoded = outer_update(delta, OuterState.zeros(5000), OuterConfig(), get_codec("int8"), consume=True)
    assert decoded.data_ptr() == delta.data_ptr()  # no new full-size tensor came back
    _, again = outer_update(kept, OuterState.zeros(5000), OuterConfig(), get_codec("int8"))
    assert again.data_ptr() != kept.data_ptr() and torch.equal(again, decoded)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 2000), st.floats(1e-3, 10), st.sampled_from([1.0, 0.5, 0.25, 0.0625]),
       st.integers(0, 2**31 - 1))
def test_chunked_merge_is_the_whole_product(numel, factor, multiplier, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    theta, step = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    want = theta - (step * factor) * multiplier
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(accumulator, "CHUNK", 61)
        acc = Accumulator(theta.clone())
        assert acc.subtract(step, float(step.abs().max()) * factor, factor=factor, multiplier=multiplier)
        assert torch.equal(acc.theta, want)
        acc.add(step, factor=factor, multiplier=multiplier)
        assert torch.equal(acc.theta, want + (step * factor) * multiplier)


def test_reference_of_a_large_model_keeps_a_sample_and_the_same_cosines() -> None:
    n = REFERENCE_SAMPLE * 4
    g = torch.Generator().manual_seed(3)
    ref = Reference()
    direction = torch.randn(n, generator=g)
    ref.fold(direction)
    assert ref.vector is not None and ref.vector.numel() == REFERENCE_SAMPLE  # not a full-size copy
    along = direction + 0.5 * torch.randn(n, generator=g)
    full_cos = float(torch.dot(along, direction) / (along.norm() * direction.norm()))
    agreement, ratio = ref.compare(along)
    assert abs(agreement - full_cos) < 0.005 and ratio == pytest.approx(float(along.norm() / direction.norm()))
    assert ref.compare(-along)[0] == pytest.approx(-agreement)
