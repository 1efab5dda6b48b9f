"""Sponsorship (sync/sponsorship.py): in a run with founders a sponsor merges at its own weight, anyone else's
update at 0 everywhere, and a sponsor relays what it judges useful inside its own next update: all proposals
together at most one share per sponsor update, nothing for negated work or near copies, and replicas that merged
the same updates equal whatever the order."""

from __future__ import annotations

import dataclasses
import hashlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_replica import DIM, MAX_WEIGHT, OUTER_LR, FnCodec, decode, theta0

from p2p_diloco.config import OuterConfig
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.sponsorship import Sponsorship
from p2p_diloco.sync.standing import Standing
from p2p_diloco.sync.types import MergeOutcome
from p2p_diloco.train.outer import OuterState, outer_update, relay_payload
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import UpdateHeader
from p2p_diloco.wire.vouches import unpack_vouches
from tests.helpers.fakes import FakeUpdate

SPONSORS = ("s1", "s2")


@dataclasses.dataclass(frozen=True)
class Signed(FakeUpdate):
    """A fake update with the header field the sponsorship reads (a sponsor's relayed values)."""

    header: UpdateHeader | None = None


def update(sender: str, seq: int, payload: torch.Tensor, vouches: bytes = b"") -> Signed:
    uid = hashlib.sha256(f"{sender}/{seq}/{payload.sum().item()}".encode()).digest()
    header = UpdateHeader("run", "spec", sender, seq, 0, 0, 1.0, "int8", DIM, 0, bytes(32), 0.0, vouches)
    return Signed(sender, seq, uid, 1.0, tuple(payload.tolist()), 4 * DIM, header=header)


def sponsored_replica(self_id: str) -> Replica:
    standing = Standing(probation=1.0, min_agreement=-1.0, max_norm_ratio=0.0, self_id=self_id, sponsors=SPONSORS)
    return Replica(theta0(), outer_lr=OUTER_LR, max_weight=MAX_WEIGHT, codec=FnCodec(decode), standing=standing)


def test_proposals_merge_at_zero_and_a_sponsor_relays_one_share_for_all_of_them() -> None:
    s1 = sponsored_replica("s1")
    g = torch.Generator().manual_seed(0)
    own = torch.randn(DIM, generator=g)
    assert s1.offer(update("s1", 1, own))[0] is MergeOutcome.MERGED
    before = s1.theta.clone()
    honest = [update(f"n{i}", 1, own + 2.0 * torch.randn(DIM, generator=g)) for i in range(20)]
    negated = update("neg", 1, -own)
    for u in [*honest, negated]:
        assert s1.offer(u)[0] is MergeOutcome.MERGED  # merged: V has it, at weight 0
    torch.testing.assert_close(s1.theta, before)
    step, vouches, share = s1.relay()
    values = dict(unpack_vouches(vouches))
    assert sum(values.values()) <= 1.0 + len(values) / 65535  # one share for all of them
    assert negated.update_id[:16] not in values and len(values) >= 15
    expected = sum(values[u.update_id[:16]] * OUTER_LR * torch.tensor(u.payload) for u in honest
                   if u.update_id[:16] in values) / len(SPONSORS)
    torch.testing.assert_close(step, expected, rtol=1e-3, atol=1e-6)  # theta's units, 1/S of the values
    assert abs(share - min(1.0, sum(values.values())) / len(SPONSORS)) < 1e-3  # they displace that much of its own
    assert s1.relay() == (None, b"", 0.0)  # drained: each proposal is relayed once


def test_near_copies_of_this_rounds_work_get_nothing_and_longer_ones_are_scaled_to_a_sponsor_updates_length() -> None:
    s = Sponsorship(SPONSORS, self_id="s1")
    g = torch.Generator().manual_seed(1)
    own, other = torch.randn(512, generator=g), torch.randn(512, generator=g)
    s.merged("s1", b"\x01" * 32, own, own)
    s.merged("s2", b"\x02" * 32, other, other)  # another sponsor's work this round
    s.merged("copier", b"\x03" * 32, other + 0.05 * torch.randn(512, generator=g), other)  # its near copy
    s.merged("long", b"\x04" * 32, 3 * (own + other), 3 * (own + other))
    _, vouches, _ = s.relay()
    (key, value), = unpack_vouches(vouches)
    assert key == b"\x04" * 16
    length = (float(own.norm()) + float(other.norm())) / 2  # one sponsor update's length, not the sum's
    assert abs(value - length / float((3 * (own + other)).norm())) < 1e-3  # along the sponsors' sum (FLTrust)


