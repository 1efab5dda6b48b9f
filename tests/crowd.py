"""A crowd of cheap identities against an open run (issue 16), for tests/net/test_crowd.py and
benchmarks/bench_crowd.py.

In an open run an identity costs nothing, so the attacker is a crowd: each identity its own Ed25519 key and
libp2p host, speaking the run's real RPCs. Here each one is a bare hivemind `P2P` (one p2pd daemon, no DHT:
a `SwarmNode` would add a forked DHT process of a few hundred MiB per identity). Measured on the 2-core test
machine (PSS, shared pages counted once): 46-50 MiB per daemon, and 0.3-0.7 s of start per identity, 8 started
at once; the Python side adds ~0.2 MiB per identity, a worker process ~200 MiB. 12 identities start in 2-7 s;
100 in two workers take 45-70 s and ~6.1 GiB (61 MiB per identity, workers included). Memory would allow ~300
here; the two cores are the limit (100 idle daemons already load them).

Behaviours (each covers every identity of the crowd; `quiet()` stops them all):
  stall(targets)          every `interval_s` (0.5 s), announce to each target a vector naming an update of our
                          own it lacks (`{own id: n}`, n growing); when it pulls, read its request and never
                          answer, holding the stream open (up to `hold_s`, or until the puller gives up)
  flood(targets)          pull everything from each target in a loop (an empty vector), reading every stream
                          to its end; bytes counted per identity and per target
  claim_holes(targets, v) announce `v` (a vector with holes naming real updates, as repair sees one) every
                          `interval_s`
  advertise(node)         a signed DHT record for every identity, stored through one SwarmNode (the DHT
                          validator checks the signature against the subkey, not who stores it), so the crowd
                          counts as members with records (repair's votes, `status`)
Every identity also serves `announce` (an ack) and, when not stalling, `pull` (nothing: END at once), so an
honest peer that pulls from it (anti-entropy, a pull back) gets a quick empty answer.

Processes: `processes=0` runs the identities on the caller's event loop; `processes=k` spreads them over k
worker processes (`python tests/crowd.py --worker RUN_ID`, JSON lines on stdin/stdout), so the crowd's own
Python work does not share the GIL with honest peers measured in the caller's process. A worker runs in its
own session and exits when its stdin closes (the parent died); `close()` asks each to stop, then kills its
whole process group (its p2pd daemons with it); in-process daemons are shut down, then SIGKILLed by pid.
`leftover_daemons(workdir)` lists any p2pd still running with a key of ours (the tests assert none).

Honest peers for the scenarios (`start_honest`): SwarmNode + Replica + Intake + UpdateStore + PeerGuard +
Gossip on the caller's loop, as PeerNetwork composes them minus training; `publish_loop` makes each publish a
signed update every `every_s`, and `LagMeter` samples how far each lags behind the others' published seqs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.net.discovery.records import encode_peer_record, peers_key
from p2p_diloco.net.gossip.messages import PULL_FAILURES, encode_request
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.framing import DATA, END, read_header, read_payload, write_frame
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.identity import Identity

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


def _pss_mib(pid: int) -> float:
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


# ---------------------------------------------------------------------------------------------- workers


class _Worker:
    """A `Group` in a child process, driven by JSON lines: {"id", "cmd", "args"} -> {"id", "ok"|"error"}."""

    def __init__(self, run_id: str, log_path: Path) -> None:
        self.run_id, self.log_path = run_id, log_path
        self.proc: asyncio.subprocess.Process | None = None
        self._replies: dict[int, asyncio.Future] = {}
        self._next_id = 0
        self._reader: asyncio.Task | None = None
        self._log: Any = None

    async def spawn(self) -> None:
        self._log = open(self.log_path, "w")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--worker", self.run_id, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, start_new_session=True, limit=1 << 24, env={**os.environ, "GOGC": "50"})
        self._reader = asyncio.ensure_future(self._read_replies())

    async def _read_replies(self) -> None:
        while line := await self.proc.stdout.readline():
            reply = json.loads(line)
            future = self._replies.pop(reply["id"], None)
            if future is not None and not future.done():
                if "error" in reply:
                    future.set_exception(RuntimeError(f"crowd worker: {reply['error']}"))
                else:
                    future.set_result(reply["ok"])
        for future in self._replies.values():
            if not future.done():
                future.set_exception(RuntimeError(f"crowd worker exited; see {self.log_path}"))

    async def call(self, cmd: str, timeout_s: float = 300.0, **args: Any) -> Any:
        self._next_id += 1
        future = self._replies[self._next_id] = asyncio.get_running_loop().create_future()
        self.proc.stdin.write(json.dumps({"id": self._next_id, "cmd": cmd, "args": args}).encode() + b"\n")
        await self.proc.stdin.drain()
        return await asyncio.wait_for(future, timeout_s)

    async def kill(self) -> None:
        """Ask it to close (its daemons shut down), then SIGKILL its whole process group whatever happened."""
        if self.proc is not None:
            with contextlib.suppress(Exception):
                await self.call("close", timeout_s=15)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.proc.wait(), 10)
        if self._reader is not None:
            self._reader.cancel()
        if self._log is not None:
            self._log.close()


async def _worker_main(run_id: str) -> None:
    """Serve a Group's methods to the parent; close everything on "close" or when stdin ends."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything printed by libraries goes to the log, never into the protocol
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    group, tasks = Group(run_id), set()

    async def serve(message: dict) -> None:
        try:
            reply = {"id": message["id"], "ok": await getattr(group, message["cmd"])(**message["args"])}
        except Exception as e:
            reply = {"id": message["id"], "error": repr(e)}
        out.write(json.dumps(reply) + "\n")
        out.flush()

    try:
        while line := await stdin.readline():
            message = json.loads(line)
            if message["cmd"] == "close":
                await serve(message)
                return
            task = asyncio.ensure_future(serve(message))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        await group.close()


