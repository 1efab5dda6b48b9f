"""The peer process (`p2p-diloco join`): lifecycle, its network side, checkpoints and resume."""
