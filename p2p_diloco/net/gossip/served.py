"""What we served each remote lately: no remote gets the same update more than twice in a window.

A remote that pulls with an empty (or stale) vector over and over would otherwise be sent everything we hold at
every pull: the newcomers' share of our uplink spent on bytes it already has. An honest peer pulls an update
from us once (its vector names it afterwards), twice when a stream broke or its gap buffer dropped it; so an
update already served to a remote `max_serves` times within `window_s` is skipped in its batches (the batch
goes on with the next update), and counted.

A remote proves it lost what we sent it (a restart from an older checkpoint, a repair that adopted another
replica's state) by a vector that holds less than the last one it sent us (`KnownVectors`): that clears its
record, at most once per window. A freeloader may fake such a fall, but only once per window: it then gets
each update at most 2 * `max_serves` times per window instead of `max_serves`, where it used to get it at every
pull; the lie also hides nothing (we pull back whatever its vector claims beyond ours).

Bounds, whatever the number of identities: at most `max_remotes` remotes and `max_entries` (remote, update)
marks in all. The remote served least recently is forgotten first (a crowd of fresh keys churns itself out;
a looping puller, served at every pull, stays remembered). Forgetting errs toward serving.

Pure: no asyncio, no I/O; every method takes `now` (default: `clock`). Not thread-safe: the gossip's loop owns it.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

SERVE_WINDOW_S = 600.0
"""The window over which serves of one update to one remote are counted."""
MAX_SERVES_PER_WINDOW = 2
"""Serves of one update to one remote within the window; further requests for it are skipped."""
MAX_REMOTES = 1024
MAX_ENTRIES = 1 << 16

Key = tuple[str, int]  # (sender, seq)


@dataclass
class Served:
    """One remote's record: when we served it each update (its last `max_serves` times, oldest first)."""

    marks: OrderedDict[Key, tuple[float, ...]] = field(default_factory=OrderedDict)
    skipped: int = 0  # requests for an update it had from us max_serves times within the window
    resets: int = 0  # times it proved it lost what we served it
    last_reset: float = -math.inf


class ServedLog:
    """Per remote, which updates we served it and when (see the module docstring). `window_s=0` serves every
    request (what the gossip did before this rule)."""

    def __init__(self, *, window_s: float = SERVE_WINDOW_S, max_serves: int = MAX_SERVES_PER_WINDOW,
                 max_remotes: int = MAX_REMOTES, max_entries: int = MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window_s < 0 or min(max_serves, max_remotes, max_entries) < 1:
            raise ValueError("need window_s >= 0 and max_serves, max_remotes, max_entries >= 1")
        self.window_s, self.max_serves = window_s, max_serves
        self.max_remotes, self.max_entries = max_remotes, max_entries
        self.clock = clock
        self._remotes: OrderedDict[str, Served] = OrderedDict()  # least recently served first
        self._entries = 0
        self.evicted = 0  # marks forgotten for the bounds

    def __len__(self) -> int:
        return self._entries

    def _now(self, now: float | None) -> float:
        return self.clock() if now is None else now

    def _recent(self, times: tuple[float, ...], now: float) -> tuple[float, ...]:
        return tuple(t for t in times if now - t < self.window_s)

    def allowed(self, remote: str, sender: str, seq: int, now: float | None = None) -> bool:
        """May we serve `remote` the update (sender, seq) now? False: it had it `max_serves` times within the
        window. Counts nothing (see `skip`)."""
        record = self._remotes.get(remote)
        if record is None or self.window_s <= 0:
            return True
        times = record.marks.get((sender, seq))
        return times is None or len(self._recent(times, self._now(now))) < self.max_serves

    def skip(self, remote: str, count: int = 1) -> None:
        """`count` requested updates were not served to `remote` (they were not `allowed`)."""
        record = self._remotes.get(remote)
        if record is not None:
            record.skipped += count

    def record(self, remote: str, sender: str, seq: int, now: float | None = None) -> None:
        """We just sent `remote` the update (sender, seq)."""
        if self.window_s <= 0:
            return
        now = self._now(now)
        record = self._remotes.pop(remote, None) or Served()
        self._remotes[remote] = record  # now the most recently served
        key = (sender, seq)
        times = record.marks.pop(key, None)
        if times is None:
            self._entries += 1
            times = ()
        record.marks[key] = (*self._recent(times, now), now)[-self.max_serves:]
        self._evict()

    def lost(self, remote: str, now: float | None = None) -> bool:
        """`remote` showed a vector holding less than its last one: forget what we served it, unless it did so
        within the window already. True if its record was cleared."""
        record = self._remotes.get(remote)
        now = self._now(now)
        if record is None or not record.marks or now - record.last_reset < self.window_s:
            return False
        self._entries -= len(record.marks)
        record.marks.clear()
        record.resets += 1
        record.last_reset = now
        return True

    def summary(self, remote: str) -> dict[str, int]:
        """What `status` can show of one remote: updates marked, requests skipped, resets."""
        record = self._remotes.get(remote)
        if record is None:
            return {"marked": 0, "skipped": 0, "resets": 0}
        return {"marked": len(record.marks), "skipped": record.skipped, "resets": record.resets}

    def _evict(self) -> None:
        while len(self._remotes) > self.max_remotes:
            _, gone = self._remotes.popitem(last=False)
            self._entries -= len(gone.marks)
            self.evicted += len(gone.marks)
        while self._entries > self.max_entries:  # the oldest marks of the least recently served remote
            peer, record = next(iter(self._remotes.items()))
            if record.marks:
                record.marks.popitem(last=False)
                self._entries -= 1
                self.evicted += 1
            if not record.marks:
                del self._remotes[peer]
