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
    cfg = OuterConfig(schedule="ramp")
    assert cfg.step_at(0) == cfg.step_at(10) == (1.4, 0.3)
    assert cfg.step_at(20) == pytest.approx((1.05, 0.6))
    assert cfg.step_at(30) == cfg.step_at(1e9) == pytest.approx((0.7, 0.9))
    constant = OuterConfig(schedule="constant")
    assert constant.step_at(0) == constant.step_at(1e9) == (1.4, 0.3)


def test_the_norm_bound_stays_the_early_steps() -> None:
    # A bound that followed the ramp to mu 0.9 would let an attacker move theta 3.5x further per update
    ramp, constant = RunSpec(outer=OuterConfig(schedule="ramp")), RunSpec(outer=OuterConfig(schedule="constant"))
    per_phase = ramp.inner.inner_steps * ramp.inner.lr * adam_step_bound(ramp.inner.beta1, ramp.inner.beta2)
    assert honest_coord_bound(ramp) == honest_coord_bound(constant) == pytest.approx(per_phase / (1 - 0.3))
    assert MergePolicy.from_spec(ramp).sender_limit == MergePolicy.from_spec(constant).sender_limit


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), clock=st.integers(0, 10), rounds=st.integers(1, 5))
def test_before_the_ramp_the_update_is_the_constant_steps_bit_for_bit(seed: int, clock: int, rounds: int) -> None:
    # A 10-round run never leaves the early step: its results are the constant schedule's exactly.
    g = torch.Generator().manual_seed(seed)
    ramp, constant = OuterConfig(codec="fp32", schedule="ramp"), OuterConfig(codec="fp32", schedule="constant")
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
    ramp = OuterConfig(codec="fp32", error_feedback=False, schedule="ramp")
    late = OuterConfig(codec="fp32", error_feedback=False, outer_lr=0.7, momentum=0.9, schedule="constant")
    s1, s2 = OuterState.zeros(32, torch.float32), OuterState.zeros(32, torch.float32)
    for _ in range(rounds):
        d = torch.randn(32, generator=g)
        a = outer_update(d, s1, ramp, FP32, replica=at(40))[1] * ramp.outer_lr
        b = outer_update(d, s2, late, FP32, replica=at(40))[1] * late.outer_lr
        assert torch.allclose(a, b, atol=1e-5)


def test_after_the_ramp_a_sender_clips_to_the_bound_and_every_peer_accepts_its_update() -> None:
    # Coordinates that move the same way round after round (the worst case the bound is built on): under mu 0.9
    # the momentum grows the payload past the early step's bound; the sender clips it there, and the bound passes it.
    spec = RunSpec(outer=OuterConfig(codec="int8", schedule="ramp"))
    policy = MergePolicy.from_spec(spec)
    per_phase = honest_coord_bound(spec) * (1 - spec.outer.momentum)  # the most one phase moves a coordinate
    state, codec = OuterState.zeros(64, torch.float32), get_codec("int8", 64)
    clipped = []
    for _ in range(30):
        out = outer_update(torch.full((64,), per_phase), state, spec.outer, codec, replica=at(40),
                           limit=policy.sender_limit)[1]
        clipped.append(state.clipped)
        assert policy.screen(out) is None
    assert clipped[0] == 0 and clipped[-1] == 64  # mu 0.9's payload outgrows 1 / (1 - 0.3) within a few rounds


@pytest.mark.parametrize("field,value,match", [
    ("schedule", "cosine", "constant or ramp"), ("late_lr", 0.0, "late_lr"), ("late_momentum", 1.0, "late_momentum"),
    ("ramp_to", 5.0, "ramp_from"), ("ramp_from", -1.0, "ramp_from"),
])
def test_a_bad_schedule_is_a_clear_error(field: str, value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        OuterConfig(**{field: value}).validate()
