"""Merge weight earned by contribution (sync/standing.py): probation by seq is exact on every replica, vetting
refuses sign-flipped and scaled payloads and leaves honest-looking ones alone, a crowd adds nothing to the
swarm's size or the votes, and every table stays bounded whatever the number of identities."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_replica import DIM, MAX_WEIGHT, OUTER_LR, FakeUpdate, FnCodec, decode, make, theta0  # the same fakes

from p2p_diloco.sync.authors import DISTRUST_STRIKES, MAX_DISTRUSTED, MAX_STANDING
from p2p_diloco.sync.probation import probation_multiplier
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.standing import Standing
from p2p_diloco.sync.types import MergeOutcome


def standing(**kwargs: object) -> Standing:
    args: dict = dict(probation=0.25, min_agreement=-0.25, max_norm_ratio=3.0, copy_cosine=0.0, self_id="me")
    args.update(kwargs)
    return Standing(**args)


def direction(seed: int, base: torch.Tensor | None = None, noise: float = 0.3) -> torch.Tensor:
    """An 'honest' payload: a shared direction plus noise (cosine ~0.95 with the direction)."""
    g = torch.Generator().manual_seed(seed)
    base = base if base is not None else torch.ones(DIM)
    return base + noise * torch.randn(DIM, generator=g)


def replica_with_standing(**kwargs: object) -> Replica:
    return Replica(theta0(), outer_lr=OUTER_LR, max_weight=MAX_WEIGHT, codec=FnCodec(decode),
                   standing=standing(**kwargs))


def test_probation_doubles_to_full_weight_by_the_third_update() -> None:
    assert [probation_multiplier(k, 0.25) for k in (1, 2, 3, 4, 100)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    assert probation_multiplier(1, 1.0) == 1.0
    assert probation_multiplier(1, 0.01) == 0.01 and probation_multiplier(8, 0.01) == 1.0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 4)), min_size=1, max_size=12, unique=True),
       st.randoms(use_true_random=False))
def test_replicas_merging_one_set_in_any_order_stay_equal_under_probation(slots, rng) -> None:
    """Probation depends on the signed seq only, so the merge rule stays exact (the invariant of equal replicas);
    honest-looking payloads are never refused, so vetting changes nothing here either."""
    updates = [make(s, q, 1.0, payload=direction(hash((s, q)) % 1000).tolist()) for s, q in slots]
    # every sender's seqs from 1 up, so nothing waits for a gap
    updates += [make(s, q, 1.0, payload=direction(7 * q).tolist())
                for s in {s for s, _ in slots} for q in range(1, max(q for t, q in slots if t == s))
                if (s, q) not in slots]
    a, b = replica_with_standing(), replica_with_standing()
    for u in sorted(updates, key=lambda u: (u.sender, u.seq)):
        assert a.offer(u)[0] is MergeOutcome.MERGED
    shuffled = list(updates)
    rng.shuffle(shuffled)
    for u in shuffled:
        b.offer(u)
    assert a.version_vector == b.version_vector
    torch.testing.assert_close(a.theta, b.theta, rtol=0, atol=1e-5)
    expected = theta0().double()
    for u in updates:
        expected -= OUTER_LR * 1.0 * probation_multiplier(u.seq, 0.25) * torch.tensor(u.payload).double()
    torch.testing.assert_close(a.theta, expected.float(), rtol=0, atol=1e-5)


def _with_reference(s: Standing, n: int = 4) -> None:
    for i in range(n):  # our own updates are the first reference (good standing: seqs 3 and 4 at full weight)
        delta = direction(100 + i)
        s.observe("me", delta, s.judge("me", i + 1, delta), now=float(i), seq=i + 1)


@pytest.mark.parametrize("attack, reason", [(lambda d: -d, "disagrees"), (lambda d: 5 * d, "too_long")])
def test_sign_flipped_and_scaled_payloads_are_refused_then_their_author_distrusted(attack, reason) -> None:
    s = standing()
    _with_reference(s)
    for k in range(1, DISTRUST_STRIKES + 1):
        verdict = s.judge("evil", 10 + k, attack(direction(k)))
        assert verdict.multiplier == 0 and verdict.reason == reason, verdict
        s.observe("evil", attack(direction(k)), verdict, now=10.0 + k)
    assert "evil" in s.distrusted
    honest_looking = direction(99)  # once distrusted, even a good-looking update counts nothing
    assert s.judge("evil", 20, honest_looking).multiplier == 0


def test_one_refusal_costs_that_update_only() -> None:
    """An honest sender's rare borderline update must not cost it the run: strikes reset once two good updates in
    a row prove its own work (not on any merge: a copy that beat its original would reset them too)."""
    s = standing()
    _with_reference(s)
    for k in range(3 * DISTRUST_STRIKES):
        delta = -direction(k) if k % 3 == 0 else direction(k)
        s.observe("noisy", delta, s.judge("noisy", 10 + k, delta), now=10.0 + k, seq=10 + k)
    assert "noisy" not in s.distrusted
    s2 = standing()
    _with_reference(s2)
    for k in range(2 * DISTRUST_STRIKES):  # every other update refused: never two good ones in a row
        delta = -direction(k) if k % 2 == 0 else direction(k)
        s2.observe("flaky", delta, s2.judge("flaky", 10 + k, delta), now=10.0 + k, seq=10 + k)
    assert "flaky" in s2.distrusted
    assert s.judge("noisy", 50, direction(50)).multiplier == 1.0


def test_honest_looking_updates_pass_and_earn_standing_and_votes() -> None:
    s = standing()
    assert s.judge("b", 1, direction(1)).reason == "probation"  # no reference yet: probation only, unvetted
    s.observe("b", direction(1), s.judge("b", 5, direction(1)), now=0.0)
    assert "b" not in s.proven(now=0.0, window_s=10)  # full weight but unvetted: no vote
    _with_reference(s)
    for k, seq in enumerate((6, 7)):
        verdict = s.judge("b", seq, direction(k))
        assert verdict.multiplier == 1.0 and verdict.vetted and verdict.agreement > 0.5
        s.observe("b", direction(k), verdict, now=5.0, seq=seq)
        assert ("b" in s.authors.good) == (seq == 7)  # two full-weight updates in a row
    assert s.proven(now=10.0, window_s=10) == {"b", "me"}
    assert s.proven(now=100.0, window_s=10) == set()  # votes are for recent contributors only


def test_a_refused_crowd_adds_nothing_to_the_swarm_size() -> None:
    s = standing()
    _with_reference(s)
    for seq in (8, 9):  # one honest peer in good standing
        s.observe("b", direction(seq), s.judge("b", seq, direction(seq)), now=3.0, seq=seq)
    s.observe("new", direction(6), s.judge("new", 1, direction(6)), now=3.0)  # one newcomer on its 1st update
    for i in range(200):
        delta = -direction(1000 + i)
        s.observe(f"sybil{i}", delta, s.judge(f"sybil{i}", 40, delta), now=3.0)
    # me 1 + b 1 + the newcomer's next update (at 0.5); the 200 sybils nothing
    assert s.swarm_size(now=4.0, window_s=10) == pytest.approx(2.5)
    assert s.proven(now=4.0, window_s=10) == {"me", "b"}


def test_tables_stay_bounded_whatever_the_number_of_identities(monkeypatch) -> None:
    """The bounds are module constants (2**16 and 2**14); at 1/64 of them, 16x as many identities as fit."""
    import p2p_diloco.sync.authors as module

    monkeypatch.setattr(module, "MAX_DISTRUSTED", MAX_DISTRUSTED // 64)
    monkeypatch.setattr(module, "MAX_STANDING", MAX_STANDING // 64)
    s = standing()
    _with_reference(s)
    bad, good = -direction(1), direction(2)
    rng = random.Random(0)
    for i in range(16 * MAX_STANDING // 64):
        delta = bad if rng.random() < 0.5 else good
        sender = f"id{i}"
        for seq in range(3, 3 + rng.choice((1, DISTRUST_STRIKES))):  # some strike out, some stay on a strike
            s.observe(sender, delta, s.judge(sender, seq, delta), now=float(i), seq=seq)
    assert len(s.recent) <= MAX_STANDING // 64 and s.authors.good <= set(s.recent)
    assert len(s.authors.strikes) <= MAX_DISTRUSTED // 64 and len(s.distrusted) <= MAX_DISTRUSTED // 64
    assert len(s.distrusted) > 0 and len(s.authors.good) > 0


def test_take_back_removes_exactly_what_a_probation_merge_added() -> None:
    """`unmerge` (equivocation repair) must subtract the update at the multiplier it earned when it merged."""
    r = replica_with_standing()
    first = make("x", 1, 1.0, payload=direction(3).tolist())
    assert r.offer(first)[0] is MergeOutcome.MERGED
    assert r.unmerge(first)
    torch.testing.assert_close(r.theta, theta0(), rtol=0, atol=1e-6)


def test_noise_at_an_honest_length_never_gets_a_weight() -> None:
    """No single-update test refuses a random direction (its cosine is ~0, above min_agreement); its average
    agreement is what keeps it out, all or nothing, so replicas that see the same updates decide alike."""
    s = standing(full_agreement=0.1)
    _with_reference(s)
    g = torch.Generator().manual_seed(5)
    weights = []
    for seq in range(3, 9):
        noise = torch.randn(DIM, generator=g)
        ref = s.reference.vector
        noise = noise - (noise @ ref) / (ref @ ref) * ref  # exactly orthogonal
        noise *= direction(seq).norm() / noise.norm()
        verdict = s.judge("noise", seq, noise)
        s.observe("noise", noise, verdict, now=float(seq))
        weights.append(verdict.multiplier)
    assert weights == [0.0] * 6, weights
    assert "noise" not in s.distrusted and s.swarm_size(now=9.0, window_s=100) == 1.0  # no strikes, no weight
    honest = direction(77)
    assert s.judge("honest", 9, honest).multiplier == 1.0 and s.judge("honest", 9, honest).average > 0.3


def test_a_joiner_merges_only_its_donors_trusted_authors_until_it_can_vet() -> None:
    """Before its own first update a joiner has no reference: without its donor's word it would merge a crowd's
    updates unvetted (at full weight past their probation) and be poisoned at once."""
    donor = standing()
    _with_reference(donor)
    donor.observe("b", direction(1), donor.judge("b", 7, direction(1)), now=1.0)
    for k in range(DISTRUST_STRIKES):
        donor.observe("evil", -direction(k), donor.judge("evil", 10 + k, -direction(k)), now=2.0)
    good, distrusted = donor.inheritance(limit=10)
    assert set(good) == {"me", "b"} and distrusted == ["evil"]

    joiner = standing(self_id="j")
    joiner.inherit(good, distrusted, known=["me", "b", "evil", "stranger"])  # the snapshot's authors
    assert joiner.judge("b", 8, direction(2)).multiplier == 1.0  # trusted by the donor: merges (unvetted)
    assert joiner.judge("evil", 13, direction(2)).multiplier == 0.0  # distrusted by the donor
    assert joiner.judge("stranger", 40, -direction(3)).reason == "unvetted"  # unknown: waits for our reference
    # A peer the snapshot held nothing of started after it was cut: the joiner sees it from its 1st update, as
    # the donor does, and merges its 3rd at full weight as the donor does (at 0 the replicas would differ).
    assert joiner.judge("late", 3, direction(6)).multiplier == 1.0
    joiner.observe("j", direction(4), joiner.judge("j", 1, direction(4)), now=3.0)  # our own first update
    assert joiner.judge("stranger", 41, direction(5)).multiplier == 1.0  # now vetted like anyone
    assert joiner.judge("stranger", 42, -direction(5)).reason == "disagrees"


def _good_authors(s: Standing, authors: list[str], seed: int = 3) -> list[torch.Tensor]:
    """A reference (our own updates) and `authors` in good standing (a full-weight update along it each)."""
    base = torch.ones(4096)
    for i in range(4):
        own = base + 0.3 * torch.randn(4096, generator=torch.Generator().manual_seed(100 + i))
        s.observe("me", own, s.judge("me", i + 1, own), now=float(i), seq=i + 1)
    g = torch.Generator().manual_seed(seed)
    for author in authors:  # an earlier update of each, then the one returned
        delta = base + 0.3 * torch.randn(4096, generator=g)
        s.observe(author, delta, s.judge(author, 4, delta), now=3.0, seq=4)
    payloads = [base + 0.3 * torch.randn(4096, generator=g) for _ in authors]  # honest pairs: cosine ~0.92
    for author, delta in zip(authors, payloads):
        s.observe(author, delta, s.judge(author, 5, delta), now=3.0, seq=5)
    assert set(authors) <= s.authors.good
    return payloads


def vetting(**kwargs: object) -> Standing:
    """The defaults' vetting: the copy test only."""
    return standing(copy_cosine=0.9999, min_agreement=-1.0, max_norm_ratio=0.0, **kwargs)


