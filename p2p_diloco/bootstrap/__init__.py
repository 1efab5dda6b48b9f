"""The bootstrap node (`p2p-diloco bootstrap`): the swarm's entry point, a DHT node that trains nothing."""
