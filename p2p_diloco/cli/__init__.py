"""The `p2p-diloco` command line."""
