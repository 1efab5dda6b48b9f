"""A freeloader re-pulling everything: bytes and re-sends to a remote that loops pull requests with an empty
version vector, against a real Gossip pull handler on SwarmNodes (127.0.0.1), with the serve rule
(net/gossip/served.py: each update at most twice per remote in 600 s) and without it (`window_s=0`, what the
gossip did before).

The server holds `--updates` updates of the `test` preset's model (real size) from 3 authors, no guard (the rule
alone; the guard's uplink share would cut both runs). The freeloader pulls (limit 32) back to back for
`--seconds`.

    python benchmarks/bench_freeloader.py --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from p2p_diloco.config import preset
from p2p_diloco.net.gossip.served import SERVE_WINDOW_S, ServedLog
from p2p_diloco.net.gossip.service import Gossip, GossipConfig, encode_request
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import NodeConfig, SwarmNode
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.train.models.build import build_model, flat_params
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import decode_update, make_update
from p2p_diloco.wire.identity import Identity

SPEC = dataclasses.replace(preset("test"), run_id="freeloader-bench")


async def start_node(folder: Path, name: str, initial: tuple[str, ...] = ()) -> SwarmNode:
    path = str(folder / f"{name}.key")
    Identity.generate().save(path)
    return await SwarmNode.start(path, NodeConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), initial_peers=initial,
                                                  start_timeout_s=30))


async def one_run(window_s: float, args: argparse.Namespace, folder: Path) -> dict:
    numel = flat_params(build_model(SPEC.model, SPEC.seed)).numel()
    codec = get_codec(SPEC.outer.codec, SPEC.outer.codec_block)
    server = await start_node(folder, f"server{window_s:g}")
    loafer = await start_node(folder, f"loafer{window_s:g}", tuple(map(str, server.visible_maddrs())))
    replica = Replica.from_spec(SPEC, torch.zeros(numel), codec=codec)
    intake = Intake(SPEC, numel, replica)
    config = GossipConfig(anti_entropy_s=3600.0, rpc_timeout_s=10.0)
    gossip = Gossip(server, SPEC.run_id, intake, UpdateStore(config.retained_bytes), config,
                    peers=lambda: [loafer.peer_id])
    gossip._server.served = ServedLog(window_s=window_s)  # the rule under test (0: off)
    gen = torch.Generator().manual_seed(0)
    authors = [Identity.generate() for _ in range(3)]
    await gossip.start()
    sent: Counter[tuple[str, int]] = Counter()
    nbytes = pulls = 0
    try:
        for i in range(args.updates):
            author = authors[i % len(authors)]
            update = make_update(run_id=SPEC.run_id, spec_hash=SPEC.spec_hash(), seq=i // len(authors) + 1, tau=0,
                                 samples=8, weight=0.5, codec=codec.name, numel=numel, identity=author,
                                 payload=codec.compress(0.01 * torch.randn(numel, generator=gen)))
            replica.offer(update)
            await gossip.publish(update)
        started = time.monotonic()
        while time.monotonic() - started < args.seconds:
            stream = rpc.call_stream(loafer.p2p, server.peer_id, gossip.pull_name, encode_request(VersionVector(), 32),
                                     max_chunk_bytes=intake.max_bytes, max_total_bytes=32 * intake.max_bytes,
                                     timeout_s=10)
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    u = decode_update(chunk, max_bytes=intake.max_bytes)
                    sent[(u.sender, u.seq)] += 1
                    nbytes += len(chunk)
            pulls += 1
        elapsed = time.monotonic() - started
    finally:
        await gossip.stop()
        for node in (loafer, server):
            await node.shutdown()
    return {"window_s": window_s, "seconds": round(elapsed, 1), "pulls": pulls, "updates_held": args.updates,
            "bytes_sent_mb": round(nbytes / 1e6, 1), "mb_per_s": round(nbytes / 1e6 / elapsed, 2),
            "max_sends_per_update": max(sent.values(), default=0),
            "min_sends_per_update": min(sent.values(), default=0),
            "skipped": gossip.stats["serves_repeated_skipped"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--updates", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("p2p_diloco").setLevel(logging.ERROR)  # the freeloader serves no announce: not news
    with tempfile.TemporaryDirectory() as tmp:
        for window_s in (0.0, SERVE_WINDOW_S):
            print(json.dumps(asyncio.run(one_run(window_s, args, Path(tmp)))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
