"""The network: hivemind DHT + P2P swarm node, discovery records, bounded RPC, in-memory exchange."""
