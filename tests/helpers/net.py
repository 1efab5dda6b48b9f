"""Shared by the network tests: an asyncio loop in a daemon thread, as the peer process runs its network."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
from collections.abc import Coroutine
from typing import Any

from p2p_diloco.net.transport.node import NodeConfig, SwarmNode
from p2p_diloco.wire.identity import Identity


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


@dataclasses.dataclass
class Member:
    """A started SwarmNode and the identity it runs under."""

    node: SwarmNode
    identity: Identity


async def start_member(tmp_path_factory, initial_peers: tuple[str, ...] = ()) -> Member:
    """A SwarmNode on 127.0.0.1, port 0, with a fresh Ed25519 identity."""
    identity = Identity.generate()
    path = str(tmp_path_factory.mktemp("keys") / "node.key")
    identity.save(path)
    config = NodeConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), initial_peers=initial_peers, start_timeout_s=30)
    return Member(await SwarmNode.start(path, config), identity)


def closed_tcp_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on: bound to find a free one, closed again on return."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