def test_copies_and_negated_copies_of_anothers_work_are_refused() -> None:
    """A crowd that computes nothing can only re-sign what others sent: scaled (x0.5..x5) or negated, it is
    the same direction on every coordinate, whatever the reference says (late in a run honest updates and their
    negations both sit near the reference's cosine 0, where no threshold on it can tell them apart)."""
    s = vetting()
    honest = _good_authors(s, ["h0", "h1", "h2", "h3"])
    g = torch.Generator().manual_seed(4)
    assert all(s.judge(f"h{k}", 6, torch.ones(4096) + 0.3 * torch.randn(4096, generator=g)).multiplier == 1.0
               for k in range(4))
    assert s.judge("crowd", 1, 3.0 * honest[1]).reason == "copy"
    assert s.judge("crowd", 1, -0.5 * honest[2]).reason == "negated_copy"
    assert s.judge("h0", 6, honest[0] * 2).multiplier == 1.0  # its own work again is no copy
    for k in range(DISTRUST_STRIKES):  # three in a row: distrusted
        s.observe("crowd", -honest[3], s.judge("crowd", 2 + k, -honest[3]), now=10.0, seq=2 + k)
    assert "crowd" in s.distrusted and s.copies_found() == []


def test_a_copy_that_beats_its_original_is_found_when_the_original_comes() -> None:
    """A fast copier's copy can reach a replica before the original: it merges (on probation), and the moment
    the original of an author in good standing merges, the copy is found (a strike) for its weight to be taken
    back, so every replica that holds both ends alike whatever the order."""
    s = vetting()
    _good_authors(s, ["h"])
    original = torch.ones(4096) + 0.3 * torch.randn(4096, generator=torch.Generator().manual_seed(9))
    early = s.judge("crowd", 1, -original)
    assert early.multiplier == 0.25  # nothing to compare with yet: probation
    s.observe("crowd", -original, early, now=5.0, seq=1)
    verdict = s.judge("h", 6, original)
    assert verdict.multiplier == 1.0
    s.observe("h", original, verdict, now=6.0, seq=6)
    assert s.copies_found() == [("crowd", 1, "negated_copy")] and s.authors.strikes["crowd"] == 1
    assert s.copies_found() == []  # drained


