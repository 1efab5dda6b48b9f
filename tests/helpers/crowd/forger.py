"""`Forger`: a crowd of K signing identities behind one network node, against real `p2p-diloco join` peers.

The simulator's crowd (sim/crowd.py) in a real swarm: one SwarmNode with the real gossip (its own replica, intake
and store, no training) joins the run, pulls what the honest peers publish, and for every update of the copied
peer (`source`) re-signs a tampered copy under each of its K identities (the modes of sim/crowd_attacks.py:
near copies, negated or not, scaled to the norm bound, noise), each at the identity's next seq and the run's
largest weight. It heralds each copy to the run's sponsors before it announces it (the best a copier can do:
net/gossip/heralds.py), then the honest peers pull the copies from it like any update and relay them to each
other. K identities cost it K keys; the network sees one peer, which is what an open run's merge rule must not
care about (whose key signed an update is all it reads).

Runs on its own event loop in a thread (`start_forger`), so a benchmark or a test can drive the honest peers'
processes synchronously; `stop()` ends it and returns what it did.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.sim.crowd_attacks import crowd_delta, forged, mode_of
from p2p_diloco.wire.identity import Identity

POLL_S = 0.05
"""How often the forger looks for new updates of the copied peer in its replica."""
MISSING_POLLS = 40
"""Polls (2 s) an update merged here may be missing from the store before the forger skips it."""


class Forger:
    """K identities that re-sign tampered copies of `source`'s updates (module docstring). Use `start_forger`."""

    def __init__(self, workdir: Path, spec: Any, numel: int, *, size: int, mode: str, source: str,
                 honest: list[str], bootstrap: str, factor: float = 1.0, seed: int = 1) -> None:
        self.workdir, self.spec, self.numel, self.source = Path(workdir), spec, numel, source
        self.honest, self.bootstrap, self.factor = honest, bootstrap, factor  # the caller may fill it later
        self.identities = [Identity.generate() for _ in range(size)]
        self.modes = [mode_of(mode, i) for i in range(size)]
        self.seqs = [0] * size
        self.rng = torch.Generator().manual_seed(seed)
        self.copied = 0  # source updates copied (or skipped)
        self.skipped = 0  # source updates not copied: the source was more than one ahead, or not in the store
        self.published = 0  # forged updates published
        self.heralds = 0  # heralds the sponsors accepted
        self.error: BaseException | None = None
        self.started_s = 0.0
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def peer_ids(self) -> list[str]:
        return [i.peer_id for i in self.identities]

    def start(self, ready_timeout_s: float) -> None:
        """Run on a loop of its own in a daemon thread; return once its gossip serves (or raise its error)."""
        self._thread = threading.Thread(target=self._run, name="forger", daemon=True)
        self._thread.start()
        started = time.monotonic()
        if not self._ready.wait(ready_timeout_s):
            self.stop(1.0)
            raise TimeoutError(f"the forger did not start in {ready_timeout_s:g} s")
        if self.error is not None:
            raise self.error
        self.started_s = time.monotonic() - started

    def stop(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """End the forger (its gossip and node) and return what it did; re-raises its error, if it failed."""
        if self._stop is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.error is not None:
            raise self.error
        return {"copied": self.copied, "skipped": self.skipped, "published": self.published, "heralds": self.heralds,
                "identities": len(self.identities)}

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - handed to the caller by stop()
            self.error = e
        finally:
            self._ready.set()

    async def _main(self) -> None:
        from p2p_diloco.net.gossip.service import Gossip, GossipConfig
        from p2p_diloco.net.transport.node import NodeConfig, SwarmNode
        from p2p_diloco.sync.intake import Intake
        from p2p_diloco.sync.replica import Replica
        from p2p_diloco.sync.robust import MergePolicy
        from p2p_diloco.sync.store import UpdateStore
        from p2p_diloco.wire.codecs import get_codec

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        key = self.workdir / "forger.key"
        Identity.generate().save(str(key))
        node = await SwarmNode.start(str(key), NodeConfig(initial_peers=(self.bootstrap,), start_timeout_s=60))
        replica = Replica.from_spec(self.spec, torch.zeros(self.numel))
        intake = Intake(self.spec, self.numel, replica)
        config = GossipConfig(anti_entropy_s=0.5)
        gossip = Gossip(node, self.spec.run_id, intake, UpdateStore(config.retained_bytes), config,
                        peers=lambda: self.honest)
        codec = get_codec(self.spec.outer.codec, self.spec.outer.codec_block)
        bound = MergePolicy.from_spec(self.spec).reject_above
        try:
            await gossip.start()
            self._ready.set()
            for peer in self.honest:  # pull at once: anti-entropy and the pulls back do the rest
                await gossip.request_pull(peer)
            missing = 0  # polls the next update to copy was merged here but not in the store
            while not self._stop.is_set():
                held = replica.version_vector.get(self.source)
                if held - self.copied > 1:  # it copies what is current, as the simulator's crowd does: a copy of
                    self.skipped += held - 1 - self.copied  # an update rounds old is a replay, another attack
                    self.copied = held - 1
                while self.copied < held and not self._stop.is_set():
                    update = gossip.store.get(self.source, self.copied + 1)
                    if update is None:  # merged but not stored yet (the merge runs off the loop, the store on
                        # it, after it), or no longer stored: wait a few polls, then skip it, counted as skipped
                        missing += 1
                        if missing < MISSING_POLLS:
                            break
                        self.copied, self.skipped, missing = self.copied + 1, self.skipped + 1, 0
                        continue
                    missing = 0
                    await self._forge(update, gossip, node, replica, codec, bound)
                    self.copied += 1
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), POLL_S)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(gossip.stop(), 30)
            with contextlib.suppress(Exception):
                await node.shutdown()

    async def _forge(self, honest: Any, gossip: Any, node: Any, replica: Any, codec: Any, bound: float) -> None:
        from p2p_diloco.net.transport import rpc
        from p2p_diloco.wire.herald import encode_herald

        d = codec.decompress(honest.payload, honest.header.numel)
        sponsors = list(self.spec.defence.sponsors)
        copies = []
        for i, identity in enumerate(self.identities):
            payload = codec.compress(crowd_delta(self.modes[i], d, factor=self.factor, bound=bound, rng=self.rng))
            self.seqs[i] += 1
            copies.append(forged(honest, payload, identity, self.seqs[i], self.spec.outer.max_weight))
        herald_name = f"p2p-diloco/{self.spec.run_id}/herald"
        calls = [rpc.call(node.p2p, sponsor, herald_name, encode_herald(u), max_response_bytes=16, timeout_s=3)
                 for u in copies for sponsor in sponsors]
        results = await asyncio.gather(*calls, return_exceptions=True)
        self.heralds += sum(1 for r in results if not isinstance(r, BaseException))
        for update in copies:
            await asyncio.to_thread(replica.offer, update)
            await gossip.publish(update)
            self.published += 1


def start_forger(workdir: Path, spec: Any, numel: int, *, ready_timeout_s: float = 120.0,
                 **kwargs: Any) -> Forger:
    """A `Forger` (its keyword arguments) running on a loop of its own in a daemon thread, once its gossip
    serves; raises its error if it failed to start."""
    forger = Forger(workdir, spec, numel, **kwargs)
    forger.start(ready_timeout_s)
    return forger


def run_spec(argv: Sequence[str]) -> tuple[Any, int]:
    """The RunSpec `p2p-diloco join ARGV` runs with, and its model's parameter count."""
    from p2p_diloco.cli.main import build_parser
    from p2p_diloco.cli.swarm import join_config
    from p2p_diloco.train.data.resolve import resolve_spec
    from p2p_diloco.train.models.build import build_model, flat_params

    args = build_parser().parse_args(["join", *argv])
    args.argv = list(argv)
    spec = resolve_spec(join_config(args).spec)  # as `join` resolves it (train/hardware/memory_fit.py)
    return spec, flat_params(build_model(spec.model, spec.seed)).numel()