# ---------------------------------------------------------------------------------------------- the crowd


class Crowd:
    """`async with Crowd(size, workdir) as crowd:` then `await crowd.stall([...])` etc. (module docstring)."""

    def __init__(self, size: int, workdir: str | Path, *, run_id: str = "default", processes: int = 0,
                 host: str = "127.0.0.1") -> None:
        self.size, self.run_id, self.processes, self.host = size, run_id, processes, host
        self.workdir = Path(workdir)
        self.identities: list[Identity] = []
        self.maddrs: dict[str, list[str]] = {}
        self.daemon_pids: list[int] = []
        self.start_s = 0.0
        self._local: Group | None = None
        self._workers: list[_Worker] = []

    @property
    def peer_ids(self) -> list[str]:
        return [i.peer_id for i in self.identities]

    async def __aenter__(self) -> Crowd:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> None:
        """Keys on disk, then every host (in this loop, or spread over the workers)."""
        started = time.monotonic()
        keydir = self.workdir / "crowd-keys"
        keydir.mkdir(parents=True, exist_ok=True)
        paths = []
        for i in range(self.size):
            identity = Identity.generate()
            paths.append(str(keydir / f"{i}.key"))
            identity.save(paths[-1])
            self.identities.append(identity)
        if self.processes == 0:
            self._local = Group(self.run_id)
            results = [await self._local.start(paths, self.host)]
        else:
            self._workers = [_Worker(self.run_id, self.workdir / f"crowd-worker-{k}.log") for k in
                             range(self.processes)]
            await asyncio.gather(*(w.spawn() for w in self._workers))
            results = await asyncio.gather(*(w.call("start", keys=paths[k::self.processes], host=self.host)
                                             for k, w in enumerate(self._workers)))
        for started_group in results:
            for entry in started_group:
                self.maddrs[entry["peer_id"]] = entry["maddrs"]
                self.daemon_pids.append(entry["pid"])
        assert set(self.maddrs) == set(self.peer_ids), "a host came up under another identity than its key's"
        self.start_s = time.monotonic() - started

    async def close(self) -> None:
        """Every behaviour stopped, every daemon and worker gone (killed if need be); idempotent."""
        if self._local is not None:
            await self._local.close()
        await asyncio.gather(*(w.kill() for w in self._workers))
        for pid in self.daemon_pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)  # normally gone already: a no-op then
        self._local, self._workers = None, []

    async def _all(self, cmd: str, **args: Any) -> list[Any]:
        """Run a Group method on every group (this loop's and the workers')."""
        if self._local is not None:
            return [await getattr(self._local, cmd)(**args)]
        return list(await asyncio.gather(*(w.call(cmd, **args) for w in self._workers)))

    async def connect(self, targets: Mapping[str, Sequence[str]]) -> int:
        """Dial every target (peer id -> its multiaddrs) from every identity; the number of dials that worked."""
        return sum(await self._all("connect", targets={p: list(m) for p, m in targets.items()}))

    async def stall(self, targets: Sequence[str], *, interval_s: float = STALL_INTERVAL_S,
                    hold_s: float = HOLD_S) -> None:
        await self._all("stall", targets=list(targets), interval_s=interval_s, hold_s=hold_s)

    async def flood(self, targets: Sequence[str]) -> None:
        await self._all("flood", targets=list(targets))

    async def claim_holes(self, targets: Sequence[str], vector: VersionVector, *,
                          interval_s: float = STALL_INTERVAL_S) -> None:
        """Announce `vector` (entries and holes, e.g. an honest peer's vector with holes at updates it merged)."""
        await self._all("claim_holes", targets=list(targets), vv=vector.to_dict(), holes=vector.holes_dict(),
                        interval_s=interval_s)

    async def quiet(self) -> None:
        await self._all("quiet")

    async def stats(self) -> dict[str, dict]:
        """Per identity: its counters (announces, pulls held, bytes received...), and `bytes_from` per target."""
        out: dict[str, dict] = {}
        for part in await self._all("stats"):
            out.update(part)
        return out

    async def bytes_from(self, target: str) -> int:
        """Bytes the whole crowd read from `target`'s pull streams so far."""
        return sum(s["bytes_from"].get(target, 0) for s in (await self.stats()).values())

    async def advertise(self, node: Any, *, ttl_s: float = 600.0, record: Mapping[str, Any] | None = None,
                        timeout_s: float = 30.0) -> int:
        """A signed peer record for every identity (its own addresses, `record` added), stored through `node`
        (a SwarmNode); how many the DHT took. Records live `ttl_s`; call again to refresh."""
        from hivemind.utils import get_dht_time

        limit = asyncio.Semaphore(16)

        async def store(identity: Identity) -> bool:
            expiration = get_dht_time() + ttl_s
            fields = {"maddrs": self.maddrs[identity.peer_id], "state": "training", "version_vector_total": 0,
                      "seq": 0, **(record or {})}
            value = encode_peer_record(self.run_id, fields, identity, expiration)
            async with limit:
                return await node.dht_store(peers_key(self.run_id), value, expiration, subkey=identity.peer_id,
                                            timeout_s=timeout_s)

        return sum(await asyncio.gather(*(store(i) for i in self.identities)))

    def memory_mib(self) -> dict[str, float]:
        """PSS of the crowd's daemons and worker processes (in-process groups add ~0.2 MiB each to ours)."""
        daemons = sum(_pss_mib(pid) for pid in self.daemon_pids)
        workers = sum(_pss_mib(w.proc.pid) for w in self._workers if w.proc is not None)
        return {"daemons": daemons, "workers": workers, "per_identity": (daemons + workers) / max(self.size, 1)}


