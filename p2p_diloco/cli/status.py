"""`p2p-diloco status [--watch]` and the bootstrap's status page: a run's peers read from the DHT.

`status` prints one table (or the raw records with --json) and exits; `--watch` keeps a live view (view/terminal.py)
refreshed every --interval-s until Ctrl-C. A bootstrap with --status-port serves the same snapshot as a web page
(bootstrap/watcher.py `SwarmWatcher`). None of them trains or holds a replica: they read the signed peer records,
nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from p2p_diloco.config import StatusConfig


def _fail(error: BaseException) -> int:
    print(f"p2p-diloco status: error: {error}", file=sys.stderr)
    return 2


def cmd_status(args: argparse.Namespace) -> int:
    from p2p_diloco.cli.args import load_config

    try:
        config = load_config(StatusConfig(), args, "status").validate()
    except ValueError as err:
        return _fail(err)
    from p2p_diloco.net.transport.node import NodeError  # hivemind only once the options are good

    try:
        return _watch(config) if config.watch else asyncio.run(_status(config))
    except NodeError as err:
        return _fail(err)
    except (TimeoutError, asyncio.TimeoutError):
        return _fail(TimeoutError(f"the DHT did not answer within {config.timeout_s:g}s"))


async def _reader_node(config: StatusConfig, tmp: str) -> Any:
    """A client-mode node with a throwaway identity: it reads the DHT and serves nothing."""
    from p2p_diloco.net.discovery.records import PeerRecordValidator
    from p2p_diloco.net.transport.node import NodeConfig, SwarmNode, parse_multiaddr
    from p2p_diloco.wire.identity import Identity

    bootstrap = tuple(parse_multiaddr(b, require_peer_id=True) for b in config.bootstrap)
    path = str(Path(tmp) / "throwaway.key")
    Identity.generate().save(path)
    node_config = NodeConfig(initial_peers=bootstrap, client_mode=True, start_timeout_s=config.timeout_s,
                             start_retries=1)
    # With the validator, a DHT node's answer that holds a forged record is dropped whole, so a forged record
    # under another peer's subkey cannot hide that peer's real record from us.
    return await SwarmNode.start(path, node_config, record_validators=[PeerRecordValidator([config.run_id])])


async def _status(config: StatusConfig) -> int:
    import json
    import tempfile

    from p2p_diloco.net.discovery.records import read_run
    from p2p_diloco.view.table import rejection_details, status_table

    with tempfile.TemporaryDirectory(prefix="p2p-diloco-status-") as tmp:
        node = await _reader_node(config, tmp)
        try:
            spec_hash, records = await read_run(node, config.run_id, config.timeout_s)
        finally:
            await node.shutdown()
    if config.json:
        print(json.dumps({"run_id": config.run_id, "spec_hash": spec_hash, "peers": records}, indent=1, default=str))
        return 0
    spec_text = f"spec {spec_hash[:12]}" if spec_hash else "no spec published"
    print(f"run '{config.run_id}': {spec_text}, {len(records)} peer record(s)")
    if records:
        print(status_table(records))
        details = rejection_details(records)
        if details:
            print("\nrejections by reason, and each peer's worst offenders:\n" + details)
        from p2p_diloco.peer.isolation import alone_lines  # stdlib only: light

        alone = alone_lines(records)
        if alone:
            print("\npeers that merge nothing while others publish (their own diagnosis and fix):\n" + "\n".join(alone))
    return 0


def _watch(config: StatusConfig) -> int:
    """The live view: one reader node on a network thread, a snapshot per refresh, until Ctrl-C."""
    import tempfile

    from p2p_diloco.net.discovery.records import read_run
    from p2p_diloco.net.transport.netloop import NetLoop
    from p2p_diloco.view.figures import ReplicaWatch
    from p2p_diloco.view.snapshot import Curves, build_snapshot
    from p2p_diloco.view.terminal import watch

    loop = NetLoop()
    curves, replicas = Curves(), ReplicaWatch()
    with tempfile.TemporaryDirectory(prefix="p2p-diloco-status-") as tmp:
        node = None
        try:
            node = loop.wait(_reader_node(config, tmp), timeout_s=config.timeout_s + 10)
            observer: dict[str, object] = {"kind": "status", "peer_id": None, "reachability": "unknown", "addrs": []}

            def fetch() -> dict:
                spec_hash, records = loop.wait(read_run(node, config.run_id, config.timeout_s),
                                               timeout_s=2 * config.timeout_s + 5)
                return build_snapshot(run_id=config.run_id, spec_hash=spec_hash, now=time.time(), records=records,
                                      observer=observer, curves=curves, replicas=replicas)

            return watch(fetch, interval_s=config.interval_s)
        finally:
            if node is not None:
                try:
                    loop.wait(node.shutdown(), timeout_s=15)
                except Exception:  # leaving cleanly is best effort: the daemon dies with us anyway
                    pass
            loop.close()
