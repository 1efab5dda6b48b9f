"""Fixtures shared by the network tests."""

import pytest
from net_helpers import LoopThread


@pytest.fixture(scope="module")
def loop():
    """One asyncio loop in a daemon thread per test module, closed (leftover tasks cancelled) at its end."""
    lt = LoopThread()
    try:
        yield lt
    finally:
        lt.close()
