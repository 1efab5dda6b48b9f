"""`--reachability auto`: can others dial this peer? Ask a bootstrap to dial us back (net/transport/probe.py).

AutoNAT inside p2pd would find out too, but it needs several peers to dial us and a while to decide, and
hivemind does not tell us its verdict; a bootstrap's dial-back to our listening ports answers in one round trip.
A peer the bootstraps can reach on one of its ports is public; one they cannot is private (behind NAT or a
firewall); with no bootstrap answering (an older or a stock hivemind bootstrap), we cannot tell and leave libp2p
to it ("unknown": streams still fall back to the relays, net/transport/relay.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from p2p_diloco.net.discovery.bootstraps import check_bootstraps, tcp_port
from p2p_diloco.net.discovery.records import PeerRecordValidator
from p2p_diloco.net.discovery.status import number
from p2p_diloco.net.transport import probe
from p2p_diloco.net.transport.addresses import as_private
from p2p_diloco.net.transport.node import NodeConfig, NodeError, SwarmNode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reachability:
    reach: str
    """public, private or unknown."""
    why: str


def tcp_ports(maddrs: list[str]) -> list[int]:
    """The TCP ports of our direct (not relayed) addresses, at most probe.MAX_REACH_PORTS."""
    return sorted({p for m in maddrs if (p := tcp_port(m)) is not None})[:probe.MAX_REACH_PORTS]


async def probe_reachability(node: SwarmNode, timeout_s: float) -> Reachability:
    """Ask the bootstraps in turn until one answers whether it could connect to one of our ports."""
    ports = tcp_ports([*node.visible_maddrs(), *node.config.announce_maddrs])
    if not ports:
        return Reachability("unknown", "no TCP port to probe")
    for maddr in node.config.initial_peers:
        bootstrap = maddr.rsplit("/p2p/", 1)[-1]
        try:
            result = await probe.reach(node, bootstrap, ports, timeout_s)
        except Exception as e:  # no probe there, busy, gone: ask the next one
            logger.debug("reachability probe failed bootstrap=%s error=%r", bootstrap, e)
            continue
        if result.open_ports:
            return Reachability("public", f"bootstrap {bootstrap[-8:]} reached {result.observed_ip} port "
                                          f"{result.open_ports[0]}")
        return Reachability("private", f"bootstrap {bootstrap[-8:]} could not connect to {result.observed_ip} on "
                                       f"port(s) {', '.join(map(str, ports))}")
    return Reachability("unknown", "no bootstrap answered the reachability probe")


async def settle_reachability(node: SwarmNode, identity_path: str, validators: Sequence[PeerRecordValidator],
                              timeout_s: float) -> tuple[SwarmNode, NodeConfig, str]:
    """`--reachability auto`: probe; a peer nobody can dial restarts its node as private (a DHT client: a NATed
    DHT server only makes others' stores fail; reached through the bootstraps' relays). Returns the node to
    use, its config and why."""
    verdict = await probe_reachability(node, timeout_s)
    logger.info("reachability %s (%s)", verdict.reach, verdict.why)
    node.reachability = verdict.reach
    if verdict.reach != "private":
        return node, node.config, verdict.why
    await node.shutdown()
    config = as_private(node.config)
    node = await start_node(identity_path, config, validators)
    node.reachability = "private"
    return node, config, verdict.why


def donor_rank(record: Mapping[str, object]) -> tuple[int, float]:
    """State-sync donors: public ones first (a snapshot from a peer behind NAT crosses a bootstrap's relay,
    which every NATed peer shares), then the freshest; a NATed donor is still tried when no public one serves."""
    ranks: dict[object, int] = {"public": 0, "private": 2}
    reach = ranks.get(record.get("reach"), 1)
    return reach, -number(record, "version_vector_total")


async def start_node(identity_path: str, config: NodeConfig, validators: Sequence[PeerRecordValidator]) -> SwarmNode:
    """SwarmNode.start; when it fails, the doctor's first checks (net/discovery/bootstraps.py: each bootstrap's
    address and a timed TCP connect) add one line per problem with its fix, as `p2p-diloco doctor` prints them."""
    try:
        return await SwarmNode.start(identity_path, config, record_validators=validators)
    except NodeError as e:
        if not config.initial_peers:
            raise
        _, findings = await check_bootstraps(config.initial_peers, timeout_s=5.0)
        raise NodeError("\n".join([str(e), *(f"problem: {f.problem} -> fix: {f.fix}" for f in findings)])) from e
