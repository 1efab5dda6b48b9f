"""The repair's arithmetic over version vectors (ARCHITECTURE.md "The network" (repair)): which merges of ours
can never reach a peer that skipped them, and, for a slot some replicas merged and others skipped, which side
yields by quorum. Pure functions of the vectors, so every peer that knows the same vectors decides alike."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from p2p_diloco.sync.version_vector import VersionVector


def unservable_merges(local: VersionVector, remote: VersionVector,
                      holds: Callable[[str, int], bool]) -> list[tuple[str, int]]:
    """Updates `local` merged that `remote` skipped (holes) and that we cannot serve (`holds` is False).

    Pulls can never make the two replicas equal then: the remote will never get the update, and we cannot
    un-merge it without its payload. The repair (ARCHITECTURE.md "The network" (repair)) is that the side that merged
    it adopts the state of the side that skipped it (`Replica.adopt`) and re-merges what it holds beyond
    that state. The skipping side never yields for this reason, so the repair goes one way and terminates.
    """
    out: list[tuple[str, int]] = []
    for sender in remote.senders_with_holes():
        seqs = sorted(remote.holes(sender))
        out.extend((sender, seq) for seq in seqs if local.has(sender, seq) and not holds(sender, seq))
    return out


def skipped_by_quorum(items: Iterable[tuple[str, int]], vectors: Iterable[VersionVector],
                      unknown: int = 0) -> list[tuple[str, int]]:
    """The `items` (updates we merged and cannot serve) that at least as many of `vectors` (the other peers'
    latest, as far as we know them) skipped as merged them, counting our own merge: those the repair may give up.

    A vector votes on `(sender, seq)` only once its entry is past `seq`: "skipped" if `seq` is one of its holes,
    "merged" if it holds it; `unknown` peers whose vectors we do not know count as merged (against yielding).
    A lone peer that claims a hole cannot make a swarm whose other members merged the update adopt its state;
    in a swarm of two, the skip wins (the repair must go one way to end)."""
    vectors = list(vectors)
    out: list[tuple[str, int]] = []
    for item in items:
        skipped, merged = _votes(item, vectors, merged_here=True)
        if skipped >= merged + unknown:
            out.append(item)
    return out


def merged_by_quorum(items: Iterable[tuple[str, int]], vectors: Iterable[VersionVector],
                     unknown: int = 0) -> list[tuple[str, int]]:
    """The `items` (our holes that nobody has served us) that more of `vectors` merged than skipped, counting
    our own skip and the `unknown` peers as skips: those for which our replica should adopt a merger's state.
    The exact complement of `skipped_by_quorum` on the mergers' side: over the same votes one side of an item
    yields, never both; with votes unknown to either side, at most one (each counts them against itself)."""
    vectors = list(vectors)
    out: list[tuple[str, int]] = []
    for item in items:
        skipped, merged = _votes(item, vectors, merged_here=False)
        if merged > skipped + unknown:
            out.append(item)
    return out


def _votes(item: tuple[str, int], vectors: Iterable[VersionVector], *, merged_here: bool) -> tuple[int, int]:
    """(skipped, merged) counts of `item` over `vectors` (those past its seq) and our own replica."""
    sender, seq = item
    skipped = sum(1 for v in vectors if seq in v.holes(sender))
    merged = sum(1 for v in vectors if v.has(sender, seq))
    return (skipped, merged + 1) if merged_here else (skipped + 1, merged)
