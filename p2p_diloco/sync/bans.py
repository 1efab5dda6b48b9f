"""The replica's bans (rules 3-5 of sync/replica.py): who is banned, the equivocations seen, and the listeners
told of each ban. A ban is recorded under the replica's lock and queued; its listeners run once the call that
banned has released the lock (`delivers_bans`), so a listener may call back into the replica (the take-back of
an equivocated slot, `Intake._on_ban`, does)."""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from p2p_diloco.sync.types import Conflict, UpdateLike

logger = logging.getLogger(__name__)

MAX_CONFLICTS = 16
"""Equivocations whose updates are kept for `Intake` to turn into evidence (the most recent ones)."""

_P = ParamSpec("_P")
_R = TypeVar("_R")
_S = TypeVar("_S", bound="HoldsBans")


class Bans:
    """Banned senders, equivocation records and ban listeners; written under `lock` (the replica's)."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self.banned: set[str] = set()
        self.evidence: dict[str, tuple[bytes, bytes]] = {}  # sender -> (earlier id, later id)
        self.conflicts: OrderedDict[str, Conflict] = OrderedDict()
        self._listeners: list[Callable[[str], None]] = []
        self._to_deliver: deque[str] = deque()  # banned under the lock, listeners not yet called
        # One thread delivers at a time, and a caller waits for the one delivering: else a call could return
        # while another thread still runs its ban's listener (the proof not kept yet, the take-back not done).
        # Re-entrant: a listener calls back into the replica, whose methods deliver too.
        self._delivering = threading.RLock()

    def add_listener(self, listener: Callable[[str], None]) -> None:
        self._listeners.append(listener)

    def ban(self, sender: str) -> None:
        """Under the lock: ban `sender` and queue its listeners' call."""
        self.banned.add(sender)
        self._to_deliver.append(sender)

    def equivocation(self, sender: str, seq: int, known_id: bytes, known: UpdateLike | None,
                     update: UpdateLike) -> None:
        """Under the lock: record the two ids, and the updates held, of an equivocation (the caller bans)."""
        self.evidence.setdefault(sender, (known_id, update.update_id))
        if sender not in self.conflicts:
            self.conflicts[sender] = Conflict(seq=seq, first_id=known_id, first=known, second=update)
            while len(self.conflicts) > MAX_CONFLICTS:
                self.conflicts.popitem(last=False)

    def pop_conflict(self, sender: str) -> Conflict | None:
        with self.lock:
            return self.conflicts.pop(sender, None)

    def deliver(self) -> None:
        """Call the listeners of the queued bans, outside the lock: when this thread holds it (a caller holds
        it around the call that banned, as the repair's `load`), the next call that releases it delivers."""
        # RLock's ownership test is CPython's (no public one) and absent from typeshed's stubs.
        if self.lock._is_owned():  # type: ignore[attr-defined]
            return
        with self._delivering:
            while True:
                try:
                    sender = self._to_deliver.popleft()  # each ban is delivered once
                except IndexError:
                    return
                for listener in self._listeners:
                    try:
                        listener(sender)
                    except Exception:  # a listener's bug must not undo or skip the ban
                        logger.exception("ban listener failed sender=%s", sender)


class HoldsBans(Protocol):
    """What `delivers_bans` decorates the methods of (the replica)."""

    bans: Bans


def delivers_bans(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """Decorates a replica method: deliver the bans it queued, once it has released the lock."""
    @functools.wraps(method)
    def wrapper(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(self, *args, **kwargs)
        finally:
            self.bans.deliver()
    return wrapper