def test_two_newcomers_with_one_payload_both_merge_at_zero() -> None:
    """Neither author in good standing: no local fact says which is the original, so both merge at 0 (no
    strike), whichever came first, and neither earns standing by it (a scaled copy points along the reference
    as well as its original does)."""
    payload = torch.ones(4096) + 0.3 * torch.randn(4096, generator=torch.Generator().manual_seed(5))
    alone = vetting()
    _good_authors(alone, [])
    first = alone.judge("newcomer", 3, payload)
    alone.observe("newcomer", payload, first, now=1.0, seq=3)
    assert first.multiplier == 1.0 and "newcomer" not in alone.authors.good  # one update: a candidate
    alone.observe("newcomer", payload + 0.1, alone.judge("newcomer", 4, payload + 0.1), now=1.0, seq=4)
    assert "newcomer" in alone.authors.good  # two in a row, unmatched
    s = vetting()
    _good_authors(s, [])
    s.observe("crowd", 2.0 * payload, s.judge("crowd", 1, 2.0 * payload), now=1.0, seq=1)
    tie = s.judge("newcomer", 3, payload)
    assert tie.multiplier == 0.0 and tie.reason == "tied_copy"
    s.observe("newcomer", payload, tie, now=2.0, seq=3)
    assert s.copies_found() == [("crowd", 1, "tied_copy")] and not s.authors.strikes
    assert not s.authors.good & {"newcomer", "crowd"}


