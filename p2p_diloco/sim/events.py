"""A discrete-event queue on a simulated clock: the simulator's only notion of time."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventQueue:
    """Run callbacks in simulated-time order; ties run in the order they were pushed (deterministic)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._counter = itertools.count()

    def push(self, at: float, fn: Callable[..., Any], *args: Any) -> None:
        if at < self.now:
            raise ValueError(f"cannot schedule in the past: {at} < {self.now}")
        heapq.heappush(self._heap, (at, next(self._counter), fn, args))

    def run(self, max_events: int = 10_000_000) -> None:
        """Run until nothing is scheduled (bounded, so a scheduling bug cannot spin forever)."""
        for _ in range(max_events):
            if not self._heap:
                return
            at, _, fn, args = heapq.heappop(self._heap)
            self.now = at
            fn(*args)
        raise RuntimeError(f"event queue did not drain after {max_events} events")

    def __len__(self) -> int:
        return len(self._heap)
