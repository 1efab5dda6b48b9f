"""The pure replica core: version vectors, the merging replica, and the store of recent updates."""
