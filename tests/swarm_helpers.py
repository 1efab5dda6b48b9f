"""Launch, watch and clean up real `p2p-diloco` processes on 127.0.0.1 (for tests/test_swarm.py).

Every process runs in its own session (process group), so its hivemind DHT process and p2pd go with it when
the group is killed; `Launcher` kills every group it started when its context exits, whatever happened.
Output goes to files (never pipes, which fill up); waits poll those files and the JSON logs for a condition
with a timeout, never a fixed sleep.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PEER_ARGS = ("--preset", "test", "--inner-steps", "10", "--torch-threads", "1", "--eval-every", "2",
             "--eval-batches", "2", "--record-ttl-s", "12", "--gossip-anti-entropy-s", "1")
"""What every test peer runs with: the tiny test model, short phases, fast refresh and anti-entropy."""


class WaitTimeout(AssertionError):
    pass


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str, *, procs: list[Proc] = (),
               interval_s: float = 0.2) -> Any:
    """Poll `condition` until it returns something truthy; on timeout fail with `what` and the procs' tails.
    Fails at once if one of `procs` exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        for proc in procs:
            if proc.returncode is not None:
                raise WaitTimeout(f"{proc.name} exited (rc={proc.returncode}) while waiting for {what}\n"
                                  f"{proc.tail()}")
        if time.monotonic() > deadline:
            tails = "\n".join(p.tail() for p in procs)
            raise WaitTimeout(f"timed out after {timeout_s:g}s waiting for {what}\n{tails}")
        time.sleep(interval_s)


