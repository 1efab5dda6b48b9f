"""The connectivity doctor: would a `join` from this host work, and if not, what to change.

Two steps, so that `join` can run them around its own node start:

1. `check_bootstraps(addresses, timeout_s)` (net/discovery/bootstraps.py): each bootstrap address parsed, then a
   timed plain TCP connection to it; no libp2p yet.
2. `diagnose(node, checks, ...)`, once a node is up (started the way `join` starts it, with the bootstraps that
   answered): ask each bootstrap to dial us back on our listen and announced ports (net/transport/probe.py) and
   classify this host as "public" (a bootstrap connected back), "nat-relayed" (it could not, but the daemon holds
   a `/p2p-circuit` address: a relay slot), or "nat-unreachable"; list the addresses; time an upload to the first
   bootstrap; compare clocks; and read the run's spec to say how long one outer update takes to upload.

Every problem becomes a `Finding(problem, fix)`; `Diagnosis.ok` is what decides the exit code: some bootstrap
reachable, and this host public or relayed. `report(line)` is called with one line per step as it goes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from p2p_diloco.net.discovery.bootstraps import LOOPBACK, BootstrapCheck, Finding, Report, quiet, tcp_port
from p2p_diloco.net.discovery.records import fetch_run_spec
from p2p_diloco.net.discovery.update_size import update_bytes
from p2p_diloco.net.transport import probe

if TYPE_CHECKING:
    from p2p_diloco.net.transport.node import SwarmNode

logger = logging.getLogger(__name__)

PUBLIC, RELAYED, UNREACHABLE, UNKNOWN = "public", "nat-relayed", "nat-unreachable", "unknown"
MAX_CLOCK_SKEW_S = 10.0
"""Peer records expire by DHT time (the local clock): beyond this, records look expired or far in the future."""
SLOW_UPDATE_S = 60.0
"""An outer update that takes longer than this to upload is a finding (what is sent goes stale)."""
RELAY_FIX = ("behind NAT: run join with --reachability private (others then reach this peer through a relay "
             "on the bootstrap), with a bootstrap that relays (p2p-diloco bootstrap of this version)")


@dataclass
class SpecSummary:
    """The run's published spec, as far as bandwidth goes."""

    run_id: str
    spec_hash: str
    params: int | None = None
    params_exact: bool = False
    codec: str = ""
    update_bytes: int | None = None
    upload_s: float | None = None
    """Seconds to upload one outer update at the measured rate (None: no rate or size)."""


@dataclass
class Diagnosis:
    """Everything the doctor found; `ok` says whether a `join` from here would work."""

    bootstraps: list[BootstrapCheck]
    reachability: str = UNKNOWN
    observed_ip: str = ""
    listen_addrs: list[str] = field(default_factory=list)
    announced_addrs: list[str] = field(default_factory=list)
    probed_ports: list[int] = field(default_factory=list)
    open_ports: list[int] = field(default_factory=list)
    clock_skew_s: float | None = None
    upload_bytes_per_s: float | None = None
    spec: SpecSummary | None = None
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return any(b.reachable for b in self.bootstraps) and self.reachability in (PUBLIC, RELAYED)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ok": self.ok}


def _listen_report(node: SwarmNode, diagnosis: Diagnosis, report: Report) -> None:
    """Step e: our addresses, and the ports a bootstrap should be able to connect to."""
    diagnosis.listen_addrs = [m for m in node.visible_maddrs() if "/p2p-circuit" not in m]
    diagnosis.announced_addrs = list(node.config.announce_maddrs)
    for maddr in diagnosis.listen_addrs:
        report(f"listening {maddr}")
    for maddr in diagnosis.announced_addrs:
        report(f"announced {maddr}")
    ports = {p for m in diagnosis.listen_addrs + diagnosis.announced_addrs if (p := tcp_port(m))}
    diagnosis.probed_ports = sorted(ports)[:probe.MAX_REACH_PORTS]


