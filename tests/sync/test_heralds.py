"""Heralds (sync/heralds.py): a sponsor ranks near-copy proposals by the date it first heard of them (their signed
headers, sent ahead of the payloads), so a copy whose payload comes first takes the credit only until its original
is judged; a herald binds the content; without heralds the first payload wins, as before."""

from __future__ import annotations

import hashlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.sync.heralds import MAX_HEARD, Seen, Window, unit_of
from p2p_diloco.sync.sponsorship import RECORD, Sponsorship
from p2p_diloco.wire.vouches import slot_key, unpack_vouches

DIM = 256
AT = torch.arange(DIM)


def _id(name: str, seq: int = 1) -> bytes:
    return hashlib.sha256(f"{name}/{seq}".encode()).digest()


def _sponsor() -> tuple[Sponsorship, torch.Tensor, torch.Generator]:
    s = Sponsorship(("s1", "s2"), self_id="s1")
    g = torch.Generator().manual_seed(0)
    own = torch.randn(DIM, generator=g)
    s.merged("s1", 1, own, own, at=AT, now=0.0)  # the direction proposals are judged by
    return s, own, g


def _propose(s: Sponsorship, author: str, step: torch.Tensor, now: float, seq: int = 1,
             uid: bytes | None = None) -> None:
    s.merged(author, seq, step, step, at=AT, update_id=uid or _id(author, seq), now=now)
    s.judge()  # at once, in the order the payloads came (a phase's end judges what merged during it the same way)


def test_a_copy_whose_payload_comes_first_gives_its_credit_to_the_original_heard_first() -> None:
    s, own, g = _sponsor()
    original = own + 0.5 * torch.randn(DIM, generator=g)
    copy = original + 0.01 * torch.randn(DIM, generator=g)  # a near copy: another identity, another payload
    s.heard("volunteer", 1, _id("volunteer"), now=1.0)  # its herald left ahead of its payload
    s.heard("copier", 1, _id("copier"), now=1.2)  # the copier could herald only once it held the payload
    _propose(s, "copier", copy, now=1.5)  # ... but its payload came first: judged, credited for now
    assert s.judged[("copier", 1)][0] > 0.5
    _propose(s, "volunteer", original, now=2.0)
    assert s.judged[("volunteer", 1)][0] > 0.5 and s.judged[("copier", 1)] == (0.0, 0.0)
    s.vouched("s2", [(slot_key("", "copier", 1), 0.9)])  # another sponsor that credited the copy first
    assert s.records.marks("copier")[1] == 0.0 and s.records.marks("volunteer")[1] > 0.5  # no vouch restores the copy's
    relayed = s.relay()
    assert relayed.step is not None
    assert float(torch.nn.functional.cosine_similarity(relayed.step, copy, 0)) > 0.999  # the work, relayed once
    assert [k for k, _ in unpack_vouches(relayed.vouches)] == [slot_key("", "volunteer", 1)]  # in its name
    assert s.relayed["volunteer"] > 0.3 and "copier" not in s.relayed


def test_copiers_that_win_every_payload_race_never_graduate() -> None:
    s, own, g = _sponsor()
    for seq in range(1, RECORD + 3):
        original = own + 0.5 * torch.randn(DIM, generator=g)
        t = 10.0 * seq
        s.heard("volunteer", seq, _id("volunteer", seq), now=t)
        s.heard("copier", seq, _id("copier", seq), now=t + 0.2)
        _propose(s, "copier", original + 0.01 * torch.randn(DIM, generator=g), now=t + 0.5, seq=seq)
        _propose(s, "volunteer", original, now=t + 1.0, seq=seq)
        s.relay()
    assert s.graduates == ["volunteer"]
    assert s.judged[("volunteer", RECORD + 1)][1] > 0  # relayed as a member's from its (RECORD + 1)th


def test_without_heralds_the_first_payload_wins_as_before() -> None:
    s, own, g = _sponsor()
    original = own + 0.5 * torch.randn(DIM, generator=g)
    _propose(s, "copier", original + 0.01 * torch.randn(DIM, generator=g), now=1.5)
    _propose(s, "volunteer", original, now=2.0)
    assert s.judged[("copier", 1)][0] > 0.5 and s.judged[("volunteer", 1)][0] == 0.0


