"""State sync throughput: a joiner fetches a donor's snapshot (signed manifest + digested chunks) on loopback.

    python benchmarks/bench_statesync.py --params 100e6 --variants 4x4,16x4
Each variant is CHUNK_MiBxPARALLEL; each is fetched twice (a new snapshot, then the donor's cached one).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

import torch

from p2p_diloco.net.statesync.client import StateSyncConfig, fetch_snapshot
from p2p_diloco.net.statesync.server import SnapshotServer
from p2p_diloco.net.transport.node import NodeConfig, SwarmNode
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.identity import Identity


async def bench(numel: int, variants: list[tuple[float, int]]) -> None:
    tmp = tempfile.mkdtemp()
    nodes, identities = [], []
    try:
        for i in range(2):
            identity = Identity.generate()
            path = os.path.join(tmp, f"{i}.key")
            identity.save(path)
            peers = tuple(nodes[0].visible_maddrs()) if nodes else ()
            nodes.append(await SwarmNode.start(path, NodeConfig(initial_peers=peers, start_timeout_s=30)))
            identities.append(identity)
        replica = Replica(torch.randn(numel), outer_lr=0.7, max_weight=1.0, codec=None,  # type: ignore[arg-type]  # serves snapshots only
                          version_vector=VersionVector({identities[0].peer_id: 5}))
        print(f"# {time.strftime('%Y-%m-%d')} snapshot of {numel / 1e6:.0f}M parameters = {numel * 4 / 1e6:.0f} MB\n"
              "| chunk | in flight | snapshot | seconds | MB/s |\n|---|---|---|---|---|")
        for chunk_mib, parallel in variants:
            cfg = StateSyncConfig(chunk_bytes=int(chunk_mib * (1 << 20)), parallel_chunks=parallel, timeout_s=60)
            server = SnapshotServer(nodes[0], "bench", "h", replica, identities[0], cfg)
            await server.start()
            try:
                for kind in ("new", "cached"):
                    t0 = time.monotonic()
                    theta, _, _ = await fetch_snapshot(nodes[1], "bench", "h", [nodes[0].peer_id], numel, cfg)
                    dt = time.monotonic() - t0
                    assert torch.equal(theta, replica.theta)
                    print(f"| {chunk_mib:g} MiB | {parallel} | {kind} | {dt:.2f} | {numel * 4 / 1e6 / dt:.0f} |",
                          flush=True)
                    del theta
            finally:
                await server.stop()
    finally:
        for node in nodes:
            await node.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--variants", default="4x4,16x4")
    args = ap.parse_args()
    variants = [(float(c), int(p)) for c, p in (v.split("x") for v in args.variants.split(","))]
    asyncio.run(bench(int(args.params), variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