# ---------------------------------------------------------------------------------------------- honest peers


@dataclasses.dataclass
class Honest:
    """One honest peer's network side (what PeerNetwork composes, minus training) and what it published."""

    name: str
    node: Any  # SwarmNode
    identity: Identity
    replica: Any
    intake: Any
    store: Any
    guard: Any  # PeerGuard
    gossip: Any  # Gossip
    view: list[str]  # what its `peers` callback returns: the honest peers (and the crowd, if it has records)
    published_at: list[float] = dataclasses.field(default_factory=list)  # monotonic time of seq i + 1

    @property
    def peer_id(self) -> str:
        return self.node.peer_id


async def start_honest(workdir: Path, n: int, *, spec: Any, numel: int, gossip: Any, limits: Any) -> list[Honest]:
    """`n` honest peers on the caller's loop, the first one the others' bootstrap; each sees the others in its
    view. On failure everything started is stopped again."""
    from p2p_diloco.net.admission.guard import PeerGuard
    from p2p_diloco.net.gossip.service import Gossip
    from p2p_diloco.net.transport.node import NodeConfig, SwarmNode
    from p2p_diloco.sync.intake import Intake
    from p2p_diloco.sync.replica import Replica
    from p2p_diloco.sync.store import UpdateStore

    peers: list[Honest] = []
    try:
        for i in range(n):
            identity = Identity.generate()
            path = str(workdir / f"honest-{i}.key")
            identity.save(path)
            bootstrap = tuple(peers[0].node.visible_maddrs()) if peers else ()
            node = await SwarmNode.start(path, NodeConfig(initial_peers=bootstrap, start_timeout_s=60))
            replica = Replica.from_spec(spec, torch.zeros(numel))
            intake = Intake(spec, numel, replica)
            guard = PeerGuard(spec.run_id, self_id=node.peer_id, limits=limits)
            view: list[str] = []
            service = Gossip(node, spec.run_id, intake, UpdateStore(gossip.retained_bytes), gossip,
                             peers=lambda v=view: v, guard=guard)
            peers.append(Honest(chr(ord("A") + i), node, identity, replica, intake, service.store, guard, service,
                                view))
            await service.start()
        for peer in peers:
            peer.view.extend(p.peer_id for p in peers)
        return peers
    except BaseException:
        await stop_honest(peers)
        raise


