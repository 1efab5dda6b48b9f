"""Transport: the libp2p node (DHT + P2P), bounded framed RPC over its streams, and the network thread."""
