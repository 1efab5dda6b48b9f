"""A bootstrap node's life, beside the peer's (peer/process.py): its node (a public DHT server that checks the
records of the runs it serves), the probe `doctor` and joiners ask to dial them back (net/transport/probe.py),
the relay that forwards streams between peers behind NAT (net/transport/relay.py), the status page with
`--status-port`, and a line of live peers every `report_s`, until `stop` is set.

The status page's source is a watcher of one run's records (bootstrap/watcher.py `SwarmWatcher`): the first run
id given, else 'default'.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from p2p_diloco.bootstrap.watcher import SwarmWatcher
from p2p_diloco.config import BootstrapConfig
from p2p_diloco.net.discovery.records import PeerRecordValidator, list_peers
from p2p_diloco.net.discovery.status import live
from p2p_diloco.net.transport.addresses import announce_maddr, listen_maddr
from p2p_diloco.net.transport.netloop import exit_with_parent
from p2p_diloco.net.transport.node import NodeConfig, SwarmNode
from p2p_diloco.net.transport.probe import serve_probe
from p2p_diloco.net.transport.relay import RelayServer
from p2p_diloco.view.metrics import metrics_endpoint
from p2p_diloco.view.web import StatusServer
from p2p_diloco.wire.identity import Identity

POLL_S = 0.2
"""How often the node looks at `stop`."""


def say(line: str) -> None:
    print(line, flush=True)


async def run_bootstrap(config: BootstrapConfig, stop: threading.Event) -> None:
    """Run the bootstrap node until `stop` is set."""
    identity_path = str(Path(config.identity).expanduser())
    identity = Identity.load_or_create(identity_path)
    run_ids = sorted({"default", *config.run_id})
    node = await SwarmNode.start(identity_path, node_config(config), record_validators=[PeerRecordValidator(run_ids)])
    exit_with_parent(node)
    page: tuple[StatusServer, asyncio.Task[None]] | None = None
    try:
        await serve_probe(node)  # `doctor` (and joiners) ask us to dial them back and time an upload
        relay = RelayServer(node.p2p)  # streams between peers behind NAT (net/transport/relay.py)
        await relay.start()
        say(f"bootstrap ready (peer id {identity.peer_id}; checks records of runs: {', '.join(run_ids)})")
        for maddr in node.visible_maddrs():
            say(maddr)
        say("peers join with: p2p-diloco join --bootstrap <one of the addresses above>")
        if config.status_port >= 0:
            watcher = SwarmWatcher(node, (config.run_id or ("default",))[0], reachability=config.reachability,
                                   timeout_s=config.dht_timeout_s)
            page = status_page(watcher, config)
            say(f"status page: {page[0].url} (metrics: {page[0].url}metrics)")
        await report_until(stop, node, relay, run_ids, config)
        say("bootstrap stopping")
    finally:
        if page is not None:
            page[1].cancel()
            page[0].close()
        await node.shutdown()


def node_config(config: BootstrapConfig) -> NodeConfig:
    return NodeConfig(host_maddrs=(listen_maddr(config.host, config.port),),
                      announce_maddrs=tuple(announce_maddr(a, config.port) for a in config.announce),
                      force_reachability=config.reachability or None)


def status_page(watcher: SwarmWatcher, config: BootstrapConfig) -> tuple[StatusServer, asyncio.Task[None]]:
    """The status page and /metrics, and the task that re-reads the run's records on the node's loop."""
    page = StatusServer(watcher.snapshot, host=config.status_host, port=config.status_port,
                        metrics=metrics_endpoint(watcher.snapshot)).start()
    return page, asyncio.get_running_loop().create_task(watcher.refresh_loop(), name="status-page")


async def report_until(stop: threading.Event, node: SwarmNode, relay: RelayServer, run_ids: list[str],
                       config: BootstrapConfig) -> None:
    """Every `report_s` (0: never), a line of live peers per run and of relayed streams, until `stop`."""
    next_report = time.monotonic() + config.report_s
    while not stop.is_set():
        await asyncio.sleep(POLL_S)
        if config.report_s > 0 and time.monotonic() >= next_report:
            next_report = time.monotonic() + config.report_s
            counts = []
            for run_id in run_ids:
                try:
                    counts.append(f"{run_id}={len(live(await list_peers(node, run_id, config.dht_timeout_s)))}")
                except Exception as e:  # a report is best effort
                    counts.append(f"{run_id}=? ({type(e).__name__})")
            say(f"live peers: {' '.join(counts)}; relayed streams {relay.stats.forwarded} "
                f"({relay.stats.bytes / 1e6:.1f} MB), {relay.stats.active} open")
