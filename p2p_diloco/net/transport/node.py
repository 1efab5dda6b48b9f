"""SwarmNode: one hivemind DHT (in its own process) plus a P2P replica in the caller's event loop, and what it
is told (`NodeConfig`, checked multiaddrs, `NodeError`).

The DHT runs in a forked process (net/transport/dht_process.py: starting, stopping and calling into it without
blocking our loop); here we retry its start while the bootstrap peers do not answer. Our own stream handlers
live on a P2P replica: a second client of the same libp2p daemon, so it shares the DHT's PeerID and listen
addresses (hivemind's `DHT.replicate_p2p`, minus its blocking call).

Identity: the DHT's p2pd is started from our Ed25519 key file (`identity_path`), so the PeerID is the public key
and signatures are checked against the PeerID alone. hivemind's `check_if_identity_free` parses the key as RSA
and fails on Ed25519, so it is off; and hivemind *writes a fresh RSA key* when `identity_path` does not exist,
so we refuse a missing file instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from hivemind.dht import DHT
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr as HivemindMultiaddr
from hivemind.utils.timed_storage import ValueWithExpiration
from multiaddr import Multiaddr as _PyMultiaddr

from p2p_diloco.config.errors import ConfigError
from p2p_diloco.config.multiaddrs import MULTIADDR_EXAMPLE, check_multiaddr
from p2p_diloco.net.transport import relay
from p2p_diloco.net.transport.dht_process import (
    await_mp,
    explain_start_error,
    is_bootstrap_unreachable,
    is_timeout,
    meet_again_in_dht,
    start_dht,
    stop_dht,
)

logger = logging.getLogger(__name__)

REACHABILITY_MODES = ("public", "private")
_RETRY_FIRST_DELAY_S = 1.0
_RETRY_MAX_DELAY_S = 8.0


class NodeError(RuntimeError):
    """A network problem a person can act on; the message says what was wrong and what to do."""


@dataclass(frozen=True)
class NodeConfig:
    """How this peer joins the swarm (addresses, bootstrap peers, NAT options)."""

    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    """Multiaddrs to listen on; `/ip4/0.0.0.0/tcp/PORT` for all interfaces (port 0 = any free port)."""
    announce_maddrs: tuple[str, ...] = ()
    """Multiaddrs other peers should dial (e.g. the public IP and forwarded port); explicit ports only."""
    initial_peers: tuple[str, ...] = ()
    """Bootstrap peers, each a full multiaddr ending in /p2p/<peer id>; empty for the first node of a swarm."""
    start_timeout_s: float = 60.0
    """Upper bound on starting the DHT, all retries included, in seconds."""
    start_retries: int = 3
    """How many more times to try when the bootstrap peers do not answer (with exponential backoff)."""
    client_mode: bool = False
    """Do not serve DHT requests (for peers others cannot dial, e.g. behind NAT without relays)."""
    use_relay: bool = True
    """Allow libp2p circuit relays (dialing peers behind NAT through a relay)."""
    use_auto_relay: bool = False
    """Look for a relay and reserve a slot on it, to be reachable from behind NAT."""
    force_reachability: str | None = None
    """Override AutoNAT: "public" (e.g. a bootstrap that relays for others) or "private"; None = detect."""
    trusted_relays: tuple[str, ...] = ()
    """Relays to reserve a circuit slot on (full multiaddrs; p2pd's default is the bootstrap peers)."""
    shutdown_timeout_s: float = 10.0
    """Upper bound on `SwarmNode.shutdown`, in seconds."""

    def validate(self) -> None:
        """Raise NodeError on any bad address or option (called by `SwarmNode.start`)."""
        if not self.host_maddrs:
            raise NodeError("host_maddrs is empty; listen on e.g. /ip4/0.0.0.0/tcp/31337 or /ip4/127.0.0.1/tcp/0")
        for addr in self.host_maddrs:
            if "/p2p/" in parse_multiaddr(addr):
                raise NodeError(f"host multiaddr '{addr}' must not contain /p2p/; give only the address to listen on")
        for addr in self.announce_maddrs:
            maddr = _PyMultiaddr(parse_multiaddr(addr))
            if any(p.name in ("tcp", "udp") and maddr.value_for_protocol(p.code) == "0" for p in maddr.protocols()):
                raise NodeError(f"announce multiaddr '{addr}' has port 0; announce the real, explicit port")
        for addr in (*self.initial_peers, *self.trusted_relays):
            parse_multiaddr(addr, require_peer_id=True)
        if self.force_reachability not in (None, *REACHABILITY_MODES):
            raise NodeError(f"force_reachability must be one of {REACHABILITY_MODES} or None, "
                            f"got {self.force_reachability!r}")
        if self.start_timeout_s <= 0 or self.start_retries < 0 or self.shutdown_timeout_s <= 0:
            raise NodeError("start_timeout_s and shutdown_timeout_s must be > 0 and start_retries >= 0")


def parse_multiaddr(s: str, *, require_peer_id: bool = False) -> str:
    """Validate one multiaddr string and return it normalized; NodeError says why not (config/multiaddrs.py's
    check, which `--bootstrap` also gets when the options are read, and the peer id as hivemind reads it).

    With `require_peer_id`, the address must end in /p2p/<peer id> (as bootstrap addresses must).
    """
    try:
        normal = check_multiaddr(s, require_peer_id=require_peer_id)
    except ConfigError as err:
        raise NodeError(str(err)) from None
    if require_peer_id:
        peer_id = _PyMultiaddr(normal).value_for_protocol("p2p")
        try:
            PeerID.from_base58(peer_id)
        except Exception:
            raise NodeError(f"bad multiaddr '{s}': '{peer_id}' is not a peer id; expected e.g. "
                            f"{MULTIADDR_EXAMPLE}") from None
    return normal


def _dht_kwargs(identity_path: str, config: NodeConfig,
                validators: Sequence[RecordValidatorBase]) -> dict[str, Any]:
    return dict(
        initial_peers=list(config.initial_peers) or None,
        host_maddrs=list(config.host_maddrs),
        announce_maddrs=list(config.announce_maddrs) or None,
        identity_path=identity_path,
        check_if_identity_free=False,  # hivemind's check parses the key as RSA; ours is Ed25519
        client_mode=config.client_mode,
        use_relay=config.use_relay,
        use_auto_relay=config.use_auto_relay,
        force_reachability=config.force_reachability,
        record_validators=list(validators),
        **({"trusted_relays": list(config.trusted_relays)} if config.trusted_relays else {}),
    )


class SwarmNode:
    """A running swarm node. Create with `await SwarmNode.start(...)`; always `await node.shutdown()`."""

    def __init__(self, dht: DHT, p2p: P2P, config: NodeConfig, maddrs: list[str]):
        self.dht = dht
        self.p2p = p2p
        self.config = config
        self.peer_id: str = p2p.peer_id.to_base58()
        self._maddrs = maddrs
        self.reachability = config.force_reachability or "unknown"
        """public, private or unknown: what others learn from our record (the join's probe may settle it)."""
        self._shutdown_task: asyncio.Task | None = None

    @classmethod
    async def start(cls, identity_path: str, config: NodeConfig, *,
                    record_validators: Sequence[RecordValidatorBase] = ()) -> SwarmNode:
        """Start the DHT (retrying while the bootstrap peers do not answer) and replicate its P2P here.

        Raises NodeError with what to do when the addresses are bad, the identity file is missing, or the
        bootstrap peers stay unreachable for `start_retries` retries or `start_timeout_s` seconds.
        """
        config.validate()
        if not os.path.isfile(identity_path):
            # hivemind would silently write a new RSA identity there; we want our Ed25519 key.
            raise NodeError(f"identity file '{identity_path}' not found; create it first "
                            "(p2p_diloco.wire.identity.Identity.load_or_create)")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.start_timeout_s
        kwargs = _dht_kwargs(identity_path, config, record_validators)
        dht = await cls._start_dht_with_retries(kwargs, config, deadline)
        try:
            remaining_s = max(deadline - loop.time(), 5.0)
            daemon_maddr = await await_mp(dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr,
                                                             return_future=True), remaining_s)
            p2p = await asyncio.wait_for(P2P.replicate(daemon_maddr), remaining_s)
            maddrs = [str(m) for m in await asyncio.wait_for(p2p.get_visible_maddrs(latest=True), remaining_s)]
        except BaseException:
            await asyncio.to_thread(stop_dht, dht)
            raise
        node = cls(dht, p2p, config, maddrs)
        # Streams to peers nobody can dial go through a bootstrap (net/transport/relay.py); a FORWARDED frame
        # is believed only from them.
        relay.install(p2p, [m.rsplit("/p2p/", 1)[-1] for m in config.initial_peers])
        logger.info("swarm node started peer_id=%s maddrs=%s client_mode=%s", node.peer_id, maddrs,
                    config.client_mode)
        return node

    @staticmethod
    async def _start_dht_with_retries(kwargs: dict[str, Any], config: NodeConfig, deadline: float) -> DHT:
        loop = asyncio.get_running_loop()
        started = loop.time()
        delay_s = _RETRY_FIRST_DELAY_S
        for attempt in range(1, config.start_retries + 2):
            remaining_s = deadline - loop.time()
            abandoned = threading.Event()
            future = loop.run_in_executor(None, start_dht, kwargs, remaining_s, abandoned)
            try:
                return await asyncio.shield(future)
            except asyncio.CancelledError:
                abandoned.set()  # the worker thread shuts the DHT down if it still comes up
                raise
            except Exception as e:
                error = e
            elapsed_s = loop.time() - started
            explained = explain_start_error(error, config.host_maddrs)
            if not (is_bootstrap_unreachable(error) or (is_timeout(error) and config.initial_peers)):
                raise NodeError(f"could not start the DHT node: {explained}") from error
            retry = attempt <= config.start_retries and deadline - loop.time() > delay_s + 1.0
            if not retry:
                raise NodeError(
                    f"could not reach bootstrap peer(s) {', '.join(config.initial_peers)} after {attempt} attempt(s) "
                    f"in {elapsed_s:.1f}s: {explained}; "
                    "check the address and that the node is running"
                ) from error
            logger.warning("bootstrap peers did not answer, retrying attempt=%d/%d delay_s=%.1f error=%s",
                           attempt, config.start_retries + 1, delay_s, error)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, _RETRY_MAX_DELAY_S)
        raise AssertionError("unreachable")

    def visible_maddrs(self) -> list[str]:
        """Full multiaddrs of this node, each ending in /p2p/<peer id>, to hand out as bootstrap addresses."""
        return list(self._maddrs)

    async def refresh_visible_maddrs(self, timeout_s: float = 10.0) -> list[str]:
        """Ask the daemon again (addresses change as NAT traversal and relays settle)."""
        self._check_alive()
        maddrs = await asyncio.wait_for(self.p2p.get_visible_maddrs(latest=True), timeout_s)
        self._maddrs = [str(m) for m in maddrs]
        return self.visible_maddrs()

    async def dht_store(self, key: str, value: Any, expiration_time: float, *, subkey: Any = None,
                        timeout_s: float) -> bool:
        """Store (key[, subkey]) -> value until `expiration_time` (DHT time); False if no replica accepted it.

        Raises asyncio.TimeoutError after `timeout_s`.
        """
        self._check_alive()
        future = self.dht.store(key, value, expiration_time, subkey=subkey, return_future=True)
        return bool(await await_mp(future, timeout_s))

    async def dht_get(self, key: str, *, latest: bool = True, timeout_s: float) -> ValueWithExpiration | None:
        """Read `key` from the DHT (the freshest value with `latest`); None if absent. asyncio.TimeoutError on timeout.

        Values of keys written with subkeys come back as {subkey: ValueWithExpiration}.
        """
        self._check_alive()
        return await await_mp(self.dht.get(key, latest=latest, return_future=True), timeout_s)

    async def meet_again(self, peers: dict[str, Sequence[str]], timeout_s: float) -> list[str]:
        """Ping each of `peers` (PeerID -> multiaddrs); return those that answered and were not in our routing table.

        Kademlia drops a node from the routing table after requests to it fail, and never looks for it again:
        a bootstrap node that restarted, or the other side of a healed partition, stays forgotten although it
        is reachable. And a restarted node has forgotten everyone, even those that still list it. A ping makes
        both sides add each other (and hand over the records the other should hold), as hivemind's own
        start-up does with its initial peers, so we ping whether or not our table lists the peer.
        """
        self._check_alive()
        wanted = {pid: list(maddrs) for pid, maddrs in peers.items() if pid != self.peer_id}
        if not wanted:
            return []
        coro = partial(meet_again_in_dht, peers=wanted, timeout_s=timeout_s)
        return await await_mp(self.dht.run_coroutine(coro, return_future=True), timeout_s + 5.0)

    async def dial(self, peers: dict[str, Sequence[str]], timeout_s: float) -> list[str]:
        """Connect our daemon to each of `peers` (PeerID -> the multiaddrs its record announces); return those
        reached. A peer we know only from DHT records has no address in the daemon's peerstore once the peers
        that introduced it are gone (a joiner whose entry point died): libp2p's routing then finds nothing
        ('routing: not found', 'failed to find any peer in table') and every stream to it fails until dialled."""
        self._check_alive()

        async def one(pid_text: str, maddrs: Sequence[str]) -> str | None:
            try:
                addrs = [HivemindMultiaddr(m.split("/p2p/")[0]) for m in maddrs]
                await asyncio.wait_for(self.p2p._client.connect(PeerID.from_base58(pid_text), addrs), timeout_s)
                return pid_text
            except Exception as e:  # untrusted addresses: a bad one is a failed dial, nothing more
                logger.debug("dial failed peer=%s error=%r", pid_text, e)
                return None

        wanted = {pid: maddrs for pid, maddrs in peers.items() if pid != self.peer_id and maddrs}
        results = await asyncio.gather(*(one(pid, maddrs) for pid, maddrs in wanted.items()))
        return [pid for pid in results if pid is not None]

    async def add_record_validators(self, validators: Sequence[RecordValidatorBase], timeout_s: float = 10.0) -> None:
        """Add DHT record validators after the start (they are pickled into the DHT process)."""
        self._check_alive()
        coro = partial(DHT._add_validators, record_validators=list(validators))
        await await_mp(self.dht.run_coroutine(coro, return_future=True), timeout_s)

    @property
    def is_alive(self) -> bool:
        return self._shutdown_task is None

    def _check_alive(self) -> None:
        if self._shutdown_task is not None:
            raise NodeError("the swarm node is shut down")

    async def shutdown(self) -> None:
        """Stop the P2P replica and the DHT process (and its p2pd). Idempotent; bounded by shutdown_timeout_s."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown())
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self) -> None:
        started = time.monotonic()
        budget_s = self.config.shutdown_timeout_s
        try:
            await asyncio.wait_for(self.p2p.shutdown(), budget_s / 4)
        except Exception as e:
            logger.debug("p2p replica shutdown failed peer_id=%s error=%r", self.peer_id, e)
        try:
            await asyncio.wait_for(asyncio.to_thread(stop_dht, self.dht, budget_s / 4), budget_s * 3 / 4)
        except Exception as e:
            logger.warning("dht process did not stop in time peer_id=%s error=%r", self.peer_id, e)
        logger.info("swarm node stopped peer_id=%s took_s=%.2f", self.peer_id, time.monotonic() - started)
