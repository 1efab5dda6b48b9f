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
    states = [OuterState.zeros(16, torch.float32) for _ in range(n_peers)]  # the algorithm, without bf16 storage
    central_m = torch.zeros(16)
    for _ in range(rounds):
        deltas = [torch.randn(16, generator=g) for _ in range(n_peers)]
        ours = torch.stack([outer_update(d, s, cfg, codec)[1] for d, s in zip(deltas, states)]).mean(0)
        mean = torch.stack(deltas).mean(0)
        central_m = mu * central_m + mean
        assert torch.allclose(ours, mean + mu * central_m, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(mu=st.floats(0.0, 0.95), nesterov=st.booleans(), rounds=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_swarm_momentum_adds_the_swarm_step_to_the_own_delta(mu, nesterov, rounds, seed):
    # momentum_source "swarm": m is the swarm's last step (set by the learner), left as it is; the payload is
    # (1 + mu) delta + mu^2 m (Nesterov) or delta + mu m (heavy-ball), per round of a stretched phase.
    g = torch.Generator().manual_seed(seed)
    cfg = OuterConfig(momentum=mu, nesterov=nesterov, momentum_source="swarm", codec="fp32", error_feedback=False)
    state = OuterState.zeros(16, torch.float32)
    state.momentum.copy_(torch.randn(16, generator=g))
    m, delta = state.momentum.clone(), torch.randn(16, generator=g)
    _, d = outer_update(delta, state, cfg, get_codec("fp32"), rounds=rounds)
    part = delta / rounds
    want = (1 + mu) * part + mu * mu * m if nesterov else part + mu * m
    assert torch.allclose(d, want, atol=1e-5)
    assert torch.equal(state.momentum, m)


@settings(max_examples=20, deadline=None)
@given(codec_name=st.sampled_from(["fp16", "int8", "int4"]), seed=st.integers(0, 10_000))
def test_error_feedback_keeps_the_sum_of_updates(codec_name, seed):
    # With error feedback, sum(decoded) = sum(d) - e_final: compression error is delayed, never lost.
    g = torch.Generator().manual_seed(seed)
    cfg = OuterConfig(momentum=0.0, codec=codec_name, error_feedback=True)
    codec = get_codec(codec_name, cfg.codec_block)
    state = OuterState.zeros(1000)
    sent, decoded_sum, lost = torch.zeros(1000), torch.zeros(1000), torch.zeros(1000)
    for _ in range(10):
        d = torch.randn(1000, generator=g)
        compressed_input = d + state.error
        sent += d
        decoded_sum += outer_update(d, state, cfg, codec)[1]
        # the carried error is one round's quantisation error of what was compressed: it never accumulates
        # (stored in bfloat16: a relative 2^-8 at most on top)
        bound = codec.error_bound(compressed_input)
        assert bool((state.error.float().abs() <= bound * (1 + 2 ** -8) + 1e-6).all())
        lost += bound * 2 ** -8  # what bfloat16's rounding of e may drop this round, never fed back
    assert bool(((decoded_sum + state.error.float() - sent).abs() <= lost + 1e-4).all())


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


@settings(max_examples=20, deadline=None)
@given(mu=st.sampled_from([0.3, 0.9]), seed=st.integers(0, 10_000))
def test_outer_state_in_bfloat16_rounds_only_what_is_stored(mu, seed):
    # m and e are stored in bfloat16, the arithmetic is float32: one round from zeros gives the float32 state's
    # payload bit for bit and its m and e rounded once; over many rounds the error in m stays within
    # 2^-8 / (1 - mu) of |m| (bfloat16's unit roundoff is 2^-8, and each rounding decays by mu per round): it does
    # not grow with the run.
    g = torch.Generator().manual_seed(seed)
    cfg, codec = OuterConfig(momentum=mu, codec="int8"), get_codec("int8", 64)
    low, exact = OuterState.zeros(4096), OuterState.zeros(4096, torch.float32)
    assert low.momentum.dtype == low.error.dtype == torch.bfloat16
    delta = torch.randn(4096, generator=g)
    payload, decoded = outer_update(delta, low, cfg, codec)
    want_payload, want_decoded = outer_update(delta, exact, cfg, codec)
    assert payload == want_payload and torch.equal(decoded, want_decoded)
    assert torch.equal(low.momentum, exact.momentum.to(torch.bfloat16))
    assert torch.equal(low.error, exact.error.to(torch.bfloat16))
    low, exact = OuterState.zeros(4096), OuterState.zeros(4096, torch.float32)
    largest = torch.zeros(4096)  # each coordinate's largest |m| so far: each rounding is at most 2^-8 of one
    for _ in range(40):
        delta = torch.randn(4096, generator=g)
        outer_update(delta, low, cfg, get_codec("fp32"))
        outer_update(delta, exact, cfg, get_codec("fp32"))
        largest = torch.maximum(largest, exact.momentum.abs())
        gap = (low.momentum.float() - exact.momentum).abs()
        assert bool((gap <= largest * 2 ** -8 / (1 - mu) * 1.01 + 1e-7).all())


def test_a_payload_is_clipped_to_the_limit_and_the_excess_is_not_carried():
    cfg, codec = OuterConfig(momentum=0.0, codec="int8"), get_codec("int8", 64)
    state = OuterState.zeros(1000)
    delta = torch.linspace(-2.0, 2.0, 1000)
    payload, decoded = outer_update(delta, state, cfg, codec, limit=1.0)
    assert state.clipped == int((delta.abs() > 1.0).sum()) > 0
    assert float(decoded.abs().max()) <= 1.0
    # e holds only the codec's error of the clipped input, not the clipped-off excess
    assert float(state.error.float().abs().max()) <= float(codec.error_bound(delta.clamp(-1, 1)).max()) * 1.01
    outer_update(delta, state, cfg, codec)  # no limit: nothing clipped
    assert state.clipped == 0
