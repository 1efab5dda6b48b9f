"""Reachability and upload probes: what `p2p-diloco doctor` (and later `join`) asks a bootstrap.

Two run-independent RPCs over the bounded RPC layer (rpc.py), served by `p2p-diloco bootstrap`:

- `p2p-diloco/probe/reach`: request `{"ports": [int, ...]}` (at most `MAX_REACH_PORTS`). The server takes the
  caller's *observed* IP from the stream's remote address (as its own daemon sees it), tries a plain TCP connect
  to that IP on each port (`DIAL_TIMEOUT_S` each) and answers `{"observed": ip, "open": [ports that accepted],
  "time": its clock}`. It dials only the IP the connection came from, never an address the caller names: no
  reflection, no port scans of third parties. A caller seen through a relay (`/p2p-circuit`) is not dialed.
- `p2p-diloco/probe/upload`: one request of up to `MAX_UPLOAD_BYTES`; the answer is the byte count. The caller
  times the call to estimate its upload rate.

Bounds (nothing a remote sends may cost a bootstrap more than this): request sizes (`MAX_REACH_REQUEST_BYTES`,
`MAX_UPLOAD_BYTES`), a per-caller token bucket checked before the request is read (`ProbeLimits`), a per-IP
bucket on dial-backs (fresh identities cost nothing, addresses do), `max_dials` TCP connects in flight over all
callers, one upload in flight, and the RPC layer's timeouts and minimum pace.

The TCP connect says whether something accepts connections on that IP and port from another host; behind a NAT
that maps ports per destination (most home routers) it fails unless the port is forwarded, which is what
decides whether peers can dial us.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
from hivemind.p2p import PeerID
from multiaddr import Multiaddr

from p2p_diloco.net.transport import relay, rpc
from p2p_diloco.net.transport.framing import DATA, ERROR, MAX_ERROR_BYTES, read_header, read_payload, write_frame

if TYPE_CHECKING:
    from p2p_diloco.net.transport.node import SwarmNode

logger = logging.getLogger(__name__)

REACH = "p2p-diloco/probe/reach"
UPLOAD = "p2p-diloco/probe/upload"
MAX_REACH_PORTS = 4
MAX_REACH_REQUEST_BYTES = 256
MAX_REACH_RESPONSE_BYTES = 512
MAX_UPLOAD_BYTES = 4 << 20
DIAL_TIMEOUT_S = 3.0
_RPC_TIMEOUT_S = 30.0
_MIN_UPLOAD_BYTES_PER_S = 16 << 10  # a trickle slower than this is cut after the grace period


@dataclass(frozen=True)
class ProbeLimits:
    """How much of a bootstrap the probes may take."""

    reach_every_s: float = 5.0
    """One reach request per caller (PeerID) per this many seconds."""
    reach_ip_burst: int = 4
    """Reach requests from one observed IP at once, refilled one per `reach_every_s`."""
    upload_burst: int = 2
    """Upload requests per caller at once, refilled one per `upload_every_s`."""
    upload_every_s: float = 5.0
    """Seconds to earn one more upload request."""
    max_dials: int = 2
    """TCP dial-backs in flight over all callers."""
    max_keys: int = 4096
    """Callers and IPs remembered by the rate limits (least recently seen forgotten first)."""


@dataclass(frozen=True)
class ReachResult:
    """What a bootstrap saw of us: our IP as it sees it, and which of the asked ports it could connect to."""

    observed_ip: str
    open_ports: tuple[int, ...]
    server_time: float | None = None
    """The bootstrap's clock (unix seconds) when it answered; None if it did not say."""
    rtt_s: float = 0.0
    """How long the call took, dial-backs included."""


class _Buckets:
    """Token buckets per key, bounded: a key unseen for long is forgotten (it starts full again)."""

    def __init__(self, burst: int, every_s: float, max_keys: int) -> None:
        self.burst, self.every_s, self.max_keys = burst, every_s, max_keys
        self._state: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def take(self, key: str, now: float) -> float:
        """0.0 if `key` may go now (a token taken), else the seconds until it may."""
        tokens, at = self._state.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) / self.every_s)
        wait_s = 0.0 if tokens >= 1.0 else (1.0 - tokens) * self.every_s
        self._state[key] = (tokens - 1.0 if wait_s == 0.0 else tokens, now)
        while len(self._state) > self.max_keys:
            self._state.popitem(last=False)
        return wait_s


