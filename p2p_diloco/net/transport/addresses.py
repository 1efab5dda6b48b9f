"""From the addresses a person types (`--host 0.0.0.0 --port 31338 --announce 203.0.113.5`) to multiaddrs, and
from a peer's `NetworkConfig` (the light config) to the transport's `NodeConfig`."""

from __future__ import annotations

from dataclasses import replace

from p2p_diloco.config.network import NetworkConfig
from p2p_diloco.net.transport.node import NodeConfig, NodeError, parse_multiaddr


def _ip_protocol(host: str) -> str:
    if ":" in host:
        return "ip6"
    return "ip4" if host.replace(".", "").isdigit() else "dns"


def listen_maddr(host: str, port: int) -> str:
    """`/ip4/HOST/tcp/PORT` (or ip6), or `host` itself if it is already a multiaddr."""
    if host.startswith("/"):
        return parse_multiaddr(host)
    if _ip_protocol(host) == "dns":
        raise NodeError(f"listen host must be an IP address (e.g. 0.0.0.0 or 127.0.0.1), got '{host}'")
    return parse_multiaddr(f"/{_ip_protocol(host)}/{host}/tcp/{port}")


def announce_maddr(address: str, port: int) -> str:
    """A multiaddr for an announced address: given as is, or built from an IP / DNS name and `port`."""
    if address.startswith("/"):
        return parse_multiaddr(address)
    if port == 0:
        raise NodeError(f"--announce {address} needs the real port: give --port too (or a full multiaddr)")
    return parse_multiaddr(f"/{_ip_protocol(address)}/{address}/tcp/{port}")


def node_config(network: NetworkConfig, reachability: str | None = None) -> NodeConfig:
    """The transport's settings for a peer of the swarm; NodeError names a bad address.

    `reachability` (default: the config's) public: AutoNAT forced public; private: forced private, a DHT
    client (nobody could dial us to serve a request; a NATed DHT server only makes others' stores fail), and
    libp2p's autorelay on with the bootstraps as trusted relays; auto: AutoNAT decides, autorelay on."""
    reach = reachability or network.reachability or "auto"
    bootstraps = tuple(parse_multiaddr(b, require_peer_id=True) for b in network.bootstrap)
    private = reach == "private"
    return NodeConfig(host_maddrs=(listen_maddr(network.host, network.port),),
                      announce_maddrs=tuple(announce_maddr(a, network.port) for a in network.announce),
                      initial_peers=bootstraps, start_timeout_s=network.start_timeout_s,
                      client_mode=network.client_mode or private,
                      use_auto_relay=network.use_auto_relay or (reach != "public" and bool(bootstraps)),
                      force_reachability=None if reach == "auto" else reach,
                      trusted_relays=bootstraps if private else ())


def as_private(config: NodeConfig) -> NodeConfig:
    """`config` for a peer nobody can dial (what `--reachability private` gives, see `node_config`)."""
    return replace(config, force_reachability="private", client_mode=True, use_auto_relay=True,
                   trusted_relays=config.initial_peers)
