"""A sponsor's records of the authors whose proposals it judged: who has graduated (sync/sponsorship.py
"Graduation"). Each record is the sponsor's own, so graduation needs no agreement between replicas."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


def bounded(table: OrderedDict[Any, Any], key: Any, value: Any, limit: int) -> None:
    """table[key] = value as the most recent entry, the least recent dropped beyond `limit`."""
    table.pop(key, None)
    table[key] = value
    while len(table) > limit:
        table.popitem(last=False)


class Records:
    """Per author, the best value this sponsor (or another's vouch) gave each of its latest proposals. An author
    whose last `record` proposals were each worth at least `proven` is a graduate; a slot that lost its credit to
    the original it copied is disowned, and no vouch restores it. At most `limit` authors (the least recent drop)."""

    def __init__(self, record: int, proven: float, limit: int) -> None:
        self.record, self.proven, self.limit = record, proven, limit
        self._marks: OrderedDict[str, dict[int, float]] = OrderedDict()  # author -> seq -> best value
        self._disowned: OrderedDict[tuple[str, int], bool] = OrderedDict()

    def graduated(self, author: str, before: int | None = None) -> bool:
        """The author's last `record` proposals (before seq `before`) were judged useful."""
        marks = self._marks.get(author, {})
        latest = sorted(seq for seq in marks if before is None or seq < before)[-self.record:]
        return len(latest) == self.record and all(marks[seq] >= self.proven for seq in latest)

    @property
    def graduates(self) -> list[str]:
        return [a for a in self._marks if self.graduated(a)]

    def marks(self, author: str) -> dict[int, float]:
        """The author's remembered proposals: seq -> the best value given to it."""
        return dict(self._marks.get(author, {}))

    def useful(self, author: str) -> bool:
        """Any of the author's remembered proposals was judged useful."""
        return any(v >= self.proven for v in self._marks.get(author, {}).values())

    def note(self, author: str, seq: int, value: float) -> None:
        """Per slot the best value given to it (a slot this sponsor lost to a copy's race may still be vouched for
        by another), the latest few slots."""
        if (author, seq) in self._disowned:  # a copy that lost its credit to its original: no vouch restores it
            return
        marks = self._marks.get(author, {})
        marks[seq] = max(value, marks.get(seq, 0.0))
        bounded(self._marks, author, {k: marks[k] for k in sorted(marks)[-self.record - 2:]}, self.limit)

    def disown(self, author: str, seq: int) -> None:
        """A near copy whose credit went to its original: its mark is 0 and stays so."""
        bounded(self._disowned, (author, seq), True, self.limit)
        if seq in self._marks.get(author, {}):
            self._marks[author][seq] = 0.0
