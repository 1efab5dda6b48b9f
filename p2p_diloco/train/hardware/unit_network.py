"""Which network interface a unit's gloo process group uses, for a unit across hosts (torchrun --nnodes N).

Gloo binds to the address this host's name resolves to, and tells the other ranks to dial it there. On many Linux
hosts (Debian's /etc/hosts, containers) the name resolves to 127.0.0.1 or 127.0.1.1: every rank then advertises a
loopback address, and ranks on other hosts fail with "connection refused" after the rendezvous succeeded. The
interface that routes to the rendezvous host (MASTER_ADDR) is the one the other hosts can reach, so a unit takes
that one unless GLOO_SOCKET_IFNAME says otherwise. A unit on one host (a loopback master) changes nothing.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

logger = logging.getLogger(__name__)

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def route_interface(master: str) -> str | None:
    """The name of this host's interface that sends to `master` (an IPv4 address or name); None when that is
    loopback, or it cannot be told (no route, IPv6, not Linux)."""
    try:
        ip = socket.gethostbyname(master)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((ip, 9))  # a UDP connect sends nothing: the kernel picks the source address of the route
            local = probe.getsockname()[0]
    except OSError:
        return None
    if ipaddress.ip_address(local).is_loopback:
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == local:
            return name
    return None


def _ipv4_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(packed[20:24])


def pick_gloo_interface() -> None:
    """Before a gloo process group starts: GLOO_SOCKET_IFNAME = the interface towards MASTER_ADDR, unless set.
    Both variables are torchrun's and gloo's contract (as unit.py reads RANK and WORLD_SIZE), not our config."""
    if "GLOO_SOCKET_IFNAME" in os.environ or not os.environ.get("MASTER_ADDR"):
        return
    interface = route_interface(os.environ["MASTER_ADDR"])
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
        logger.info("gloo binds to the route to the master interface=%s master=%s", interface,
                    os.environ["MASTER_ADDR"])
