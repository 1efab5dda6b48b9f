"""Fixtures shared by the network tests."""

import pytest
from net_helpers import LoopThread, Member, start_member


@pytest.fixture(scope="module")
def loop():
    """One asyncio loop in a daemon thread per test module, closed (leftover tasks cancelled) at its end."""
    lt = LoopThread()
    try:
        yield lt
    finally:
        lt.close()


@pytest.fixture(scope="module")
def members(loop, tmp_path_factory):
    """Three SwarmNodes on 127.0.0.1 (port 0) per module: the first, and two bootstrapped from it."""
    out: list[Member] = []
    try:
        for _ in range(3):
            out.append(loop.run(start_member(tmp_path_factory, tuple(out[0].node.visible_maddrs()) if out else ())))
        yield out
    finally:
        for m in out:
            loop.run(m.node.shutdown(), timeout_s=30)
