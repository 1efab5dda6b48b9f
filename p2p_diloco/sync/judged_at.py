"""Where a sponsor judges proposals (sync/sponsorship.py): COPY_SAMPLE coordinates drawn from a secret of its key,
again every TURN_EVERY rounds.

What a sponsor relays is a proposal's whole step, but it reads only a sample of it. The copy test's sample is fixed
and public (sync/copies.py: every replica must read the same), so work honest there and negated everywhere else was
judged honest and relayed whole (BENCHMARKS "Judged where nobody can aim": +7.4%, +44% at the norm bound). A
secret sample fixed for the run could still be learned: sponsors publish their values, and a crowd that varies one
honest proposal's coordinates and reads the values could locate it in ~4,096 log2(N / 4,096) answers (~40,000 bits
for a 1M-parameter model), some hundreds of rounds at 64 proposals a round. So the sample is drawn again every
TURN_EVERY rounds: no set of coordinates is read long enough to be found.

What a sponsor compares across rounds (its copy window, the sponsors' latest updates) must be at the coordinates of
the round that compares it. In the last round before a turn, updates are also gathered at the next coordinates
(drawn a period ahead, just as secret), in the screening pass that reads them anyway (sync/decoded.py); `rotate`
then makes those the current ones. Turning every round cost 1.3x in judging at N = 64 on `test`; every TURN_EVERY
rounds, 1/TURN_EVERY of that.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from p2p_diloco.sync.copies import copy_coordinates
from p2p_diloco.sync.decoded import Decoded
from p2p_diloco.sync.echoes import echoing
from p2p_diloco.sync.worth import Along, along, worths

TURN_EVERY = 8
"""Rounds a sponsor judges at one set of coordinates. At most ~64 proposals' values a round tell about them: some
hundreds of bits a set, against the tens of thousands it takes to locate one."""


class JudgedAt:
    """A sponsor's coordinates: this period's (`now`) and, in its last round, the next period's, from `seed` (keep it
    secret). `round`: relays so far."""

    def __init__(self, seed: int, every: int = TURN_EVERY) -> None:
        self.seed, self.every, self.round = seed, every, 0
        self.numel = 0  # of the payloads drawn for
        self._now: Tensor | None = None
        self._gather: Tensor | None = None  # `_now`, or `_now` and the next period's in a period's last round

    @property
    def turning(self) -> bool:
        """The relay that ends this round turns to new coordinates."""
        return (self.round + 1) % self.every == 0

    def both(self, numel: int) -> Tensor:
        """Where to gather an update's values: this period's coordinates, followed in a period's last round by the
        next period's."""
        if self._gather is None or numel != self.numel:
            self.numel = numel
            self._now = self._draw(self.round // self.every)
            self._gather = self._with_next()
        return self._gather

    def now(self, numel: int) -> Tensor:
        """This period's coordinates."""
        self.both(numel)
        assert self._now is not None
        return self._now

    def ahead(self, numel: int) -> Tensor:
        """The next period's coordinates."""
        self.both(numel)
        return self._draw(self.round // self.every + 1)

    def owns(self, at: Tensor | None) -> bool:
        """`at` is this period's coordinates (not a caller's own choice): what a sponsor holds moves when it turns."""
        return at is not None and at is self._now

    def split(self, values: Tensor, at: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(values now, values at the next period's coordinates or None, this period's coordinates) of `values`
        gathered at `at`; a caller's own `at` (not `both`'s) is all now."""
        if at is None or at is not self._gather or self._now is None:
            return values, None, at
        k = self._now.numel()
        return (values[:k], values[k:], self._now) if values.numel() > k else (values, None, self._now)

    def rotate(self) -> bool:
        """A relay: the round ends. Returns whether it turned: the next period's coordinates are this period's now."""
        self.round += 1
        turned = self.round % self.every == 0
        if self._now is not None and self._gather is not None:
            if turned:
                self._now = self._gather[self._now.numel():] if self._gather.numel() > self._now.numel() \
                    else self._draw(self.round // self.every)
            self._gather = self._with_next()
        return turned

    def _with_next(self) -> Tensor:
        assert self._now is not None
        return torch.cat([self._now, self._draw(self.round // self.every + 1)]) if self.turning else self._now

    def _draw(self, period: int) -> Tensor:
        """A period's coordinates, from a digest of (seed, period): one period's tell nothing of another's."""
        digest = hashlib.sha256(f"judged-at/{self.seed}/{period}".encode()).digest()
        return copy_coordinates(self.numel, int.from_bytes(digest[:8], "big") >> 2)


class Latest:
    """Each sponsor's latest update as a sponsor judges by it (sync/sponsorship.py): its sample at this period's
    coordinates (`now`), at the next period's if it came in a period's last round, and a reference to another
    sponsor's step, to read again when the coordinates turn before a newer one came."""

    def __init__(self) -> None:
        self.now: dict[str, Tensor] = {}
        self._ahead: dict[str, Tensor] = {}
        self._steps: dict[str, tuple[Tensor | Decoded, float]] = {}
        self._basis: tuple[Along | None, float] | None = None

    def basis(self) -> tuple[Along | None, float]:
        """Their sum, as a direction to judge by, and one update's mean length (not the sum's), until one changes."""
        if self._basis is None:
            latest = list(self.now.values())
            self._basis = along(torch.stack(latest).sum(0)), sum(float(x.norm()) for x in latest) / len(latest)
        return self._basis

    def set(self, author: str, now: Tensor, ahead: Tensor | None, step: Tensor | Decoded | None, factor: float) -> None:
        self.now[author], self._basis = now, None
        self._ahead.pop(author, None)
        if ahead is not None:
            self._ahead[author] = ahead
        if step is not None:
            self._steps[author] = (step, factor)

    def rotate(self, at: Tensor | None) -> None:
        """The coordinates turned: each sample at the new ones `at` (read again from its step if not gathered there
        ahead; dropped if its step is not held: our own, whose next update comes right after the turn)."""
        self._basis = None
        for author in list(self.now):
            if author in self._ahead:
                self.now[author] = self._ahead.pop(author)
            elif author in self._steps and at is not None:
                step, factor = self._steps[author]
                self.now[author] = Decoded.of(step).take(at) * factor
            else:
                del self.now[author]

    def worths(self, samples: Tensor, direction: Along | None, self_id: str, own_length: float, fresh: list[Tensor],
               echo_of: float, share: float, proven: float) -> list[tuple[float, float]]:
        """(v, keep) of each row of `samples` at sponsor `self_id` (sync/sponsorship.py): a proposal's value and the
        share of a graduate's step to relay. Once it knows theta's recent moves (`fresh`), by the cosine of its part
        outside them with `direction` (its pseudo-gradient of the proposal's phase, the same part), nothing for an
        echo (|cos| >= `echo_of` with a sponsor's latest update's new part); before, by its cosine with the sum of
        the sponsors' latest updates or, if larger, with `direction`. Lengths are held to one sponsor update's, and
        to `own_length` (the sponsor's own work without what it carried) when known."""
        if self_id not in self.now:
            return [(0.0, 0.0)] * samples.shape[0]  # no work of our own yet to judge by
        basis, length = self.basis()
        if own_length > 0:
            length = min(length, own_length)
        if fresh:  # only what is new is worth anything: an echo of theta's recent moves is not
            # Only the sponsors' updates: honest proposals of one phase share what none of them has merged yet,
            # and their new parts are as near each other (up to 0.82) as an echo's is to its source's.
            echoes = echoing(samples, fresh, torch.stack(list(self.now.values())), echo_of)
            return worths(samples, fresh, (direction,), length, share, proven, echoes)
        return worths(samples, [], (basis, direction), length, share, proven)
