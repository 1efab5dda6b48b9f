"""The bootstrap's status page source: one run's records, re-read on the node's loop, as the snapshot every view
draws (view/snapshot.py)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from p2p_diloco.net.discovery.records import read_run
from p2p_diloco.net.transport.node import SwarmNode
from p2p_diloco.view import figures
from p2p_diloco.view.snapshot import Curves, build_snapshot

logger = logging.getLogger(__name__)


class SwarmWatcher:
    """The bootstrap's view of its runs for the status page: the records of one run, re-read every `every_s` on
    the node's loop (`refresh_loop`), and a snapshot of the newest read on request (any thread). Its own
    reachability is what it was told (`--reachability`), else its node's verdict: a bootstrap probes nobody."""

    def __init__(self, node: SwarmNode, run_id: str, *, reachability: str, timeout_s: float,
                 every_s: float = 2.0) -> None:
        self.node, self.run_id, self.timeout_s, self.every_s = node, run_id, timeout_s, every_s
        self.curves, self.replicas = Curves(), figures.ReplicaWatch()
        self._records: dict[str, dict] = {}  # replaced whole
        self._spec_hash: str | None = None
        self._lock = threading.Lock()
        self.observer = {"kind": "bootstrap", "peer_id": node.peer_id, "addrs": node.visible_maddrs()[:8],
                         "reachability": figures.reachability(reachability or node.reachability)}

    async def refresh_loop(self) -> None:
        while True:
            try:
                spec_hash, records = await read_run(self.node, self.run_id, self.timeout_s)
                self._spec_hash, self._records = spec_hash, records
                with self._lock:  # also while nobody watches: the page then shows the whole run
                    self.curves.observe(records, time.time())
                    self.replicas.observe(records, time.time())
            except Exception as e:  # a slow DHT must not end the page's updates
                logger.debug("status page refresh failed error=%r", e)
            await asyncio.sleep(self.every_s)

    def snapshot(self) -> dict:
        with self._lock:
            return build_snapshot(run_id=self.run_id, spec_hash=self._spec_hash, now=time.time(),
                                  records=self._records, observer=self.observer, curves=self.curves,
                                  replicas=self.replicas)
