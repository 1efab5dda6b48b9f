"""What each remote last told us it holds: the vector of its latest announce or pull request.

Announces skip remotes whose vector already holds all of ours (vectors only grow), repair compares every
member's vector with ours (`Gossip.known_vectors`), and `Gossip.pulling_missing` asks whether a pull under way
will change our replica.
"""

from __future__ import annotations

from collections import OrderedDict

from p2p_diloco.net.gossip.slots import MAX_WANTED_PEERS
from p2p_diloco.sync.version_vector import VersionVector


class KnownVectors:
    """The last vector each remote sent us, for at most `max_peers` remotes (the least recently heard from
    forgotten first). Read from other threads by copying, never by iterating the live table."""

    def __init__(self, max_peers: int = MAX_WANTED_PEERS) -> None:
        self.max_peers = max_peers
        self._known: OrderedDict[str, VersionVector] = OrderedDict()

    def record(self, peer: str, remote: VersionVector) -> None:
        """`peer` holds `remote` now: replaced, not merged (a peer restarted from a checkpoint may hold less)."""
        self._known.pop(peer, None)
        self._known[peer] = remote
        while len(self._known) > self.max_peers:
            self._known.popitem(last=False)

    def get(self, peer: str) -> VersionVector | None:
        return self._known.get(peer)

    def satisfied(self, ours: VersionVector) -> list[str]:
        """The remotes whose last vector already holds all of `ours`: an announce would tell them nothing."""
        return [peer for peer, theirs in self._known.items() if theirs.dominates(ours)]

    def snapshot(self) -> dict[str, VersionVector]:
        return dict(self._known)

    def clear(self) -> None:
        self._known.clear()
