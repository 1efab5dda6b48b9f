"""Heralds on real SwarmNodes (net/gossip/heralds.py): in a run with a sponsor, a proposer's published update is
heralded to the sponsor before it is announced, and the sponsor dates the proposal by the herald (sync/heralds.py);
a forged or garbled herald is refused and dates nothing; nobody heralds to a non-sponsor or in a run without one."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgpack
import torch

from p2p_diloco.net.gossip.heralds import Heralds
from p2p_diloco.net.gossip.service import Gossip, GossipConfig
from p2p_diloco.net.transport import rpc
from p2p_diloco.sync.heralds import HERALD_WAIT_S
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.store import UpdateStore
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import FORMAT_VERSION, UPDATE_DOMAIN, make_update
from p2p_diloco.wire.herald import encode_herald
from p2p_diloco.wire.identity import Identity, sign_blob
from tests.net.test_gossip import NUMEL, QUIET, SPEC, wait_until

CODEC = get_codec(SPEC.outer.codec, SPEC.outer.codec_block)


def test_a_proposer_heralds_its_update_to_the_sponsor_which_dates_it_by_the_herald(loop, members) -> None:
    sponsor, proposer, bystander = members
    spec = dataclasses.replace(SPEC, defence=dataclasses.replace(SPEC.defence, sponsors=(sponsor.node.peer_id,)))
    config = GossipConfig(fanout=3, anti_entropy_s=QUIET, rpc_timeout_s=5)
    everyone = [m.node.peer_id for m in members]
    gossips: list[Gossip] = []
    try:
        intakes = []
        for member in members:
            replica = Replica.from_spec(spec, torch.zeros(NUMEL), codec=CODEC, self_id=member.node.peer_id)
            intakes.append(Intake(spec, NUMEL, replica))
            gossips.append(Gossip(member.node, spec.run_id, intakes[-1], UpdateStore(config.retained_bytes), config,
                                  peers=lambda: everyone))
            loop.run(gossips[-1].start())
        heralds = intakes[0].replica.standing.sponsorship.heralds
        update = make_update(run_id=spec.run_id, spec_hash=spec.spec_hash(), seq=1, tau=0, samples=8, weight=0.5,
                             codec=CODEC.name, numel=NUMEL, identity=proposer.identity,
                             payload=CODEC.compress(0.01 * torch.randn(NUMEL, generator=torch.Generator())))
        assert intakes[1].replica.offer(update)[0].value == "merged"
        loop.run(gossips[1].publish(update))
        # publish returned once the sponsor acked the herald: it had heard of the update before anyone could pull it
        assert gossips[0].stats["heralds_heard"] == 1 and gossips[1].store.has(proposer.node.peer_id, 1)
        wait_until(lambda: intakes[0].replica.version_vector.get(proposer.node.peer_id) == 1, 20, "the sponsor's merge")
        assert gossips[1].stats["heralds_sent"] == 1 and gossips[0].stats["heralds_heard"] == 1
        assert heralds.priority(proposer.node.peer_id, 1, update.update_id, now=float("inf")) < float("inf")
        assert gossips[2].stats.get("heralds_heard", 0) == 0  # only sponsors are heralded to

        # A herald signed by another key in the proposer's name, and garbage: refused, nothing dated.
        forged = make_update(run_id=spec.run_id, spec_hash=spec.spec_hash(), seq=2, tau=0, samples=8, weight=0.5,
                             codec=CODEC.name, numel=NUMEL, identity=Identity.generate(),
                             payload=CODEC.compress(torch.zeros(NUMEL)))
        in_its_name = msgpack.packb(dataclasses.replace(forged.header, sender=proposer.node.peer_id).to_list(),
                                    use_bin_type=True)
        stolen = msgpack.packb({"v": FORMAT_VERSION, "h": in_its_name,
                                "s": sign_blob(bystander.identity, UPDATE_DOMAIN, in_its_name)}, use_bin_type=True)
        for bad in (stolen, b"\x81\xa1v\x01", encode_herald(forged)[:-3]):
            loop.run(rpc.call(bystander.node.p2p, sponsor.node.peer_id, gossips[0]._heralds.name, bad,
                              max_response_bytes=16, timeout_s=5))
        assert gossips[0].stats["heralds_refused"] == 3 and gossips[0].stats["heralds_heard"] == 1
        assert intakes[0].counts["bad_signature"] == 1
        assert heralds.priority(proposer.node.peer_id, 2, forged.update_id, now=7.0) == 7.0  # nothing dated
    finally:
        for gossip in gossips:
            loop.run(gossip.stop(), timeout_s=30)


def test_nobody_heralds_in_a_run_without_sponsors(loop, members) -> None:
    intake = Intake(SPEC, NUMEL, Replica.from_spec(SPEC, torch.zeros(NUMEL), codec=CODEC))
    stats: dict[str, int] = {}
    heralds = Heralds(members[1].node, SPEC.run_id, intake, sponsors=lambda: [], timeout_s=5, stats=stats)
    update = make_update(run_id=SPEC.run_id, spec_hash=SPEC.spec_hash(), seq=1, tau=0, samples=8, weight=0.5,
                         codec=CODEC.name, numel=NUMEL, identity=members[1].identity,
                         payload=CODEC.compress(torch.zeros(NUMEL)))
    loop.run(_send(heralds, update))
    assert not heralds.judging and heralds._sends.in_flight == 0
    assert stats["heralds_sent"] == stats["heralds_dropped"] == stats["bytes_sent"] == 0


async def _send(heralds: Heralds, update) -> None:  # noqa: ANN001
    await heralds.herald(update)


def test_a_sponsor_that_never_acks_holds_a_proposers_update_back_for_the_wait_only(loop, members) -> None:
    sponsor, proposer, bystander = members
    spec = dataclasses.replace(SPEC, defence=dataclasses.replace(SPEC.defence, sponsors=(sponsor.node.peer_id,)))
    config = GossipConfig(fanout=3, anti_entropy_s=QUIET, rpc_timeout_s=5)
    release = asyncio.Event()

    async def hang(request: bytes, caller: str) -> bytes:
        await release.wait()
        return b""

    name = f"p2p-diloco/{spec.run_id}/herald"
    loop.run(rpc.serve(sponsor.node.p2p, name, hang, max_request_bytes=1 << 16, timeout_s=3600))
    gossips: list[Gossip] = []
    try:
        intakes = []
        for member in (proposer, bystander):
            replica = Replica.from_spec(spec, torch.zeros(NUMEL), codec=CODEC, self_id=member.node.peer_id)
            intakes.append(Intake(spec, NUMEL, replica))
            gossips.append(Gossip(member.node, spec.run_id, intakes[-1], UpdateStore(config.retained_bytes), config,
                                  peers=lambda: [proposer.node.peer_id, bystander.node.peer_id]))
            loop.run(gossips[-1].start())
        update = make_update(run_id=spec.run_id, spec_hash=spec.spec_hash(), seq=1, tau=0, samples=8, weight=0.5,
                             codec=CODEC.name, numel=NUMEL, identity=proposer.identity,
                             payload=CODEC.compress(0.01 * torch.randn(NUMEL, generator=torch.Generator())))
        assert intakes[0].replica.offer(update)[0].value == "merged"
        started = time.monotonic()
        loop.run(gossips[0].publish(update))
        assert HERALD_WAIT_S <= time.monotonic() - started < HERALD_WAIT_S + 2.0
        wait_until(lambda: intakes[1].replica.version_vector.get(proposer.node.peer_id) == 1, 20,
                   "the bystander to get the update once the wait ran out")
    finally:
        loop.loop.call_soon_threadsafe(release.set)
        for gossip in gossips:
            loop.run(gossip.stop(), timeout_s=30)
        loop.run(rpc.unserve(sponsor.node.p2p, name), timeout_s=30)
