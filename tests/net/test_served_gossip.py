"""A remote looping pulls with an empty vector, on real SwarmNodes (127.0.0.1, port 0): the gossip's pull handler
sends it each update at most twice in the window, then only what is new; a vector that falls below its last one
(a restart) gets them once more, once per window (net/gossip/served.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter

import pytest
import torch

from p2p_diloco.config import preset
from p2p_diloco.net.gossip.service import Gossip, GossipConfig, encode_request
from p2p_diloco.net.transport import rpc
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import OuterUpdate, decode_update, make_update
from p2p_diloco.wire.identity import Identity
from tests.helpers.net import LoopThread, Member

pytestmark = pytest.mark.timeout(120)

SPEC = dataclasses.replace(preset("test"), run_id="served-test")
NUMEL = 2000
CODEC = get_codec(SPEC.outer.codec, SPEC.outer.codec_block)
CONFIG = GossipConfig(anti_entropy_s=3600.0, rpc_timeout_s=5.0)


def _updates(identity: Identity, count: int) -> list[OuterUpdate]:
    generator = torch.Generator().manual_seed(7)
    return [make_update(run_id=SPEC.run_id, spec_hash=SPEC.spec_hash(), seq=seq, tau=0, samples=8, weight=0.5,
                        codec=CODEC.name, numel=NUMEL, identity=identity,
                        payload=CODEC.compress(0.01 * torch.randn(NUMEL, generator=generator)))
            for seq in range(1, count + 1)]


def test_a_looping_puller_gets_each_update_twice_unless_it_lost_them(loop: LoopThread,
                                                                     members: list[Member]) -> None:
    server, puller = members[0], members[1]
    replica = Replica.from_spec(SPEC, torch.zeros(NUMEL), codec=CODEC)
    intake = Intake(SPEC, NUMEL, replica)
    gossip = Gossip(server.node, SPEC.run_id, intake, UpdateStore(CONFIG.retained_bytes), CONFIG,
                    peers=lambda: [puller.node.peer_id])
    author = Identity.generate()
    updates = _updates(author, 6)
    sent: Counter[int] = Counter()

    async def pull(vv: VersionVector) -> list[int]:
        stream = rpc.call_stream(puller.node.p2p, server.node.peer_id, gossip.pull_name, encode_request(vv, 32),
                                 max_chunk_bytes=1 << 20, max_total_bytes=1 << 24, timeout_s=5)
        async with contextlib.aclosing(stream):
            seqs = [decode_update(chunk, max_bytes=intake.max_bytes).seq async for chunk in stream]
        sent.update(seqs)
        return seqs

    loop.run(gossip.start())
    try:
        for update in updates[:4]:
            assert replica.offer(update)[0].value == "merged"
            loop.run(gossip.publish(update))
        everything = [1, 2, 3, 4]
        got = [loop.run(pull(VersionVector())) for _ in range(5)]  # a freeloader: the empty vector, again and again
        assert got == [everything, everything, [], [], []]
        for update in updates[4:]:  # new updates still reach it, twice each
            replica.offer(update)
            loop.run(gossip.publish(update))
        assert [loop.run(pull(VersionVector())) for _ in range(3)] == [[5, 6], [5, 6], []]
        assert set(sent.values()) == {2} and gossip.stats["serves_repeated_skipped"] == 3 * 4 + 4 * 2 + 6
        # It shows it held everything, then asks with the empty vector: a restart. Served again, once per window.
        assert loop.run(pull(VersionVector({author.peer_id: 6}))) == []
        assert loop.run(pull(VersionVector())) == [*everything, 5, 6]
        assert gossip.stats["serves_reset"] == 1
        assert loop.run(pull(VersionVector({author.peer_id: 6}))) == []
        assert loop.run(pull(VersionVector())) == [*everything, 5, 6]  # its second serve since the reset
        assert loop.run(pull(VersionVector())) == []
        assert loop.run(pull(VersionVector({author.peer_id: 6}))) == [] and loop.run(pull(VersionVector())) == []
        assert gossip.stats["serves_reset"] == 1 and max(sent.values()) == 4
        # An honest remote asking from where its vector stands gets exactly what it lacks, once.
        honest = members[2]
        stream = rpc.call_stream(honest.node.p2p, server.node.peer_id, gossip.pull_name,
                                 encode_request(VersionVector({author.peer_id: 3}), 32), max_chunk_bytes=1 << 20,
                                 max_total_bytes=1 << 24, timeout_s=5)

        async def drain() -> list[int]:
            async with contextlib.aclosing(stream):
                return [decode_update(chunk, max_bytes=intake.max_bytes).seq async for chunk in stream]

        assert loop.run(drain()) == [4, 5, 6]
        assert gossip._server.served.summary(honest.node.peer_id) == {"marked": 3, "skipped": 0, "resets": 0}
    finally:
        loop.run(gossip.stop(), timeout_s=30)


def test_a_peer_banned_as_an_author_gets_no_pull_slot(loop: LoopThread, members: list[Member]) -> None:
    """It would serve us its own refused updates first, at every announce and anti-entropy tick."""
    us, banned = members[0], members[1]
    replica = Replica.from_spec(SPEC, torch.zeros(NUMEL), codec=CODEC)
    intake = Intake(SPEC, NUMEL, replica)
    gossip = Gossip(us.node, SPEC.run_id, intake, UpdateStore(CONFIG.retained_bytes), CONFIG,
                    peers=lambda: [banned.node.peer_id])
    replica.ban(banned.node.peer_id, "test")
    loop.run(gossip.start())
    try:
        claim = encode_request(VersionVector({Identity.generate().peer_id: 3}))  # holds what we lack
        for _ in range(2):
            loop.run(rpc.call(banned.node.p2p, us.node.peer_id, gossip.announce_name, claim, max_response_bytes=16,
                              timeout_s=5))
        deadline = time.monotonic() + 10
        while gossip.stats["pulls_skipped"] < 1:
            assert time.monotonic() < deadline, gossip.stats
            time.sleep(0.02)
        assert gossip.stats["pulls"] == 0 and gossip.stats["announces_received"] == 2
    finally:
        loop.run(gossip.stop(), timeout_s=30)
