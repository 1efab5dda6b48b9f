"""A sponsor's records (sync/records.py): graduation after `record` useful proposals in a row, a strike breaks it,
a disowned slot stays at 0 whatever vouches for it later, and the table forgets the least recent authors."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.sync.records import Records


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12))
def test_an_author_graduates_exactly_when_its_last_record_proposals_were_each_useful(values: list[float]) -> None:
    records = Records(record=2, proven=0.1, limit=16)
    for seq, value in enumerate(values, 1):
        records.note("a", seq, value)
        expected = len(values[:seq]) >= 2 and all(v >= 0.1 for v in values[:seq][-2:])
        assert records.graduated("a") == expected
        assert records.graduated("a", before=seq + 1) == expected
    assert records.useful("a") == any(v >= 0.1 for v in values[-4:])  # the latest record + 2 slots are kept


def test_a_disowned_slot_stays_at_zero_and_the_least_recent_authors_are_forgotten() -> None:
    records = Records(record=2, proven=0.1, limit=2)
    records.note("copier", 1, 0.9)
    records.note("copier", 2, 0.9)
    assert records.graduated("copier")
    records.disown("copier", 2)
    records.note("copier", 2, 0.8)  # another sponsor's vouch for it: no
    assert records.marks("copier") == {1: 0.9, 2: 0.0} and not records.graduated("copier")
    records.note("b", 1, 0.5)
    records.note("c", 1, 0.5)
    assert records.marks("copier") == {} and records.graduates == []