def test_a_herald_binds_the_content_a_slot_claimed_early_cannot_be_filled_with_a_copy() -> None:
    s, own, g = _sponsor()
    original = own + 0.5 * torch.randn(DIM, generator=g)
    s.heard("copier", 1, _id("a payload it did not have yet"), now=0.5)  # claims the slot before anyone
    s.heard("volunteer", 1, _id("volunteer"), now=1.0)
    _propose(s, "copier", original + 0.01 * torch.randn(DIM, generator=g), now=1.5)  # not what it heralded: dated now
    _propose(s, "volunteer", original, now=2.0)
    assert s.judged[("volunteer", 1)][0] > 0.5 and s.judged[("copier", 1)][0] == 0.0


def test_a_herald_dates_a_proposal_by_the_earlier_of_the_herald_and_the_merge() -> None:
    s, _, _ = _sponsor()
    assert s.heralds.priority("late", 1, _id("late"), now=3.0) == 3.0  # never heralded: its merge
    s.heard("late", 1, _id("late"), now=4.0)  # a herald that came after its payload (another path) moves nothing
    assert s.heralds.priority("late", 1, _id("late"), now=3.0) == 3.0
    s.heard("early", 1, _id("early"), now=1.0)
    assert not s.heralds.heard("early", 1, _id("early"), now=0.5)  # the first heard counts
    assert s.heralds.priority("early", 1, _id("early"), now=3.0) == 1.0
    assert s.heralds.priority("early", 1, _id("other content"), now=3.0) == 3.0


def test_a_copy_of_a_sponsors_update_earns_nothing_whatever_its_herald_says() -> None:
    s, own, g = _sponsor()
    theirs = own + 0.5 * torch.randn(DIM, generator=g)  # sponsor s2's next update, which s1 has not merged yet
    s.heard("copier", 1, _id("copier"), now=1.0)  # heralded before s2's payload reached us: sponsors do not herald
    _propose(s, "copier", theirs + 0.01 * torch.randn(DIM, generator=g), now=1.5)
    assert s.judged[("copier", 1)][0] > 0.5  # nothing to compare it with yet
    s.merged("s2", 1, theirs, theirs, at=AT, now=2.0)
    assert s.judged[("copier", 1)] == (0.0, 0.0) and s.records.marks("copier")[1] == 0.0  # its credit taken back
    s.relay()  # a new round
    again = own + 0.5 * torch.randn(DIM, generator=g)
    s.heard("copier", 2, _id("copier", 2), now=2.5)  # its herald beat s2's payload here ...
    s.merged("s2", 2, again, again, at=AT, now=3.0)
    _propose(s, "copier", again + 0.01 * torch.randn(DIM, generator=g), now=3.5, seq=2)  # ... its payload did not
    assert s.judged[("copier", 2)] == (0.0, 0.0) and not s.graduated("copier")


def test_a_flood_of_heralds_cannot_push_out_a_proven_authors_and_a_stranger_pushes_out_only_its_own() -> None:
    s, own, g = _sponsor()
    _propose(s, "volunteer", own + 0.5 * torch.randn(DIM, generator=g), now=1.0)  # judged useful once here
    s.relay()
    s.heard("volunteer", 2, _id("volunteer", 2), now=2.0)
    s.heard("newcomer", 1, _id("newcomer"), now=2.0)
    for seq in range(1, 50):  # one stranger heralding many seqs keeps its last MAX_PER_STRANGER
        s.heard("chatty", seq, _id("chatty", seq), now=2.1)
    assert s.heralds.priority("newcomer", 1, _id("newcomer"), now=9.0) == 2.0
    assert s.heralds.priority("chatty", 1, _id("chatty", 1), now=9.0) == 9.0  # its oldest forgotten
    assert s.heralds.priority("chatty", 49, _id("chatty", 49), now=9.0) == 2.1
    for k in range(MAX_HEARD + 10):  # a crowd of fresh identities, one herald each
        s.heard(f"crowd{k}", 1, _id(f"crowd{k}"), now=2.2)
    assert len(s.heralds) <= 2 * MAX_HEARD
    # the proven volunteer is still dated by its herald: a copy whose payload came first gives the credit back
    original = own + 0.5 * torch.randn(DIM, generator=g)
    s.heard("copier", 2, _id("copier", 2), now=2.5)
    _propose(s, "copier", original + 0.01 * torch.randn(DIM, generator=g), now=3.0, seq=2)
    _propose(s, "volunteer", original, now=3.5, seq=2)
    assert s.judged[("volunteer", 2)][0] > 0.5 and s.judged[("copier", 2)] == (0.0, 0.0)
    # what is left open: a newcomer's first herald shares the strangers' table with the crowd, and is pushed out
    assert s.heralds.priority("newcomer", 1, _id("newcomer"), now=9.0) == 9.0


