"""The uplink shared by reciprocity (issue 16; net/admission/uplink.py): all remotes that gave us nothing share
ONE newcomers' share, contributors are served while newcomers are refused, the best-scored contributors are
unchoked when the contributors' part is spent, re-serving costs; on the guard alone, then on real SwarmNodes
(127.0.0.1, port 0) through the gossip's pull handler, which ends a response early when the share is spent."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest
import torch

from p2p_diloco.config import preset
from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.admission.policy import RateLimitConfig
from p2p_diloco.net.gossip.service import Gossip, GossipConfig, encode_request
from p2p_diloco.net.transport import rpc
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import make_update

pytestmark = pytest.mark.timeout(120)

SPEC = dataclasses.replace(preset("test"), run_id="uplink-test")
NUMEL = 2000
CODEC = get_codec(SPEC.outer.codec, SPEC.outer.codec_block)
PULL, CHUNK = "p2p-diloco/r/pull", "p2p-diloco/r/chunk"
# newcomers: 250 B/s, 250 B saved; contributors: 750 B/s, 750 B saved (burst_s 1)
LIMITS = RateLimitConfig(uplink_bytes_per_s=1000.0, newcomer_share=0.25, burst_s=1.0, unchoked_contributors=1,
                         pulls_per_s=1000.0, snapshot_requests_per_s=1000.0)


def _serve(guard: PeerGuard, caller: str, handler: str = PULL, nbytes: int = 0) -> str | None:
    """One request through the guard as rpc.serve does it: admit, send `nbytes`, release."""
    async def go() -> str | None:
        why = await guard.admit(caller, handler, 10)
        if why is None:
            guard.charge_out(caller, nbytes)
            guard.release(caller)
        return why

    return asyncio.run(go())


def test_a_crowd_of_newcomers_gets_one_share_and_contributors_are_still_served() -> None:
    guard = PeerGuard("r", self_id="me", limits=LIMITS)
    guard.ledger.gave("contributor", 1, 5000)
    served = [c for c in (f"sybil{i}" for i in range(200)) if _serve(guard, c, nbytes=400) is None]
    assert served == ["sybil0"]  # its 400 bytes spent the newcomers' 250 B: the other 199 wait
    why = _serve(guard, "sybil7", CHUNK)  # snapshot requests too
    assert why is not None and why.startswith("busy: the newcomers' share")
    assert guard.rejections.totals["uplink_newcomers"] == 200
    assert _serve(guard, "contributor", nbytes=400) is None and _serve(guard, "contributor", CHUNK) is None
    assert _serve(guard, "sybil9", "p2p-diloco/r/announce") is None  # small requests are not shared out


def test_when_the_contributors_part_is_spent_the_best_scored_are_unchoked() -> None:
    guard = PeerGuard("r", self_id="me", limits=LIMITS)
    guard.ledger.gave("best", 4, 100_000)
    guard.ledger.gave("other", 1, 1000)
    assert _serve(guard, "other", nbytes=2000) is None  # spends the contributors' 750 B
    why = _serve(guard, "other")
    assert why is not None and why.startswith("busy: this peer's uplink is over budget")
    assert _serve(guard, "best", nbytes=2000) is None and _serve(guard, "best") is None
    assert guard.rejections.totals["uplink_choked"] == 1
    assert guard.uplink.contributors.tokens >= -guard.uplink.contributors.capacity  # a bounded debt


def test_a_newcomer_served_again_waits_for_the_upper_half_of_the_share() -> None:
    guard = PeerGuard("r", self_id="me", limits=LIMITS)
    ledger = guard.ledger
    for _ in range(2):  # it asks for the same update twice: the second serve is a re-serve
        ledger.served_update("looper", "s", 1, 100)
    assert ledger.account("looper").reserved_bytes == 100
    assert ledger.score("looper") < ledger.score("fresh") == 0.0
    guard.uplink.charge("fresh", 150)  # the newcomers' bucket is below half (100 of 250 B left)
    assert _serve(guard, "looper") is not None
    assert _serve(guard, "fresh") is None


def test_no_budget_refuses_nothing() -> None:
    guard = PeerGuard("r", self_id="me", limits=dataclasses.replace(LIMITS, uplink_bytes_per_s=0))
    assert all(_serve(guard, f"sybil{i}", nbytes=10**9) is None for i in range(20))


# ---------------------------------------------------------------------------------------------- loopback


def test_a_pull_response_ends_early_when_the_newcomers_share_is_spent(loop, members) -> None:
    """A holds 8 updates (about 2 KB each). A newcomer that pulls everything gets a short batch, the next one is
    refused with the reason; a contributor gets all 8, and pulling them again costs it."""
    a_member, newcomer, contributor = members
    limits = dataclasses.replace(LIMITS, uplink_bytes_per_s=4000.0, unchoked_contributors=4)
    config = GossipConfig(anti_entropy_s=3600.0, rpc_timeout_s=5.0)
    replica = Replica.from_spec(SPEC, torch.zeros(NUMEL), codec=CODEC)
    guard = PeerGuard(SPEC.run_id, self_id=a_member.node.peer_id, limits=limits)
    store = UpdateStore(config.retained_bytes)
    gossip = Gossip(a_member.node, SPEC.run_id, Intake(SPEC, NUMEL, replica), store, config, peers=lambda: [],
                    guard=guard)
    generator = torch.Generator().manual_seed(3)
    updates = [make_update(run_id=SPEC.run_id, spec_hash=SPEC.spec_hash(), seq=seq, tau=0, samples=8, weight=0.5,
                           codec=CODEC.name, numel=NUMEL, identity=a_member.identity,
                           payload=CODEC.compress(0.01 * torch.randn(NUMEL, generator=generator)))
               for seq in range(1, 9)]

    async def setup() -> None:
        for u in updates:
            replica.offer(u)
            store.add(u)
        guard.ledger.gave(contributor.node.peer_id, 1, 10_000)

    async def pull(member) -> list[bytes] | str:
        stream = rpc.call_stream(member.node.p2p, a_member.node.peer_id, gossip.pull_name,
                                 encode_request(VersionVector(), 8), max_chunk_bytes=1 << 20,
                                 max_total_bytes=1 << 24, timeout_s=5)
        try:
            async with contextlib.aclosing(stream):
                return [chunk async for chunk in stream]
        except rpc.RpcRemoteError as e:
            return e.remote_message

    async def account(peer: str):
        return dataclasses.replace(guard.ledger.account(peer))

    loop.run(gossip.start())
    try:
        loop.run(setup())
        first = loop.run(pull(newcomer))
        assert isinstance(first, list) and len(first) == 1, first  # cut after one update: a short batch
        refused = loop.run(pull(newcomer))
        assert isinstance(refused, str) and refused.startswith("busy: the newcomers' share"), refused
        for _ in range(2):
            assert len(loop.run(pull(contributor))) == 8  # unchoked: served in full, though over budget
        assert gossip.stats["serves_cut"] == 1 and guard.rejections.totals["uplink_newcomers"] == 2
        served = loop.run(account(contributor.node.peer_id))
        assert (served.served_updates, served.reserved_updates) == (16, 8)  # the second time, all again
        assert served.score < loop.run(account(newcomer.node.peer_id)).score + 10_000
    finally:
        loop.run(gossip.stop(), timeout_s=30)
