"""`trim_free_heap` gives freed heap memory back (train/hardware/host_heap.py): in a fresh process (a heap of its
own), after glibc's mmap threshold has risen, 1 MiB tensors come from the heap and stay resident once freed while
a later block pins the heap's top; the trim returns them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from p2p_diloco.train.hardware.host_heap import trim_free_heap

SCRIPT = """
import torch
from p2p_diloco.train.hardware.host_heap import trim_free_heap
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
big = torch.empty(16 << 20, dtype=torch.uint8); del big  # a freed mapped block raises glibc's mmap threshold
blocks = [torch.ones(1 << 18) for _ in range(300)]  # 300 x 1 MiB, now carved from the heap
keep = blocks[-1:]  # the last one pins the heap's top: free() alone cannot shrink it
del blocks
before = rss()
assert trim_free_heap()
print(before - rss())
"""


def test_trim_returns_freed_heap_pages_to_the_system() -> None:
    if not trim_free_heap():
        pytest.skip("the C library has no malloc_trim (not glibc)")
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 250 << 20  # most of the 300 MiB freed left the process
