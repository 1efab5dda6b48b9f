"""Who gets the next pull slot (by track record: ARCHITECTURE.md "Who counts"). Pure: no asyncio, `now` passed in.

An announce is a hint, not a claim on a slot. `PullSlots` keeps the wishes (what each remote said it holds;
a wish keeps its place when the remote announces again, its vectors merged) and each remote's backoff, and
`pick` says whom to start, given who is running and what the ledger says:
  - a remote whose pull timed out, was refused, broke, or brought nothing of what it claimed backs off:
    BACKOFF_MIN_S, doubling up to BACKOFF_MAX_S, reset by a pull that brought something new; while it backs
    off its announces are merged into its wish but start nothing;
  - contributors (ledger.is_contributor: they gave us verified data) start first, best score first (ties:
    oldest wish first), and may use every slot;
  - every other remote waits in the order it first wished, and all of them together use at most `probation`
    slots (at least 1: a new honest volunteer is still pulled from), counted over the pulls running now (a
    newcomer whose pull brought something is a contributor at once and frees the probation slot);
  - at most MAX_WANTED_PEERS wishes; a newcomer's wish goes first when there are more (anti-entropy repairs it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection

from p2p_diloco.sync.version_vector import VersionVector

BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 60.0
MAX_WANTED_PEERS = 1024
"""Remotes waiting for a pull slot, at most."""
MAX_BACKOFFS = 4096
"""Remotes whose backoff is remembered, at most (least recently failed forgotten first)."""


class PullSlots:
    """Wishes, backoffs and the choice of the next pulls (see the module docstring)."""

    def __init__(self, max_pulls: int, probation: int) -> None:
        self.max_pulls, self.probation = max_pulls, max(1, min(probation, max_pulls))
        self.wanted: OrderedDict[str, tuple[VersionVector, bool]] = OrderedDict()  # first wish first
        self._backoff: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer -> (until, delay_s)

    def clear(self) -> None:
        self.wanted.clear()
        self._backoff.clear()

    def want(self, peer: str, remote: VersionVector, force: bool, is_contributor: Callable[[str], bool]) -> int:
        """Remember that `peer` holds `remote` (`force`: pull even if that looks like nothing new); returns the
        number of wishes dropped to stay within MAX_WANTED_PEERS."""
        pending = self.wanted.get(peer)
        if pending is not None:  # keeps its place
            self.wanted[peer] = (pending[0].merge(remote), force or pending[1])
            return 0
        self.wanted[peer] = (remote, force)
        dropped = 0
        while len(self.wanted) > MAX_WANTED_PEERS:
            victim = next((p for p in self.wanted if not is_contributor(p)), next(iter(self.wanted)))
            del self.wanted[victim]
            dropped += 1
        return dropped

    def pop(self, peer: str) -> tuple[VersionVector, bool] | None:
        return self.wanted.pop(peer, None)

    # ---- backoff ------------------------------------------------------------------------------------------

    def failed(self, peer: str, now: float, *, grow: bool = True) -> float:
        """A pull from `peer` failed or brought nothing it claimed: back off (doubling; `grow=False`: the
        shortest backoff, e.g. a contributor that was busy); returns the delay."""
        previous = self._backoff.pop(peer, None)
        delay = BACKOFF_MIN_S if previous is None or not grow else min(BACKOFF_MAX_S, 2 * previous[1])
        self._backoff[peer] = (now + delay, delay)
        while len(self._backoff) > MAX_BACKOFFS:
            self._backoff.popitem(last=False)
        return delay

    def succeeded(self, peer: str) -> None:
        """A pull from `peer` brought something new: no more backoff."""
        self._backoff.pop(peer, None)

    def backoff_until(self, peer: str, now: float) -> float | None:
        """When `peer`'s backoff ends, if it is backing off at `now`."""
        entry = self._backoff.get(peer)
        return entry[0] if entry is not None and entry[0] > now else None

    def delay(self, peer: str) -> float:
        """`peer`'s last backoff delay (0 if none remembered)."""
        entry = self._backoff.get(peer)
        return entry[1] if entry is not None else 0.0

    # ---- choosing -----------------------------------------------------------------------------------------

    def pick(self, running: Collection[str], now: float, is_contributor: Callable[[str], bool],
             score: Callable[[str], float]) -> tuple[list[str], float | None]:
        """The remotes to start now, and when a backoff of a remaining wish ends (None if none)."""
        free = self.max_pulls - len(running)
        wake: float | None = None
        if free <= 0:
            return [], None
        probation_free = self.probation - sum(1 for p in running if not is_contributor(p))
        contributors: list[str] = []
        newcomers: list[str] = []
        for peer in self.wanted:
            if peer in running:
                continue
            until = self.backoff_until(peer, now)
            if until is not None:
                wake = until if wake is None else min(wake, until)
            elif is_contributor(peer):
                contributors.append(peer)
            elif len(newcomers) < probation_free:
                newcomers.append(peer)
        contributors.sort(key=score, reverse=True)  # stable: among equal scores, the oldest wish first
        picked = contributors[:free]
        picked += newcomers[:max(0, min(free - len(picked), probation_free))]
        return picked, wake

    def may_start(self, peer: str, running: Collection[str], now: float,
                  is_contributor: Callable[[str], bool]) -> bool:
        """Cheap check before a full `pick`: could `peer`'s fresh wish start now (a free slot of its class, no
        backoff)? False saves a scan of every wish on each announce of a crowd."""
        if peer in running or len(running) >= self.max_pulls or self.backoff_until(peer, now) is not None:
            return False
        return is_contributor(peer) or sum(1 for p in running if not is_contributor(p)) < self.probation
