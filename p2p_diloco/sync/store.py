"""Retention of recent updates, to serve pulls from peers (ARCHITECTURE.md "The network" (gossip)).

Peers keep recent updates in bounded bytes; the oldest (by insertion) go first. A peer whose gap is older
than what the swarm retains does a state sync instead: `oldest_seq` lets it see that a gap can no longer be
filled from us.

Holes: a remote vector's holes (seqs it skipped, `VersionVector.holes`) are served like seqs above its entry,
so anti-entropy fills them too. An update we merged, the remote skipped and we no longer hold can never reach
it: `unservable_for` names those, and the repair is `Replica.adopt` (ARCHITECTURE.md "The network" (repair)).

Bans: `ban(sender)` drops a banned sender's updates and refuses new ones, so they are never served again
(`Intake.attach_store` wires it to `Replica.ban`). The banned set is bounded (`MAX_BANNED`).

Held back: `hold_back(sender, seq, for_s)` keeps one update out of what we serve (`missing_for(...,
to_serve=True)`) for that long (`release` ends it); a repair or a resync re-merging what we hold still sees it.
An author whose update goes up an aggregation tree holds it back `GossipConfig.aggregate_settle_s`: the tree gets
that long to bring it inside a total before a pull fetches the same bytes whole.

Served as kept: an envelope is stored with its encoded bytes (`wire.envelope.retained`, which holds them once),
so a pull serves them without encoding the update again.

Thread-safe: the network loop adds and serves, while `Intake` (in worker threads) looks up the earlier message
of an equivocation and bans; one lock guards every method.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from p2p_diloco.sync.quorum import unservable_merges
from p2p_diloco.sync.types import UpdateLike
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.envelope import OuterUpdate, retained

MAX_BANNED = 100_000
"""Bound on remembered banned senders (older bans are forgotten first; the replica keeps its own set)."""


class UpdateStore:
    """Updates keyed by (sender, seq), at most `max_bytes` of them by their `nbytes`."""

    def __init__(self, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes, self.clock = max_bytes, clock
        self._held_back: dict[tuple[str, int], float] = {}  # key -> until (clock); only keys still held
        # (sender, seq) -> (update, nbytes as counted at insertion); insertion order = eviction order
        self._by_key: OrderedDict[tuple[str, int], tuple[UpdateLike, int]] = OrderedDict()
        self._seqs: dict[str, list[int]] = {}  # sender -> sorted seqs held
        self._nbytes = 0
        self._banned: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._by_key)

    @property
    def nbytes(self) -> int:
        """Sum of `nbytes` of the updates held; always <= max_bytes."""
        return self._nbytes

    def add(self, update: UpdateLike) -> bool:
        """Keep `update`, evicting the oldest as needed. False if (sender, seq) is already held (the first
        message wins; a different one is the replica's business: equivocation), if the update alone is
        larger than max_bytes (evicting everything for it would still not make it fit), or if its sender is
        banned."""
        key = (update.sender, update.seq)
        size = update.nbytes
        if size < 0:
            raise ValueError(f"update nbytes must be >= 0, got {size}")
        with self._lock:
            if key in self._by_key or size > self.max_bytes or update.sender in self._banned:
                return False
            while self._nbytes + size > self.max_bytes:
                self._remove(next(iter(self._by_key)))
            if isinstance(update, OuterUpdate):
                update = retained(update)  # encoded once here, served as it is
            self._by_key[key] = (update, size)
            bisect.insort(self._seqs.setdefault(update.sender, []), update.seq)
            self._nbytes += size
            return True

    def get(self, sender: str, seq: int) -> UpdateLike | None:
        with self._lock:
            held = self._by_key.get((sender, seq))
            return held[0] if held else None

    def has(self, sender: str, seq: int) -> bool:
        with self._lock:
            return (sender, seq) in self._by_key

    def oldest_seq(self, sender: str) -> int | None:
        """Smallest seq of `sender` still held (None if none): a remote needing an older one must look
        elsewhere or state-sync."""
        with self._lock:
            seqs = self._seqs.get(sender)
            return seqs[0] if seqs else None

    def senders(self) -> list[str]:
        with self._lock:
            return list(self._seqs)

    def hold_back(self, sender: str, seq: int, for_s: float) -> None:
        """Leave (sender, seq), if held, out of `missing_for` for `for_s` seconds."""
        with self._lock:
            if (sender, seq) in self._by_key and for_s > 0:
                self._held_back[(sender, seq)] = self.clock() + for_s

    def release(self, sender: str, seq: int) -> None:
        """Serve (sender, seq) again at once (an author that falls back announces it)."""
        with self._lock:
            self._held_back.pop((sender, seq), None)

    def missing_for(self, remote: VersionVector, limit: int, *, to_serve: bool = False) -> list[UpdateLike]:
        """Updates we hold that `remote` has not merged (seq above its entry, or one of its holes), at most
        `limit`, in seq order per sender; `to_serve` (a pull's answer): less those held back.

        Senders are interleaved round-robin (each sender's lowest missing seq first), so that a tight limit
        still moves every sender's gap forward instead of serving one sender only: the remote can merge only
        a sender's next seq (or a hole), so the low seqs of all senders are worth more than the high seqs of one.
        """
        if limit <= 0:
            return []
        with self._lock:
            queues: list[list[int]] = []
            senders: list[str] = []
            now = self.clock()
            for key in [k for k, until in self._held_back.items() if until <= now]:
                del self._held_back[key]
            held_back = self._held_back if to_serve else {}
            for sender in sorted(self._seqs):
                seqs = self._seqs[sender]
                if held_back:
                    seqs = [q for q in seqs if (sender, q) not in held_back]
                holes = sorted(q for q in remote.holes(sender)
                               if (sender, q) in self._by_key and (sender, q) not in held_back)
                start = bisect.bisect_right(seqs, remote.get(sender))
                queue = (holes + seqs[start:start + limit])[:limit]  # holes are below the entry: still ascending
                if queue:
                    senders.append(sender)
                    queues.append(queue)
            out: list[UpdateLike] = []
            rank = 0
            while len(out) < limit and any(rank < len(q) for q in queues):
                for sender, queue in zip(senders, queues, strict=True):
                    if rank < len(queue) and len(out) < limit:
                        out.append(self._by_key[(sender, queue[rank])][0])
                rank += 1
            return out

    def unservable_for(self, local: VersionVector, remote: VersionVector) -> list[tuple[str, int]]:
        """Updates `local` merged that `remote` skipped and this store no longer holds: pulls cannot make the
        two replicas equal, `Replica.adopt` can (see `quorum.unservable_merges`)."""
        with self._lock:
            return unservable_merges(local, remote, lambda sender, seq: (sender, seq) in self._by_key)

    def drop_sender(self, sender: str) -> int:
        """Forget every update of `sender`; returns how many were dropped."""
        with self._lock:
            seqs = list(self._seqs.get(sender, ()))
            for seq in seqs:
                self._remove((sender, seq))
            return len(seqs)

    def ban(self, sender: str) -> int:
        """Drop `sender`'s updates and refuse its future ones (a banned sender's updates are never re-served);
        returns how many were dropped."""
        with self._lock:
            self._banned.pop(sender, None)
            self._banned[sender] = None
            while len(self._banned) > MAX_BANNED:
                self._banned.popitem(last=False)
            return self.drop_sender(sender)

    def is_banned(self, sender: str) -> bool:
        with self._lock:
            return sender in self._banned

    def _remove(self, key: tuple[str, int]) -> None:
        _, size = self._by_key.pop(key)
        self._held_back.pop(key, None)
        self._nbytes -= size
        seqs = self._seqs[key[0]]
        del seqs[bisect.bisect_left(seqs, key[1])]
        if not seqs:
            del self._seqs[key[0]]
