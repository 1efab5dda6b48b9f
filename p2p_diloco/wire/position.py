"""Where an update's phase read its data (wire/envelope.py `UpdateHeader.data`): what a judge needs to redraw the
batches the update was trained on (train/fit.py)."""

from __future__ import annotations

from typing import NamedTuple

_MAX_INT = 2**63 - 1


class DataPosition(NamedTuple):
    """The data an update's phase trained on: inner steps `first_step .. first_step + steps - 1` of the author's
    stream, file shard `shard` of `num_shards`, salted by the author's PeerID (`salted` 1) or not (0). A unit's
    batches are a pure function of these (train/data/corpus.py `ShardSampler.batch`), so anyone holding the run's
    data can redraw them: what a fit judge reads (train/fit.py)."""

    first_step: int
    steps: int
    shard: int
    num_shards: int
    salted: int


def position_error(data: tuple[int, ...]) -> str:
    """Why `data` is no `DataPosition` ("" if it is one); the values are a remote peer's word."""
    if len(data) != len(DataPosition._fields) or any(type(x) is not int or not 0 <= x <= _MAX_INT for x in data):
        return f"must be {len(DataPosition._fields)} ints in [0, 2**63), got {len(data)} values"
    p = DataPosition(*data)
    if p.steps < 1 or p.num_shards < 1 or p.shard >= p.num_shards or p.salted > 1:
        return "must have steps >= 1, 0 <= shard < num_shards and salted 0 or 1"
    return ""
