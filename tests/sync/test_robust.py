"""Robust merging: the spec-derived norm bound holds for real AdamW, clipping rules, CenteredClip."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.config import DefenceConfig, OuterConfig, preset
from p2p_diloco.sync.robust import (
    CenteredClipWindow,
    MergePolicy,
    adam_step_bound,
    centered_clip,
    honest_coord_bound,
)
from p2p_diloco.train.outer import OuterState, outer_update
from p2p_diloco.wire.codecs import get_codec

SPEC = preset("test")


def with_defence(**kw: object):
    return dataclasses.replace(SPEC, defence=dataclasses.replace(SPEC.defence, **kw))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False) | st.just(0.0), min_size=1, max_size=40),
       st.sampled_from([(0.9, 0.95), (0.9, 0.999), (0.5, 0.9), (0.0, 0.5)]),
       st.floats(1e-5, 1e-1))
def test_adam_moves_a_coordinate_by_at_most_the_bound_per_step(grads: list[float], betas: tuple[float, float],
                                                                lr: float) -> None:
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = torch.optim.AdamW([p], lr=lr, betas=betas, weight_decay=0.0, eps=1e-12)
    bound = lr * adam_step_bound(*betas)
    for g in grads:
        before = p.detach().clone()
        p.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
        assert abs(float(p.detach() - before)) <= bound * (1 + 1e-9)


def test_adam_step_bound_values() -> None:
    assert adam_step_bound(0.9, 0.95) == pytest.approx(1.16496, abs=1e-5)  # the presets' betas
    assert adam_step_bound(0.0, 0.5) == pytest.approx(math.sqrt(2))  # |g_t| / sqrt(0.5 g_t^2 + ...)
    with pytest.raises(ValueError, match="no bound"):
        adam_step_bound(0.99, 0.95)


def test_honest_coord_bound_is_h_lr_adam_over_one_minus_mu() -> None:
    # mu: the outer schedule's early momentum (its ramp's late one would loosen the bound 3.5x: not taken)
    expected = SPEC.inner.inner_steps * SPEC.inner.lr * adam_step_bound(0.9, 0.95) / (1 - SPEC.outer.momentum)
    assert honest_coord_bound(SPEC) == pytest.approx(expected)


def test_screen_rejects_above_the_bound_only() -> None:
    policy = MergePolicy.from_spec(SPEC)
    bound = honest_coord_bound(SPEC)
    assert policy.screen(torch.full((8,), bound)) is None
    assert policy.screen(torch.tensor([0.0, -bound * 1.001])) == "norm_bound"
    assert MergePolicy.from_spec(with_defence(norm_bound=0.0)).screen(torch.full((3,), 1e30)) is None
    assert MergePolicy.passthrough().screen(torch.full((3,), 1e30)) is None


@settings(max_examples=60, deadline=None)
@given(st.floats(1e-3, 1e4), st.integers(0, 2**31), st.sampled_from(["int8", "int4", "fp16", "fp32"]))
def test_sender_clip_makes_any_payload_pass_every_peers_screen(scale: float, seed: int, codec_name: str) -> None:
    # The sender's own path: the outer step clips what enters the codec to the policy's sender limit.
    policy = MergePolicy.from_spec(with_defence(aggregation="coord_clip"))
    codec = get_codec(codec_name, 64)
    d = torch.randn(300, generator=torch.Generator().manual_seed(seed)) * scale
    plain = OuterConfig(momentum=0.0, error_feedback=False)
    _, decoded = outer_update(d, OuterState.zeros(300, torch.float32), plain, codec, limit=policy.sender_limit)
    assert policy.screen(decoded) is None
    assert torch.equal(policy.shape(decoded), decoded)  # already within the clip: merged as sent


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50))
def test_coord_clip_is_deterministic_bounded_and_exact_inside(values: list[float]) -> None:
    policy = MergePolicy.from_spec(with_defence(aggregation="coord_clip", coord_clip=0.5))
    x = torch.tensor(values)
    out = policy.shape(x)
    limit = 0.5 * honest_coord_bound(SPEC)
    assert torch.equal(out, policy.shape(x.clone())) and policy.deterministic
    assert float(out.abs().max()) <= limit
    inside = x.abs() <= limit
    assert torch.equal(out[inside], x[inside])
    assert torch.all(out.abs() <= x.abs()) and torch.all(out * x >= 0)  # shrinks, never flips a sign


def test_centered_clip_without_clipping_is_the_mean() -> None:
    points = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(centered_clip(points, torch.zeros(7), math.inf, iters=1), points.mean(0), atol=1e-6)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31), st.floats(1e-3, 1e9), st.floats(0.01, 10.0))
def test_one_point_moves_centered_clip_by_at_most_tau_over_n(seed: int, far: float, tau: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    points = torch.randn(6, 9, generator=gen)
    center = torch.randn(9, generator=gen)
    moved = points.clone()
    moved[0] = torch.randn(9, generator=gen) * far
    a = centered_clip(points, center, tau, iters=1)
    b = centered_clip(moved, center, tau, iters=1)
    assert float(torch.linalg.vector_norm(a - b)) <= 2 * tau / 6 * (1 + 1e-5)


def test_centered_clip_window_is_exact_inside_and_clips_outside() -> None:
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(50, generator=gen)
    window = CenteredClipWindow(window=8, radius=1.5)  # tighter than the default, to see it clip
    first = base + 0.1 * torch.randn(50, generator=gen)
    assert window.shape(first) is first  # nothing to compare with yet
    window.observe(first)
    huge = first * 100
    assert float(window.shape(huge).norm()) == pytest.approx(1.5 * float(first.norm()), rel=1e-5)  # warming up
    for _ in range(7):
        window.observe(base + 0.1 * torch.randn(50, generator=gen))
    assert window.center is not None and math.isfinite(window.tau)
    honest = base + 0.1 * torch.randn(50, generator=gen)
    assert window.shape(honest) is honest  # within tau: merged bit-exact, so replicas agree on it
    flipped = -honest * 100
    shaped = window.shape(flipped)
    assert float(torch.linalg.vector_norm(shaped - window.center)) == pytest.approx(window.tau, rel=1e-4)
    # a burst of outliers moves the centre by at most tau / n each
    before = window.center.clone()
    window.observe(flipped)
    assert float(torch.linalg.vector_norm(window.center - before)) < float(torch.linalg.vector_norm(base))


def test_policy_modes() -> None:
    assert MergePolicy.from_spec(SPEC).deterministic
    assert not MergePolicy.from_spec(with_defence(aggregation="centered_clip")).deterministic
    with pytest.raises(Exception, match="aggregation"):
        MergePolicy(DefenceConfig(aggregation="median"), 1.0)
    x = torch.randn(4)
    assert MergePolicy.from_spec(SPEC).shape(x) is x


def test_defence_config_round_trips_and_refuses_bad_values() -> None:
    from p2p_diloco.config import ConfigError, RunSpec

    spec = with_defence(aggregation="centered_clip", allowed_senders=("12D3KooWa", "12D3KooWb"))
    back = RunSpec.from_dict(spec.to_dict())
    assert back == spec and back.defence.allowed_senders == ("12D3KooWa", "12D3KooWb")
    assert back.spec_hash() == spec.spec_hash() != SPEC.spec_hash()  # a protocol parameter: in the hash
    for bad, message in ((dict(aggregation="median"), "aggregation"), (dict(norm_bound=-1.0), "norm_bound"),
                         (dict(clip_window=1), "clip_window"), (dict(max_hole_span=0), "max_hole_span"),
                         (dict(gap_timeout_s=0.0), "gap_timeout_s")):
        with pytest.raises(ConfigError, match=message):
            with_defence(**bad).validate()
    d = SPEC.to_dict()
    d["defence"]["allowed_senders"] = [1]
    with pytest.raises(ConfigError, match="allowed_senders"):
        RunSpec.from_dict(d)


def test_defence_options_are_on_the_command_line() -> None:
    from p2p_diloco.cli.args import ArgumentParser, add_config_args, apply_args
    from p2p_diloco.cli.options import join_options

    parser = ArgumentParser()
    add_config_args(parser, join_options("test"))
    args = parser.parse_args(["--aggregation", "coord_clip", "--spec.defence.norm-bound", "2",
                              "--allowed-senders", "a,b"])
    spec = apply_args(SPEC, args, "join__spec")
    assert (spec.defence.aggregation, spec.defence.norm_bound, spec.defence.allowed_senders) == \
        ("coord_clip", 2.0, ("a", "b"))
