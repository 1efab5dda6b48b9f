"""The names the replica, its buffer, the store and the intake share: what an update must offer, and the
outcomes of offering one (ARCHITECTURE.md, "Invariants"). A leaf module, so none of them imports another for
its types."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from torch import Tensor

from p2p_diloco.wire.codecs import Payload


class UpdateLike(Protocol):
    """What the replica needs from an outer update (the wire envelope satisfies it)."""

    @property
    def sender(self) -> str: ...
    @property
    def seq(self) -> int:
        """>= 1, contiguous per sender, starting at 1."""
    @property
    def update_id(self) -> bytes:
        """Digest of the signed header: two different messages with the same (sender, seq) differ here."""
    @property
    def weight(self) -> float: ...
    @property
    def nbytes(self) -> int:
        """Size on the wire."""
    @property
    def payload(self) -> Payload:
        """The compressed tensor, decoded by the run's codec."""


class MergeOutcome(str, Enum):
    MERGED = "merged"
    BUFFERED = "buffered"
    DUPLICATE = "duplicate"
    EQUIVOCATION = "equivocation"
    REJECTED_LAYOUT = "bad_layout"
    REJECTED_NONFINITE = "rejected_nonfinite"
    REJECTED_NORM = "norm_bound"
    REJECTED_INVALID = "rejected_invalid"
    REJECTED_BUFFER_FULL = "rejected_buffer_full"
    REJECTED_BANNED = "rejected_banned"


@dataclass(frozen=True)
class Conflict:
    """An equivocation this replica saw: the earlier message's id (and the message, if it was buffered)."""

    seq: int
    first_id: bytes
    first: UpdateLike | None
    second: UpdateLike


Fit = Callable[[str, tuple[int, ...], Tensor, Tensor], "bool | None"]
"""A sponsor's fit check (train/fit.py, sync/fitness.py): (author, its declared data position, its step, theta) ->
whether the step teaches the stream declared more than the judge's own step did; None: it cannot be judged
(nothing to redraw, no budget left)."""