class Proc:
    """One launched process: its output file, JSON log, out dir; signals go to its main pid or whole group."""

    def __init__(self, name: str, argv: list[str], workdir: Path, *, json_log: Path | None = None,
                 out_dir: Path | None = None, nice: int = 0):
        self.name, self.argv, self.json_log, self.out_dir = name, argv, json_log, out_dir
        self.log_path = workdir / f"{name}.out"
        self._log_file = open(self.log_path, "w")  # closed in cleanup()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen(argv, stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True, cwd=workdir,
                                      preexec_fn=(lambda: os.nice(nice)) if nice else None)
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, n: int = 25) -> str:
        lines = self.output().splitlines()[-n:]
        return f"--- {self.name} (rc={self.returncode}) ---\n" + "\n".join(lines)

    def events(self, kind: str | None = None) -> list[dict]:
        if self.json_log is None or not self.json_log.exists():
            return []
        out = []
        for line in self.json_log.read_text().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # a line being written
                continue
            if kind is None or event.get("event") == kind:
                out.append(event)
        return out

    def rounds(self) -> list[dict]:
        return self.events("round")

    def wait_for_line(self, pattern: str, timeout_s: float) -> re.Match:
        regex = re.compile(pattern, re.MULTILINE)
        return wait_until(lambda: regex.search(self.output()), timeout_s, f"{self.name}: /{pattern}/", procs=[])

    def wait_rounds(self, n: int, timeout_s: float) -> list[dict]:
        return wait_until(lambda: len(self.rounds()) >= n and self.rounds(), timeout_s,
                          f"{self.name} to complete {n} rounds", procs=[self])

    def interrupt(self) -> None:
        """SIGINT to the main process only (as the CLI's own signal handling would see a Ctrl-C)."""
        if self.returncode is None:
            self.popen.send_signal(signal.SIGINT)

    def finish(self) -> None:
        """SIGUSR1: end after the current round, linger until the swarm is quiet, exit."""
        if self.returncode is None:
            self.popen.send_signal(signal.SIGUSR1)

    def kill_group(self) -> None:
        """SIGKILL to the whole process group: the peer, its DHT process and p2pd die at once (a crash)."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def pause(self) -> None:
        """SIGSTOP to the whole process group: the peer, its DHT process and p2pd freeze (a hung machine)."""
        try:
            os.killpg(self.popen.pid, signal.SIGSTOP)
        except (ProcessLookupError, PermissionError):
            pass

    def resume(self) -> None:
        """SIGCONT to the whole process group (after `pause`)."""
        try:
            os.killpg(self.popen.pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout_s: float) -> int:
        return self.popen.wait(timeout_s)

    def cleanup(self) -> None:
        self.kill_group()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._log_file.close()

    def state(self) -> tuple[torch.Tensor, dict]:
        assert self.out_dir is not None
        theta = torch.load(self.out_dir / "theta.pt")
        vv = json.loads((self.out_dir / "version_vector.json").read_text())
        return theta, vv


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2p_diloco.cli", *args]


class Launcher:
    """Starts bootstrap and peer processes under `workdir`; `with Launcher(...)` kills them all on exit."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        for proc in self.procs:
            proc.cleanup()

    def start(self, name: str, argv: list[str], **kwargs: Any) -> Proc:
        proc = Proc(name, argv, self.workdir, **kwargs)
        self.procs.append(proc)
        return proc

    def restart(self, proc: Proc, name: str, *, nice: int = 0) -> Proc:
        """Run `proc`'s command again as `name`: the same identity, JSON log (appended), out dir and checkpoints."""
        return self.start(name, proc.argv, json_log=proc.json_log, out_dir=proc.out_dir, nice=nice)

    def bootstrap(self, name: str = "bootstrap", timeout_s: float = 60, *, host: str = "127.0.0.1",
                  prefix: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> tuple[Proc, str]:
        """Our bootstrap on `host` port 0 (`prefix`: e.g. `ip netns exec NS`); returns it and its multiaddr."""
        proc = self.start(name, [*prefix, *cli("bootstrap", "--host", host, "--port", "0", "--report-s", "0",
                                               "--identity", str(self.workdir / f"{name}.key"), *extra)])
        match = wait_until(lambda: re.search(r"^bootstrap ready.*\n(/ip4/\S+)$", proc.output(), re.MULTILINE),
                           timeout_s, "the bootstrap's address", procs=[proc])
        return proc, match.group(1)

    def stock_bootstrap(self, name: str = "hivemind-dht", timeout_s: float = 60) -> tuple[Proc, str]:
        """A stock `hivemind-dht` node on 127.0.0.1; returns it and the multiaddr it printed."""
        exe = os.path.join(os.path.dirname(sys.executable), "hivemind-dht")
        proc = self.start(name, [exe, "--host_maddrs", "/ip4/127.0.0.1/tcp/0"])
        match = wait_until(lambda: re.search(r"--initial_peers (\S+)", proc.output()), timeout_s,
                           "hivemind-dht's address", procs=[proc])
        return proc, match.group(1)

    def peer(self, name: str, bootstrap: str | None, *extra: str, rounds: int = 0, linger_s: float = 60,
             base: tuple[str, ...] = PEER_ARGS, nice: int = 0, prefix: tuple[str, ...] = ()) -> Proc:
        """A `join` peer with its own identity, JSON log and out dir (named after `name`). `nice` lowers its CPU
        priority: peers that train at full speed then leave room for one that is starting up."""
        json_log, out_dir = self.workdir / f"{name}.jsonl", self.workdir / f"{name}-state"
        argv = cli("join", *base, "--identity", str(self.workdir / f"{name}.key"), "--json-log", str(json_log),
                   "--out-dir", str(out_dir), "--rounds", str(rounds), "--linger-s", str(linger_s), *extra)
        if bootstrap:
            argv += ["--bootstrap", bootstrap]
        argv = [*prefix, *argv]  # e.g. `ip netns exec NS`, which execs the peer in place: signals still reach it
        return self.start(name, argv, json_log=json_log, out_dir=out_dir, nice=nice)


def max_relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |a|: replicas that merged the same updates agree to float rounding."""
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-12))


# ---------------------------------------------------------------------------------------------- faults
# Shared by tests/test_faults.py, tests/test_partition.py and benchmarks/chaos.py.


def peer_id_of(proc: Proc) -> str:
    """The PeerID a `join` process logged at start-up."""
    return wait_until(lambda: proc.events("start") and proc.events("start")[0]["peer_id"], 5, f"{proc.name}'s id")


def listen_maddr_of(proc: Proc, timeout_s: float = 60) -> str:
    """The first multiaddr a `join` peer printed ("listening on ..."): other peers may bootstrap from it."""
    match = wait_until(lambda: re.search(r"^listening on (/ip4/\S+)$", proc.output(), re.MULTILINE), timeout_s,
                       f"{proc.name}'s listening address", procs=[proc])
    return match.group(1)


def published_counts(procs: list[Proc]) -> dict[str, int]:
    """PeerID -> the highest seq its round events name (incarnations of one identity share a JSON log)."""
    out: dict[str, int] = {}
    for proc in procs:
        for r in proc.rounds():
            out[r["peer_id"]] = max(out.get(r["peer_id"], 0), r["seq"])
    return out


def incarnations(proc: Proc) -> list[list[dict]]:
    """The JSON log of a peer split at each "start" event: one list of events per process that ran it."""
    runs: list[list[dict]] = []
    for event in proc.events():
        if event["event"] == "start":
            runs.append([])
        if runs:
            runs[-1].append(event)
    return runs


def of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["event"] == kind]


def assert_replicas_agree(procs: list[Proc], published: dict[str, int] | None = None, *, rtol: float = 1e-5,
                          clean: bool = False) -> None:
    """The standard assertion after a fault: every final replica holds exactly the updates `published` (each
    sender's seqs 1..n: none lost, and a version vector counts each (sender, seq) once), equal vectors, equal
    theta to float rounding. `published` defaults to each peer's last signed seq (its last process's final
    record); `clean` also asserts that no peer rejected anything, saw equivocation or banned anyone."""
    finals = {proc.name: of(incarnations(proc)[-1], "final")[-1] for proc in procs} if \
        (published is None or clean) else {}
    if published is None:
        published = {f["peer_id"]: f["seq"] for f in finals.values()}
    states = [proc.state() for proc in procs]
    for proc, (_, vv) in zip(procs, states):
        held = {pid: vv["version_vector"].get(pid, 0) for pid in published}
        assert held == published, f"{proc.name} holds {held}, published {published}"
        if clean:
            final = finals[proc.name]
            assert final["rejected"] == 0 and final["equivocations"] == 0 and final["banned"] == [], \
                (proc.name, final)
    assert len({vv["digest"] for _, vv in states}) == 1, [vv["version_vector"] for _, vv in states]
    for proc, (theta, _) in zip(procs[1:], states[1:]):
        assert max_relative_difference(states[0][0], theta) < rtol, f"{procs[0].name} and {proc.name} differ"


def assert_merged_once(proc: Proc) -> None:
    """A peer that ran once (no restart) merged every update in its vector exactly once: what its state sync
    loaded + the remote updates its intake merged + its own rounds == its final V total. An update merged
    twice would make the left side larger."""
    final = proc.events("final")[-1]
    sync = proc.events("sync")
    loaded = sync[-1]["vv_total"] if sync else 0
    own = len(proc.rounds())
    assert loaded + final["merged"] + own == final["vv_total"], \
        f"{proc.name}: synced {loaded} + merged {final['merged']} + own {own} != V total {final['vv_total']}"


def netns_unavailable() -> str | None:
    """Why network-namespace tests cannot run here (None: they can)."""
    import shutil
    import uuid

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
