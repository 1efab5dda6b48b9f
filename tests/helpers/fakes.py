"""Stand-ins for what the sync layer reads of an update, so its rules are tested without signing or encoding."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FakeUpdate:
    """The fields `Replica`, `UpdateStore` and the resync logic read of an `OuterUpdate`; `payload` stands for
    the compressed pseudo-gradient (a codec stand-in turns it into a tensor), `nbytes` for its size on the wire."""

    sender: str
    seq: int
    update_id: bytes = b""
    weight: float = 1.0
    payload: tuple[float, ...] = ()
    nbytes: int = 0
