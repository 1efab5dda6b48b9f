"""How a peer meets the swarm: its addresses and DHT options, gossip, state sync; the bootstrap node and `status`.

Only the settings a person chooses live here; the transport builds its own `NodeConfig` from `NetworkConfig`
(net/transport/addresses.py `node_config`), since checking a multiaddr needs the network libraries.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2p_diloco.config.errors import require
from p2p_diloco.config.multiaddrs import check_multiaddr

DEFAULT_BOOTSTRAP_PORT = 31337
MAX_CHUNK_BYTES = 64 << 20
"""Largest chunk a joiner accepts a manifest to declare (bounds one response in memory)."""
REACHABILITY = ("", "public", "private")
PEER_REACHABILITY = ("auto", "public", "private")


@dataclass(frozen=True)
class NetworkConfig:
    """This peer on the network: identity, addresses, bootstrap peers, NAT options, DHT timeouts (not shared)."""

    bootstrap: tuple[str, ...] = ()
    """Bootstrap multiaddrs, comma-separated, each ending in /p2p/<peer id> (empty: start a new swarm)."""
    identity: str = "~/.config/p2p-diloco/identity.key"
    """Ed25519 identity file, created if missing (mode 0600); peers on one machine need one each."""
    host: str = "0.0.0.0"
    """Address to listen on: an IP (0.0.0.0: every interface, so a host with a public address can be dialed;
    127.0.0.1 keeps a local swarm on this host) or a full multiaddr."""
    port: int = 0
    """TCP port to listen on (0: any free port; a fixed one for a port forward or a firewall rule)."""
    announce: tuple[str, ...] = ()
    """Addresses others should dial, comma-separated: public IPs or DNS names (with --port) or multiaddrs."""
    client_mode: bool = False
    """Serve no DHT requests (implied by reachability private: nobody could dial us to ask)."""
    use_auto_relay: bool = False
    """Also ask libp2p's autorelay for a circuit slot on the bootstrap (implied by reachability private; it
    takes ~3 minutes, so p2p-diloco forwards streams through the bootstrap meanwhile: net/transport/relay.py)."""
    reachability: str = "auto"
    """Can others dial this peer? auto: ask a bootstrap to dial us back at start (AutoNAT-like), public: yes
    (an open port or --announce), private: no (behind NAT: others reach us through the bootstrap)."""
    start_timeout_s: float = 60.0
    """Upper bound on starting the node, retries on an unresponsive bootstrap included, in seconds."""
    record_ttl_s: float = 60.0
    """Lifetime of this peer's DHT record, refreshed every third of it: a dead peer vanishes within it."""
    dht_timeout_s: float = 10.0
    """Timeout of one DHT read or write, in seconds."""

    def validate(self) -> NetworkConfig:
        require(0 <= self.port < 65536, f"port must be in [0, 65535], got {self.port}")
        require(3 <= self.record_ttl_s <= 3600, f"record_ttl_s must be in [3, 3600], got {self.record_ttl_s}")
        require(self.dht_timeout_s > 0 and self.start_timeout_s > 0, "dht_timeout_s and start_timeout_s must be > 0")
        require(self.reachability in (*PEER_REACHABILITY, ""),
                f"reachability must be auto, public or private, got {self.reachability!r}")
        return self


