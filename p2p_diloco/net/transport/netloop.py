"""The network thread of a peer: one asyncio loop in a daemon thread, and the DHT process's orphan watchdog.

The compute thread submits coroutines to the loop and waits for them with `NetLoop.wait`, which gives up when
the peer is asked to stop (Ctrl-C, SIGTERM: `Stopped`) or a timeout passes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from hivemind.dht import DHT
from hivemind.dht.node import DHTNode

from p2p_diloco.net.transport.node import SwarmNode

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Stopped(Exception):
    """The peer was asked to stop (Ctrl-C, SIGTERM) while the compute thread waited on the loop."""


async def _exit_with_parent(_dht: DHT, dht_node: DHTNode, parent_pid: int) -> None:
    """Runs inside hivemind's DHT process: if our process dies without shutting it down (SIGKILL, OOM), take
    p2pd down and exit, instead of lingering as an orphan that holds the identity and the port."""
    try:
        while os.getppid() == parent_pid:
            await asyncio.sleep(1.0)
    except asyncio.CancelledError:  # the DHT is shutting down normally
        return
    with contextlib.suppress(Exception):
        dht_node.p2p._terminate()  # hivemind's own teardown of its p2pd child
    os._exit(0)


def exit_with_parent(node: SwarmNode) -> None:
    """Make the node's DHT process (and its p2pd) exit when this process dies, even by SIGKILL."""
    try:
        node.dht.run_coroutine(functools.partial(_exit_with_parent, parent_pid=os.getpid()), return_future=True)
    except Exception as e:  # a convenience: never a reason to fail
        logger.debug("could not arm the DHT orphan watchdog error=%r", e)


class NetLoop:
    """An asyncio loop in a daemon thread. `wait` runs a coroutine there and blocks the caller until it ends,
    the stop event is set (the coroutine is then cancelled and `Stopped` raised) or a timeout passes."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="p2p-diloco-net", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def wait(self, coro_or_future: Coroutine[Any, Any, T] | concurrent.futures.Future[T],
             stop: threading.Event | None = None, timeout_s: float | None = None) -> T:
        future = coro_or_future if isinstance(coro_or_future, concurrent.futures.Future) \
            else self.submit(coro_or_future)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                return future.result(timeout=0.2)
            except concurrent.futures.TimeoutError:
                pass
            if stop is not None and stop.is_set():
                future.cancel()
                raise Stopped()
            if deadline is not None and time.monotonic() > deadline:
                future.cancel()
                raise TimeoutError(f"network operation did not finish within {timeout_s:g}s")

    def close(self, timeout_s: float = 5.0) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout_s)

        if self.loop.is_closed():
            return
        try:
            self.submit(cancel_all()).result(timeout_s + 1)
        except Exception as e:  # leftovers must not keep the process alive; the thread is a daemon anyway
            logger.debug("net loop: cancelling leftover tasks failed error=%r", e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout_s)
        if not self.thread.is_alive():
            self.loop.close()
