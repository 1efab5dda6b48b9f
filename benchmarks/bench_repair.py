"""Replica repair on loopback (issue 4's second trap): how long until replicas that disagree about a lost update
agree again, by model size, against the code before the repair (which never converged).

Four real SwarmNodes in one process, each with the peer's Intake, UpdateStore, Gossip, SnapshotServer and Repair
(what `PeerNetwork.serve` starts). Sender S published seqs 1-3 and an honest sender H seqs 1-2. Peer A merged
everything; B, C and D never got S#2, waited out the gap and skipped it. Then, per case:

    repair     A no longer holds S#2 (restart, eviction): A adopts a skipping peer's state (net/gossip/repair.py)
    late fill  A still holds S#2: the skippers' requests name the hole, A serves it, they merge it late
    before     A no longer holds S#2, and gossip carries no holes and has no repair (the code before):
               measured for `--before-s` seconds, the replicas never meet

Each case starts when B, C and D pull from A (what anti-entropy does every ~5 s); the repair's grace is 0 here
(the peer's default waits 3 anti-entropy periods, 15 s, before it adopts: add that for a real swarm).
"equal" is vectors equal and every theta within 1e-6 of A's.

    python benchmarks/bench_repair.py --params 1e6,10.8e6,50e6 --repeat 3 --out benchmarks/results/repair
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from p2p_diloco.config import preset
from p2p_diloco.net.gossip.repair import Repair
from p2p_diloco.net.gossip.service import Gossip, GossipConfig
from p2p_diloco.net.statesync.client import StateSyncConfig
from p2p_diloco.net.statesync.server import SnapshotServer
from p2p_diloco.net.transport.node import NodeConfig, SwarmNode
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import make_update
from p2p_diloco.wire.identity import Identity

SPEC = dataclasses.replace(preset("test"), run_id="bench-repair")
CODEC = get_codec(SPEC.outer.codec, SPEC.outer.codec_block)
GOSSIP = GossipConfig(anti_entropy_s=3600.0, rpc_timeout_s=30)
SYNC = StateSyncConfig(snapshot_reuse_s=0.0, timeout_s=60.0)
PEERS = 4


def updates(identity: Identity, numel: int, count: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [make_update(run_id=SPEC.run_id, spec_hash=SPEC.spec_hash(), seq=seq, tau=0, samples=8, weight=0.5,
                        codec=CODEC.name, numel=numel, identity=identity,
                        payload=CODEC.compress(1e-3 * torch.randn(numel, generator=g)))
            for seq in range(1, count + 1)]


@dataclasses.dataclass
class Unit:
    node: SwarmNode
    identity: Identity
    replica: Replica
    intake: Intake
    store: UpdateStore
    services: list


async def case(nodes: list[tuple[SwarmNode, Identity]], numel: int, kind: str, before_s: float) -> dict:
    base = torch.linspace(-1, 1, numel)
    s_up, h_up = updates(Identity.generate(), numel, 3, 1), updates(Identity.generate(), numel, 2, 2)
    units = []
    for i, (node, identity) in enumerate(nodes):
        replica = Replica.from_spec(SPEC, base.clone(), codec=CODEC)
        intake = Intake(SPEC, numel, replica)
        store = UpdateStore(GOSSIP.retained_bytes)
        for u in (s_up if i == 0 else [s_up[0], s_up[2]]) + h_up:
            replica.offer(u)
            if i > 0 or u is not s_up[1] or kind == "late fill":
                store.add(u)
        if i > 0:
            intake.expire_gaps(now_s=replica.clock() + SPEC.defence.gap_timeout_s + 1)
        units.append(Unit(node, identity, replica, intake, store, []))
    everyone = [u.node.peer_id for u in units]
    for u in units:
        others = [p for p in everyone if p != u.node.peer_id]
        repair = None
        if kind != "before":
            repair = Repair(u.node, SPEC.run_id, SPEC.spec_hash(), u.replica, u.store, SYNC,
                            known=lambda u=u: u.services[1].known_vectors(), members=lambda o=others: o,
                            grace_s=0.0, cooldown_s=0.0)
        gossip = Gossip(u.node, SPEC.run_id, u.intake, u.store, GOSSIP, peers=lambda o=others: o,
                        on_vector=repair.observe if repair else None)
        server = SnapshotServer(u.node, SPEC.run_id, SPEC.spec_hash(), u.replica, u.identity, SYNC)
        u.services = [repair, gossip, server]
        await gossip.start()
        await server.start()

    def apart() -> float:
        a = units[0].replica.theta
        return max(float((u.replica.theta - a).abs().max()) for u in units[1:])

    def equal() -> bool:
        return len({u.replica.version_vector for u in units}) == 1 and apart() <= 1e-6

    try:
        if kind == "before":  # requests without holes, as before: the responder never sees them
            import p2p_diloco.net.gossip.service as gossip_module
            from p2p_diloco.net.gossip.messages import encode_request as with_holes

            def encode_request(vv, limit=None, ids=None):  # noqa: ANN001, ANN202
                return with_holes(type(vv)(vv.to_dict()), limit, ids)

            gossip_module.encode_request = encode_request
        divergence0 = apart()
        sent0 = sum(u.services[1].stats["bytes_sent"] + u.services[2].stats["bytes_sent"] for u in units)
        t0 = time.monotonic()
        for u in units[1:]:
            await u.services[1].request_pull(units[0].node.peer_id)
        deadline = t0 + (before_s if kind == "before" else 120.0)
        while not equal() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        seconds = time.monotonic() - t0
        await asyncio.sleep(0.5)  # the repair task counts itself after the replica already changed
        sent = sum(u.services[1].stats["bytes_sent"] + u.services[2].stats["bytes_sent"] for u in units) - sent0
        return {"params": numel, "case": kind, "equal": equal(), "seconds": seconds,
                "repairs": sum(u.services[0].stats["repairs"] for u in units if u.services[0] is not None),
                "bytes": sent, "divergence_before": divergence0, "divergence_after": apart(),
                "holes_after": [u.replica.version_vector.n_holes for u in units]}
    finally:
        if kind == "before":
            gossip_module.encode_request = with_holes
        for u in units:
            for service in u.services:
                if service is not None:
                    await service.stop()


async def bench(sizes: list[int], before_s: float, repeat: int) -> list[dict]:
    tmp = tempfile.mkdtemp()
    nodes: list[tuple[SwarmNode, Identity]] = []
    rows = []
    try:
        for i in range(PEERS):
            identity = Identity.generate()
            path = os.path.join(tmp, f"{i}.key")
            identity.save(path)
            peers = tuple(nodes[0][0].visible_maddrs()) if nodes else ()
            config = NodeConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), initial_peers=peers, start_timeout_s=30)
            nodes.append((await SwarmNode.start(path, config), identity))
        for numel in sizes:
            for kind in [k for _ in range(repeat) for k in ("repair", "late fill", "before")]:  # interleaved
                row = await case(nodes, numel, kind, before_s)
                rows.append(row)
                print(f"| {numel / 1e6:g}M | {kind} | {'yes' if row['equal'] else 'no'} | {row['seconds']:.2f} | "
                      f"{row['repairs']} | "
                      f"{row['bytes'] / 1e6:.1f} | {row['divergence_before']:.2e} -> {row['divergence_after']:.2e} |",
                      flush=True)
    finally:
        for node, _ in nodes:
            await node.shutdown()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="1e6,10.8e6", help="comma-separated model sizes (parameters)")
    parser.add_argument("--before-s", type=float, default=10.0, help="how long the 'before' case is watched")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each case (the summary gives medians)")
    parser.add_argument("--out", default="", help="write OUT.json and OUT.md")
    args = parser.parse_args()
    sizes = [int(float(p)) for p in args.params.split(",")]
    header = (f"# {time.strftime('%Y-%m-%d')} replica repair, {PEERS} peers on loopback (`{' '.join(sys.argv)}`)\n\n"
              "| params | case | equal | seconds | repairs | MB sent | max coordinate apart |\n"
              "|---|---|---|---|---|---|---|")
    print(header, flush=True)
    rows = asyncio.run(bench(sizes, args.before_s, args.repeat))
    summary = ["", "| params | case | equal (runs) | median seconds | median MB sent |", "|---|---|---|---|---|"]
    for numel in sizes:
        for kind in ("repair", "late fill", "before"):
            runs = [r for r in rows if r["params"] == numel and r["case"] == kind]
            summary.append(f"| {numel / 1e6:g}M | {kind} | {sum(r['equal'] for r in runs)}/{len(runs)} | "
                           f"{statistics.median(r['seconds'] for r in runs):.2f} | "
                           f"{statistics.median(r['bytes'] for r in runs) / 1e6:.1f} |")
    print("\n".join(summary))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps(rows, indent=1))
        lines = [header] + [
            f"| {r['params'] / 1e6:g}M | {r['case']} | {'yes' if r['equal'] else 'no'} | {r['seconds']:.2f} | "
            f"{r['repairs']} | {r['bytes'] / 1e6:.1f} | "
            f"{r['divergence_before']:.2e} -> {r['divergence_after']:.2e} |" for r in rows]
        Path(args.out + ".md").write_text("\n".join(lines + summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