class _ProbeGuard:
    """The RPC layer's guard for the probes: a per-caller rate limit decided before the request is read."""

    def __init__(self, limits: ProbeLimits) -> None:
        self.buckets = {REACH: _Buckets(1, limits.reach_every_s, limits.max_keys),
                        UPLOAD: _Buckets(limits.upload_burst, limits.upload_every_s, limits.max_keys)}

    async def admit(self, caller: str, handler: str, request_bytes: int) -> str | None:
        wait_s = self.buckets[handler].take(caller, time.monotonic())
        return f"rate limited: try again in {wait_s:.1f}s" if wait_s else None

    def release(self, caller: str) -> None:
        pass

    def charge_out(self, caller: str, nbytes: int) -> None:
        pass

    def on_reject(self, caller: str, counter: str) -> None:
        pass

    def is_contributor(self, caller: str) -> bool:
        return True  # no ledger here: every caller may use every slot, the buckets bound each of them


def observed_ip(remote_maddr: str) -> str | None:
    """The IP of a stream's remote multiaddr; None when it came through a relay or names no IP."""
    try:
        maddr = Multiaddr(remote_maddr)
        names = [p.name for p in maddr.protocols()]
    except Exception:
        return None
    if "p2p-circuit" in names:
        return None
    for name in ("ip4", "ip6"):
        if name in names:
            return maddr.value_for_protocol(name)
    return None


async def _dial(ip: str, port: int, slots: asyncio.Semaphore) -> bool:
    async with slots:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), DIAL_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError):
            return False
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except (OSError, asyncio.TimeoutError):
            pass
        return True


def _parse_ports(request: bytes) -> list[int]:
    try:
        obj = msgpack.unpackb(request, raw=False, strict_map_key=True, max_array_len=MAX_REACH_PORTS + 1)
    except Exception as e:
        raise rpc.RpcError(f"malformed reach request: {type(e).__name__}") from None
    ports = obj.get("ports") if isinstance(obj, dict) else None
    if not isinstance(ports, list) or not 1 <= len(ports) <= MAX_REACH_PORTS:
        raise rpc.RpcError(f"malformed reach request: 'ports' must be a list of 1 to {MAX_REACH_PORTS} ports")
    if not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports):
        raise rpc.RpcError("malformed reach request: ports must be integers in [1, 65535]")
    return sorted(set(ports))


class _ProbeServer:
    def __init__(self, limits: ProbeLimits) -> None:
        self.ip_buckets = _Buckets(limits.reach_ip_burst, limits.reach_every_s, limits.max_keys)
        self.dial_slots = asyncio.Semaphore(limits.max_dials)

    async def rpc_reach(self, request: bytes, caller: str, remote: str) -> bytes:
        ports = _parse_ports(request)
        ip = observed_ip(remote)
        if ip is None:  # through a relay: dialing the relay's address would say nothing about the caller
            logger.info("probe reach without a direct address caller=%s remote=%s", caller, remote)
            return msgpack.packb({"observed": "", "open": [], "time": time.time()})
        wait_s = self.ip_buckets.take(ip, time.monotonic())
        if wait_s:
            raise rpc.RpcError(f"rate limited: too many reach requests from {ip}; try again in {wait_s:.1f}s")
        accepted = await asyncio.gather(*(_dial(ip, port, self.dial_slots) for port in ports))
        open_ports = [port for port, ok in zip(ports, accepted) if ok]
        logger.info("probe reach caller=%s observed=%s ports=%s open=%s", caller, ip, ports, open_ports)
        return msgpack.packb({"observed": ip, "open": open_ports, "time": time.time()})

    async def rpc_upload(self, request: bytes, caller: str) -> bytes:
        return msgpack.packb(len(request))


