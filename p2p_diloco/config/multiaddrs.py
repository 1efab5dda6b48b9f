"""One multiaddr string checked with the `multiaddr` package alone (no hivemind, no torch), so that a typo in
--bootstrap is answered when the options are read, in half a second, not after the node's imports (5 s)."""

from __future__ import annotations

from p2p_diloco.config.errors import ConfigError

MULTIADDR_EXAMPLE = "/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."
ADDRESS_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6", "p2p")


def check_multiaddr(s: str, *, require_peer_id: bool = False) -> str:
    """`s` normalized; ConfigError says why it is not a multiaddr (with `require_peer_id`: one that ends in
    /p2p/<peer id>, as a bootstrap's must). The package checks the peer id itself (a multihash in base58)."""
    from multiaddr import Multiaddr
    from multiaddr.exceptions import Error as MultiaddrError

    def bad(why: str) -> ConfigError:
        return ConfigError(f"bad multiaddr '{s}': {why}; expected e.g. {MULTIADDR_EXAMPLE}")

    if not isinstance(s, str) or not s.strip():
        raise bad("empty")
    if not s.startswith("/"):
        raise bad("it must start with '/'")
    try:
        maddr = Multiaddr(s)
    except (MultiaddrError, ValueError, TypeError) as e:
        raise bad(str(e).split(" (string:")[0]) from None
    names = [p.name for p in maddr.protocols()]
    if names[0] not in ADDRESS_PROTOCOLS:
        raise bad(f"it must start with an address (/ip4, /ip6, /dns...), not /{names[0]}")
    if require_peer_id and names[-1] != "p2p":
        raise bad("it must end with /p2p/<peer id> of the node you connect to")
    return str(maddr)
