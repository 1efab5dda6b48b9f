"""What each remote gave us and what it cost us: the contribution ledger (open runs against a crowd).

In an open run an identity costs nothing, so nothing may be shared per PeerID alone: pull slots
(net/gossip/pulls.py) and the uplink (net/admission/uplink.py) go by what a remote DID for us, as recorded
here. Pure: no asyncio, no I/O; every method takes `now` (default: the ledger's `clock`). Owned by the
`PeerGuard` (`guard.ledger`), so every path that has a guard records into one ledger; it is a table of its own,
so the guard forgetting a remote's buckets (`max_tracked_peers`) forgets nothing here.

An account per remote PeerID (the transport identity libp2p authenticated, never a payload's claim):
  given  verified things it brought us: updates that merged or were buffered here (`gave`), snapshots whose
         every chunk verified (`gave_snapshot`), with their bytes;
  cost   what we served it (`served`, `served_update`, `served_chunk`): bytes, and separately bytes we served
         it AGAIN (an update at or below the high-water mark of what we already sent it of that sender, a
         snapshot chunk index we already sent it), plus its failures (`failed`: a pull that timed out, one that
         brought nothing of what it claimed, a refusal, a broken stream, invalid data);
  first_seen  when this ledger first met it (membership age; a forgotten newcomer starts again).

  score = given_bytes - SERVE_WEIGHT * served_bytes - RESERVE_WEIGHT * reserved_bytes - sum(FAILURE_BYTES)
in bytes: a byte given counts 1, a byte served 1/2 (an honest peer takes from any one remote more than it gives
it: gossip brings each update from whoever announced it first), a byte served again 2 more, and each failure
what a slot could have brought meanwhile (FAILURE_BYTES). Scores order contributors; nothing is refused on a
score alone.

Bounds, whatever the number of identities: remotes that never gave anything (newcomers) live in an LRU of
`max_newcomers`; the first verified gift moves an account to the contributors' table (`max_contributors`),
where eviction drops the lowest score, so a flood of fresh keys only churns the newcomers' LRU and can never
evict a contributor. Invalid data demotes a contributor back to the newcomers. The re-serve marks are LRU
tables of their own (`max_marks`).

Who counts in votes and in the swarm's size is not decided here but by what the senders' own updates earned
in the merge (sync/standing.py `Standing.proven`): relaying is a contribution to the uplink, not a vote.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

SERVE_WEIGHT = 0.5
"""Score cost of one byte served."""
RESERVE_WEIGHT = 2.0
"""Extra score cost of one byte served again (the remote had it from us already)."""
FAILURE_BYTES = {"timeout": 1 << 20, "empty": 256 << 10, "error": 256 << 10, "refused": 64 << 10,
                 "invalid": 64 << 20}
"""Score cost of one failure, by kind: a pull that timed out or kept too slow a pace, one that brought nothing
of what the remote claimed, a broken stream, a refusal, invalid data (which also demotes a contributor)."""
MAX_NEWCOMERS = 4096
MAX_CONTRIBUTORS = 16384
MAX_MARKS = 1 << 15


@dataclass
class Account:
    """One remote's record (bytes are encoded sizes)."""

    first_seen: float
    last_seen: float
    gave_updates: int = 0
    gave_bytes: int = 0
    gave_snapshots: int = 0
    snapshot_bytes: int = 0
    last_gave: float = -math.inf
    served_updates: int = 0
    served_bytes: int = 0
    reserved_updates: int = 0
    reserved_bytes: int = 0
    timeout: int = 0
    empty: int = 0
    error: int = 0
    refused: int = 0
    invalid: int = 0

    @property
    def given(self) -> int:
        return self.gave_bytes + self.snapshot_bytes

    @property
    def cost(self) -> float:
        failures = sum(getattr(self, kind) * nbytes for kind, nbytes in FAILURE_BYTES.items())
        return SERVE_WEIGHT * self.served_bytes + RESERVE_WEIGHT * self.reserved_bytes + failures

    @property
    def score(self) -> float:
        return self.given - self.cost

    @property
    def failures(self) -> int:
        return sum(getattr(self, kind) for kind in FAILURE_BYTES)


