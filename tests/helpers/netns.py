"""Hosts in Linux network namespaces, and an internet of them: public hosts on one bridge, NATed hosts each
behind its own router.

    inet (hub namespace)  bridge br0, 10.240.0.0/24: the "public internet"
    public member         its own namespace, eth0 on br0 with 10.240.0.N
    NATed member          its own namespace, eth0 = 192.168.N.2/24, default route via its router;
                          the router namespace has lan (192.168.N.1) and wan (10.240.0.N on br0), forwards, and
                          MASQUERADEs everything leaving by wan; from wan it forwards only replies to connections
                          the inside opened (conntrack ESTABLISHED,RELATED): unsolicited inbound is dropped, as at
                          a home router without port forwards

Uplink caps are `tc tbf` on the member's own eth0 (what it sends). Everything lives on private addresses inside
namespaces this class creates, and is deleted on exit whatever happened (stop the processes in them first).
Needs root, `ip` (iproute2), `iptables` and `tc`; `nat_unavailable()` says why not when they are missing.
`NetnsTopology`: hosts on bridges joined by veth links, no NAT (tests/peer/test_partition.py, benchmarks/chaos.py);
`NatTopology`: the internet above (tests/peer/test_nat.py, benchmarks/bench_netns_caps.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from typing import Any


def netns_unavailable() -> str | None:
    """Why network-namespace tests cannot run here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    name = f"p2dprobe{uuid.uuid4().hex[:6]}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns add` failed: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


