"""Pull slots by track record (issue 16; net/gossip/slots.py, net/gossip/pulls.py).

The scheduling rules on `PullSlots` alone (pure: backoff, probation, order, bounds), then on real SwarmNodes
(127.0.0.1, port 0): a crowd of fresh identities that announce a claim and never answer their pull streams holds
at most the probationary slot, backs off more and more, and an honest contributor's updates still arrive at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import pytest
import torch

from p2p_diloco.config import preset
from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.admission.policy import RateLimitConfig
from p2p_diloco.net.gossip.service import Gossip, GossipConfig, encode_request
from p2p_diloco.net.gossip.slots import BACKOFF_MAX_S, BACKOFF_MIN_S, MAX_WANTED_PEERS, PullSlots
from p2p_diloco.net.transport import rpc
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import make_update
from p2p_diloco.wire.identity import Identity
from tests.helpers.net import start_member

pytestmark = pytest.mark.timeout(120)

SPEC = dataclasses.replace(preset("test"), run_id="pull-slots-test")
NUMEL = 2000
CODEC = get_codec(SPEC.outer.codec, SPEC.outer.codec_block)
V1 = VersionVector({"x": 1})


def _scores(**scores: float):
    """is_contributor and score callbacks for the peers named (a contributor has a score)."""
    return (lambda p: p in scores), (lambda p: scores.get(p, 0.0))


# ---------------------------------------------------------------------------------------------- rules


def test_backoff_grows_to_its_cap_and_a_success_resets_it() -> None:
    slots = PullSlots(4, 1)
    delays = [slots.failed("s", now=0.0) for _ in range(9)]
    assert delays[:3] == [BACKOFF_MIN_S, 2 * BACKOFF_MIN_S, 4 * BACKOFF_MIN_S] and delays[-1] == BACKOFF_MAX_S
    assert slots.backoff_until("s", now=BACKOFF_MAX_S - 1) == BACKOFF_MAX_S
    slots.want("s", V1, False, lambda p: False)  # remembered while it backs off, not started
    assert slots.pick([], 1.0, *_scores()) == ([], BACKOFF_MAX_S)
    assert slots.pick([], BACKOFF_MAX_S, *_scores()) == (["s"], None)  # its backoff ended
    slots.succeeded("s")
    assert slots.delay("s") == 0.0 and slots.failed("s", now=100.0) == BACKOFF_MIN_S


def test_newcomers_share_the_probationary_slots_and_contributors_go_first_by_score() -> None:
    slots = PullSlots(4, 1)
    is_contributor, score = _scores(c1=10.0, c2=50.0, c3=5.0)
    for peer in ("n1", "n2", "c1", "n3", "c2"):
        slots.want(peer, V1, False, is_contributor)
    assert slots.pick([], 0.0, is_contributor, score) == (["c2", "c1", "n1"], None)
    assert slots.pick(["n1"], 0.0, is_contributor, score)[0] == ["c2", "c1"]  # n1 holds the probation slot
    assert slots.pick(["c2", "c1", "n1", "n2"], 0.0, is_contributor, score)[0] == []  # all 4 taken
    assert slots.pick(["n1", "n2"], 0.0, is_contributor, score)[0] == ["c2", "c1"]  # probation overfull: no more
    assert not slots.may_start("n3", ["n1"], 0.0, is_contributor) and slots.may_start("c3", ["n1"], 0.0, is_contributor)
    assert PullSlots(1, 1).probation == 1 and PullSlots(8, 0).probation == 1  # at least one slot for newcomers


def test_a_contributor_announcing_often_keeps_its_place() -> None:
    slots = PullSlots(1, 1)
    is_contributor, score = _scores(a=1.0, b=1.0)
    slots.want("a", V1, False, is_contributor)
    slots.want("b", V1, False, is_contributor)
    for seq in range(2, 20):  # a announces again and again: its wish grows, its place stays
        slots.want("a", VersionVector({"x": seq}), False, is_contributor)
        slots.want("b", VersionVector({"y": seq}), False, is_contributor)
    assert list(slots.wanted) == ["a", "b"] and slots.wanted["a"][0].get("x") == 19
    assert slots.pick([], 0.0, is_contributor, score)[0] == ["a"]


def test_a_crowd_of_wishes_drops_newcomers_before_contributors() -> None:
    slots = PullSlots(4, 1)
    is_contributor = lambda p: p == "c"  # noqa: E731
    slots.want("c", V1, False, is_contributor)
    dropped = sum(slots.want(f"n{i}", V1, False, is_contributor) for i in range(MAX_WANTED_PEERS + 100))
    assert dropped == 101 and "c" in slots.wanted and len(slots.wanted) == MAX_WANTED_PEERS


# ---------------------------------------------------------------------------------------------- loopback


def _updates(identity: Identity, count: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [make_update(run_id=SPEC.run_id, spec_hash=SPEC.spec_hash(), seq=seq, tau=0, samples=8, weight=0.5,
                        codec=CODEC.name, numel=NUMEL, identity=identity,
                        payload=CODEC.compress(0.01 * torch.randn(NUMEL, generator=generator)))
            for seq in range(1, count + 1)]


def _gossip(loop, member, limits: RateLimitConfig, config: GossipConfig, view: list[str]):
    replica = Replica.from_spec(SPEC, torch.zeros(NUMEL), codec=CODEC)
    guard = PeerGuard(SPEC.run_id, self_id=member.node.peer_id, limits=limits)
    gossip = Gossip(member.node, SPEC.run_id, Intake(SPEC, NUMEL, replica), UpdateStore(config.retained_bytes),
                    config, peers=lambda: view, guard=guard)
    loop.run(gossip.start())
    return gossip, replica


def test_a_crowd_that_announces_and_stalls_holds_only_the_probation_slot(loop, members, tmp_path_factory) -> None:
    """Four fresh identities announce a claim to A four times a second and never answer its pulls: they share
    A's one probation slot, back off more and more, and B's updates still reach A at once."""
    bootstrap = tuple(members[0].node.visible_maddrs())
    crowd = [loop.run(start_member(tmp_path_factory, bootstrap)) for _ in range(4)]
    release = asyncio.Event()

    async def stall(request: bytes, caller: str) -> bytes:
        await release.wait()
        return b""

    limits = RateLimitConfig(probation_timeout_s=0.5)
    config = GossipConfig(fanout=1, anti_entropy_s=3600.0, rpc_timeout_s=5.0, max_concurrent_pulls=4)
    a_member, b_member = members[:2]
    gossips = []
    try:
        for m in crowd:
            loop.run(rpc.serve(m.node.p2p, f"p2p-diloco/{SPEC.run_id}/pull", stall, max_request_bytes=1 << 20,
                               timeout_s=3600))
        a, a_replica = _gossip(loop, a_member, limits, config, [])
        b, b_replica = _gossip(loop, b_member, limits, config, [a_member.node.peer_id])
        gossips += [a, b]
        updates = _updates(b_member.identity, 4, seed=1)

        def publish(update) -> float:
            b_replica.offer(update)
            started = time.monotonic()
            loop.run(b.publish(update))
            while a_replica.version_vector.get(b_member.node.peer_id) < update.seq:
                assert time.monotonic() - started < 10, "B's update did not reach A"
                time.sleep(0.01)
            return time.monotonic() - started

        publish(updates[0])  # B gave A something: a contributor from now on (recorded on the loop after the merge)

        async def b_contributes() -> bool:
            return a.guard.ledger.is_contributor(b_member.node.peer_id)

        started = time.monotonic()
        while not loop.run(b_contributes()):
            assert time.monotonic() - started < 5, "B is not a contributor at A"
            time.sleep(0.01)
        crowd_ids = {m.node.peer_id for m in crowd}
        claim = encode_request(VersionVector({Identity.generate().peer_id: 1}))

        async def announce(m) -> None:
            with contextlib.suppress(rpc.RpcError):
                await rpc.call(m.node.p2p, a_member.node.peer_id, f"p2p-diloco/{SPEC.run_id}/announce", claim,
                               max_response_bytes=16, timeout_s=5)

        async def announce_all() -> None:
            await asyncio.gather(*(announce(m) for m in crowd))

        async def crowd_running() -> int:
            return sum(1 for p in a._puller.tasks if p in crowd_ids)

        most, took = 0, []
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            loop.run(announce_all())
            for _ in range(5):
                most = max(most, loop.run(crowd_running()))
                time.sleep(0.05)
            if len(took) < 3 and time.monotonic() > deadline - 2.5 + 0.7 * len(took):
                took.append(publish(updates[len(took) + 1]))
        assert most == 1, f"the crowd held {most} pull slots at once"
        assert max(took) < 2.0, took  # B's updates do not wait for the crowd's stalls (5 s each before)

        async def delays() -> dict[str, float]:
            return {p: a._puller.slots.delay(p) for p in crowd_ids}

        started = time.monotonic()  # their wishes stay: each is tried again when its backoff ends, and fails
        while max(loop.run(delays()).values()) < 2.0:
            assert time.monotonic() - started < 10, loop.run(delays())
            time.sleep(0.05)
        assert min(loop.run(delays()).values()) >= 1.0
        for p in crowd_ids:
            account = a.guard.ledger.account(p)
            assert account.timeout >= 1 and not a.guard.ledger.is_contributor(p)
        assert a.guard.rejections.totals["timeout"] >= 4
    finally:
        loop.loop.call_soon_threadsafe(release.set)
        for gossip in gossips:
            loop.run(gossip.stop(), timeout_s=30)
        for m in crowd:
            loop.run(m.node.shutdown(), timeout_s=30)