def test_a_copy_relayed_before_its_original_came_gives_its_credit_over_in_the_next_round() -> None:
    s, own, g = _sponsor()
    original = own + 0.5 * torch.randn(DIM, generator=g)
    s.heard("volunteer", 1, _id("volunteer"), now=1.0)
    s.heard("copier", 1, _id("copier"), now=1.2)
    _propose(s, "copier", original + 0.01 * torch.randn(DIM, generator=g), now=1.5)  # its payload came first...
    first = s.relay()  # ... and went out in this round's relay, before the original reached us
    assert first.step is not None and s.relayed["copier"] > 0.3
    _propose(s, "volunteer", original, now=2.0)  # the original, dated first by its herald, in the next round
    assert s.records.marks("copier")[1] == 0.0 and s.records.marks("volunteer")[1] > 0.5  # the credit passes over
    assert s.relay().step is None  # its work went out through the copy: not relayed twice
    # a copy of the last round's work is still a copy; an author's own earlier work is no original it copies
    again = own + 0.5 * torch.randn(DIM, generator=g)
    _propose(s, "volunteer", again, now=3.0, seq=2)
    s.relay()
    _propose(s, "replayer", again + 0.01 * torch.randn(DIM, generator=g), now=4.0)
    assert s.judged[("replayer", 1)] == (0.0, 0.0)
    steady = own + 0.5 * torch.randn(DIM, generator=g)
    _propose(s, "steady", steady, now=5.0)
    s.relay()
    _propose(s, "steady", steady + 0.01 * torch.randn(DIM, generator=g), now=6.0, seq=2)
    assert s.judged[("steady", 2)][0] > 0.5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "copy", "keep", "trim", "credit"]), st.integers(0, 2**16)),
                max_size=60))
def test_the_window_finds_exactly_the_near_copies_a_loop_over_its_entries_finds(ops: list[tuple[str, int]]) -> None:
    """Window (one matrix of samples) against the list it replaced, through appends, compactions and credit changes:
    the same entries, and for every query the same near ones (all `race` reads of a window besides its entries)."""
    window, naive = Window(), []
    g = torch.Generator().manual_seed(0)
    for op, arg in ops:
        if op in ("append", "copy"):
            base = naive[arg % len(naive)].unit if op == "copy" and naive else torch.randn(16, generator=g)
            unit = unit_of(base + 0.05 * torch.randn(16, generator=g))
            assert unit is not None
            slot = ("a", arg) if arg % 3 else None
            seen = Seen(unit, float(arg % 7), slot, sponsor=arg % 5 == 0, author=f"a{arg % 4}")
            window.append(seen)
            naive.append(seen)
        elif op == "keep":
            which = [i for i in range(len(naive)) if (arg >> (i % 16)) & 1]
            window.keep(which)
            naive = [naive[i] for i in which]
        elif op == "trim":
            window.trim(arg % 8)
            naive = naive[len(naive) - min(len(naive), arg % 8):]
        elif naive:
            i = arg % len(naive)
            naive[i] = naive[i]._replace(slot=None)
            window[i] = window[i]._replace(slot=None)
        query = unit_of(torch.randn(16, generator=g) if not naive or arg % 2 else naive[-1].unit)
        assert query is not None
        assert window.seen == naive
        assert window.near(query, 0.9) == [i for i, seen in enumerate(naive)
                                           if abs(float(torch.dot(seen.unit, query))) >= 0.9]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 12), st.lists(st.integers(-1, 30), min_size=1, max_size=12), st.integers(0, 2**16))
def test_nears_of_a_batch_are_what_near_finds_as_each_is_appended_in_turn(old: int, batch: list[int],
                                                                           seed: int) -> None:
    """A sponsor judges a phase's proposals at once (`Window.nears`): for each, the entries near it once every one
    before it is in the window, as one call of `near` per proposal after appending the ones before finds them.
    Batches mix fresh units (-1) and near copies of an earlier entry or an earlier unit of the batch."""
    g = torch.Generator().manual_seed(seed)
    window, units = Window(), []
    for i in range(old):
        window.append(Seen(unit_of(torch.randn(16, generator=g)), float(i), None))  # type: ignore[arg-type]
    for pick in batch:
        pool = [s.unit for s in window.seen] + units
        base = pool[pick % len(pool)] if pick >= 0 and pool else torch.randn(16, generator=g)
        unit = unit_of(base + 0.05 * torch.randn(16, generator=g))
        assert unit is not None
        units.append(unit)
    found = window.nears(torch.stack(units), 0.9)
    for unit, nearby in zip(units, found):
        assert nearby == window.near(unit, 0.9)
        window.append(Seen(unit, 0.0, None))
