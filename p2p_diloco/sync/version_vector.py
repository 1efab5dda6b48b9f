"""Version vectors: which updates a replica holds.

`V[sender]` is the highest *contiguous* `seq` of that sender merged into the replica (0 = none), as in
DESIGN.md section 2. Because merges per sender are contiguous, the vector names the exact set of merged
updates, so two replicas with equal vectors merged the same set (and are equal to fp tolerance). The vector
drives staleness (`tau`), catch-up (`missing_from`) and anti-entropy (`digest`).

Vectors are immutable values: a replica swaps in a new one on each merge, so a snapshot can hand its vector
out without copying and without the lock.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Mapping
from typing import Any

MAX_SENDERS = 100_000
"""Bound on entries accepted from the wire: a remote vector must not make us allocate without limit."""
MAX_SENDER_LEN = 256
"""Bound on a sender id's length in characters (a PeerID is ~52)."""
MAX_SEQ = 2**63 - 1
"""Largest seq we accept; keeps the canonical encoding fixed-width (8 bytes)."""

_DIGEST_DOMAIN = b"p2p-diloco/version-vector/v1\0"


def _validated(entries: Mapping[Any, Any], max_senders: int | None) -> dict[str, int]:
    """Check types and bounds; drop zero entries so that equal vectors have one representation."""
    if not isinstance(entries, Mapping):
        raise ValueError(f"version vector must be a mapping, got {type(entries).__name__}")
    if max_senders is not None and len(entries) > max_senders:
        raise ValueError(f"version vector has {len(entries)} senders, more than the bound {max_senders}")
    out: dict[str, int] = {}
    for sender, seq in entries.items():
        if not isinstance(sender, str) or not sender or len(sender) > MAX_SENDER_LEN:
            raise ValueError(f"version vector sender must be a non-empty str of <= {MAX_SENDER_LEN} chars, "
                             f"got {sender!r:.80}")
        try:
            sender.encode("utf-8")  # lone surrogates cannot be hashed into the canonical digest
        except UnicodeEncodeError:
            raise ValueError(f"version vector sender {sender!r:.80} is not valid unicode") from None
        # bool is an int subclass; True as a seq is a malformed message, not 1.
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_SEQ:
            raise ValueError(f"version vector seq for {sender!r} must be an int in [0, {MAX_SEQ}], got {seq!r:.80}")
        if seq:
            out[sender] = seq
    return out


class VersionVector(Mapping[str, int]):
    """Immutable map sender -> highest contiguous seq merged. Absent senders read as 0 through `get`."""

    __slots__ = ("_entries", "_hash")

    def __init__(self, entries: Mapping[str, int] | None = None) -> None:
        self._entries: dict[str, int] = _validated(entries or {}, max_senders=None)
        self._hash: int | None = None

    @classmethod
    def _trusted(cls, entries: dict[str, int]) -> VersionVector:
        """Build from a dict we produced ourselves (already valid, no zeros): skips the O(n) validation."""
        vv = cls.__new__(cls)
        vv._entries = entries
        vv._hash = None
        return vv

    # --- Mapping protocol -------------------------------------------------------------------------------

    def __getitem__(self, sender: str) -> int:
        return self._entries[sender]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, sender: str, default: int = 0) -> int:  # type: ignore[override]
        return self._entries.get(sender, default)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, VersionVector):
            return NotImplemented
        return self._entries == other._entries

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._entries.items()))
        return self._hash

    def __repr__(self) -> str:
        return f"VersionVector({dict(sorted(self._entries.items()))!r})"

    # --- algebra ----------------------------------------------------------------------------------------

    def advanced(self, sender: str, seq: int) -> VersionVector:
        """A new vector with `sender` at `seq`. Vectors only grow: moving a sender backwards is a bug."""
        current = self.get(sender)
        if seq < current:
            raise ValueError(f"version vector cannot move {sender!r} back from {current} to {seq}")
        if seq == current:
            return self
        entries = dict(self._entries)
        entries.update(_validated({sender: seq}, max_senders=None))
        return VersionVector._trusted(entries)

    def merge(self, other: VersionVector) -> VersionVector:
        """Pointwise max: the vector of the union of both sets of updates (commutative, associative, idempotent)."""
        entries = dict(self._entries)
        for sender, seq in other._entries.items():
            if seq > entries.get(sender, 0):
                entries[sender] = seq
        return VersionVector._trusted(entries)

    def dominates(self, other: VersionVector) -> bool:
        """True if self holds every update other holds (self[k] >= other[k] for all k; equal vectors dominate)."""
        return all(self.get(sender) >= seq for sender, seq in other._entries.items())

    def staleness(self, base: VersionVector) -> int:
        """`tau = sum_k max(0, self[k] - base[k])`: updates merged since `base` was taken (DESIGN.md section 2)."""
        return sum(max(0, seq - base.get(sender)) for sender, seq in self._entries.items())

    def missing_from(self, other: VersionVector) -> dict[str, tuple[int, int]]:
        """Inclusive seq ranges `(from_seq, to_seq)` per sender that `other` holds and self lacks."""
        return {sender: (self.get(sender) + 1, seq)
                for sender, seq in other._entries.items() if seq > self.get(sender)}

    def total(self) -> int:
        """Number of updates merged (sum of all entries)."""
        return sum(self._entries.values())

    # --- encoding ---------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, int]:
        """Plain dict (sorted by sender) for msgpack/JSON; zero entries are omitted."""
        return dict(sorted(self._entries.items()))

    @classmethod
    def from_dict(cls, data: Mapping[Any, Any], *, max_senders: int = MAX_SENDERS) -> VersionVector:
        """Parse a vector received from a peer or a checkpoint; ValueError on bad types, values or size."""
        return cls._trusted(_validated(data, max_senders=max_senders))

    def digest(self) -> bytes:
        """sha256 of a canonical encoding (sorted senders, length-prefixed, fixed-width seqs).

        Anti-entropy compares digests first and exchanges full vectors only when they differ.
        """
        h = hashlib.sha256(_DIGEST_DOMAIN)
        for sender, seq in sorted(self._entries.items()):
            raw = sender.encode("utf-8")
            h.update(struct.pack(">I", len(raw)))
            h.update(raw)
            h.update(struct.pack(">Q", seq))
        return h.digest()
