"""The outer step: sender-side Nesterov equals DiLoCo's Nesterov of the mean; error feedback loses nothing."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.config import InnerConfig, OuterConfig
from p2p_diloco.train.inner import lr_at
from p2p_diloco.train.outer import OuterState, outer_update, pseudo_gradient, update_weight
from p2p_diloco.wire.codecs import get_codec


@settings(max_examples=25, deadline=None)
@given(n_peers=st.integers(1, 5), rounds=st.integers(1, 6), mu=st.floats(0.0, 0.95), seed=st.integers(0, 10_000))
def test_sender_side_nesterov_equals_nesterov_of_the_mean(n_peers, rounds, mu, seed):
    # DiLoCo: m <- mu m + mean(delta); step = mean(delta) + mu m. Ours: each sender runs that on its own delta
    # and receivers average. Linearity makes the two identical, round after round.
    g = torch.Generator().manual_seed(seed)
    cfg = OuterConfig(momentum=mu, nesterov=True, codec="fp32", error_feedback=False)
    codec = get_codec("fp32")
    states = [OuterState.zeros(16) for _ in range(n_peers)]
    central_m = torch.zeros(16)
    for _ in range(rounds):
        deltas = [torch.randn(16, generator=g) for _ in range(n_peers)]
        ours = torch.stack([outer_update(d, s, cfg, codec)[1] for d, s in zip(deltas, states)]).mean(0)
        mean = torch.stack(deltas).mean(0)
        central_m = mu * central_m + mean
        assert torch.allclose(ours, mean + mu * central_m, atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(codec_name=st.sampled_from(["fp16", "int8", "int4"]), seed=st.integers(0, 10_000))
def test_error_feedback_keeps_the_sum_of_updates(codec_name, seed):
    # With error feedback, sum(decoded) = sum(d) - e_final: compression error is delayed, never lost.
    g = torch.Generator().manual_seed(seed)
    cfg = OuterConfig(momentum=0.0, codec=codec_name, error_feedback=True)
    codec = get_codec(codec_name, cfg.codec_block)
    state = OuterState.zeros(1000)
    sent, decoded_sum = torch.zeros(1000), torch.zeros(1000)
    for _ in range(10):
        d = torch.randn(1000, generator=g)
        compressed_input = d + state.error
        sent += d
        decoded_sum += outer_update(d, state, cfg, codec)[1]
        # the carried error is one round's quantisation error of what was compressed: it never accumulates
        assert bool((state.error.abs() <= codec.error_bound(compressed_input) + 1e-6).all())
    assert torch.allclose(decoded_sum + state.error, sent, atol=1e-4)


def test_pseudo_gradient_is_theta0_minus_phi():
    theta0, phi = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 3.0])
    assert torch.equal(pseudo_gradient(theta0, phi), torch.tensor([0.5, -1.0]))


def test_weight_is_share_of_round_and_damps_only_excess_staleness():
    cfg = OuterConfig(staleness_power=0.5)
    assert update_weight(100, 400, tau=3, num_peers=4, cfg=cfg) == 0.25  # tau = N-1 is a normal round
    assert update_weight(100, 400, tau=0, num_peers=4, cfg=cfg) == 0.25
    assert update_weight(100, 400, tau=11, num_peers=4, cfg=cfg) < 0.25 * 0.6  # 8 excess -> (1+2)^-0.5
    assert update_weight(100, 400, tau=99, num_peers=4, cfg=OuterConfig(staleness_power=0.0)) == 0.25
    assert update_weight(10_000, 1, tau=0, num_peers=1, cfg=cfg) == cfg.max_weight


def test_lr_schedule_warms_up_then_decays_to_floor():
    cfg = InnerConfig(lr=1.0, warmup_steps=10, decay_steps=110, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(200)]
    assert lrs[0] == 0.1 and lrs[9] == 1.0
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:110], lrs[11:111]))
    assert abs(lrs[110] - 0.1) < 1e-9 and lrs[199] == lrs[110]
