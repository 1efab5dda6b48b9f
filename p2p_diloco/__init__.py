"""p2p-diloco: peer-to-peer Decoupled DiLoCo."""

__version__ = "0.1.0"
