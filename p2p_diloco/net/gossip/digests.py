"""Equivocation digests: which update ids two replicas merged for the same seqs (ARCHITECTURE.md,
"The network").

Version vectors cannot show an equivocation split between two replicas: both hold (sender, seq), one merged
one signed version and the other another. So a pull request carries, for up to MAX_ID_DIGESTS senders, a
digest of the update ids the requester merged for its newest ID_WINDOW seqs of that sender (its "ids"); a
responder whose own digest over the same seqs differs serves the updates it holds for them, and the
requester's intake proves the equivocation. Pure functions: no network, no locks.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator, Mapping, Sequence

from p2p_diloco.sync.version_vector import VersionVector

ID_WINDOW = 8
"""Seqs per sender whose update ids a pull request summarizes (its newest merged ones): the slots where two
replicas could hold different versions of one (sender, seq) without their vectors showing it."""
MAX_ID_DIGESTS = 64
"""Senders summarized in one pull request; with more, a random subset each time (anti-entropy covers all)."""

IdsOf = Callable[[str, list[int]], "list[bytes] | None"]
"""`Replica.recent_ids`: the ids merged for (sender, seqs), or None if some are no longer known."""


def id_window(vv: VersionVector, sender: str) -> list[int]:
    """The seqs of `sender` whose ids a request with vector `vv` summarizes: its newest ID_WINDOW merged."""
    top = vv.get(sender)
    return [seq for seq in range(max(1, top - ID_WINDOW + 1), top + 1) if vv.has(sender, seq)]


def ids_digest(seqs: Sequence[int], ids: Sequence[bytes]) -> str:
    """16 hex digits naming which update was merged for each of `seqs` (equal iff the same updates, whp)."""
    h = hashlib.blake2b(digest_size=8)
    for seq, update_id in zip(seqs, ids, strict=True):
        h.update(seq.to_bytes(8, "big") + update_id)
    return h.hexdigest()


def summarize_ids(vv: VersionVector, ids_of: IdsOf, senders: Sequence[str]) -> dict[str, str]:
    """Per sender in `senders` (at most MAX_ID_DIGESTS), the digest of the ids merged in its window;
    `ids_of(sender, seqs)` gives them, or None if some are no longer known (that sender is left out)."""
    out: dict[str, str] = {}
    for sender in senders[:MAX_ID_DIGESTS]:
        seqs = id_window(vv, sender)
        ids = ids_of(sender, seqs) if seqs else None
        if ids is not None:
            out[sender] = ids_digest(seqs, ids)
    return out


def request_digests(wanted: VersionVector, ours: VersionVector, ids_of: IdsOf, rng: random.Random) -> dict[str, str]:
    """The "ids" of a pull request asking beyond `wanted`: digests of the ids we merged lately, for up to
    MAX_ID_DIGESTS random senders whose window in `wanted` is all merged in `ours` (claims of other pulls are
    not)."""
    candidates = list(wanted)
    rng.shuffle(candidates)  # with more senders than MAX_ID_DIGESTS, another subset each pull
    senders: list[str] = []
    for sender in candidates:  # on every pull: stop as soon as there are enough
        # Only hole-free windows compare: a responder that filled a hole since would see another window.
        if not ours.holes(sender) and id_window(wanted, sender) == id_window(ours, sender):
            senders.append(sender)
            if len(senders) == MAX_ID_DIGESTS:
                break
    return summarize_ids(wanted, ids_of, senders)


def differing_windows(digests: Mapping[str, str], remote: VersionVector,
                      ids_of: IdsOf) -> Iterator[tuple[str, list[int]]]:
    """(sender, seqs) of each window where a requester with vector `remote` and `digests` merged other updates
    than we did (`ids_of` gives ours); windows we do not hold all merged, or merged the same, are skipped."""
    for sender, digest in digests.items():
        seqs = id_window(remote, sender)
        ours = ids_of(sender, seqs)
        if ours is None or ids_digest(seqs, ours) == digest:
            continue  # we do not hold the same slots merged, or we merged the same updates
        yield sender, seqs
