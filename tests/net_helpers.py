"""Shared by the network tests: an asyncio loop in a daemon thread, as the peer process runs its network."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any


class LoopThread:
    """An asyncio loop in a daemon thread; `run` submits a coroutine and waits for its result."""

    def __init__(self, name: str = "test-net-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        async def cancel_leftovers() -> None:  # e.g. the server side of deliberately hanging handlers
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=5)
            await self.loop.shutdown_asyncgens()

        self.run(cancel_leftovers(), timeout_s=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