@dataclass(frozen=True)
class GossipConfig:
    """How updates spread: fanout, anti-entropy period, pull sizes and timeouts."""

    fanout: int = 3
    """Random peers to announce to after publishing, and after a pull that brought anything new."""
    anti_entropy_s: float = 5.0
    """Mean seconds between anti-entropy pulls from one random peer (jittered +-50%)."""
    pull_max_updates: int = 32
    """Most updates in one pull response (asked for and served); a full batch makes the requester pull again."""
    rpc_timeout_s: float = 10.0
    """Timeout of each call, and of each chunk of a pull response, in seconds."""
    retained_bytes: int = 512 << 20
    """Bytes of recent updates kept to serve pulls: build the store as `UpdateStore(config.retained_bytes)`."""
    max_concurrent_pulls: int = 4
    """Pulls in flight at once, at most one per remote."""
    max_concurrent_serves: int = 8
    """Pull requests served at once; more are refused as busy (the requester tries again later)."""
    log_interval_s: float = 30.0
    """A failing peer is logged at most once per this many seconds (every failure is counted in `stats`)."""
    stream_bytes_per_s: float = 512e3
    """Bandwidth awareness: the rate one outgoing stream should get. fanout and max_concurrent_serves shrink to
    the streams this peer's uplink feeds at this rate (at least 2 each; the uplink: min of admission.rate's
    uplink_bytes_per_s and the rate measured from our own transfers), and grow back with it (0: never adapt)."""

    aggregate: int = 0
    """Fan-in of the aggregation tree (ARCHITECTURE.md "Aggregation"): updates go up a tree every peer computes
    and come back as audited, signed sums, so a peer's traffic stays flat as the swarm grows; 0: every update to
    every peer (full dissemination). Needs exact merge weights: no payload-reading vetting
    (--spec.defence.copy-cosine 0) unless the run has sponsors. The tree is over the live peers whose record
    says the same fan-in; the others gossip as before."""
    aggregate_epoch_s: float = 60.0
    """The tree rotates every this many seconds of wall-clock time (places drawn again by a seeded hash)."""
    aggregate_wait_s: float = 0.0
    """A node sends its sum once every child has sent something, or this long after the first new item; 0 (the
    default): a quarter of our round, the time between our last two updates (the simulator's nodes wait a quarter
    of a phase). Every second a node waits is staleness for each update under it, and what staleness costs goes
    by its share of a round (BENCHMARKS.md "The tree's delay"): at 6 peers on 1 s rounds a fixed 1 s cost +23%
    loss against full dissemination (median of 3), a quarter round +7%."""
    aggregate_fallback_s: float = 30.0
    """An author whose update is in no total it merged this long after publishing announces it as in full
    dissemination (a dead or lying aggregator costs this much delay, not the update)."""
    aggregate_settle_s: float = 10.0
    """With a tree, our own update is not served to pulls for this long after it went up the tree (capped at
    `aggregate_fallback_s`, when we announce it anyway): the tree's head start. Without it, anti-entropy fetched
    nearly every update whole before its total came (on loopback, 5032 of 5627 totals found every part held).
    An update we announce (no tree yet, or a fallback) is served at once. 0: never held back."""

    def validate(self) -> GossipConfig:
        if self.aggregate != 0 and self.aggregate < 2:
            raise ValueError(f"aggregate (the tree's fan-in) must be 0 or >= 2, got {self.aggregate}")
        if not (self.aggregate_epoch_s > 0 and self.aggregate_fallback_s > 0):
            raise ValueError("aggregate_epoch_s and aggregate_fallback_s must be > 0, got "
                             f"{self.aggregate_epoch_s} and {self.aggregate_fallback_s}")
        if not self.aggregate_wait_s >= 0:
            raise ValueError(f"aggregate_wait_s must be >= 0 (0: a quarter of our round), got {self.aggregate_wait_s}")
        if not 0 <= self.aggregate_settle_s <= 600:
            raise ValueError(f"aggregate_settle_s must be in [0, 600] seconds, got {self.aggregate_settle_s}")
        if self.fanout < 1 or self.pull_max_updates < 1 or self.max_concurrent_pulls < 1 \
                or self.max_concurrent_serves < 1:
            raise ValueError("fanout, pull_max_updates, max_concurrent_pulls and max_concurrent_serves must be >= 1")
        if not (self.anti_entropy_s > 0 and self.rpc_timeout_s > 0 and self.log_interval_s >= 0):
            raise ValueError("anti_entropy_s and rpc_timeout_s must be > 0, log_interval_s >= 0")
        if self.retained_bytes < 0 or self.stream_bytes_per_s < 0:
            raise ValueError("retained_bytes and stream_bytes_per_s must be >= 0")
        return self


