"""A sponsor judges proposals at coordinates only its key knows (sync/sponsorship.py `sample_at`): the copy
test's are fixed and public, and a proposal that is honest work there and an attack everywhere else was judged
honest work and relayed whole."""

from __future__ import annotations

import pytest
import torch
from test_replica import MAX_WEIGHT, OUTER_LR, FnCodec, decode

from p2p_diloco.sim.adversary import masked
from p2p_diloco.sync.copies import copy_coordinates
from p2p_diloco.sync.judged_at import TURN_EVERY, JudgedAt, Latest
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.sponsorship import Sponsorship
from p2p_diloco.sync.standing import Standing
from p2p_diloco.sync.types import MergeOutcome
from p2p_diloco.wire.identity import Identity
from p2p_diloco.wire.vouches import slot_key, unpack_vouches
from tests.helpers.fakes import FakeUpdate

SPONSORS = ("s1", "s2")
NUMEL = 40_000  # ten times the coordinates a judge reads


def test_the_secret_is_the_keys_own_and_stable() -> None:
    a, b = Identity.generate(), Identity.generate()
    again = Identity.from_protobuf(a.to_protobuf())  # the same key, loaded again (a restart)
    assert a.secret(b"judge run") == again.secret(b"judge run")
    assert len({a.secret(b"judge run"), b.secret(b"judge run"), a.secret(b"judge other-run")}) == 3
    assert 0 <= a.secret(b"judge run") < 2**62


def test_a_sponsor_reads_its_own_coordinates_drawn_again_every_few_rounds() -> None:
    public = copy_coordinates(NUMEL)
    mine, theirs = Sponsorship(SPONSORS, "s1", seed=7), Sponsorship(SPONSORS, "s2", seed=8)
    judged_at = mine.judged_at
    first = mine.sample_at(NUMEL)
    assert first is mine.sample_at(NUMEL) and first is judged_at.now(NUMEL)  # drawn once; no next ones yet
    assert bool((first[1:] >= first[:-1]).all()) and 0 <= int(first[0]) and int(first[-1]) < NUMEL  # sorted
    shared = len(set(first.tolist()) & set(public.tolist())) / len(set(first.tolist()))
    assert shared < 0.2  # about 1 in 10 by chance, as any other draw
    assert not torch.equal(first, theirs.sample_at(NUMEL))
    for _ in range(TURN_EVERY - 2):
        assert not judged_at.rotate() and mine.sample_at(NUMEL) is first
    assert not judged_at.rotate() and judged_at.turning  # the last round of the period gathers the next ones too
    both = mine.sample_at(NUMEL)
    assert torch.equal(both[:4096], first) and not torch.equal(both[4096:], first)
    assert judged_at.rotate()  # the period ends: its next coordinates are the current ones now
    assert torch.equal(judged_at.now(NUMEL), both[4096:]) and mine.sample_at(NUMEL) is judged_at.now(NUMEL)
    again = JudgedAt(7)
    again.both(NUMEL)
    for _ in range(TURN_EVERY):
        again.rotate()
    assert torch.equal(again.now(NUMEL), judged_at.now(NUMEL))  # a pure function of (seed, round)
    assert Sponsorship(SPONSORS, "s1").judged_at.seed != Sponsorship(SPONSORS, "s1").judged_at.seed  # a random one


def update(sender: str, seq: int, payload: torch.Tensor) -> FakeUpdate:
    return FakeUpdate(sender, seq, f"{sender}/{seq}".encode().ljust(32, b"."), 1.0, tuple(payload.tolist()),
                      4 * NUMEL)


