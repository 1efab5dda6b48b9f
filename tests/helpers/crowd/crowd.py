"""`Crowd`: many cheap identities, in this process or spread over worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from p2p_diloco.net.discovery.records import encode_peer_record, peers_key
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.identity import Identity
from tests.helpers.crowd.group import HOLD_S, STALL_INTERVAL_S, Group, pss_mib
from tests.helpers.crowd.worker import Worker


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
        self._workers: list[Worker] = []

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
            self._workers = [Worker(self.run_id, self.workdir / f"crowd-worker-{k}.log") for k in
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
        daemons = sum(pss_mib(pid) for pid in self.daemon_pids)
        workers = sum(pss_mib(w.proc.pid) for w in self._workers if w.proc is not None)
        return {"daemons": daemons, "workers": workers, "per_identity": (daemons + workers) / max(self.size, 1)}