@dataclass(frozen=True)
class StateSyncConfig:
    """Chunking, parallelism and timeouts of snapshot transfers (both sides)."""

    chunk_bytes: int = 4 << 20
    """Bytes per chunk (donor side), a multiple of 4 (whole float32 values); the last chunk may be shorter."""
    parallel_chunks: int = 4
    """Chunk requests in flight at once (joiner side)."""
    timeout_s: float = 30.0
    """Timeout of each request (manifest or chunk), in seconds, on both sides."""
    snapshot_ttl_s: float = 30.0
    """A donor drops a cached snapshot this many seconds after its last request."""
    snapshot_reuse_s: float = 5.0
    """A manifest request within this many seconds of the last snapshot gets that snapshot (still consistent;
    gossip brings the joiner the rest), saving a copy and a hash of theta per joiner."""
    max_manifest_bytes: int = 1 << 20
    """Largest signed manifest, both sent and accepted."""
    max_concurrent_chunks: int = 16
    """Chunk requests a donor serves at once; more are refused as busy."""
    chunk_retries: int = 3
    """Retries of a chunk whose stream broke or timed out, before dropping the donor (a bad chunk drops it at once)."""

    def validate(self) -> StateSyncConfig:
        if not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES or self.chunk_bytes % 4:
            raise ValueError(f"chunk_bytes must be a multiple of 4 in (0, {MAX_CHUNK_BYTES}], got {self.chunk_bytes}")
        if self.parallel_chunks < 1 or self.max_concurrent_chunks < 1 or self.max_manifest_bytes < 1024 \
                or self.chunk_retries < 0:
            raise ValueError("parallel_chunks and max_concurrent_chunks must be >= 1, max_manifest_bytes >= 1024, "
                             "chunk_retries >= 0")
        if not (self.timeout_s > 0 and self.snapshot_ttl_s > 0 and self.snapshot_reuse_s >= 0):
            raise ValueError("timeout_s and snapshot_ttl_s must be > 0, snapshot_reuse_s >= 0")
        return self


@dataclass(frozen=True)
class BootstrapConfig:
    """A bootstrap node: a DHT node with a persistent identity that trains nothing."""

    identity: str = "~/.config/p2p-diloco/bootstrap.key"
    """Ed25519 identity file, created if missing (mode 0600): keep it, and the printed addresses stay valid."""
    host: str = "0.0.0.0"
    """Address to listen on: an IP (0.0.0.0 for every interface) or a full multiaddr."""
    port: int = DEFAULT_BOOTSTRAP_PORT
    """TCP port to listen on (0: any free port; the printed addresses carry it)."""
    announce: tuple[str, ...] = ()
    """Addresses peers should dial, comma-separated: public IPs or DNS names (with --port) or multiaddrs."""
    run_id: tuple[str, ...] = ()
    """Run ids whose peer records this node checks, comma-separated (the run 'default' always is)."""
    reachability: str = "public"
    """NAT reachability to assume: public (relays for peers behind NAT), private, or empty (detect)."""
    report_s: float = 60.0
    """Print the number of live peers per run every this many seconds (0: never)."""
    dht_timeout_s: float = 10.0
    """Timeout of one DHT read, in seconds (for the reports)."""
    status_port: int = -1
    """Serve the web status page of the runs' peers, /api/status and Prometheus /metrics on this port (-1: off,
    0: any free port)."""
    status_host: str = "127.0.0.1"
    """Address the status page binds to: 127.0.0.1 keeps it on this host; 0.0.0.0 shows it to everyone."""

    def validate(self) -> BootstrapConfig:
        require(self.reachability in REACHABILITY,
                f"reachability must be public, private or empty, got {self.reachability!r}")
        check_status_port(self.status_port, self.status_host)
        return self


@dataclass(frozen=True)
class StatusConfig:
    """`p2p-diloco status`: which run to show, through which bootstrap node."""

    bootstrap: tuple[str, ...] = ()
    """Bootstrap multiaddr(s), comma-separated, each ending in /p2p/<peer id> (required)."""
    run_id: str = "default"
    """The run to show."""
    timeout_s: float = 30.0
    """Bound on starting the node and on each DHT read, in seconds."""
    json: bool = False
    """Print the raw peer records as JSON instead of a table."""
    watch: bool = False
    """Keep a live view of the run's peers on the terminal, refreshed every --interval-s, until Ctrl-C."""
    interval_s: float = 2.0
    """Seconds between refreshes of --watch."""

    def validate(self) -> StatusConfig:
        require(bool(self.bootstrap), "give the swarm's bootstrap multiaddr with --bootstrap")
        for address in self.bootstrap:
            check_multiaddr(address, require_peer_id=True)
        require(self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}")
        require(self.interval_s >= 0.2, f"interval_s must be >= 0.2, got {self.interval_s}")
        require(not (self.watch and self.json), "--watch and --json do not go together")
        return self


def check_status_port(port: int, host: str) -> None:
    """A status page's port: -1 (off), 0 (any free port) or a TCP port; a host to bind it to."""
    require(-1 <= port < 65536, f"status_port must be -1 (off), 0 (any free port) or a TCP port, got {port}")
    require(bool(host.strip()), "status_host must not be empty (127.0.0.1 keeps the page on this host)")