async def stop_honest(peers: Sequence[Honest]) -> None:
    for peer in peers:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(peer.gossip.stop(), 30)
        with contextlib.suppress(Exception):
            await peer.node.shutdown()


def honest_payload(spec: Any, numel: int, seed: int = 0) -> bytes:
    """One compressed payload of small values, reused by every update of one peer (signing makes each one
    distinct); give each peer its own `seed`."""
    from p2p_diloco.wire.codecs import get_codec

    codec = get_codec(spec.outer.codec, spec.outer.codec_block)
    return codec.compress(1e-4 * torch.randn(numel, generator=torch.Generator().manual_seed(seed)))


async def publish_loop(peer: Honest, spec: Any, numel: int, payload: bytes, every_s: float) -> None:
    """What a learner does every round, every `every_s`: sign the next update, merge it, hand it to gossip."""
    from p2p_diloco.wire.envelope import make_update

    while True:
        seq = len(peer.published_at) + 1
        update = make_update(run_id=spec.run_id, spec_hash=spec.spec_hash(), seq=seq, tau=0, samples=8, weight=0.5,
                             codec=spec.outer.codec, numel=numel, payload=payload, identity=peer.identity)
        await asyncio.to_thread(peer.replica.offer, update)
        await peer.gossip.publish(update)
        peer.published_at.append(time.monotonic())
        await asyncio.sleep(every_s)


class LagMeter:
    """Samples, every `interval_s`, how many of each other honest peer's published updates each one lacks
    (its merge lag, in updates), and when each update first showed as merged (its delay, in seconds)."""

    def __init__(self, peers: Sequence[Honest], interval_s: float = 0.05) -> None:
        self.peers, self.interval_s = list(peers), interval_s
        self.lags: list[int] = []
        self.delays: list[float] = []
        self._seen: dict[tuple[str, str], int] = {}
        self._started = 0.0

    async def run(self, duration_s: float) -> dict[str, float]:
        """Sample for `duration_s` from now (updates published before now count from now); the summary."""
        self._started = time.monotonic()
        self.lags, self.delays = [], []
        for a in self.peers:
            for b in self.peers:
                if a is not b:
                    self._seen[a.name, b.name] = a.replica.version_vector.get(b.peer_id)
        while time.monotonic() - self._started < duration_s:
            self._sample()
            await asyncio.sleep(self.interval_s)
        return self.summary()

    def _sample(self) -> None:
        now = time.monotonic()
        for a in self.peers:
            for b in self.peers:
                if a is b:
                    continue
                held = a.replica.version_vector.get(b.peer_id)
                self.lags.append(max(len(b.published_at) - held, 0))
                for seq in range(self._seen[a.name, b.name] + 1, held + 1):
                    self.delays.append(now - max(b.published_at[seq - 1], self._started))
                self._seen[a.name, b.name] = max(self._seen[a.name, b.name], held)

    def summary(self) -> dict[str, float]:
        """Median and worst lag (updates), median and worst delay (s; an update still missing at the end counts
        with its age then), and how many updates were still missing at the end."""
        now = time.monotonic()
        missing = [now - max(b.published_at[seq - 1], self._started) for a in self.peers for b in self.peers
                   if a is not b for seq in range(self._seen[a.name, b.name] + 1, len(b.published_at) + 1)]
        delays = self.delays + missing
        return {"lag_median": statistics.median(self.lags) if self.lags else 0.0,
                "lag_worst": max(self.lags, default=0),
                "delay_median_s": statistics.median(delays) if delays else 0.0,
                "delay_worst_s": max(delays, default=0.0), "merged": len(self.delays), "missing_at_end": len(missing)}