async def serve_probe(node: SwarmNode, limits: ProbeLimits = ProbeLimits()) -> dict[str, rpc.RpcStats]:
    """Serve the reach and upload probes on `node` (a bootstrap); returns each handler's live counters."""
    server, guard = _ProbeServer(limits), _ProbeGuard(limits)
    # A reach request waits for its dial-backs: up to MAX_REACH_PORTS connects, `max_dials` at a time.
    reach_timeout_s = DIAL_TIMEOUT_S * (MAX_REACH_PORTS + 2) + 5.0
    return {
        REACH: await rpc.serve(node.p2p, REACH, server.rpc_reach, max_request_bytes=MAX_REACH_REQUEST_BYTES,
                               timeout_s=reach_timeout_s, max_concurrent=2, guard=guard, pass_remote_addr=True),
        UPLOAD: await rpc.serve(node.p2p, UPLOAD, server.rpc_upload, max_request_bytes=MAX_UPLOAD_BYTES,
                                timeout_s=_RPC_TIMEOUT_S, max_concurrent=1, guard=guard,
                                min_bytes_per_s=_MIN_UPLOAD_BYTES_PER_S),
    }


async def unserve_probe(node: SwarmNode) -> None:
    """Stop serving the probes."""
    for name in (REACH, UPLOAD):
        await rpc.unserve(node.p2p, name)


def _unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, max_array_len=MAX_REACH_PORTS, max_map_len=8, max_str_len=128)
    except Exception:
        raise rpc.RpcError(f"malformed {what} response") from None


async def reach(node: SwarmNode, peer_id: str, ports: list[int] | tuple[int, ...], timeout_s: float) -> ReachResult:
    """Ask bootstrap `peer_id` to dial us back on `ports` (at most MAX_REACH_PORTS); RpcError on any failure."""
    ports = sorted(set(ports))[:MAX_REACH_PORTS]
    if not ports:
        raise ValueError("reach needs at least one port")
    started = time.monotonic()
    raw = await rpc.call(node.p2p, peer_id, REACH, msgpack.packb({"ports": ports}),
                         max_response_bytes=MAX_REACH_RESPONSE_BYTES, timeout_s=timeout_s)
    reply = _unpack(raw, "reach")
    if not (isinstance(reply, dict) and isinstance(reply.get("observed"), str) and isinstance(reply.get("open"), list)):
        raise rpc.RpcError(f"malformed reach response from {peer_id}")
    server_time = reply.get("time")
    return ReachResult(observed_ip=reply["observed"],
                       open_ports=tuple(p for p in reply["open"] if isinstance(p, int) and p in ports),
                       server_time=float(server_time) if isinstance(server_time, (int, float)) else None,
                       rtt_s=time.monotonic() - started)


async def upload_rate(node: SwarmNode, peer_id: str, nbytes: int, timeout_s: float) -> float:
    """Send `nbytes` (at most MAX_UPLOAD_BYTES) of random data to bootstrap `peer_id`; bytes per second, as timed
    from the request to the answer (one round trip included). RpcError on any failure."""
    if not 0 < nbytes <= MAX_UPLOAD_BYTES:
        raise ValueError(f"nbytes must be in (0, {MAX_UPLOAD_BYTES}], got {nbytes}")
    payload = os.urandom(nbytes)  # random: nothing on the way can compress it
    started = time.monotonic()
    raw = await rpc.call(node.p2p, peer_id, UPLOAD, payload, max_response_bytes=16, timeout_s=timeout_s)
    elapsed_s = max(time.monotonic() - started, 1e-6)
    if _unpack(raw, "upload") != nbytes:
        raise rpc.RpcError(f"bootstrap {peer_id} counted another number of bytes than the {nbytes} sent")
    return nbytes / elapsed_s


async def serves_relay(node: SwarmNode, peer_id: str, timeout_s: float) -> bool:
    """Whether `peer_id` forwards streams to peers nobody can dial (net/transport/relay.py `RelayServer`), over
    the connections those peers opened to it. Asked with a request every relay refuses at once (a stream to
    ourselves), so it costs the relay one refusal; its refusal says it is one."""
    try:
        _, reader, writer = await asyncio.wait_for(
            node.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), relay.RELAY_PROTOCOL), timeout_s)
    except Exception:  # "protocol not supported": no relay there; or not reachable at all
        return False
    try:
        await write_frame(writer, DATA, msgpack.packb({"t": node.peer_id, "p": REACH}), timeout_s)
        kind, length = await read_header(reader, timeout_s)
        if kind != ERROR:
            return False
        message = await read_payload(reader, min(length, MAX_ERROR_BYTES), timeout_s)
        return message.startswith(b"relay")
    except Exception:
        return False
    finally:
        writer.close()
