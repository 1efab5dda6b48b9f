"""The doctor's first step (net/discovery/doctor.py runs the rest): are the bootstrap addresses well formed, and
does each accept a plain TCP connection?

`check_bootstraps(addresses, timeout_s)` parses each bootstrap multiaddr (a malformed one is a finding naming
what is wrong) and opens a plain TCP connection to each, timed: a bootstrap that refuses it is down or its port
is closed. No libp2p yet: this answers in a second where the DHT start would retry for a minute, so `join` runs
it before its own node start.

Every problem becomes a `Finding(problem, fix)`; `report(line)` is called with one line per step as it goes.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from multiaddr import Multiaddr

from p2p_diloco.config.multiaddrs import MULTIADDR_EXAMPLE
from p2p_diloco.net.transport.node import NodeError, parse_multiaddr

BAD_ADDRESS_FIX = ("bad address: correct it to /ip4/IP/tcp/PORT/p2p/PEER_ID (or /dns/NAME/...), as the bootstrap "
                   "printed it")
DOWN_FIX = "this bootstrap is down or the port is closed: use another (or ask its operator)"
LOOPBACK = ("127.", "::1", "localhost")
"""How loopback hosts start: a bootstrap there is this machine, and says nothing about the internet."""

Report = Callable[[str], None]


@dataclass(frozen=True)
class Finding:
    """One problem and the change that fixes it."""

    problem: str
    fix: str


@dataclass
class BootstrapCheck:
    """One --bootstrap address: parsed, then dialed over plain TCP."""

    address: str
    peer_id: str = ""
    host: str = ""
    port: int = 0
    connect_ms: float | None = None
    """Time to open a TCP connection; None if it failed or was not tried."""
    error: str = ""
    """What was wrong: the address, or the connection."""

    @property
    def reachable(self) -> bool:
        return self.connect_ms is not None

    @property
    def loopback(self) -> bool:
        return self.host.startswith(LOOPBACK)


def quiet(line: str) -> None:
    """A `Report` that prints nothing."""
    pass


def parse_bootstrap(address: str) -> BootstrapCheck:
    """The host, TCP port and peer id of a bootstrap multiaddr; `error` says what is wrong with it."""
    check = BootstrapCheck(address=address)
    try:
        maddr = Multiaddr(parse_multiaddr(address, require_peer_id=True))
    except NodeError as e:
        check.error = str(e)
        return check
    names = [p.name for p in maddr.protocols()]
    host_proto = next((n for n in names if n in ("ip4", "ip6", "dns", "dns4", "dns6")), None)
    if host_proto is None or "tcp" not in names:
        check.error = f"bad multiaddr '{address}': it names no host and TCP port; expected e.g. {MULTIADDR_EXAMPLE}"
        return check
    check.host = maddr.value_for_protocol(host_proto)
    check.port = int(maddr.value_for_protocol("tcp"))
    check.peer_id = maddr.value_for_protocol("p2p")
    return check


async def _connect(check: BootstrapCheck, timeout_s: float) -> None:
    started = time.monotonic()
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(check.host, check.port), timeout_s)
    except asyncio.TimeoutError:
        check.error = f"no answer within {timeout_s:g}s"
        return
    except OSError as e:  # asyncio's message repeats the address: the errno's text says it all
        check.error = (os.strerror(e.errno) if e.errno else str(e)) or type(e).__name__
        return
    check.connect_ms = (time.monotonic() - started) * 1000
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except (OSError, asyncio.TimeoutError):
        pass


async def check_bootstraps(addresses: Sequence[str], timeout_s: float,
                           report: Report = quiet) -> tuple[list[BootstrapCheck], list[Finding]]:
    """Steps a and b: parse each address, then a timed TCP connect to each well-formed one (all at once)."""
    checks = [parse_bootstrap(a) for a in addresses]
    findings = [Finding(c.error, BAD_ADDRESS_FIX) for c in checks if c.error]
    for c in checks:
        if c.error:
            report(f"address   {c.address}: BAD ({c.error})")
    good = [c for c in checks if not c.error]
    await asyncio.gather(*(_connect(c, timeout_s) for c in good))
    for c in good:
        if c.reachable:
            report(f"bootstrap {c.host}:{c.port}: TCP connect {c.connect_ms:.0f} ms")
        else:
            report(f"bootstrap {c.host}:{c.port}: DOWN ({c.error})")
            findings.append(Finding(f"bootstrap {c.host}:{c.port} refused a TCP connection ({c.error})", DOWN_FIX))
    return checks, findings


def tcp_port(maddr: str) -> int | None:
    """The TCP port of a direct (not relayed) multiaddr; None for anything else."""
    try:
        parsed = Multiaddr(maddr)
        names = [p.name for p in parsed.protocols()]
        return int(parsed.value_for_protocol("tcp")) if "tcp" in names and "p2p-circuit" not in names else None
    except Exception:
        return None
