"""Give the host's freed memory back to the system between phases.

glibc serves allocations under its mmap threshold from heaps it keeps, and raises that threshold (up to 32 MB)
each time a large block is freed, so after the first phase the outer step's chunks, an evaluation's activations
and a checkpoint's buffers are carved from the heap and left there, free but resident, scattered between blocks
still in use. The next phase's gradients and activations then come on top: measured 3 B/parameter of the
unit's peak (BENCHMARKS.md "Big models"). A fixed low threshold would avoid it, at 20-40% of a CPU inner step's
time (every activation mapped and faulted in afresh); `malloc_trim(0)` returns every free page of every heap
for a few milliseconds, and the round loop calls it twice a round: at a phase's start, and at its end before the
outer step (train/loop.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc.malloc_trim if libc is not None else None  # glibc only: musl and macOS have none
    except (OSError, AttributeError):
        return None


def trim_free_heap() -> bool:
    """Return the heaps' free pages to the system; False where the C library has no `malloc_trim`."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
