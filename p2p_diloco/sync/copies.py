"""The copy window of vetting (sync/standing.py): the recent payloads merged here, each kept as a unit sample of
COPY_SAMPLE fixed coordinates, and which of them a new payload copies up to a scale.

A crowd that computes nothing can only re-sign others' work. So a payload whose |cosine| with a recent payload of
another author is at least `copy_cosine` is a *copy* or a *negated copy* of it. A re-signed copy is exact
(cosine 1 up to float rounding); honest payloads of different authors measured at most 0.91, so the test never
touches honest work. Which of a pair is the original is the standing's call (`Standing`), not this window's.

The samples sit in one matrix (a ring of COPY_WINDOW rows), so a copy test is one product, not a loop. Not
thread-safe: the replica calls it under its lock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from p2p_diloco.sync.decoded import Decoded

COPY_COSINE = 0.9999
"""|cosine| with a recent payload of another author at or above which a payload is a copy (or a negated copy) of
it. A re-signed copy, scaled or negated, decodes to exactly the same direction (the codec's codes are the same
or negated, their block scales scaled), so the bar can sit at 0.9999; honest payloads of different authors
come close only at a run's start (first updates from one init: 0.91 at H=20, and with H=2 close enough that
0.99 refused some: replicas 0.5% apart)."""
COPY_SAMPLE = 4096
"""Coordinates (fixed, drawn once per model size) the copy test compares: a cosine over them is within ~0.02 of
the full one for dense payloads, and a copy, scaled or negated, is exact on any subset."""
COPY_WINDOW = 1024
"""Recent payloads a new one is compared with (4 KiB each). A copy is found only while its original or copy
is still here: at 64, 100 copies of one update pushed the first ones out before the original came (their
authors were never struck; ties had already taken their weight), and a crowd could evict a copy on purpose with
junk; 1024 (4 MiB, one 1024 x 4096 product per update) covers rounds of hundreds of identities."""
COPY_SEED = 0x5EED


def copy_coordinates(numel: int, seed: int = COPY_SEED) -> Tensor:
    """COPY_SAMPLE coordinates of a payload of `numel` values drawn from `seed`, sorted (a pass over a payload
    takes them in order, sync/decoded.py); all of them if there are no more. The copy test's are the same on every
    replica, so anyone can know them: a copy is a copy on any coordinates, but a judge of worth must not read only
    these (sync/sponsorship.py)."""
    if numel <= COPY_SAMPLE:  # nothing to hide, and no coordinate read twice
        return torch.arange(numel)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, numel, (min(COPY_SAMPLE, numel),), generator=g).sort().values


@dataclass
class WindowEntry:
    """One payload in the window: its author and seq, its row of the sample matrix, and its state: "" (merged
    with a weight), TIED or REFUSED (sync/verdict.py)."""

    author: str
    seq: int
    row: int
    state: str


class CopyWindow:
    """The last COPY_WINDOW payloads merged here (with a weight, or tied), as unit samples, newest last."""

    def __init__(self) -> None:
        self._entries: deque[WindowEntry] = deque(maxlen=COPY_WINDOW)
        self._samples: Tensor | None = None
        self._next_row = 0
        self._last: tuple[str, int, Tensor | None] = ("", 0, None)  # the last sample `matches` took
        self._sample_at: Tensor | None = None

    def matches(self, sender: str, seq: int, delta: Tensor | Decoded, bar: float) -> list[tuple[WindowEntry, float]]:
        """The entries of other authors whose |cosine| with `delta` is at least `bar`, with the cosine. Keeps
        the sample it took, for `remember_sample` of the same update."""
        sample = self.sample(delta)
        self._last = (sender, seq, sample)
        if sample is None or not self._entries or self._samples is None:
            return []
        cosines = self._samples @ sample  # rows not yet written are zero
        rows = {entry.row: entry for entry in self._entries}
        return [(rows[row], float(cosines[row])) for row in
                (cosines.abs() >= bar).nonzero().flatten().tolist() if rows[row].author != sender]

    def remember_sample(self, sender: str, seq: int, delta: Tensor | Decoded, state: str) -> None:
        """Add `sender`'s payload `seq` (the sample `matches` took of it, else a new one); a zero one is left out."""
        sample = self._last[2] if self._last[:2] == (sender, seq) else self.sample(delta)
        if sample is not None:
            self._remember(sender, seq, sample, state)

    def sample(self, delta: Tensor | Decoded) -> Tensor | None:
        """The payload at the fixed COPY_SAMPLE coordinates, unit length (None if it is zero)."""
        decoded = Decoded.of(delta)
        sample = decoded.take(self.sample_at(decoded.numel))
        norm = float(sample.norm())
        return sample / norm if norm > 0 and math.isfinite(norm) else None

    def sample_at(self, numel: int) -> Tensor:
        """The fixed coordinates the test compares, for a payload of `numel` values (drawn once per size)."""
        if self._sample_at is None or int(self._sample_at[-1]) >= numel:  # sorted: the last is the largest
            self._sample_at = copy_coordinates(numel)
        return self._sample_at

    def _remember(self, sender: str, seq: int, sample: Tensor, state: str) -> None:
        """Add a payload's sample; the ring's row is the oldest entry's, which the deque drops."""
        if self._samples is None or self._samples.shape[1] != sample.numel():
            self._samples, self._next_row = torch.zeros(COPY_WINDOW, sample.numel()), 0
            self._entries.clear()
        row = self._next_row
        self._samples[row] = sample
        self._next_row = (row + 1) % COPY_WINDOW
        self._entries.append(WindowEntry(sender, seq, row, state))
