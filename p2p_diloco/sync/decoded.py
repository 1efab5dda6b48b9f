"""An update's decoded payload, read a chunk at a time (ARCHITECTURE.md "Memory").

Screening, the standing and the merge read a decoded payload: its peak, its norm, its values at fixed sampled
coordinates, and its chunks for the axpy. `Decoded` gives all of them without a full-size float32 vector: from
the payload bytes, one chunk decoded at a time (`Codec.decompress_range`), or from a tensor already decoded (the
sender's own update, a clip policy's input). Both read the same chunks, bit for bit the whole decode's values,
in the same order, so every number they give (a float64 sum of squares included) is the same on every replica
whichever path it took there. A remote update then costs a receiver a chunk (16 MB) at a time, not 4 bytes per
parameter, at the price of decoding it twice: screening's pass (outside the replica's lock) finds the peak and
the norm and takes the standing's sampled coordinates (`want`), and the axpy's pass under the lock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from p2p_diloco.wire.codecs import Codec, Payload

CHUNK = 1 << 22
"""Values per chunk (16 MB of float32); sync/accumulator.py's merge reads these chunks."""


class Decoded:
    """A decoded payload of `numel` float32 values: `chunks()`, `peak()`, `norm()`, `take(at)`, `whole()`."""

    def __init__(self, numel: int, read: Callable[[slice], Tensor], tensor: Tensor | None = None) -> None:
        self.numel = numel
        self._read = read
        self._tensor = tensor
        self._stats: tuple[float, float] | None = None  # (peak, norm), from one pass
        self._single: Tensor | None = None  # a payload of one chunk, decoded once
        self._wanted: list[Tensor] = []  # index sets the first pass also takes (`want`)
        self._taken: dict[int, tuple[Tensor, Tensor]] = {}  # id(at) -> (at, its values)

    @classmethod
    def of(cls, x: Tensor | Decoded) -> Decoded:
        """`x` itself, or a flat float32 tensor read in place."""
        if isinstance(x, Decoded):
            return x
        flat = x.detach().reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        return cls(flat.numel(), lambda part: flat[part], tensor=flat)

    @classmethod
    def stream(cls, codec: Codec, payload: Payload, numel: int) -> Decoded:
        """Decoded from the bytes on each read (a chunk at a time). Raises what `decompress_range` raises on
        a malformed payload: the first read of every chunk (`peak`) finds it, before anything merges."""
        def read(part: slice) -> Tensor:
            values = codec.decompress_range(payload, numel, part)
            if not isinstance(values, Tensor) or values.shape != (part.stop - part.start,):
                raise ValueError(f"{codec.name}: decoded {type(values).__name__} does not fit values {part}")
            return values.detach().to(torch.float32)

        return cls(numel, read)

    @property
    def materialized(self) -> Tensor | None:
        """The tensor it reads, when it reads one (None: it decodes the payload on each read)."""
        return self._tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.numel])

    def chunks(self) -> Iterator[tuple[slice, Tensor]]:
        """(slice, its float32 values), CHUNK values at a time, in order."""
        if self._tensor is None and self.numel <= CHUNK:
            if self._single is None:
                self._single = self._read(slice(0, self.numel))
            yield slice(0, self.numel), self._single
            return
        for start in range(0, self.numel, CHUNK):
            part = slice(start, min(self.numel, start + CHUNK))
            yield part, self._read(part)

    def want(self, *ats: Tensor) -> None:
        """Take the values at these index sets in the first pass (`peak`), so a later `take` of the same tensor
        reads no chunk again: screening runs that pass outside the replica's lock, the standing takes under it."""
        if self._stats is None and self._tensor is None:
            self._wanted.extend(ats)

    def _scan(self) -> tuple[float, float]:
        if self._stats is None:
            top, squares = 0.0, 0.0
            gathers = [(at, *_sorted(at), torch.empty(at.numel(), dtype=torch.float32)) for at in self._wanted]
            for part, values in self.chunks():
                for _, order, ordered, out in gathers:
                    _gather(part, values, order, ordered, out)
                if not values.numel():
                    continue
                here = float(torch.linalg.vector_norm(values, ord=math.inf))
                if not math.isfinite(here):  # inf or nan: nothing more to learn, and max() would drop a nan
                    top, squares = math.inf, math.inf
                    break
                wide = values.double()  # float64 sums: the same on every replica's path, and exact enough
                top, squares = max(top, here), squares + float(wide.mul_(wide).sum())
            self._stats = (top, math.sqrt(squares))
            self._taken = {id(at): (at, out) for at, _, _, out in gathers}
            self._wanted = []
        return self._stats

    def peak(self) -> float:
        """max |x_i| (inf or nan if some value is not finite)."""
        return self._scan()[0]

    def norm(self) -> float:
        """The L2 norm, summed in float64 chunk by chunk."""
        return self._scan()[1]

    def take(self, at: Tensor) -> Tensor:
        """The values at indices `at` (a 1-D int64 tensor, any order, repeats allowed)."""
        if self._tensor is not None:
            return self._tensor[at]
        kept = self._taken.get(id(at))
        if kept is not None and kept[0] is at:
            return kept[1]
        out = torch.empty(at.numel(), dtype=torch.float32)
        order, ordered = _sorted(at)
        for part, values in self.chunks():
            _gather(part, values, order, ordered, out)
        return out

    def whole(self) -> Tensor:
        """All the values as one tensor (4 bytes per parameter: only for a policy that needs them at once)."""
        if self._tensor is not None:
            return self._tensor
        out = torch.empty(self.numel, dtype=torch.float32)
        for part, values in self.chunks():
            out[part] = values
        return out


def _sorted(at: Tensor) -> tuple[Tensor | None, Tensor]:
    """(order, at[order]) with at[order] ascending; order None where `at` is sorted already (the standing's
    coordinates are: nothing to allocate for them)."""
    if at.numel() < 2 or bool((at[1:] >= at[:-1]).all()):
        return None, at
    order = torch.argsort(at)
    return order, at[order]


def _gather(part: slice, values: Tensor, order: Tensor | None, ordered: Tensor, out: Tensor) -> None:
    """out[j] = values at at[j], for the at[j] inside `part` (`ordered` = at sorted, `order` its permutation)."""
    lo, hi = (int(i) for i in torch.searchsorted(ordered, torch.tensor([part.start, part.stop])))
    if hi > lo:
        taken = values[ordered[lo:hi] - part.start]
        if order is None:
            out[lo:hi] = taken
        else:
            out[order[lo:hi]] = taken