def _take_back_found(r: Replica, updates: dict[tuple[str, int], FakeUpdate]) -> None:
    """What Intake.take_back_copies does, with the test's updates as the store."""
    assert r.standing is not None
    for sender, seq, _ in r.standing.copies_found():
        assert r.unmerge(updates[(sender, seq)], keep_slot=True)


@settings(max_examples=30, deadline=None)
@given(st.randoms(use_true_random=False))
def test_copies_merge_at_zero_on_every_replica_whatever_the_order(rng) -> None:
    """Two honest authors in good standing, a newcomer on probation and two copiers that re-sign their work
    (negated, scaled): in any order of arrival both replicas end equal, with every copy at weight 0 and the
    honest work merged (the newcomer's copied update at 0 too: a tie)."""
    g = torch.Generator().manual_seed(11)
    pay = [(torch.ones(DIM) + 0.3 * torch.randn(DIM, generator=g)).tolist() for _ in range(15)]  # all different
    setup = [make(a, q, 1.0, payload=pay[4 * i + q - 1]) for i, a in enumerate(("me", "a", "b")) for q in (1, 2, 3, 4)]
    honest = [make("a", 5, 1.0, payload=pay[12]), make("b", 5, 1.0, payload=pay[13]),
              make("n", 1, 1.0, payload=pay[14])]
    copies = [make("x", 1, 1.0, payload=[-v for v in pay[12]]), make("x", 2, 1.0, payload=[3 * v for v in pay[13]]),
              make("y", 1, 1.0, payload=[0.5 * v for v in pay[14]])]
    everything = {(u.sender, u.seq): u for u in setup + honest + copies}
    replicas = []
    for order in (honest + copies, rng.sample(honest + copies, len(honest) + len(copies))):
        r = replica_with_standing(copy_cosine=0.9999, min_agreement=-1.0, max_norm_ratio=0.0)
        for u in setup + order:
            r.offer(u)
            _take_back_found(r, everything)
        replicas.append(r)
    a, b = replicas
    assert a.version_vector == b.version_vector
    torch.testing.assert_close(a.theta, b.theta, rtol=0, atol=1e-5)
    expected = theta0().double()
    for u in setup + honest[:2]:
        expected -= OUTER_LR * probation_multiplier(u.seq, 0.25) * torch.tensor(u.payload).double()
    torch.testing.assert_close(a.theta, expected.float(), rtol=0, atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(st.randoms(use_true_random=False))
def test_twin_updates_weigh_the_same_on_their_authors_replicas_as_on_any_other(rng) -> None:
    """Two honest peers that trained on the same batches from one theta publish one payload (twins). Each
    author's replica may get the other's twin before it merges its own, and a third replica gets them in any
    order. The author's own update is vetted like any other, so all three end equal (before, an author that
    got the twin first kept both at weight while the other tied both: replicas apart)."""
    g = torch.Generator().manual_seed(3)
    twin = (torch.ones(DIM) + 0.3 * torch.randn(DIM, generator=g)).tolist()
    other = (torch.ones(DIM) + 0.3 * torch.randn(DIM, generator=g)).tolist()
    mine, theirs, third = make("me", 1, 1.0, payload=twin), make("a", 1, 1.0, payload=twin), make("c", 1, 1.0,
                                                                                                  payload=other)
    everything = {(u.sender, u.seq): u for u in (mine, theirs, third)}
    replicas = []
    for self_id in ("me", "a", "c"):
        order = rng.sample([mine, theirs, third], 3)
        r = replica_with_standing(copy_cosine=0.9999, min_agreement=-1.0, max_norm_ratio=0.0, self_id=self_id)
        for u in order:
            r.offer(u)
            _take_back_found(r, everything)
        replicas.append(r)
    for r in replicas[1:]:
        assert r.version_vector == replicas[0].version_vector
        torch.testing.assert_close(r.theta, replicas[0].theta, rtol=0, atol=1e-6)
    assert all(r.merged_weight("me", 1) == 0.0 == r.merged_weight("a", 1) for r in replicas)  # a tie everywhere