async def _reach_all(node: SwarmNode, reachable: list[BootstrapCheck], diagnosis: Diagnosis, timeout_s: float,
                     report: Report) -> bool:
    """Step d, the dial-backs; True if at least one bootstrap answered the probe."""
    answered, open_ports = False, set[int]()
    for check in reachable:
        try:
            result = await probe.reach(node, check.peer_id, diagnosis.probed_ports, timeout_s)
        except Exception as e:  # an older bootstrap without the probe, busy, rate limited, gone
            report(f"reach     {check.host}:{check.port}: no answer ({e})")
            continue
        answered = True
        diagnosis.observed_ip = diagnosis.observed_ip or result.observed_ip
        open_ports.update(result.open_ports)
        shut = sorted(set(diagnosis.probed_ports) - set(result.open_ports))
        report(f"reach     {check.host}:{check.port} sees us as {result.observed_ip or '(relayed)'}: "
               f"open {list(result.open_ports) or 'none'}" + (f", closed {shut}" if shut else ""))
        if result.server_time is not None and diagnosis.clock_skew_s is None:
            diagnosis.clock_skew_s = result.server_time - (time.time() - result.rtt_s / 2)
    diagnosis.open_ports = sorted(open_ports)
    return answered


async def _relayed(node: SwarmNode, reachable: list[BootstrapCheck], wait_s: float, timeout_s: float,
                   report: Report) -> bool:
    """Whether peers can reach us through a relay: a bootstrap that forwards streams to us over our own
    connection (net/transport/relay.py), or a libp2p circuit slot (a /p2p-circuit address)."""
    for check in reachable:
        if await probe.serves_relay(node, check.peer_id, timeout_s):
            report(f"relay     {check.host}:{check.port} forwards streams to peers behind NAT")
            return True
    if await _has_relay_slot(node, wait_s if reachable else 0.0):
        report("relay     this node holds a libp2p relay slot (/p2p-circuit address)")
        return True
    return False


async def _has_relay_slot(node: SwarmNode, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if any("/p2p-circuit" in m for m in await node.refresh_visible_maddrs(timeout_s=max(wait_s, 1.0))):
                return True
        except Exception as e:
            logger.debug("refreshing visible addresses failed error=%r", e)
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))


def _reachability_findings(node: SwarmNode, diagnosis: Diagnosis, reachable: list[BootstrapCheck]) -> None:
    if diagnosis.reachability == UNKNOWN:
        diagnosis.findings.append(Finding(
            "no bootstrap answered the reachability probe: cannot tell whether peers can dial this host",
            "use a bootstrap of this version (it serves the probe), or try again in a few seconds"))
    if diagnosis.reachability == RELAYED and diagnosis.probed_ports:
        ports = ", ".join(str(p) for p in diagnosis.probed_ports)
        diagnosis.findings.append(Finding(
            "peers reach this host only through a relay (slower, and it depends on the relay)",
            f"for direct connections open TCP port {ports} (or pass --announce IP with a port forward); join works "
            "as is with --reachability private or auto"))
    if diagnosis.reachability != UNREACHABLE:
        return
    remote = any(not b.loopback for b in reachable)
    loopback_only = all(a.split("/")[2].startswith(LOOPBACK) for a in diagnosis.listen_addrs if a.count("/") > 2)
    if remote and loopback_only:
        diagnosis.findings.append(Finding("listening on 127.0.0.1 only: no other host can dial this one",
                                          "pass --host 0.0.0.0 (and --port P with TCP port P open)"))
    random_port = any(tcp_port(m) == 0 for m in node.config.host_maddrs)
    where = diagnosis.observed_ip or "this host's public IP"
    for port in sorted(set(diagnosis.probed_ports) - set(diagnosis.open_ports)):
        fix = (f"open TCP port {port} (or pass --announce IP with a port forward)" if not random_port else
               f"listen on a fixed port (--port P, not the random {port}), open TCP port P, or forward it and pass "
               "--announce IP")
        diagnosis.findings.append(Finding(f"TCP port {port} on {where} is not reachable from the bootstrap", fix))
    diagnosis.findings.append(Finding("behind NAT (or a firewall) with no relay slot: peers cannot dial this host",
                                      RELAY_FIX))


