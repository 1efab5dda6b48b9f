"""A unit that shares its machine computes only part of the time: BOINC's "use at most N% of the CPU time".

Volunteers run units on machines they also use (a desktop, a shared lab box, a laptop on battery). With
`training.duty_cycle` d < 1 the unit rests after each inner step for as long as the step's share says,
`busy * (1 - d) / d`, so that over a phase it computes d of the wall time. Only the inner steps are paced: the
outer step, evaluation and the grace window are not, and the network loop never rests (it keeps serving and
merging). The rest is a wait on the peer's stop event, so Ctrl-C ends it at once.
"""

from __future__ import annotations


class Pace:
    """The rest after each inner step, for a unit computing `duty_cycle` of the wall time (1: never rests)."""

    def __init__(self, duty_cycle: float = 1.0) -> None:
        if not 0.0 < duty_cycle <= 1.0:
            raise ValueError(f"duty_cycle must be in (0, 1], got {duty_cycle}")
        self.duty_cycle = duty_cycle
        self._busy_since: float | None = None

    def begin(self, now: float) -> None:
        """A phase begins at `now`: what came before it (waiting, the last outer step) is not paced."""
        self._busy_since = now

    def rest_s(self, now: float) -> float:
        """An inner step ended at `now`: seconds to rest before the next one."""
        if self.duty_cycle >= 1.0 or self._busy_since is None:
            self._busy_since = now
            return 0.0
        rest = max(0.0, now - self._busy_since) * (1.0 - self.duty_cycle) / self.duty_cycle
        self._busy_since = now + rest
        return rest
