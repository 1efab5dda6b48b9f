"""Launch, watch and clean up real `p2p-diloco` processes on 127.0.0.1 (the multi-process tests and benchmarks).

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
PACED = ("--training.duty-cycle", "0.5")
"""For peers that train until told to stop beside the ones a test waits on: they compute half the time
(train/pace.py), as a volunteer sharing its desktop would, so the machine's cores go to the processes starting up
and to the other test workers. Rounds and merges are as before, at half the CPU (the main swarm test: 58 CPU-s
against 85 alone)."""


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
        priority: peers that train at full speed then leave room for one that is starting up. Only against
        processes of its own session, where the kernel has autogroups (sched_autogroup_enabled = 1, as on the
        machines here): every peer has a session of its own (start_new_session) and each session gets an equal
        share, the 4 pytest workers one between them, so beside the swarms an in-process test runs ~10x slower
        than alone. Niceing the autogroup too starved niced peers and failed 3 swarm tests; a session per worker
        made the suite slower (330 s against ~310 s): both tried and left out."""
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


def founder_key(workdir: Path, name: str) -> str:
    """The key `join --identity workdir/NAME.key` will use, made before the run (as a run's founders do, so that
    the spec can name them): keygen, then `id`; returns its PeerID."""
    key = str(workdir / f"{name}.key")
    subprocess.run(cli("keygen", "--identity", key), capture_output=True, text=True, timeout=60, check=True)
    out = subprocess.run(cli("id", "--identity", key), capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip().split()[-1]
