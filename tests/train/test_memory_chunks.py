"""The end of a phase and a merge work a chunk at a time (ARCHITECTURE.md "Memory"): the same numbers, bit for bit,
as the whole-vector arithmetic they replace, with no full-size temporary."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import p2p_diloco.sync.decoded as decoded_module
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
    # float32 state: the reference's whole-vector ops would round a bfloat16 m twice per round
    ours, theirs = OuterState.zeros(numel, torch.float32), OuterState.zeros(numel, torch.float32)
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
        patch.setattr(decoded_module, "CHUNK", 61)
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
    # (the norms are summed in float64, chunk by chunk: float32's whole-vector norm is off by ~2e-5 here)
    expected_ratio = float(along.norm() / direction.norm())
    assert abs(agreement - full_cos) < 0.005 and ratio == pytest.approx(expected_ratio, rel=1e-4)
    assert ref.compare(-along)[0] == pytest.approx(-agreement)


def _mapped_rss_kib(path_prefix: str) -> int:
    """Resident KiB of this process's mappings of (deleted) files whose name starts with `path_prefix`."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
                inside = len(head) >= 6 and head[5].startswith(path_prefix)
            elif inside and line.startswith("Rss:"):
                total += int(head[1])
    return total


def test_outer_state_in_files_leaves_memory_between_uses_and_keeps_its_values(tmp_path) -> None:
    n = 4 << 20  # 16 MB each
    state = OuterState.in_files(n, tmp_path)
    assert not any(tmp_path.iterdir())  # unlinked at once: nothing left behind
    assert float(state.momentum.abs().max()) == 0.0 and float(state.error.abs().max()) == 0.0
    state.momentum.fill_(0.5)
    state.error.copy_(torch.arange(n, dtype=torch.float32) % 256)  # integers below 256: exact in bfloat16
    before = _mapped_rss_kib(str(tmp_path))
    assert before >= n * (2 + 2) // 1024 * 0.9  # both vectors resident once written (bfloat16)
    state.release()
    assert _mapped_rss_kib(str(tmp_path)) < before // 10  # out of this process's memory...
    assert float(state.momentum[123]) == 0.5 and float(state.error[n - 1]) == (n - 1) % 256  # ...back when read
    kept = state.error.clone()
    state.release()
    assert torch.equal(state.error, kept)


def test_a_learner_with_its_outer_state_in_files_signs_the_same_updates(tmp_path, corpus) -> None:
    from p2p_diloco.config import preset
    from p2p_diloco.train.exchange import CollectingExchange
    from p2p_diloco.train.learner import Learner, SwarmView
    from p2p_diloco.train.loop import Schedule, rounds
    from p2p_diloco.wire.identity import Identity

    base, identity = preset("test"), Identity.generate()
    spec = dataclasses.replace(base, inner=dataclasses.replace(base.inner, inner_steps=3),
                               model=dataclasses.replace(base.model, n_layer=1, n_embd=32, block_size=32))
    view = SwarmView(num_peers=2, samples_per_round=2 * spec.inner.inner_steps * spec.data.batch_size)
    sent = []
    for folder in ("", str(tmp_path / "outer")):
        unit = Learner(spec, identity, corpus, shard=0, num_shards=2, outer_state_dir=folder)
        exchange = CollectingExchange(view)
        list(rounds(unit, exchange, Schedule(rounds=3)))
        sent.append([u.payload for u in exchange.sent])
    assert len(sent[0]) == 3 and sent[0] == sent[1]  # bit for bit: the same numbers, only where they live differs
