"""A peer's first steps on the swarm: start its node (settling `--reachability auto`), derive its run-secret key,
and check the run's spec (the first peer of a run publishes it). What comes out, `NodeUp`, is what the peer's
services are built from (peer/compose.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from p2p_diloco.config import ConfigError, RunSpec
from p2p_diloco.net.admission.hello import AccessDenied
from p2p_diloco.net.admission.invites import NO_INVITATION
from p2p_diloco.net.admission.membership import NOT_IN_ALLOW_LIST, REFUSED_PREFIX
from p2p_diloco.net.admission.policy import MembershipKey, NetPolicy
from p2p_diloco.net.discovery.records import PeerRecordValidator, fetch_run_spec, publish_run_spec
from p2p_diloco.net.transport.netloop import exit_with_parent
from p2p_diloco.net.transport.node import NodeConfig, SwarmNode
from p2p_diloco.peer.reach import settle_reachability, start_node

logger = logging.getLogger(__name__)

SpecRecord = tuple[dict[str, object], str]
"""The swarm's RunSpec as the DHT holds it: (its dict, its hash)."""


class SpecMismatchError(ConfigError):
    """The run on the swarm has another RunSpec than ours; the message names the differing fields."""


def check_spec(theirs: SpecRecord | None, spec: RunSpec) -> None:
    """Raise SpecMismatchError unless the swarm's (spec_dict, spec_hash) is ours."""
    if theirs is None or theirs[1] == spec.spec_hash():
        return
    spec_dict, spec_hash = theirs
    try:
        diff = RunSpec.from_dict(spec_dict).differing_fields(spec)
    except (ConfigError, TypeError) as e:
        raise SpecMismatchError(
            f"run '{spec.run_id}' on this swarm has a RunSpec this version cannot read ({e}); upgrade p2p-diloco "
            "or use another --run-id") from None
    if [d.split(":")[0] for d in diff] == ["defence.operators"] and not spec.defence.operators:
        # A run that admits by invitation, joined without one: say that, not "join with the swarm's values".
        raise AccessDenied(f"{REFUSED_PREFIX}{NO_INVITATION} (run '{spec.run_id}')")
    listed = "\n  ".join(diff) or "(no field differs: the spec hashes are computed differently; upgrade p2p-diloco)"
    raise SpecMismatchError(
        f"run '{spec.run_id}' on this swarm has a different RunSpec (spec hash {spec_hash[:12]} vs ours "
        f"{spec.spec_hash()[:12]}). Differing fields (swarm != ours):\n  {listed}\n"
        "Join with the swarm's values (the matching options, e.g. --inner-steps, or --config), or start a new "
        "run with another --run-id.")


@dataclass(frozen=True)
class NodeUp:
    """A started node whose run spec matches ours."""

    node: SwarmNode
    node_config: NodeConfig
    """The config the node runs with: a private one after `--reachability auto` found nobody can dial us."""
    reach_why: str
    """How `--reachability auto` decided ("" when it was forced)."""
    key: MembershipKey | None
    """The run secret's key (None: an open run)."""
    how: str
    """"published" (we are the first peer of the run) or "matched"."""

    @property
    def proof(self) -> str | None:
        """Our membership proof, carried in our record."""
        return self.key.proof(self.node.peer_id) if self.key is not None else None


async def start_settled(run_id: str, identity_path: str, node_config: NodeConfig, *,
                        dht_timeout_s: float) -> tuple[SwarmNode, NodeConfig, str]:
    """Start the node; with `--reachability auto`, probe and restart it as private if nobody can dial us.
    Returns the node, the config it runs with, and why (peer/reach.py)."""
    started = time.monotonic()
    validators = [PeerRecordValidator([run_id])]
    node, reach_why = await start_node(identity_path, node_config, validators), ""
    if node_config.force_reachability is None and node_config.initial_peers:  # --reachability auto
        node, node_config, reach_why = await settle_reachability(node, identity_path, validators, dht_timeout_s)
    exit_with_parent(node)
    logger.info("node up took_s=%.2f", time.monotonic() - started)
    return node, node_config, reach_why


async def join_run(node: SwarmNode, spec: RunSpec, policy: NetPolicy, *,
                   dht_timeout_s: float) -> tuple[MembershipKey | None, str]:
    """Check the run's spec (publish it if we are the first peer); returns the run secret's key and "published"
    or "matched". AccessDenied if the run's allow list (in the spec) does not name this peer."""
    started, run_id = time.monotonic(), spec.run_id
    key = await asyncio.to_thread(_membership_key, policy, spec)  # scrypt: ~50 ms of CPU, off the loop
    theirs = await fetch_run_spec(node, run_id, timeout_s=dht_timeout_s)
    logger.info("run spec read found=%s took_s=%.2f", theirs is not None, time.monotonic() - started)
    check_spec(theirs, spec)
    allowed = spec.defence.allowed_senders
    if allowed and node.peer_id not in allowed:
        raise AccessDenied(f"{REFUSED_PREFIX}{NOT_IN_ALLOW_LIST}: this peer ({node.peer_id}) is not in the "
                           "run's allow list; ask the run's operator to add it, or join with another --identity")
    how = "matched" if theirs else "published"
    await publish_run_spec(node, run_id, spec.to_dict(), spec.spec_hash(),
                           timeout_s=dht_timeout_s)  # first peer: publish; later ones: refresh expiry
    if theirs is None:  # two first peers may race with different specs: the DHT keeps one; check again
        check_spec(await fetch_run_spec(node, run_id, timeout_s=dht_timeout_s), spec)
    logger.info("run spec %s took_s=%.2f", how, time.monotonic() - started)
    return key, how


def _membership_key(policy: NetPolicy, spec: RunSpec) -> MembershipKey | None:
    secret = policy.access.secret()
    key = MembershipKey(secret, spec.run_id) if secret else None
    logger.info("access policy allow_list=%d run_secret=%s", len(spec.defence.allowed_senders), key is not None)
    return key
