"""The crowd's identities on one event loop (`Group`) and their behaviours: stall, flood, claim holes, advertise."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.net.gossip.messages import PULL_FAILURES, encode_request
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.framing import DATA, END, read_header, read_payload, write_frame
from p2p_diloco.sync.version_vector import VersionVector

STALL_INTERVAL_S = 0.5
"""How often a stalling identity announces (the issue's measurement: twice a second)."""
HOLD_S = 120.0
"""A stalled pull is held at most this long (the puller's own timeout cuts it much sooner)."""
IO_TIMEOUT_S = 10.0
"""Every read, write and call of the crowd's own."""
FLOOD_LIMIT = 1 << 16
"""`limit` of a flooding pull request: everything (the responder caps it at its pull_max_updates)."""
FLOOD_RETRY_S = 0.1
"""A flooding identity refused or cut waits this long before it pulls again."""
MAX_REQUEST_BYTES = 1 << 20
START_CONCURRENCY = 8
"""Daemons started at once."""
P2P_OPTIONS = dict(check_if_identity_free=False, auto_nat=False, nat_port_map=False, use_relay=False,
                   dht_mode="client", startup_timeout=60)
"""The lightest host that still dials and serves streams (no NAT services, no relay, no DHT server)."""



def _reason(error: BaseException) -> str:
    """How gossip itself would count a failed pull (messages.PULL_FAILURES), else the error's type."""
    return next((r for kind, r in PULL_FAILURES if isinstance(error, kind)), type(error).__name__)


def pss_mib(pid: int) -> float:
    """Proportional set size of a process in MiB (0 if it is gone): shared pages counted once in all."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) / 1024
    except (OSError, StopIteration):
        return 0.0


def leftover_daemons(workdir: str | Path) -> list[int]:
    """p2pd processes still running with a key file under `workdir` (ours; other sessions' are not)."""
    found = subprocess.run(["pgrep", "-f", f"p2pd.*-id={Path(workdir).resolve()}"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


class _Sybil:
    """One identity: its host and its counters."""

    def __init__(self, p2p: P2P, peer_id: str) -> None:
        self.p2p, self.peer_id = p2p, peer_id
        self.stats: Counter[str] = Counter()
        self.bytes_from: Counter[str] = Counter()  # target -> bytes it served us (flood)

    @property
    def daemon_pid(self) -> int:
        return self.p2p._child.pid


class Group:
    """Identities on one event loop (this process's, or a worker's). Every public method is a coroutine with
    JSON-able arguments and result, so a worker process can serve them as commands."""

    def __init__(self, run_id: str) -> None:
        self.pull_name = f"p2p-diloco/{run_id}/pull"
        self.announce_name = f"p2p-diloco/{run_id}/announce"
        self.sybils: list[_Sybil] = []
        self.mode = "idle"  # what our pull handler does: "idle" answers nothing at once, "stall" never answers
        self.hold_s = HOLD_S
        self._tasks: set[asyncio.Task] = set()
        self._held: set[asyncio.StreamWriter] = set()
        self._generation = 0  # bumped by quiet(): every behaviour loop ends when it sees a newer one

    # ---- lifecycle ----------------------------------------------------------------------------------------

    async def start(self, keys: list[str], host: str = "127.0.0.1") -> list[dict]:
        """One host per key file; [{peer_id, maddrs, pid}] in the order of `keys`. On failure the hosts
        started so far stay in `sybils`, for `close`."""
        limit = asyncio.Semaphore(START_CONCURRENCY)

        async def one(path: str) -> _Sybil:
            async with limit:
                p2p = await P2P.create(identity_path=path, host_maddrs=[f"/ip4/{host}/tcp/0"], **P2P_OPTIONS)
            sybil = _Sybil(p2p, p2p.peer_id.to_base58())
            self.sybils.append(sybil)
            await p2p.add_binary_stream_handler(self.pull_name, lambda *a, s=sybil: self._on_pull(s, *a))
            await p2p.add_binary_stream_handler(self.announce_name, lambda *a, s=sybil: self._on_announce(s, *a))
            return sybil

        started = await asyncio.gather(*(one(k) for k in keys), return_exceptions=True)
        failed = next((r for r in started if isinstance(r, BaseException)), None)
        if failed is not None:  # every start has ended: what did start is in `sybils`, for `close`
            raise failed
        out = []
        for sybil in started:
            maddrs = [str(m) for m in await sybil.p2p.get_visible_maddrs()]
            out.append({"peer_id": sybil.peer_id, "maddrs": maddrs, "pid": sybil.daemon_pid})
        return out

    async def close(self) -> None:
        """Stop every behaviour, shut every daemon down (SIGKILL to those that did not stop within 5 s)."""
        await self.quiet()
        await asyncio.gather(*(self._shutdown(s) for s in self.sybils))
        self.sybils.clear()

    @staticmethod
    async def _shutdown(sybil: _Sybil) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(sybil.p2p.shutdown(), 5)
        child = sybil.p2p._child
        if child is not None and child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)

    async def connect(self, targets: dict[str, list[str]]) -> int:
        """Dial every target (peer id -> multiaddrs) from every identity; how many dials succeeded."""
        limit = asyncio.Semaphore(32)

        async def dial(sybil: _Sybil, peer: str, maddrs: list[str]) -> bool:
            addrs = [Multiaddr(m.split("/p2p/")[0]) for m in maddrs]
            async with limit:
                try:
                    await asyncio.wait_for(sybil.p2p._client.connect(PeerID.from_base58(peer), addrs), IO_TIMEOUT_S)
                    return True
                except Exception:
                    sybil.stats["dial_failed"] += 1
                    return False

        done = await asyncio.gather(*(dial(s, p, m) for s in self.sybils for p, m in targets.items()))
        return sum(done)

    async def quiet(self) -> None:
        """Stop every behaviour and release every held stream. A cancellation can be lost (Python 3.11's
        `asyncio.wait_for` swallows one that lands as its inner read completes, and rpc then raises the remote's
        error instead), so the loops also stop at their next turn when they see the generation has moved on."""
        self.mode = "idle"
        self._generation += 1
        pending, self._tasks = set(self._tasks), set()
        for _ in range(3):
            if not pending:
                break
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=IO_TIMEOUT_S / 3)
        for writer in list(self._held):
            writer.close()

    async def stats(self) -> dict[str, dict]:
        return {s.peer_id: {**s.stats, "bytes_from": dict(s.bytes_from)} for s in self.sybils}

    # ---- behaviours ---------------------------------------------------------------------------------------

    async def stall(self, targets: list[str], interval_s: float = STALL_INTERVAL_S, hold_s: float = HOLD_S) -> None:
        self.mode, self.hold_s = "stall", hold_s
        for sybil in self.sybils:
            self._spawn(self._stall_loop(sybil, targets, interval_s))

    async def flood(self, targets: list[str], max_chunk_bytes: int = 1 << 26) -> None:
        for sybil in self.sybils:
            for target in targets:
                self._spawn(self._flood_loop(sybil, target, max_chunk_bytes))

    async def claim_holes(self, targets: list[str], vv: dict[str, int], holes: dict[str, list[int]],
                          interval_s: float = STALL_INTERVAL_S) -> None:
        request = encode_request(VersionVector(vv, holes=holes))
        for sybil in self.sybils:
            self._spawn(self._announce_loop(sybil, targets, interval_s, lambda _n, r=request: r))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stall_loop(self, sybil: _Sybil, targets: list[str], interval_s: float) -> None:
        """Claim a new update of our own every round: a victim that remembered our last vector still pulls."""
        def claim(n: int) -> bytes:
            return encode_request(VersionVector({sybil.peer_id: n}))
        await self._announce_loop(sybil, targets, interval_s, claim)

    async def _announce_loop(self, sybil: _Sybil, targets: list[str], interval_s: float, request: Any) -> None:
        generation = self._generation
        await asyncio.sleep(random.uniform(0, interval_s))  # spread the crowd over the interval
        n = 0
        while generation == self._generation:
            n += 1
            await asyncio.gather(*(self._announce(sybil, t, request(n)) for t in targets))
            await asyncio.sleep(interval_s)

    async def _announce(self, sybil: _Sybil, target: str, request: bytes) -> None:
        try:
            await rpc.call(sybil.p2p, target, self.announce_name, request, max_response_bytes=16,
                           timeout_s=IO_TIMEOUT_S)
            sybil.stats["announces"] += 1
        except rpc.RpcError as e:
            sybil.stats[f"announce_{_reason(e)}"] += 1

    async def _flood_loop(self, sybil: _Sybil, target: str, max_chunk_bytes: int) -> None:
        request = encode_request(VersionVector(), FLOOD_LIMIT)
        generation = self._generation
        while generation == self._generation:
            stream = rpc.call_stream(sybil.p2p, target, self.pull_name, request, max_chunk_bytes=max_chunk_bytes,
                                     max_total_bytes=1 << 40, timeout_s=IO_TIMEOUT_S)
            try:
                async with contextlib.aclosing(stream):
                    async for chunk in stream:
                        sybil.bytes_from[target] += len(chunk)
                        sybil.stats["updates_received"] += 1
                sybil.stats["pulls"] += 1
            except rpc.RpcError as e:
                sybil.stats[f"pull_{_reason(e)}"] += 1
                await asyncio.sleep(FLOOD_RETRY_S)

    # ---- serving ------------------------------------------------------------------------------------------

    async def _on_announce(self, sybil: _Sybil, _info: Any, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> None:
        try:  # an ack, whatever it says (we never pull back)
            _, length = await read_header(reader, IO_TIMEOUT_S)
            await read_payload(reader, min(length, MAX_REQUEST_BYTES), IO_TIMEOUT_S)
            await write_frame(writer, DATA, b"", IO_TIMEOUT_S)
            await write_frame(writer, END, b"", IO_TIMEOUT_S)
        except Exception:
            pass
        finally:
            writer.close()

    async def _on_pull(self, sybil: _Sybil, _info: Any, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        started = time.monotonic()
        try:
            _, length = await read_header(reader, IO_TIMEOUT_S)
            await read_payload(reader, min(length, MAX_REQUEST_BYTES), IO_TIMEOUT_S)
            if self.mode != "stall":
                sybil.stats["pulls_answered"] += 1
                await write_frame(writer, END, b"", IO_TIMEOUT_S)
                return
            sybil.stats["pulls_held"] += 1
            self._held.add(writer)
            with contextlib.suppress(Exception):  # EOF: the puller gave up; an error: we released it
                await asyncio.wait_for(reader.read(1), self.hold_s)
            sybil.stats["held_ms"] += int(1000 * (time.monotonic() - started))
        except Exception:
            sybil.stats["pulls_broken"] += 1
        finally:
            self._held.discard(writer)
            writer.close()
