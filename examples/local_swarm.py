"""A whole swarm on this machine: one bootstrap and N peers, each a separate `p2p-diloco` process on 127.0.0.1.

    python examples/local_swarm.py                      # 3 peers, the tiny "test" model, 60 rounds each
    python examples/local_swarm.py --peers 4 --rounds 30 -- --preset tiny --codec int4

Every peer gets its own identity (in a temporary folder), its own data stream and its own JSON log; the table
below is redrawn from those logs as rounds complete. When every peer has done its rounds, each one lingers
until the swarm is quiet (all replicas hold the same updates), writes its replica and exits; the script then
prints each peer's final eval loss, how closely the replicas agree, and the bytes each one sent.

Ctrl-C asks every peer to finish (SIGUSR1: end the current round, linger until the swarm is quiet, write the
replica); a second Ctrl-C stops them at once (SIGINT: each leaves cleanly). The bootstrap goes last; anything
still running after a timeout gets SIGKILL, and so does everything left over if this script itself dies
(atexit). Options after `--` go to every `p2p-diloco join` unchanged.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STOP_TIMEOUT_S = 20.0


class Child:
    """One process in its own session: its group (DHT process and p2pd included) can be killed at once."""

    def __init__(self, name: str, argv: list[str], workdir: Path):
        self.name = name
        self.log_path = workdir / f"{name}.out"
        self._log = open(self.log_path, "w")  # closed in kill()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def interrupt(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGINT)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def stop_all(children: list[Child], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGINT every child, wait up to `timeout_s` for them to leave, then SIGKILL whatever is left."""
    for child in children:
        child.interrupt()
    deadline = time.monotonic() + timeout_s
    while any(c.alive() for c in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    for child in children:
        if child.alive():
            print(f"{child.name} did not stop within {timeout_s:g}s: killing it", file=sys.stderr)
        child.kill()


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2p_diloco.cli", *args]


def start_bootstrap(workdir: Path, children: list[Child], timeout_s: float = 90) -> tuple[str, str]:
    """The bootstrap's multiaddr and the URL of its status page (on 127.0.0.1, a free port)."""
    boot = Child("bootstrap", cli("bootstrap", "--host", "127.0.0.1", "--port", "0", "--report-s", "0",
                                  "--identity", str(workdir / "bootstrap.key"), "--status-port", "0"), workdir)
    children.append(boot)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"^bootstrap ready.*\n(/ip4/\S+)$", boot.output(), re.MULTILINE)
        page = re.search(r"^status page: (\S+)", boot.output(), re.MULTILINE)
        if found and page:
            return found.group(1), page.group(1)
        if not boot.alive():
            raise RuntimeError(f"the bootstrap exited:\n{boot.output()}")
        time.sleep(0.2)
    raise RuntimeError(f"the bootstrap printed no address within {timeout_s:g}s:\n{boot.output()}")


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            pass
    return events


def fmt_mb(n: float) -> str:
    return f"{n / 1e6:.1f}MB"


def data_of(start: dict) -> str:
    """What a peer reads: `all` (the whole split, its own stream: the default) or its shard of the text."""
    if not start:
        return ""
    return "all" if start.get("num_shards", 1) == 1 else f"{start.get('shard')}/{start.get('num_shards')}"


def table(peers: list[tuple[str, Child, Path]], rounds: int) -> list[str]:
    lines = [f"{'peer':<6} {'id':<9} {'data':>5} {'round':>9} {'loss':>6} {'eval':>6} {'peers':>5} {'V':>5} "
             f"{'sent':>8} {'merged':>6} {'util':>5}  state"]
    for name, child, log in peers:
        events = read_events(log)
        start = next((e for e in events if e["event"] == "start"), {})
        last = next((e for e in reversed(events) if e["event"] == "round"), {})
        last_eval = next((e["eval_loss"] for e in reversed(events) if e["event"] == "eval"), None)
        final = next((e for e in events if e["event"] == "final"), None)
        state = ("done" if final else "starting" if not start else
                 "lingering" if any(e["event"] == "linger" for e in events) else "training")
        if not child.alive() and not final:
            state = f"exited rc={child.proc.returncode}"
        eval_text = f"{last_eval:6.3f}" if last_eval is not None else f"{'-':>6}"
        loss_text = f"{last['loss']:6.3f}" if last else f"{'-':>6}"
        lines.append(
            f"{name:<6} {start.get('peer_id', '')[-8:]:<9} {data_of(start):>5} "
            f"{str(last.get('round', 0)) + '/' + str(rounds):>9} {loss_text} {eval_text} {last.get('peers', ''):>5} "
            f"{last.get('vv_total', ''):>5} {fmt_mb(last.get('bytes_sent', 0)):>8} {last.get('merged', ''):>6} "
            f"{last.get('utilization', 0):>5.0%}  {state}")
    return lines


