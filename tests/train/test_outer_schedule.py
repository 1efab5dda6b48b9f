"""The outer step's schedule on the swarm's clock (`OuterConfig.step_at`): the ramp from the 10-round step to
DiLoCo's, applied by the sender alone, and the norm bound that follows it."""

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.config import ConfigError, OuterConfig, RunSpec
from p2p_diloco.sync.robust import MergePolicy, adam_step_bound, honest_coord_bound
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.train.outer import OuterState, outer_update
from p2p_diloco.wire.codecs import get_codec

FP32 = get_codec("fp32")


@dataclass
class At:
    """What `outer_update` reads of the sender's replica for the clock: its version vector."""

    version_vector: VersionVector


def at(rounds: int) -> At:
    return At(VersionVector({"a": rounds, "b": rounds}))  # equal counts: swarm_rounds == rounds


def test_the_ramp_holds_the_early_step_then_moves_linearly_to_the_late_one() -> None:
    cfg = OuterConfig()
    assert cfg.step_at(0) == cfg.step_at(10) == (1.4, 0.3)
    assert cfg.step_at(20) == pytest.approx((1.05, 0.6))
    assert cfg.step_at(30) == cfg.step_at(1e9) == pytest.approx((0.7, 0.9))
    constant = OuterConfig(schedule="constant")
    assert constant.step_at(0) == constant.step_at(1e9) == (1.4, 0.3)


def test_peak_gain_is_the_schedules_worst_end() -> None:
    assert OuterConfig().peak_gain() == pytest.approx(0.5 / 0.1)  # lr 0.7 of the merged 1.4, mu 0.9
    assert OuterConfig(schedule="constant").peak_gain() == pytest.approx(1 / 0.7)
    # DiLoCo's step throughout: the ramp from (0.7, 0.9) to (0.7, 0.9) is constant
    assert OuterConfig(outer_lr=0.7, momentum=0.9).peak_gain() == pytest.approx(10.0)
    assert OuterConfig(late_lr=0.1, late_momentum=0.0).peak_gain() == pytest.approx(1 / 0.7)


def test_the_norm_bound_follows_the_schedule() -> None:
    ramp, constant = RunSpec(), RunSpec(outer=OuterConfig(schedule="constant"))
    per_phase = ramp.inner.inner_steps * ramp.inner.lr * adam_step_bound(ramp.inner.beta1, ramp.inner.beta2)
    assert honest_coord_bound(ramp) == pytest.approx(per_phase * 5.0)
    assert honest_coord_bound(ramp) / honest_coord_bound(constant) == pytest.approx(3.5)
    assert MergePolicy.from_spec(ramp).sender_limit > MergePolicy.from_spec(constant).sender_limit


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), clock=st.integers(0, 10), rounds=st.integers(1, 5))
def test_before_the_ramp_the_update_is_the_constant_steps_bit_for_bit(seed: int, clock: int, rounds: int) -> None:
    # A 10-round run never leaves the early step: its results are the constant schedule's exactly.
    g = torch.Generator().manual_seed(seed)
    ramp, constant = OuterConfig(codec="fp32"), OuterConfig(codec="fp32", schedule="constant")
    s1, s2 = OuterState.zeros(32, torch.float32), OuterState.zeros(32, torch.float32)
    for r in range(rounds):
        d = torch.randn(32, generator=g)
        a = outer_update(d, s1, ramp, FP32, replica=at(min(clock + r, 10)))[1]
        b = outer_update(d, s2, constant, FP32, replica=at(min(clock + r, 10)))[1]
        assert torch.equal(a, b)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), rounds=st.integers(1, 6))
def test_after_the_ramp_theta_moves_as_with_the_late_step(seed: int, rounds: int) -> None:
    # Receivers merge at outer_lr (1.4); the sender's payload then moves theta as DiLoCo's step would at its lr.
    g = torch.Generator().manual_seed(seed)
    ramp = OuterConfig(codec="fp32", error_feedback=False)
    late = OuterConfig(codec="fp32", error_feedback=False, outer_lr=0.7, momentum=0.9, schedule="constant")
    s1, s2 = OuterState.zeros(32, torch.float32), OuterState.zeros(32, torch.float32)
    for _ in range(rounds):
        d = torch.randn(32, generator=g)
        a = outer_update(d, s1, ramp, FP32, replica=at(40))[1] * ramp.outer_lr
        b = outer_update(d, s2, late, FP32, replica=at(40))[1] * late.outer_lr
        assert torch.allclose(a, b, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), clocks=st.lists(st.integers(0, 50), min_size=1, max_size=30),
       lr0=st.floats(0.1, 2.0), lr1=st.floats(0.1, 2.0), mu0=st.floats(0.0, 0.95), mu1=st.floats(0.0, 0.95),
       nesterov=st.booleans())
def test_no_clock_sequence_takes_an_honest_payload_past_peak_gain(seed, clocks, lr0, lr1, mu0, mu1, nesterov):
    # The receivers' bound assumes |payload| <= peak_gain * |delta|max whatever the clock did: forward, back (a
    # joiner's few updates pull swarm_rounds down) or jumping. Worst-case deltas: every coordinate at +-1.
    cfg = OuterConfig(codec="fp32", error_feedback=False, outer_lr=lr0, momentum=mu0, late_lr=lr1,
                      late_momentum=mu1, nesterov=nesterov)
    g = torch.Generator().manual_seed(seed)
    state = OuterState.zeros(16, torch.float32)
    for c in clocks:
        d = torch.sign(torch.randn(16, generator=g)) if seed % 2 else torch.ones(16)
        out = outer_update(d, state, cfg, FP32, replica=at(c))[1]
        assert float(out.abs().max()) <= cfg.peak_gain() * (1 + 1e-5)


@pytest.mark.parametrize("field,value,match", [
    ("schedule", "cosine", "constant or ramp"), ("late_lr", 0.0, "late_lr"), ("late_momentum", 1.0, "late_momentum"),
    ("ramp_to", 5.0, "ramp_from"), ("ramp_from", -1.0, "ramp_from"),
])
def test_a_bad_schedule_is_a_clear_error(field: str, value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        OuterConfig(**{field: value}).validate()