# ---------------------------------------------------------------------------------------------- scenarios


async def engage(honest: Sequence[Honest], crowd: Crowd | None, *, spec: Any, numel: int, publish_s: float,
                 records: bool = False, timeout_s: float = 60.0) -> list[asyncio.Task]:
    """Dial the crowd to the honest peers (with `records`, also put it in their views, as its DHT records would
    in an open run: then their announces and anti-entropy pick crowd members too), start every honest peer's
    publishing, and wait until each merged an update of each other (each is then a contributor to the others).
    Returns the publishing tasks: cancel them (`disengage`) when done."""
    if crowd is not None:
        dialled = await crowd.connect({h.peer_id: h.node.visible_maddrs() for h in honest})
        assert dialled == crowd.size * len(honest), f"only {dialled} of {crowd.size * len(honest)} dials worked"
        if records:
            for peer in honest:
                peer.view.extend(crowd.peer_ids)
    # One payload per honest peer, from its own seed: two peers sending the very same payload would be a copy
    # of each other's work, and vetting (sync/standing.py) gives a copy no weight and its relay no credit.
    tasks = [asyncio.ensure_future(publish_loop(h, spec, numel, honest_payload(spec, numel, seed=i), publish_s))
             for i, h in enumerate(honest)]
    deadline = time.monotonic() + timeout_s
    while not all(a.replica.version_vector.get(b.peer_id) > 0 for a in honest for b in honest if a is not b):
        if time.monotonic() > deadline:
            await disengage(tasks)
            raise TimeoutError(f"the honest peers did not merge each other's updates within {timeout_s:g}s")
        await asyncio.sleep(0.05)
    return tasks


async def disengage(tasks: Sequence[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def measure(honest: Sequence[Honest], crowd: Crowd | None, behaviour: str, *, base_s: float,
                  attack_s: float) -> dict[str, Any]:
    """A baseline window (the crowd idle), then `behaviour` ("stall": at every honest peer; "flood": at the
    first, the victim; "none") for `attack_s`, then quiet. Lags of both windows (`LagMeter.summary`), the bytes
    the crowd read from the victim and all the victim served meanwhile, the crowd's counters."""
    victim, meter = honest[0], LagMeter(honest)
    base = await meter.run(base_s)
    counted_before = await _counted(crowd, victim.peer_id)
    served_before = victim.gossip.stats["bytes_sent"]
    started = time.monotonic()
    if crowd is not None and behaviour == "stall":
        await crowd.stall([h.peer_id for h in honest])
    elif crowd is not None and behaviour == "flood":
        await crowd.flood([victim.peer_id])
    try:
        attacked = await meter.run(attack_s)
    finally:
        if crowd is not None:
            await crowd.quiet()
    seconds = time.monotonic() - started
    counted = await _counted(crowd, victim.peer_id)
    counted.subtract(counted_before)
    crowd_bytes = counted.pop("bytes_from_victim", 0)
    return {"base": base, "attack": attacked, "seconds": seconds, "crowd_bytes": crowd_bytes,
            "served_bytes": victim.gossip.stats["bytes_sent"] - served_before, "crowd": dict(+counted)}


async def _counted(crowd: Crowd | None, victim: str) -> Counter:
    """The crowd's counters summed over its identities, and the bytes it read from `victim`."""
    out: Counter = Counter()
    for part in (await crowd.stats()).values() if crowd is not None else ():
        out.update({k: v for k, v in part.items() if k != "bytes_from"})
        out["bytes_from_victim"] += part["bytes_from"].get(victim, 0)
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    asyncio.run(_worker_main(sys.argv[2]))