def watch(peers: list[tuple[str, Child, Path]], rounds: int, timeout_s: float) -> None:
    """Redraw the table as rounds complete (in place on a terminal), until every peer has exited."""
    tty = sys.stdout.isatty()
    shown: list[str] = []
    last_progress = -1
    deadline = time.monotonic() + timeout_s
    while any(child.alive() for _, child, _ in peers):
        if time.monotonic() > deadline:
            print(f"\nthe peers did not finish within {timeout_s:g}s; stopping them")
            return
        lines = table(peers, rounds)
        progress = sum(len([e for e in read_events(log) if e["event"] in ("round", "final")]) for *_, log in peers)
        if tty and lines != shown:
            if shown:
                sys.stdout.write(f"\x1b[{len(shown)}F\x1b[J")  # back to the table's first line, clear below
            print("\n".join(lines), flush=True)
            shown = lines
        elif not tty and progress >= last_progress + 5 * len(peers):
            print("\n".join(lines) + "\n", flush=True)
            last_progress = progress
        time.sleep(0.5)
    if not tty:
        print("\n".join(table(peers, rounds)))


def summarize(peers: list[tuple[str, Child, Path]], workdir: Path) -> None:
    import torch  # only here: the rest of the script runs without it

    print("\nfinal:")
    thetas = {}
    for name, child, log in peers:
        final = next((e for e in read_events(log) if e["event"] == "final"), None)
        if final is None:
            print(f"  {name}: no final state (exit code {child.proc.returncode}); see {child.log_path}")
            continue
        theta_path = workdir / f"{name}-state" / "theta.pt"
        if theta_path.exists():
            thetas[name] = torch.load(theta_path)
        print(f"  {name}: eval loss {final['eval_loss']:.4f}  rounds {final['round']}  updates merged into its "
              f"replica {final['vv_total']}  sent {fmt_mb(final['bytes_sent'])}  received "
              f"{fmt_mb(final['bytes_received'])}  rejected {final['rejected']}  utilization "
              f"{final['utilization']:.0%}")
    if len(thetas) >= 2:
        mean = torch.stack(list(thetas.values())).mean(0)
        divergence = max(float((t - mean).norm() / mean.norm()) for t in thetas.values())
        verdict = "equal to float rounding" if divergence < 1e-5 else "not equal: peers left before the swarm was quiet"
        print(f"replica agreement: max over peers of ||theta_i - mean|| / ||mean|| = {divergence:.2e} ({verdict})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Options after -- go to every `p2p-diloco join`.")
    parser.add_argument("--peers", type=int, default=3, help="number of peers (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=60, help="outer rounds per peer (default: %(default)s)")
    parser.add_argument("--preset", default="test", help="RunSpec preset (default: %(default)s)")
    parser.add_argument("--workdir", help="keep identities, logs and replicas here (default: a temporary folder)")
    parser.add_argument("--timeout-s", type=float, default=1200, help="give up after this long (default: %(default)s)")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="p2p-diloco-local-"))
    workdir.mkdir(parents=True, exist_ok=True)

    children: list[Child] = []
    atexit.register(lambda: [c.kill() for c in children])  # last resort: nothing outlives us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below on SIGTERM too
    threads = "1" if (os.cpu_count() or 1) <= 2 * args.peers else "0"
    try:
        print(f"workdir {workdir}")
        bootstrap, page = start_bootstrap(workdir, children)
        print(f"bootstrap {bootstrap}")
        print(f"watch it live: open {page} in a browser, or in another terminal run\n"
              f"  p2p-diloco status --watch --bootstrap {bootstrap}\n")
        peers = []
        for i in range(args.peers):
            name = f"peer{i}"
            log = workdir / f"{name}.jsonl"
            argv = cli("join", "--bootstrap", bootstrap, "--preset", args.preset, "--identity",
                       str(workdir / f"{name}.key"), "--rounds", str(args.rounds), "--linger-s", "120",
                       "--eval-every", "5",
                       "--json-log", str(log), "--out-dir", str(workdir / f"{name}-state"),
                       "--torch-threads", threads, *extra)
            child = Child(name, argv, workdir)
            children.append(child)
            peers.append((name, child, log))
        try:
            watch(peers, args.rounds, args.timeout_s)
        except KeyboardInterrupt:
            # SIGUSR1: each peer ends its current round, lingers until the swarm is quiet, writes its replica
            print("\ninterrupted: each peer finishes its round and waits for the swarm to go quiet "
                  "(Ctrl-C again to stop them at once)")
            for _, child, _ in peers:
                if child.alive():
                    child.proc.send_signal(signal.SIGUSR1)
            try:
                watch(peers, args.rounds, 150)
            except KeyboardInterrupt:
                print("\nstopping the peers now")
        stop_all([child for _, child, _ in peers])
        summarize(peers, workdir)
        print(f"\nlogs, identities and replicas: {workdir}")
        plots = subprocess.run(cli("plot", *(str(log) for _, _, log in peers), "--out-dir", str(workdir / "plots")),
                               capture_output=True, text=True)
        if plots.returncode == 0:
            print(f"loss, bytes and utilization plots: {workdir / 'plots'} (summary.png); "
                  f"again any time with `p2p-diloco plot {workdir}/*.jsonl`")
        return 0 if all(child.proc.returncode == 0 for _, child, _ in peers) else 1
    finally:
        stop_all([c for c in children if c.name != "bootstrap"])
        stop_all([c for c in children if c.name == "bootstrap"], timeout_s=10)


if __name__ == "__main__":
    sys.exit(main())