@pytest.mark.parametrize("judged_at_public", [False, True])
def test_work_that_is_honest_only_where_the_copy_test_reads_is_worth_nothing(judged_at_public: bool,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer that publishes its honest work on the copy test's coordinates and that work negated on every other
    (sim/adversary.py `masked`, BENCHMARKS "Judged where nobody can aim": +7.4% negated, +44% negated x5) is worth
    nothing to a sponsor that reads its own; one that read the public coordinates valued it as the honest work."""
    if judged_at_public:
        monkeypatch.setattr(Sponsorship, "sample_at", lambda self, numel: copy_coordinates(numel))
    standing = Standing(probation=1.0, min_agreement=-1.0, max_norm_ratio=0.0, self_id="s1", sponsors=SPONSORS,
                        judge_seed=11)
    s1 = Replica(torch.zeros(NUMEL), outer_lr=OUTER_LR, max_weight=MAX_WEIGHT, codec=FnCodec(decode),
                 standing=standing)
    g = torch.Generator().manual_seed(0)
    own = torch.randn(NUMEL, generator=g)
    assert s1.offer(update("s1", 1, own))[0] is MergeOutcome.MERGED
    honest = [own + 0.5 * torch.randn(NUMEL, generator=g) for _ in range(2)]  # cosine ~0.9 with the sponsor's work
    attack = masked(honest[0], copy_coordinates(NUMEL), -1.0)
    assert float(torch.nn.functional.cosine_similarity(attack, own, dim=0)) < -0.7  # negated almost everywhere
    for u in (update("mask", 1, attack), update("vol", 1, honest[1])):
        assert s1.offer(u)[0] is MergeOutcome.MERGED
    values = dict(unpack_vouches(s1.relay().vouches))
    assert values[slot_key("", "vol", 1)] > 0.5  # honest work is valued either way
    if judged_at_public:
        assert values[slot_key("", "mask", 1)] > 0.5  # the attack, judged where it aimed, looked just as honest
    else:
        assert slot_key("", "mask", 1) not in values


@pytest.mark.parametrize("every", [1, TURN_EVERY])
def test_what_a_sponsor_compares_across_rounds_moves_to_the_new_coordinates_when_they_turn(every: int) -> None:
    """The copy window and the sponsors' latest updates are read at the next coordinates too, so a copy of last
    round's work is still a copy once the sample is drawn again, and honest work is still valued."""
    s = Sponsorship(SPONSORS, "s1", seed=3)
    s.judged_at.every = every
    g = torch.Generator().manual_seed(5)
    own = torch.randn(NUMEL, generator=g)
    work = own + 0.5 * torch.randn(NUMEL, generator=g)

    def merge(author: str, seq: int, step: torch.Tensor, now: float) -> None:
        at = s.sample_at(NUMEL)
        s.merged(author, seq, step[at], step, at=at, update_id=f"{author}/{seq}".encode(), now=now)

    for seq in range(1, every):  # the period's rounds before its last
        merge("s1", seq, own, 0.0)
        s.relay()
    merge("s1", every, own, 0.0)
    merge("vol", 1, work, 1.0)
    first = s.sample_at(NUMEL)[:4096].clone()
    s.relay()  # the period ends: new coordinates
    assert not torch.equal(s.sample_at(NUMEL)[:4096], first)
    assert s.judged[("vol", 1)][0] > 0.5
    merge("copier", 1, work + 0.01 * torch.randn(NUMEL, generator=g), 2.0)  # a copy of last round's work
    merge("next", 1, own + 0.5 * torch.randn(NUMEL, generator=g), 2.5)
    s.relay()
    assert s.judged[("copier", 1)] == (0.0, 0.0)  # found in the window at the new coordinates
    assert s.judged[("next", 1)][0] > 0.5  # judged by our latest update, read at the new coordinates


def test_a_slower_sponsors_latest_update_is_read_again_at_the_new_coordinates() -> None:
    judged_at, latest = JudgedAt(1, every=1), Latest()
    g = torch.Generator().manual_seed(2)
    fast, slow = torch.randn(NUMEL, generator=g), torch.randn(NUMEL, generator=g)
    k = judged_at.now(NUMEL).numel()
    both = judged_at.both(NUMEL)
    latest.set("fast", fast[both][:k], fast[both][k:], None, 1.0)  # gathered at both: moves without a re-read
    latest.set("slow", 2.0 * slow[both][:k], None, slow, 2.0)  # only this round's: read again from its step
    latest.set("gone", slow[both][:k], None, None, 1.0)  # neither: dropped
    judged_at.rotate()
    latest.rotate(judged_at.now(NUMEL))
    at = judged_at.now(NUMEL)
    assert torch.equal(latest.now["fast"], fast[at]) and torch.allclose(latest.now["slow"], 2.0 * slow[at])
    assert "gone" not in latest.now
