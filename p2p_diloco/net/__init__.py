"""The real network, one subpackage per job; each imports only from the layers below it (config, wire, sync,
train) and from the subpackages before it in this list:

- transport/  the libp2p node (hivemind DHT + P2P: `SwarmNode`), bounded framed RPC over its streams (`rpc`:
              calling side rpc_client.py, serving side rpc_server.py), and the network thread (`NetLoop`).
- admission/  who may talk to this peer and how much of its time a remote may take: the run's access policy
              and membership proofs (policy.py), the `PeerGuard` in front of every service (guard.py).
- discovery/  the run's spec and one signed, expiring record per live peer on the DHT (records.py), and how
              the swarm's records are read and shown (status.py).
- statesync/  a joiner fetches a verified snapshot of (theta, V) from a donor (client.py); the donor serves it
              (server.py).
- gossip/     how signed outer updates spread: announce/pull/anti-entropy (`Gossip`, service.py; its pulls in
              pulls.py), the request codec (messages.py), equivocation digests (digests.py), the evidence relay
              and the replica repair (which fetches its donor's snapshot through statesync/).

The peer process that composes them lives in p2p_diloco/peer/; the in-memory network in p2p_diloco/sim/.
"""