class Namespaces:
    """Namespaces a test creates (`created`) and always deletes: `with X(...)` runs `_create`, and on any error
    in it, or at the end, `destroy` (stop the processes in them first)."""

    created: list[str]

    def _create(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def destroy(self) -> None:
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.created.clear()


class NetnsTopology(Namespaces):
    """Every member in its own network namespace, each on one of two bridges (its group) in a hub namespace;
    a veth link joins the bridges. `cut()` sets that link down (the groups cannot reach each other, each
    group still can reach itself), `heal()` sets it up. Nothing outside the namespaces it creates is touched;
    use it as a context manager: the namespaces are always deleted (stop the processes in them first)."""

    SUBNET = "10.231.0"

    def __init__(self, groups: dict[str, list[str]]):
        import uuid

        if len(groups) != 2:
            raise ValueError("two groups: the partition cuts the link between them")
        self.token = f"p2d{uuid.uuid4().hex[:5]}"
        self.hub = f"{self.token}-hub"
        self.groups = {g: list(members) for g, members in groups.items()}
        self.members = [m for members in self.groups.values() for m in members]
        self.created: list[str] = []

    def namespace(self, member: str) -> str:
        return f"{self.token}-{self.members.index(member)}"

    def prefix(self, member: str) -> tuple[str, ...]:
        """Run a command inside `member`'s namespace (`ip netns exec` execs it in place)."""
        return ("ip", "netns", "exec", self.namespace(member))

    def host(self, member: str) -> str:
        return f"{self.SUBNET}.{self.members.index(member) + 1}"

    @staticmethod
    def _ip(*args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")

    def _create(self) -> None:
        hub = self.hub
        self._ip("netns", "add", hub)
        self.created.append(hub)
        for g in self.groups:
            self._ip("-n", hub, "link", "add", f"br{g}", "type", "bridge")
            self._ip("-n", hub, "link", "set", f"br{g}", "up")
        (ga, gb) = self.groups
        self._ip("-n", hub, "link", "add", "cut-a", "type", "veth", "peer", "name", "cut-b")
        for end, g in (("cut-a", ga), ("cut-b", gb)):
            self._ip("-n", hub, "link", "set", end, "master", f"br{g}", "up")
        for g, members in self.groups.items():
            for member in members:
                ns, index = self.namespace(member), self.members.index(member)
                self._ip("netns", "add", ns)
                self.created.append(ns)
                self._ip("-n", ns, "link", "set", "lo", "up")
                self._ip("-n", hub, "link", "add", f"m{index}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                self._ip("-n", hub, "link", "set", f"m{index}", "master", f"br{g}", "up")
                self._ip("-n", ns, "addr", "add", f"{self.host(member)}/24", "dev", "eth0")
                self._ip("-n", ns, "link", "set", "eth0", "up")

    def cut(self) -> None:
        self._ip("-n", self.hub, "link", "set", "cut-a", "down")

    def heal(self) -> None:
        self._ip("-n", self.hub, "link", "set", "cut-a", "up")


# ---------------------------------------------------------------------------------------------- NAT

PUBLIC_SUBNET = "10.240.0"


def nat_unavailable() -> str | None:
    """Why NAT topologies cannot be built here (None: they can)."""
    if reason := netns_unavailable():
        return reason
    for tool, package in (("iptables", "iptables"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (apt-get install {package})"
    return None


def _run(*argv: str) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")


class NatTopology(Namespaces):
    """`members`: name -> "public" or "nat"; `caps_mbit`: name -> uplink cap in Mbit/s (tbf), absent = none.

    Use as a context manager; `prefix(name)` runs a command inside a member's namespace, `host(name)` is the
    address it listens on (a NATed member's is private: nobody outside its router can dial it)."""

    def __init__(self, members: dict[str, str], caps_mbit: dict[str, float] | None = None):
        bad = {n: kind for n, kind in members.items() if kind not in ("public", "nat")}
        if bad:
            raise ValueError(f"members must be 'public' or 'nat': {bad}")
        self.token = f"p2n{uuid.uuid4().hex[:5]}"
        self.members = dict(members)
        self.caps_mbit = dict(caps_mbit or {})
        self.hub = f"{self.token}-inet"
        self.created: list[str] = []

    def _index(self, name: str) -> int:
        return list(self.members).index(name) + 1

    def namespace(self, name: str) -> str:
        return f"{self.token}-{self._index(name)}"

    def router(self, name: str) -> str:
        return f"{self.token}-r{self._index(name)}"

    def prefix(self, name: str) -> tuple[str, ...]:
        """`ip netns exec NS`: execs the command in place, so signals still reach it."""
        return ("ip", "netns", "exec", self.namespace(name))

    def host(self, name: str) -> str:
        """The member's own address (what it listens on)."""
        i = self._index(name)
        return f"{PUBLIC_SUBNET}.{i}" if self.members[name] == "public" else f"192.168.{i}.2"

    def public_address(self, name: str) -> str:
        """Where the internet sees the member: its own address, or its router's wan address."""
        return f"{PUBLIC_SUBNET}.{self._index(name)}"

    def _netns(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self.created.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _create(self) -> None:
        hub = self.hub
        self._netns(hub)
        _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", hub, "link", "set", "br0", "up")
        for name, kind in self.members.items():
            i, ns = self._index(name), self.namespace(name)
            self._netns(ns)
            if kind == "public":
                _run("ip", "-n", hub, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                _run("ip", "-n", hub, "link", "set", f"p{i}", "master", "br0", "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.host(name)}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
            else:
                self._nat(name, i, ns)
            if name in self.caps_mbit:
                mbit = self.caps_mbit[name]
                # burst: a few ms of the rate (at least 16 KiB, so the qdisc can send a full-size packet)
                burst = max(16 * 1024, int(mbit * 1e6 / 8 * 0.004))
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                     "rate", f"{mbit}mbit", "burst", str(burst), "latency", "200ms")

    def _nat(self, name: str, i: int, ns: str) -> None:
        hub, router = self.hub, self.router(name)
        self._netns(router)
        _run("ip", "-n", hub, "link", "add", f"w{i}", "type", "veth", "peer", "name", "wan", "netns", router)
        _run("ip", "-n", hub, "link", "set", f"w{i}", "master", "br0", "up")
        _run("ip", "-n", router, "addr", "add", f"{PUBLIC_SUBNET}.{i}/24", "dev", "wan")
        _run("ip", "-n", router, "link", "set", "wan", "up")
        _run("ip", "-n", router, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "-n", router, "addr", "add", f"192.168.{i}.1/24", "dev", "lan")
        _run("ip", "-n", router, "link", "set", "lan", "up")
        _run("ip", "-n", ns, "addr", "add", f"192.168.{i}.2/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "route", "add", "default", "via", f"192.168.{i}.1")
        ipt = ("ip", "netns", "exec", router, "iptables")
        _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _run(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
        _run(*ipt, "-P", "FORWARD", "DROP")
        _run(*ipt, "-A", "FORWARD", "-i", "lan", "-o", "wan", "-j", "ACCEPT")
        _run(*ipt, "-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack", "--ctstate",
             "ESTABLISHED,RELATED", "-j", "ACCEPT")