async def _upload(node: SwarmNode, check: BootstrapCheck, diagnosis: Diagnosis, *, nbytes: int, tries: int,
                  timeout_s: float, report: Report) -> None:
    """Step f: the best of `tries` uploads of `nbytes` to one bootstrap."""
    rates = []
    for _ in range(tries):
        try:
            rates.append(await probe.upload_rate(node, check.peer_id, nbytes, timeout_s))
        except Exception as e:
            report(f"upload    {check.host}:{check.port}: failed ({e})")
            break
    if rates:
        diagnosis.upload_bytes_per_s = max(rates)
        report(f"upload    {check.host}:{check.port}: {diagnosis.upload_bytes_per_s * 8 / 1e6:.1f} Mbit/s "
               f"({len(rates)} x {nbytes / (1 << 20):.1f} MiB)")


async def _spec(node: SwarmNode, run_id: str, diagnosis: Diagnosis, timeout_s: float, report: Report) -> None:
    """Step g: the run's published spec, and what one outer update costs at the measured rate."""
    try:
        found = await fetch_run_spec(node, run_id, timeout_s=timeout_s)
    except Exception as e:
        report(f"run       '{run_id}': could not read its spec ({type(e).__name__}: {e})")
        return
    if found is None:
        report(f"run       '{run_id}': no spec published yet (the run's first peer publishes it)")
        return
    spec, spec_hash = found
    summary = SpecSummary(run_id=run_id, spec_hash=spec_hash)
    sized = update_bytes(spec)
    if sized is not None:
        summary.update_bytes, summary.params, summary.params_exact, summary.codec = sized
        if diagnosis.upload_bytes_per_s:
            summary.upload_s = summary.update_bytes / diagnosis.upload_bytes_per_s
    diagnosis.spec = summary
    line = f"run       '{run_id}': spec {spec_hash[:12]}"
    if sized is not None:
        nbytes, params, exact, codec = sized
        line += (f", {'' if exact else '~'}{params / 1e6:.2f}M parameters, codec {codec}, "
                 f"{nbytes / 1e6:.2f} MB per outer update")
        if summary.upload_s is not None:
            line += f", {summary.upload_s:.1f}s to upload one"
    report(line)
    if summary.upload_s is not None and summary.upload_s > SLOW_UPDATE_S:
        diagnosis.findings.append(Finding(
            f"one outer update takes {summary.upload_s:.0f}s to upload at the measured rate",
            "slow uplink: updates go stale; a faster link helps, and the run's codec (int4) and inner steps (H) "
            "decide the bytes per round (run-wide: ask the run's operator)"))


async def diagnose(node: SwarmNode, checks: list[BootstrapCheck], *, run_id: str = "default",
                   timeout_s: float = 10.0, relay_wait_s: float = 5.0, upload_bytes: int = 1 << 20,
                   upload_tries: int = 2, report: Report = quiet) -> Diagnosis:
    """Steps d to g on a started node; the findings of `check_bootstraps` are the caller's to add."""
    diagnosis = Diagnosis(bootstraps=list(checks))
    reachable = [c for c in checks if c.reachable and c.peer_id]
    _listen_report(node, diagnosis, report)
    answered = bool(reachable and diagnosis.probed_ports) and await _reach_all(node, reachable, diagnosis,
                                                                               timeout_s, report)
    if diagnosis.open_ports:
        diagnosis.reachability = PUBLIC
    elif await _relayed(node, reachable, relay_wait_s, timeout_s, report):
        diagnosis.reachability = RELAYED
    elif answered:
        diagnosis.reachability = UNREACHABLE
    report(f"reachable {diagnosis.reachability}" + (f" (seen as {diagnosis.observed_ip})" if diagnosis.observed_ip
                                                     else ""))
    _reachability_findings(node, diagnosis, reachable)
    if diagnosis.clock_skew_s is not None and abs(diagnosis.clock_skew_s) > MAX_CLOCK_SKEW_S:
        diagnosis.findings.append(Finding(
            f"this machine's clock is {diagnosis.clock_skew_s:+.0f}s off the bootstrap's",
            "clock: synchronize this machine's clock (NTP, e.g. `timedatectl set-ntp true`)"))
    if reachable and upload_bytes > 0:
        await _upload(node, reachable[0], diagnosis, nbytes=min(upload_bytes, probe.MAX_UPLOAD_BYTES),
                      tries=upload_tries, timeout_s=timeout_s, report=report)
    if reachable:
        await _spec(node, run_id, diagnosis, timeout_s, report)
    return diagnosis
