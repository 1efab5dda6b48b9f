"""Version vectors: which updates a replica holds.

`V[sender]` is the highest `seq` of that sender merged into the replica (0 = none), as in ARCHITECTURE.md "Vocabulary",
and `holes(sender)` are the seqs below it that were *skipped*, not merged. The merged set of a sender is
therefore `{1..V[sender]} - holes(sender)`, and the vector names the exact set of merged updates: two
replicas with equal vectors merged the same set (and are equal to fp tolerance). The vector drives
staleness (`tau`), catch-up (`missing_from`, `holes`) and anti-entropy (`digest`).

Holes (the lost-update trap, ARCHITECTURE.md "The network" (repair)): merges per sender are contiguous except where a
replica gave up waiting for a seq that no live peer could serve (`Replica.expire_gaps`). It then records that
seq as a hole and merges the later ones; if the missing update turns up after all, it is merged late and the
hole is filled (`with_merged`). A sum commutes, so a late merge gives exactly the replica that merged in order,
and the hole record is what stops a double merge. Every method below is exact on merged *sets*: `merge` is
their union, `dominates` is inclusion, `staleness` counts the difference. Vectors without holes behave, encode
and hash exactly as before holes existed.

Invariant (checked on construction): every hole of a sender is in `[1, V[sender])`; `V[sender]` itself is
merged. The representation of a merged set is therefore unique: V = its maximum, holes = the rest below.

Vectors are immutable values: a replica swaps in a new one on each merge, so a snapshot can hand its vector
out without copying and without the lock.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Container, Iterable, Iterator, Mapping
from typing import Any, TypeVar, overload

MAX_SENDERS = 100_000
"""Bound on entries accepted from the wire: a remote vector must not make us allocate without limit."""
MAX_SENDER_LEN = 256
"""Bound on a sender id's length in characters (a PeerID is ~52)."""
MAX_SEQ = 2**63 - 1
"""Largest seq we accept; keeps the canonical encoding fixed-width (8 bytes)."""
MAX_HOLES = 100_000
"""Bound on the holes one vector may hold (from the wire or made locally)."""

_T = TypeVar("_T")
_DIGEST_DOMAIN = b"p2p-diloco/version-vector/v1\0"
_HOLES_MARK = b"\xffholes\0"  # appended to the digest input only when there are holes: hole-free digests unchanged


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


def _validated_holes(holes: Mapping[Any, Any] | None, entries: dict[str, int]) -> dict[str, frozenset[int]]:
    """Holes must lie strictly below their sender's entry; empty sets are dropped (one representation)."""
    if holes is None:
        return {}
    if not isinstance(holes, Mapping):
        raise ValueError(f"version vector holes must be a mapping, got {type(holes).__name__}")
    out: dict[str, frozenset[int]] = {}
    count = 0
    for sender, seqs in holes.items():
        if not isinstance(seqs, (list, tuple, set, frozenset)):
            raise ValueError(f"holes of {sender!r:.80} must be a list of seqs, got {type(seqs).__name__}")
        count += len(seqs)
        if count > MAX_HOLES:
            raise ValueError(f"version vector has more than the bound of {MAX_HOLES} holes")
        top = entries.get(sender, 0) if isinstance(sender, str) else 0
        for seq in seqs:
            if isinstance(seq, bool) or not isinstance(seq, int) or not 1 <= seq < top:
                raise ValueError(f"hole {seq!r:.40} of {sender!r:.80} must be an int in [1, {top})")
        if seqs:
            out[sender] = frozenset(seqs)
    return out