class Ledger:
    """The contribution ledger (see the module docstring)."""

    def __init__(self, *, max_newcomers: int = MAX_NEWCOMERS, max_contributors: int = MAX_CONTRIBUTORS,
                 max_marks: int = MAX_MARKS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if min(max_newcomers, max_contributors, max_marks) < 1:
            raise ValueError("every ledger bound must be >= 1")
        self.max_newcomers, self.max_contributors = max_newcomers, max_contributors
        self.max_marks = max_marks
        self.clock = clock
        self._newcomers: OrderedDict[str, Account] = OrderedDict()  # least recently seen first
        self._contributors: dict[str, Account] = {}
        self._update_marks: OrderedDict[tuple[str, str], int] = OrderedDict()  # (remote, sender) -> highest seq sent
        self._chunk_marks: OrderedDict[tuple[str, int], None] = OrderedDict()  # (remote, chunk index) sent
        self.evicted = {"newcomers": 0, "contributors": 0}

    def __len__(self) -> int:
        return len(self._newcomers) + len(self._contributors)

    def _now(self, now: float | None) -> float:
        return self.clock() if now is None else now

    # ---- reading ------------------------------------------------------------------------------------------

    def account(self, peer: str) -> Account | None:
        """The account of `peer` (live: do not edit), or None if this ledger does not know it (now)."""
        return self._contributors.get(peer) or self._newcomers.get(peer)

    def is_contributor(self, peer: str) -> bool:
        """True if `peer` gave us something verified and has not sent invalid data since."""
        return peer in self._contributors

    def score(self, peer: str) -> float:
        """`peer`'s score (module docstring); 0 for a remote this ledger does not know."""
        account = self.account(peer)
        return account.score if account is not None else 0.0

    def age(self, peer: str, now: float | None = None) -> float:
        """Seconds since this ledger first met `peer` (0 if it does not know it)."""
        account = self.account(peer)
        return self._now(now) - account.first_seen if account is not None else 0.0

    def top(self, k: int) -> list[str]:
        """The `k` contributors with the best scores, best first (O(contributors))."""
        return heapq.nlargest(k, self._contributors, key=lambda p: self._contributors[p].score) if k > 0 else []

    def summary(self) -> dict[str, int]:
        return {"contributors": len(self._contributors), "newcomers": len(self._newcomers),
                **{f"evicted_{k}": n for k, n in self.evicted.items()}}

    # ---- recording ----------------------------------------------------------------------------------------

    def seen(self, peer: str, now: float | None = None) -> Account:
        """`peer`'s account, created (a newcomer) if this ledger does not know it; refreshes its LRU place."""
        now = self._now(now)
        account = self._contributors.get(peer)
        if account is None:
            account = self._newcomers.pop(peer, None) or Account(now, now)
            self._newcomers[peer] = account
            while len(self._newcomers) > self.max_newcomers:
                self._newcomers.popitem(last=False)
                self.evicted["newcomers"] += 1
        account.last_seen = now
        return account

    def gave(self, peer: str, n: int, nbytes: int, now: float | None = None) -> None:
        """`peer` brought `n` updates new to us (merged or buffered) of `nbytes` in all: it is a contributor."""
        if n <= 0:
            return
        now = self._now(now)
        account = self._promote(peer, now)
        account.gave_updates += n
        account.gave_bytes += max(0, nbytes)
        account.last_gave = now

    def gave_snapshot(self, peer: str, nbytes: int, now: float | None = None) -> None:
        """`peer` served us a snapshot whose every chunk verified (`nbytes` of theta)."""
        now = self._now(now)
        account = self._promote(peer, now)
        account.gave_snapshots += 1
        account.snapshot_bytes += max(0, nbytes)
        account.last_gave = now

    def served(self, peer: str, nbytes: int, *, again: bool = False, n: int = 1, now: float | None = None) -> None:
        """We sent `peer` `n` things of `nbytes` in all; `again`: it had them from us already."""
        account = self.seen(peer, now)
        account.served_updates += n
        account.served_bytes += max(0, nbytes)
        if again:
            account.reserved_updates += n
            account.reserved_bytes += max(0, nbytes)

    def served_update(self, peer: str, sender: str, seq: int, nbytes: int, now: float | None = None) -> bool:
        """We sent `peer` update (sender, seq); True if that was a re-serve (seq at or below what we already
        sent it of `sender`: a hole filled late counts too, which is rare and cheap)."""
        key = (peer, sender)
        mark = self._update_marks.pop(key, 0)
        again = seq <= mark
        self._update_marks[key] = max(mark, seq)
        self._trim(self._update_marks)
        self.served(peer, nbytes, again=again, now=now)
        return again

    def served_chunk(self, peer: str, index: int, nbytes: int, now: float | None = None) -> bool:
        """We sent `peer` snapshot chunk `index` (of any snapshot); True if it had that index from us already."""
        key = (peer, index)
        again = key in self._chunk_marks
        self._chunk_marks.pop(key, None)
        self._chunk_marks[key] = None
        self._trim(self._chunk_marks)
        self.served(peer, nbytes, again=again, now=now)
        return again

    def failed(self, peer: str, kind: str, now: float | None = None) -> None:
        """A failure of `peer`'s, one of FAILURE_BYTES' kinds; "invalid" demotes a contributor."""
        if kind not in FAILURE_BYTES:
            raise ValueError(f"unknown failure kind {kind!r}")
        now = self._now(now)
        account = self._contributors.pop(peer, None) if kind == "invalid" else None
        if account is not None:  # back among the newcomers, with its record
            self._newcomers[peer] = account
        account = self.seen(peer, now)
        setattr(account, kind, getattr(account, kind) + 1)

    # ---- helpers ------------------------------------------------------------------------------------------

    def _promote(self, peer: str, now: float) -> Account:
        account = self._contributors.get(peer)
        if account is None:
            account = self._newcomers.pop(peer, None) or Account(now, now)
            if len(self._contributors) >= self.max_contributors:  # the least useful goes (O(contributors))
                worst = min(self._contributors, key=lambda p: self._contributors[p].score)
                del self._contributors[worst]
                self.evicted["contributors"] += 1
            self._contributors[peer] = account
        account.last_seen = now
        return account

    def _trim(self, marks: OrderedDict) -> None:
        while len(marks) > self.max_marks:
            marks.popitem(last=False)
