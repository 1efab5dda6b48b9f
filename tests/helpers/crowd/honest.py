"""Honest peers for the crowd scenarios: the network side of a peer on the caller's loop, and what it published."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.wire.identity import Identity


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
