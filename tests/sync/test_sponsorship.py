"""Sponsorship (sync/sponsorship.py): in a run with founders a sponsor merges at its own weight, anyone else's
update at 0 everywhere, and a sponsor relays what it judges useful inside its own next update: all proposals
together at most one share per sponsor update, nothing for negated work or near copies, and replicas that merged
the same updates equal whatever the order."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_replica import DIM, MAX_WEIGHT, OUTER_LR, FnCodec, decode, theta0

from p2p_diloco.config import OuterConfig
from p2p_diloco.sync import sponsorship as sponsorship_module
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.sponsorship import PROVEN, Relayed, Sponsorship
from p2p_diloco.sync.standing import Standing
from p2p_diloco.sync.types import MergeOutcome
from p2p_diloco.train.outer import OuterState, outer_update, relay_payload
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import UpdateHeader
from p2p_diloco.wire.vouches import slot_key, unpack_vouches
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


def key(u: Signed) -> bytes:
    return slot_key("", u.sender, u.seq)  # what a vouch names: the slot (sponsored_replica's run is "")


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
    step, vouches, share, carried = s1.relay()
    assert carried == 0.0  # no graduate yet
    values = dict(unpack_vouches(vouches))  # what each proposal is worth, before the one-share scaling
    assert key(negated) not in values and len(values) >= 15
    # Each relayed at its value over its crowding (sync/relayed.py): 1 + its positive cosines with the others.
    relayed = [u for u in honest if key(u) in values]
    at = s1.standing.sponsorship.sample_at(DIM)  # where the sponsor read them
    units = [torch.tensor(u.payload)[at] / torch.tensor(u.payload)[at].norm() for u in relayed]
    weights = [values[key(u)] / sum(max(0.0, float(units[i] @ unit)) for unit in units) for i, u in enumerate(relayed)]
    assert all(w < values[key(u)] / 2 for w, u in zip(weights, relayed))  # they share `own`: crowded
    total = sum(weights)
    assert sum(values.values()) > 1.0  # 20 honest proposals: worth more than one share together, uncrowded
    expected = sum(w * OUTER_LR * torch.tensor(u.payload) for w, u in zip(weights, relayed)) / (
        len(SPONSORS) * max(1.0, total))
    torch.testing.assert_close(step, expected, rtol=1e-3, atol=1e-5)  # theta's units, at most 1/S of one share
    assert abs(share - min(1.0, total) / len(SPONSORS)) < 1e-4  # they displace that much of its own
    assert s1.relay() == (None, b"", 0.0, 0.0)  # drained: each proposal is relayed once


def test_near_copies_of_this_rounds_work_get_nothing_and_longer_ones_are_scaled_to_a_sponsor_updates_length() -> None:
    s = Sponsorship(SPONSORS, self_id="s1")
    g = torch.Generator().manual_seed(1)
    own, other = torch.randn(512, generator=g), torch.randn(512, generator=g)
    s.merged("s1", 1, own, own)
    s.merged("s2", 1, other, other)  # another sponsor's work this round
    s.merged("copier", 1, other + 0.05 * torch.randn(512, generator=g), other)  # its near copy
    s.merged("long", 1, 3 * (own + other), 3 * (own + other))
    vouches = s.relay().vouches
    (vouched, value), = unpack_vouches(vouches)
    assert vouched == slot_key("", "long", 1)
    length = min((float(own.norm()) + float(other.norm())) / 2, float(own.norm()))  # one update's, not the sum's
    assert abs(value - length / float((3 * (own + other)).norm())) < 1e-3  # along the sponsors' sum (FLTrust)


def test_a_sponsors_relay_displaces_part_of_its_own_step_and_skips_the_momentum() -> None:
    cfg = OuterConfig()
    step = torch.full((8,), 0.3)
    extra, vouches, own, signed = relay_payload(Relayed(step.clone(), b"v", 0.5, 0.0), 0.5, cfg)
    assert own == 1 / 1.5 and vouches == b"v" and signed == 0.5
    torch.testing.assert_close(extra * cfg.outer_lr * 0.5, step / 1.5)  # merged at outer_lr * w: step / (1 + t)
    assert relay_payload(Relayed(None, b"", 0.0, 0.0), 0.5, cfg) == (None, b"", 1.0, 0.5)
    assert relay_payload(Relayed(step, b"v", 0.5, 0.0), 0.0, cfg)[0] is None
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
    step = s1.relay().step
    own_step = OUTER_LR * 0.5 * own
    assert float(step.norm()) <= float(own_step.norm()) / len(SPONSORS) * 1.001
    assert float(step.norm()) > 0.5 * float(own_step.norm()) / len(SPONSORS)  # relayed (at its cosine's share)


def _proposal(s: Sponsorship, author: str, seq: int, step: torch.Tensor) -> None:
    s.merged(author, seq, step, step)
    s.judge()  # at once, by the sponsors' latest updates (a phase's end judges by its pseudo-gradient: below)


def test_a_proposer_with_a_useful_record_is_relayed_as_a_member_and_a_strike_breaks_the_record() -> None:
    """Graduation: after RECORD useful proposals a sponsor relays an author's next ones as a member's
    (GRADUATE_SHARE of its step, over S, outside the newcomers' share, with a weight to carry it); a negated one
    gets nothing and the author is back at a newcomer's share until RECORD more useful ones."""
    from p2p_diloco.sync.sponsorship import GRADUATE_SHARE, RECORD

    s = Sponsorship(SPONSORS, self_id="s1")
    g = torch.Generator().manual_seed(4)
    own = torch.randn(512, generator=g)
    relayed_as_member = {}
    for seq in range(1, 9):
        s.merged("s1", seq, own, own)
        work = own + torch.randn(512, generator=g)
        step = -work if seq == RECORD + 2 else work  # one strike, right after graduating
        _proposal(s, "v", seq, step)
        out = s.relay()
        relayed_as_member[seq] = s.judged[("v", seq)][1]
        if relayed_as_member[seq] > 0:
            keep = relayed_as_member[seq]
            assert abs(out.carried - keep / len(SPONSORS)) < 1e-6  # the weight units of what it carries
            assert keep <= GRADUATE_SHARE
            torch.testing.assert_close(out.step, keep * (1 + out.share) / len(SPONSORS) * work)
    assert [seq for seq, k in relayed_as_member.items() if k > 0] == [RECORD + 1, RECORD + 5, RECORD + 6]
    assert s.graduates == ["v"]


def test_a_slot_lost_to_a_copys_race_counts_by_another_sponsors_word() -> None:
    """A crowd that races copies of a volunteer's updates to one sponsor does not keep the volunteer from
    graduating there: a slot that sponsor lost to the race does not break the record, and another sponsor's vouch
    for it fills it."""
    s = Sponsorship(SPONSORS, self_id="s1")
    g = torch.Generator().manual_seed(5)
    own = torch.randn(512, generator=g)
    s.merged("s1", 1, own, own)
    first = own + torch.randn(512, generator=g)
    _proposal(s, "v", 1, first)
    s.relay()
    s.merged("s1", 2, own, own)
    second = own + torch.randn(512, generator=g)
    _proposal(s, "copier", 1, second)  # its copy arrives first: relayed at a newcomer's share
    _proposal(s, "v", 2, second)  # the original: a near copy now, relayed with nothing
    assert s.judged[("v", 2)] == (0.0, 0.0) and not s.graduated("v")
    s.vouched("s2", [(slot_key("", "v", 2), 0.4)])  # s2 got the original first
    assert s.graduated("v")
    s.relay()
    s.merged("s1", 3, own, own)
    _proposal(s, "v", 3, own + torch.randn(512, generator=g))
    assert s.judged[("v", 3)][1] > 0  # its 3rd update: relayed as a member's


def test_a_sponsor_signs_the_weight_that_carries_a_graduates_work() -> None:
    """relay_payload: the sponsor's own output scaled by 1 / (1 + t) times its weight over the signed one, the
    relayed step divided by outer_lr times the signed weight: theta moves by exactly own + relayed."""
    cfg = OuterConfig()
    relayed_step = torch.full((8,), 0.03)
    extra, _, own_share, signed = relay_payload(Relayed(relayed_step.clone(), b"", 0.25, 0.1), 0.5, cfg)
    assert signed == min(cfg.max_weight, 0.5 + 0.1 / cfg.outer_lr)
    own_out = torch.ones(8)
    moved = cfg.outer_lr * signed * (own_out * own_share + extra)
    torch.testing.assert_close(moved, cfg.outer_lr * 0.5 * own_out / 1.25 + relayed_step / 1.25)


def test_a_sponsor_relays_nothing_along_thetas_recent_moves() -> None:
    """An echo of what theta moved by over a sponsor's last phases points along the sponsors' work; but that move
    is merged already, and relaying it moves theta along it a second time. The sponsor judges a proposal by its part
    outside the span of its last ECHO moves (against the same part of its own phase's work): an echo is worth
    nothing; and it relays only that part: a proposal that redoes a move besides new work is relayed without the
    move."""
    s1 = sponsored_replica("s1")
    g = torch.Generator().manual_seed(3)
    assert s1.relay().step is None  # the first phase: theta's point the moves are measured from
    points = [s1.theta.clone()]
    for seq in (1, 2):
        for sponsor in SPONSORS:
            assert s1.offer(update(sponsor, seq, torch.randn(DIM, generator=g)))[0] is MergeOutcome.MERGED
        points.append(s1.theta.clone())
        if seq == 1:
            assert s1.relay().step is None  # nothing proposed in that phase
    moves = torch.stack([points[1] - points[2], points[0] - points[1]], dim=1)
    echo = update("echo", 1, (points[0] - points[2]) / OUTER_LR)  # both phases' moves, echoed
    fresh = torch.randn(DIM, generator=g)
    q, _ = torch.linalg.qr(moves)
    fresh -= q @ (q.T @ fresh)  # nothing of the moves in it
    new = update("new", 1, fresh + 0.5 * (points[1] - points[2]) / OUTER_LR)
    for u in (echo, new):
        assert s1.offer(u)[0] is MergeOutcome.MERGED
    own_work = fresh + 0.3 * (points[0] - points[1]) / OUTER_LR  # the sponsor's phase: new work and a redo
    step, vouches, _, _ = s1.relay(own_work)
    values = dict(unpack_vouches(vouches))
    assert key(echo) not in values and s1.standing.sponsorship.judged[("echo", 1)][0] == 0.0  # worth nothing
    assert values[key(new)] > 0.5
    total = max(1.0, sum(values.values()))
    torch.testing.assert_close(moves.T @ step, torch.zeros(2), rtol=0, atol=1e-5)  # nothing along either move
    torch.testing.assert_close(step, values[key(new)] * OUTER_LR * fresh / (len(SPONSORS) * total), rtol=1e-4,
                               atol=1e-6)  # what is left: the new work, whole


def test_a_phases_proposals_are_judged_by_the_sponsors_work_of_that_phase_too() -> None:
    """A proposer rebases onto what merges while it trains, so its work is often the round's beside the sponsor's,
    which points nearly across the round before (BENCHMARKS "What a proposal points along"): at its phase's end a
    sponsor judges the proposals merged during it by its pseudo-gradient of the phase as well as by the sponsors'
    latest updates (the larger cosine: no proposal is judged lower than by the latest alone)."""
    g = torch.Generator().manual_seed(7)
    at = torch.arange(512)
    last = torch.randn(512, generator=g)  # our update of the round before
    now = torch.randn(512, generator=g)  # our pseudo-gradient of the phase now ending: across `last`
    beside = now + 0.5 * torch.randn(512, generator=g)  # honest work of this round
    echo = last + 0.5 * torch.randn(512, generator=g)  # the round before, again
    noise = torch.randn(512, generator=g)
    judged = {}
    for current in (now, None):
        s = Sponsorship(SPONSORS, self_id="s1")
        s.merged("s1", 1, last, last, at=at)
        for author, step in (("v", beside), ("e", echo), ("n", noise)):
            s.merged(author, 1, step, step, at=at)
        assert not s.judged  # not before the phase ends
        s.relay(current=current)
        judged[current is None] = [s.judged[(a, 1)][0] for a in "ven"]
    (v, e, n), (v_latest, e_latest, n_latest) = judged[False], judged[True]
    assert v > 0.6 and v_latest < 0.15  # this round's work, judged by this round's
    assert e == e_latest > 0.6  # the round before's: what the latest updates say, no more
    assert n < 0.15 and n_latest < 0.15


def test_another_sponsors_vouch_for_the_proposal_being_judged_does_not_count_for_its_graduation() -> None:
    """A sponsor judges a phase's proposals when the phase ends, so another sponsor's vouch for one may come first:
    the record it is judged on is the one before it (an author graduates on RECORD proposals before the one relayed
    as a member's)."""
    s = Sponsorship(SPONSORS, self_id="s1")
    g = torch.Generator().manual_seed(9)
    own = torch.randn(512, generator=g)
    s.merged("s1", 1, own, own)
    _proposal(s, "v", 1, own + torch.randn(512, generator=g))  # judged useful: one in its record
    s.relay()
    second = own + torch.randn(512, generator=g)
    s.merged("v", 2, second, second)  # judged when our phase ends
    s.vouched("s2", [(slot_key("", "v", 2), 0.5)])  # s2's update, vouching for it, merged first
    s.relay()
    assert s.judged[("v", 2)][0] > PROVEN and s.judged[("v", 2)][1] == 0.0  # a proposal's share, not a member's
    assert s.graduated("v")  # from its 3rd



def test_an_echo_of_the_swarms_move_with_its_own_noise_is_worth_nothing_and_new_work_is() -> None:
    """A crowd with no compute echoes what theta just did, each identity with its own noise, at cosine 0.9 (no two
    of them near copies: sim/crowd_attacks.py `echo_noise`). That points along the sponsors' work as much as honest
    work does; once the sponsor knows theta's moves it judges what is new in a proposal, outside their span, against
    the same part of its own phase's work, and a cosine under PROVEN counts as 0: the echo and pure noise are worth
    nothing, a proposal trained beside the sponsor is worth what it was."""
    from p2p_diloco.sim.crowd_attacks import crowd_delta

    s = Sponsorship(SPONSORS, self_id="s1")
    g = torch.Generator().manual_seed(7)
    dim, at = 1024, torch.arange(1024)
    theta = torch.zeros(dim)
    shared = torch.randn(dim, generator=g)  # what every unit's gradient has in common this run
    for seq in range(1, 5):  # sponsors' phases: their updates merge and move theta; the sponsor relays each time
        before = theta.clone()
        for sponsor in SPONSORS:
            u = shared + torch.randn(dim, generator=g)
            s.merged(sponsor, seq, 0.1 * u, 0.1 * u, at=at, now=float(seq))
            theta -= 0.1 * u
        own = shared + torch.randn(dim, generator=g)
        if seq < 4:
            s.relay(theta.clone(), current=0.1 * own)
    echoes = [crowd_delta("echo_noise", own, factor=1.0, bound=float("inf"), rng=g, along=before - theta)
              for _ in range(2)]
    beside = own + 0.7 * torch.randn(dim, generator=g)  # a volunteer trained beside us this round
    noise = torch.randn(dim, generator=g)
    proposals = {"echo1": echoes[0], "echo2": echoes[1], "beside": beside, "noise": noise}
    for author, work in proposals.items():
        s.merged(author, 1, 0.1 * work, 0.1 * work, at=at, now=4.5)
    s.relay(theta.clone(), current=0.1 * own)
    assert [s.judged[(a, 1)][0] for a in ("echo1", "echo2", "noise")] == [0.0, 0.0, 0.0]
    assert s.judged[("beside", 1)][0] > 0.5
    # The judge before it knows theta's moves (its first relays) valued the echoes as highly as honest work:
    old = Sponsorship(SPONSORS, self_id="s1")
    for sponsor in SPONSORS:
        old.merged(sponsor, 4, before - theta, before - theta, at=at)
    for author, work in proposals.items():
        old.merged(author, 1, 0.1 * work, 0.1 * work, at=at)
    old.judge(0.1 * own)
    assert min(old.judged[("echo1", 1)][0], old.judged[("echo2", 1)][0]) > 0.5


def _async_rounds(s: Sponsorship, g: torch.Generator, dim: int = 1024) -> tuple[torch.Tensor, ...]:
    """Four rounds at sponsor s1 of an async run: s2 publishes each round's work, s3 runs a round behind, so theta's
    move over a phase mixes rounds and its span keeps part of this round's common direction out. (theta, our work
    of the round, s2's update of the round, the round's common direction.)"""
    at = torch.arange(dim)
    theta, source = torch.zeros(dim), torch.zeros(dim)
    rounds = [0.6 * torch.randn(dim, generator=g) for _ in range(5)]  # what a round's gradients have in common
    for seq in range(1, 5):
        for sponsor, shared in (("s2", rounds[seq]), ("s3", rounds[seq - 1])):
            u = shared + torch.randn(dim, generator=g)
            s.merged(sponsor, seq, 0.1 * u, 0.1 * u, at=at, now=float(seq))
            theta -= 0.1 * u
            if sponsor == "s2":
                source = u
        own = rounds[seq] + torch.randn(dim, generator=g)  # ours of this round, merged when we publish it
        s.merged("s1", seq, 0.1 * own, 0.1 * own, at=at, now=float(seq))
        if seq < 4:
            s.relay(theta.clone(), current=0.1 * own)
            theta -= 0.1 * own
    return theta, own, source, rounds[4]


@pytest.mark.parametrize("echo_of", [sponsorship_module.ECHO_OF, 1.01])
def test_an_echo_of_one_sponsors_update_is_worth_nothing_and_work_of_the_same_round_is_not_one(
        monkeypatch: pytest.MonkeyPatch, echo_of: float) -> None:
    """A crowd echoes one sponsor's published update with its own noise, at cosine 0.9 (sim/crowd_attacks.py
    `echo_source`). The span of theta's moves keeps part of the round's common direction out (`_async_rounds`), so
    the echo's new part points along the judge's work of the round: judged by direction alone it passes (ECHO_OF
    off: 1.01). Its new part is near that of the update it echoes: worth nothing. A volunteer's work of the same
    round is not near it."""
    from p2p_diloco.sim.crowd_attacks import crowd_delta

    monkeypatch.setattr(sponsorship_module, "ECHO_OF", echo_of)
    s = Sponsorship(("s1", "s2", "s3"), self_id="s1")
    g = torch.Generator().manual_seed(11)
    theta, own, source, shared = _async_rounds(s, g)
    echoes = [crowd_delta("echo_source", source, factor=1.0, bound=float("inf"), rng=g) for _ in range(3)]
    beside = shared + torch.randn(len(theta), generator=g)  # a volunteer's work of this round
    for i, work in enumerate([*echoes, beside]):
        s.merged(f"p{i}", 1, 0.1 * work, 0.1 * work, at=torch.arange(len(theta)), now=4.5)
    s.relay(theta.clone(), current=0.1 * own)
    values = [s.judged[(f"p{i}", 1)][0] for i in range(4)]
    assert values[3] > 0.15, values  # valued as before
    if echo_of <= 1:
        assert values[:3] == [0.0, 0.0, 0.0], values
    else:
        assert min(values[:3]) >= PROVEN, values  # what the echo test is there for


@pytest.mark.parametrize("crowded", [True, False])
def test_echoes_of_a_volunteers_proposal_carry_about_its_worth_not_the_newcomers_whole_share(
        monkeypatch: pytest.MonkeyPatch, crowded: bool) -> None:
    """A crowd with no compute echoes a late volunteer's proposal, each identity with its own noise at cosine 0.9
    (sim/crowd_attacks.py `echo_source`, dated after it). Each echo points along the judge's work nearly as well
    as the proposal, and the echo test reads only the sponsors' updates, so by value alone 30 echoes fill the
    newcomers' share with that one proposal's work (uncrowded: the rule off). Crowded (sync/relayed.py), the
    proposal and its echoes relay about what the proposal alone would; the proposal's value is unchanged."""
    from p2p_diloco.sim.crowd_attacks import crowd_delta
    from p2p_diloco.sync.relayed import Carry

    if not crowded:
        monkeypatch.setattr(Carry, "weights", lambda self: [p.value for p in self.proposals])
    relays = []
    for echoes in (0, 30):
        s = Sponsorship(("s1", "s2", "s3"), self_id="s1")
        g = torch.Generator().manual_seed(11)
        theta, own, _, shared = _async_rounds(s, g)
        volunteer = shared + torch.randn(len(theta), generator=g)
        proposals = [volunteer] + [crowd_delta("echo_source", volunteer, factor=1.0, bound=float("inf"), rng=g)
                                   for _ in range(echoes)]
        for i, work in enumerate(proposals):
            s.merged(f"p{i}", 1, 0.1 * work, 0.1 * work, at=torch.arange(len(theta)), now=4.5 + i / 100)
        relays.append(s.relay(theta.clone(), current=0.1 * own))
        assert s.judged[("p0", 1)][0] > PROVEN  # the volunteer's work is valued, echoed or not
    alone, echoed = relays
    assert 0 < alone.share < 0.5 / 3  # one proposal: its value's part of one sponsor's share
    if crowded:
        assert echoed.share < 1.5 * alone.share, (alone.share, echoed.share)
    else:
        assert echoed.share > 0.99 / 3, (alone.share, echoed.share)  # the whole share: what the rule is there for