class VersionVector(Mapping[str, int]):
    """Immutable map sender -> highest seq merged, plus the holes below it. Absent senders read as 0."""

    __slots__ = ("_entries", "_holes", "_hash")

    def __init__(self, entries: Mapping[str, int] | None = None,
                 holes: Mapping[str, Iterable[int]] | None = None) -> None:
        self._entries: dict[str, int] = _validated(entries or {}, max_senders=None)
        self._holes: dict[str, frozenset[int]] = _validated_holes(
            None if holes is None else {k: tuple(v) for k, v in holes.items()}, self._entries)
        self._hash: int | None = None

    @classmethod
    def _trusted(cls, entries: dict[str, int], holes: dict[str, frozenset[int]] | None = None) -> VersionVector:
        """Build from dicts we produced ourselves (valid, no zeros, no empty hole sets): skips validation."""
        vv = cls.__new__(cls)
        vv._entries = entries
        vv._holes = holes or {}
        vv._hash = None
        return vv

    # --- Mapping protocol -------------------------------------------------------------------------------

    def __getitem__(self, sender: str) -> int:
        return self._entries[sender]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @overload
    def get(self, sender: str) -> int: ...
    @overload
    def get(self, sender: str, default: int) -> int: ...
    @overload
    def get(self, sender: str, default: _T) -> int | _T: ...

    def get(self, sender: str, default: object = 0) -> object:
        """`V[sender]`: 0 for an absent sender (not None: none of its seqs is merged)."""
        return self._entries.get(sender, default)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, VersionVector):
            return NotImplemented
        return self._entries == other._entries and self._holes == other._holes

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash((frozenset(self._entries.items()), frozenset(self._holes.items())))
        return self._hash

    def __repr__(self) -> str:
        holes = f", holes={ {k: sorted(v) for k, v in sorted(self._holes.items())} !r}" if self._holes else ""
        return f"VersionVector({dict(sorted(self._entries.items()))!r}{holes})"

    # --- holes ------------------------------------------------------------------------------------------

    def holes(self, sender: str) -> frozenset[int]:
        """Seqs of `sender` below `self[sender]` that were skipped, not merged."""
        return self._holes.get(sender, frozenset())

    def holes_merged_by(self, other: VersionVector, skip: Container[str] = ()) -> list[tuple[str, int]]:
        """Our holes that `other` merged (senders in `skip` left out), in seq order per sender: what a pull
        from it could fill, or, if nobody serves them, what the repair's vote is about."""
        return [(sender, seq) for sender, seqs in self._holes.items() if sender not in skip
                for seq in sorted(seqs) if other.has(sender, seq)]

    def senders_with_holes(self) -> list[str]:
        """The senders that have holes (in the order they got them)."""
        return list(self._holes)

    def has(self, sender: str, seq: int) -> bool:
        """True if update `(sender, seq)` is merged."""
        return 1 <= seq <= self._entries.get(sender, 0) and seq not in self._holes.get(sender, ())

    @property
    def n_holes(self) -> int:
        return sum(len(h) for h in self._holes.values())

    # --- algebra ----------------------------------------------------------------------------------------

    def advanced(self, sender: str, seq: int) -> VersionVector:
        """A new vector with `sender` at `seq`, everything between merged. Vectors only grow: moving a sender
        backwards is a bug. (Holes below the old entry stay holes; `with_merged` adds one seq at a time.)"""
        current = self.get(sender)
        if seq < current:
            raise ValueError(f"version vector cannot move {sender!r} back from {current} to {seq}")
        if seq == current:
            return self
        entries = dict(self._entries)
        entries.update(_validated({sender: seq}, max_senders=None))
        return VersionVector._trusted(entries, self._holes)

    def with_merged(self, sender: str, seq: int) -> VersionVector:
        """The vector of this set plus update `(sender, seq)`: fills a hole, advances by one, or (seq beyond
        the entry + 1) skips the seqs between, recording them as holes. ValueError if already merged."""
        current = self.get(sender)
        holes = self._holes.get(sender, frozenset())
        if seq > current:
            _validated({sender: seq}, max_senders=None)
            new_holes = holes | frozenset(range(current + 1, seq)) if seq > current + 1 else holes
            if len(new_holes) - len(holes) + self.n_holes > MAX_HOLES:
                raise ValueError(f"skipping to seq {seq} of {sender!r} would exceed {MAX_HOLES} holes")
            entries = dict(self._entries)
            entries[sender] = seq
        elif seq in holes:
            entries, new_holes = self._entries, holes - {seq}
        else:
            raise ValueError(f"update ({sender!r}, {seq}) is already merged (or seq < 1)")
        all_holes = dict(self._holes)
        if new_holes:
            all_holes[sender] = new_holes
        else:
            all_holes.pop(sender, None)
        return VersionVector._trusted(entries, all_holes)

    def without(self, sender: str, seq: int) -> VersionVector:
        """The vector of this set minus update `(sender, seq)` (the inverse of `with_merged`): below the entry
        the seq becomes a hole; at the entry, the entry drops to the highest merged seq below it (holes under
        it go with it, so the representation stays unique). ValueError if it is not merged."""
        if not self.has(sender, seq):
            raise ValueError(f"update ({sender!r}, {seq}) is not merged")
        current, holes = self.get(sender), self._holes.get(sender, frozenset())
        entries, all_holes = dict(self._entries), dict(self._holes)
        if seq < current:
            if self.n_holes + 1 > MAX_HOLES:
                raise ValueError(f"taking back ({sender!r}, {seq}) would exceed {MAX_HOLES} holes")
            all_holes[sender] = holes | {seq}
            return VersionVector._trusted(entries, all_holes)
        top = seq - 1
        while top in holes:
            top -= 1
        kept = frozenset(h for h in holes if h < top)
        if top > 0:
            entries[sender] = top
        else:
            entries.pop(sender, None)
        if kept:
            all_holes[sender] = kept
        else:
            all_holes.pop(sender, None)
        return VersionVector._trusted(entries, all_holes)

    def merge(self, other: VersionVector) -> VersionVector:
        """The vector of the union of both merged sets (commutative, associative, idempotent). Without holes
        this is the pointwise max."""
        entries = dict(self._entries)
        for sender, seq in other._entries.items():
            if seq > entries.get(sender, 0):
                entries[sender] = seq
        holes: dict[str, frozenset[int]] = {}
        for sender in set(self._holes) | set(other._holes):
            a, b = self.get(sender), other.get(sender)
            ha, hb = self.holes(sender), other.holes(sender)
            # Skipped in the union = skipped (or not reached) in both: below the lower entry, a hole in both;
            # above it, a hole of the higher vector.
            low, high_holes = (a, hb) if a < b else (b, ha)
            union_holes = (ha & hb) | {h for h in high_holes if h > low}
            if union_holes:
                holes[sender] = frozenset(union_holes)
        return VersionVector._trusted(entries, holes)

    def dominates(self, other: VersionVector) -> bool:
        """True if self holds every update other holds (its merged set includes other's; equal vectors dominate)."""
        for sender, seq in other._entries.items():
            if self.get(sender) < seq:
                return False
            mine = self._holes.get(sender)
            if mine and any(h <= seq and h not in other.holes(sender) for h in mine):
                return False
        return True

    def staleness(self, base: VersionVector, only: frozenset[str] | None = None) -> int:
        """`tau`: updates merged here and not in `base` (ARCHITECTURE.md "Vocabulary"); without holes
        `sum_k max(0, self[k] - base[k])`. `only`: count these senders' updates alone."""
        tau = 0
        for sender, seq in self._entries.items():
            if only is not None and sender not in only:
                continue
            b = base.get(sender)
            mine = self._holes.get(sender, frozenset())
            if seq > b:
                tau += seq - b - sum(1 for h in mine if h > b)
            low = min(seq, b)
            tau += sum(1 for h in base.holes(sender) if h <= low and h not in mine)  # filled since base
        return tau

    def missing_from(self, other: VersionVector) -> dict[str, tuple[int, int]]:
        """Inclusive seq ranges `(from_seq, to_seq)` per sender above our entry that `other` has passed. Our
        holes are not listed (ask `holes`); neither are other's holes inside a range (the range is a hull)."""
        return {sender: (self.get(sender) + 1, seq)
                for sender, seq in other._entries.items() if seq > self.get(sender)}

    def total(self) -> int:
        """Number of updates merged (sum of all entries, less the holes)."""
        return sum(self._entries.values()) - self.n_holes

    # --- encoding ---------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, int]:
        """Plain dict (sorted by sender) of the entries for msgpack/JSON; zero entries are omitted. Holes are
        not in it: send `holes_dict()` alongside where the receiver must know them."""
        return dict(sorted(self._entries.items()))

    def holes_dict(self) -> dict[str, list[int]]:
        """Plain dict sender -> sorted holes (only senders with holes), for msgpack/JSON."""
        return {sender: sorted(h) for sender, h in sorted(self._holes.items())}

    @classmethod
    def from_dict(cls, data: Mapping[Any, Any], *, holes: Mapping[Any, Any] | None = None,
                  max_senders: int = MAX_SENDERS) -> VersionVector:
        """Parse a vector (and optionally its `holes_dict`) received from a peer or a checkpoint; ValueError on
        bad types, values or size."""
        entries = _validated(data, max_senders=max_senders)
        return cls._trusted(entries, _validated_holes(holes, entries))

    def digest(self) -> bytes:
        """sha256 of a canonical encoding (sorted senders, length-prefixed, fixed-width seqs; then the holes,
        if any). Anti-entropy compares digests first and exchanges full vectors only when they differ."""
        h = hashlib.sha256(_DIGEST_DOMAIN)
        for sender, seq in sorted(self._entries.items()):
            raw = sender.encode("utf-8")
            h.update(struct.pack(">I", len(raw)))
            h.update(raw)
            h.update(struct.pack(">Q", seq))
        if self._holes:
            h.update(_HOLES_MARK)
            for sender, seqs in sorted(self._holes.items()):
                raw = sender.encode("utf-8")
                h.update(struct.pack(">II", len(raw), len(seqs)))
                h.update(raw)
                h.update(b"".join(struct.pack(">Q", s) for s in sorted(seqs)))
        return h.digest()