def test_a_sponsors_relay_displaces_part_of_its_own_step_and_skips_the_momentum() -> None:
    cfg = OuterConfig()
    step = torch.full((8,), 0.3)
    extra, vouches, own = relay_payload((step.clone(), b"v", 0.5), 0.5, cfg)
    assert own == 1 / 1.5 and vouches == b"v"
    torch.testing.assert_close(extra * cfg.outer_lr * 0.5, step / 1.5)  # merged at outer_lr * w: step / (1 + t)
    assert relay_payload((None, b"", 0.0), 0.5, cfg) == (None, b"", 1.0)
    assert relay_payload((step, b"v", 0.5), 0.0, cfg)[0] is None
    state, codec = OuterState.zeros(8), get_codec("fp32")
    delta = torch.ones(8)
    payload, decoded = outer_update(delta, state, cfg, codec, extra=torch.full((8,), 2.0), own_share=0.5)
    plain, _ = outer_update(delta, OuterState.zeros(8), cfg, codec)
    expected = 0.5 * codec.decompress(plain, 8) + 2.0
    torch.testing.assert_close(decoded, expected)
    torch.testing.assert_close(state.momentum.float(), torch.ones(8))  # the momentum saw its own work alone


@settings(max_examples=30, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(1, 5))
def test_replicas_merging_one_set_in_any_order_are_equal(rng, proposals) -> None:
    """A proposal's weight is 0 and a sponsor's its own, wherever and whenever they merge: replicas that merged
    one set are equal, whatever came first (no verdict can arrive late)."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    everything = [update(f"n{i}", 1, torch.randn(DIM, generator=g)) for i in range(proposals)]
    sponsors = [update("s1", 1, torch.randn(DIM, generator=g), b"\x00" * 18),
                update("s2", 1, torch.randn(DIM, generator=g))]
    everything += sponsors
    thetas = []
    for self_id in ("s1", "x"):
        r = sponsored_replica(self_id)
        order = list(everything)
        rng.shuffle(order)
        for u in order:
            assert r.offer(u)[0] is MergeOutcome.MERGED
        thetas.append(r.theta.clone())
    expected = theta0() - OUTER_LR * sum(torch.tensor(s.payload) for s in sponsors)
    torch.testing.assert_close(thetas[0], thetas[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(thetas[0], expected, rtol=0, atol=1e-5)


def test_a_proposal_that_signs_itself_more_weight_is_relayed_no_longer_than_a_sponsor_step() -> None:
    """Lengths are compared as steps (the signed weight included), not as payloads: a proposal signing the run's
    largest weight (4x the sponsor's) along the sponsor's direction gets no more than one sponsor step's length,
    over S."""
    s1 = sponsored_replica("s1")
    g = torch.Generator().manual_seed(3)
    own = torch.randn(DIM, generator=g)
    mine = dataclasses.replace(update("s1", 1, own), weight=0.5)
    assert s1.offer(mine)[0] is MergeOutcome.MERGED
    greedy = dataclasses.replace(update("g", 1, own + 0.5 * torch.randn(DIM, generator=g)), weight=MAX_WEIGHT)
    assert s1.offer(greedy)[0] is MergeOutcome.MERGED
    step, _, _ = s1.relay()
    own_step = OUTER_LR * 0.5 * own
    assert float(step.norm()) <= float(own_step.norm()) / len(SPONSORS) * 1.001
    assert float(step.norm()) > 0.5 * float(own_step.norm()) / len(SPONSORS)  # relayed (at its cosine's share)
