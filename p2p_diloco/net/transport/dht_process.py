"""The hivemind DHT's own process, seen from ours: starting it, stopping it, and calling into it.

hivemind runs the DHT in a forked process with its own event loop; `DHT.get/store` talk to it over a pipe and
return `MPFuture`s. We never call the blocking forms from our loop: every DHT call goes through
`return_future=True` + `await_mp` (a timeout on the wrapped future), and the DHT start (fork + bootstrap) runs
in a worker thread (`start_dht`). Stopping is bounded: ask, then terminate, then kill (`stop_dht`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from typing import Any, TypeVar

from hivemind.dht import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr as HivemindMultiaddr

logger = logging.getLogger(__name__)

DHT_PROCESS_SHUTDOWN_S = 3.0  # hivemind's grace period before it terminates the DHT process
# Phrases in hivemind / p2pd errors that mean "the bootstrap peer did not answer (yet)": worth a retry.
_BOOTSTRAP_UNREACHABLE = ("failed to connect to bootstrap peers", "none of the initial_peers responded")

T = TypeVar("T")


def start_dht(kwargs: dict[str, Any], timeout_s: float, abandoned: threading.Event) -> DHT:
    """Runs in a worker thread: fork the DHT process and wait until it is ready (or failed). `kwargs` go to
    hivemind's `DHT` as they are."""
    dht = DHT(start=False, startup_timeout=max(timeout_s, 1.0), **kwargs)
    dht.start()
    try:
        dht.wait_until_ready(timeout=timeout_s)
    except BaseException:
        stop_dht(dht)
        raise
    if abandoned.is_set():  # the caller was cancelled while we waited: nobody will shut this one down
        stop_dht(dht)
        raise asyncio.CancelledError()
    return dht


def stop_dht(dht: DHT, timeout_s: float = DHT_PROCESS_SHUTDOWN_S) -> None:
    """Blocking, bounded: ask the DHT process to stop, then terminate, then kill it (p2pd dies with it)."""
    try:
        dht.shutdown_timeout = min(dht.shutdown_timeout, timeout_s)
        dht.shutdown()
    except Exception as e:
        logger.debug("dht shutdown request failed error=%r", e)
    if dht.pid is not None and dht.is_alive():
        dht.join(1.0)
        if dht.is_alive():
            dht.kill()
            dht.join(1.0)


def explain_start_error(error: BaseException, host_maddrs: Sequence[str]) -> str:
    """The start error's text, with what to do for the causes a person can fix."""
    text = str(error) or type(error).__name__
    if "can't access this node" in text:
        return (f"{text}. Peers could not dial this node back: announce a reachable address (announce_maddrs), "
                "or run with client_mode=True (or use_auto_relay=True) behind NAT")
    if "local time must be within" in text:
        return f"{text}. Synchronize this machine's clock (NTP)"
    if "address already in use" in text.lower():
        return f"{text}. Another process listens on {', '.join(host_maddrs)}: choose another port"
    return text


def is_bootstrap_unreachable(error: BaseException) -> bool:
    return any(phrase in str(error) for phrase in _BOOTSTRAP_UNREACHABLE)


def is_timeout(error: BaseException) -> bool:
    return isinstance(error, (asyncio.TimeoutError, concurrent.futures.TimeoutError, TimeoutError))


async def meet_again_in_dht(_dht: DHT, node: DHTNode, peers: dict[str, list[str]], timeout_s: float) -> list[str]:
    """Runs in the DHT process (`DHT.run_coroutine`): see `SwarmNode.meet_again`."""
    table = node.protocol.routing_table

    async def meet(pid_text: str, maddrs: list[str]) -> str | None:
        peer_id = PeerID.from_base58(pid_text)
        known = peer_id in table
        if maddrs and not known:
            # libp2p may have forgotten the addresses of a peer it lost (hivemind's P2P has no public dial, so
            # its daemon client's); a failed dial is fine: the ping says whether the peer is back
            try:
                addrs = [HivemindMultiaddr(m.split("/p2p/")[0]) for m in maddrs]
                await asyncio.wait_for(node.p2p._client.connect(peer_id, addrs), timeout_s / 2)
            except Exception as e:
                logger.debug("dial before ping failed peer=%s error=%r", pid_text, e)
        node_id = await node.protocol.call_ping(peer_id)
        return pid_text if node_id is not None and not known else None

    # One deadline per peer for dial and ping together: the caller waits timeout_s (+ margin) for all of them.
    results = await asyncio.gather(*(asyncio.wait_for(meet(p, m), timeout_s) for p, m in peers.items()),
                                   return_exceptions=True)
    return [r for r in results if isinstance(r, str)]


async def await_mp(future: concurrent.futures.Future[T], timeout_s: float) -> T:
    """Await a hivemind MPFuture (a concurrent.futures.Future) from asyncio, with a timeout."""
    return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
