"""Chaos harness: a real local swarm under a schedule of kills, restarts, pauses and partitions; goodput
measured, and the same schedule replayed for data-parallel and synchronous DiLoCo.

    python benchmarks/chaos.py --random --kill-every-s 120 --down-s 30 --duration-s 600 --inner-steps 400
    python benchmarks/chaos.py --schedule faults.json --duration-s 300
    sudo python benchmarks/chaos.py --netns --random --partition-every-s 150 --partition-s 40   # partitions

A bootstrap and N `p2p-diloco join` processes (each its own process group: a kill takes its DHT process and
p2pd with it) run on 127.0.0.1, or with --netns each in its own network namespace, on two bridges (groups:
the first half of the peers with the bootstrap, the rest) whose link a partition sets down. The clock starts
when every peer has published a round; the schedule's times count from there. A restarted peer runs the same
command again: same identity, JSON log, out dir and checkpoints. At --duration-s every peer is told to finish
(SIGUSR1: end the round, linger until the swarm is quiet, write its replica).

A schedule file is a JSON list of {"at_s", "action", "peer"} (actions: kill, restart, pause, resume,
partition, heal; a kill, pause or partition may carry "for_s" instead of its pair). --random draws kills every
~--kill-every-s (each restarted --down-s later), and pauses and partitions likewise if asked.

Writes OUT.json (everything, the definitions in benchmarks/chaos_metrics.py), OUT.png and OUT.md (a table
with the command). Options after `--` go to every `join`. A status line shows progress while it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmarks.*, and tests.helpers: the process launcher the multi-peer tests use

from benchmarks.chaos_metrics import (  # noqa: E402
    Action,
    intervals,
    load_schedule,
    measure_peer,
    median_or,
    random_schedule,
    replay_from_report,
    replays,
    restart_costs,
    sensitivity,
    summarize,
    validate_schedule,
)
from benchmarks.chaos_plot import write_outputs  # noqa: E402
from tests.helpers.netns import NetnsTopology, netns_unavailable  # noqa: E402
from tests.helpers.swarm import Launcher, Proc, wait_until  # noqa: E402

START_S = 180.0  # one process's start-up on a loaded machine, with margin


class Slot:
    """One peer position: its incarnations (a restart is a new process with the same identity and folders)."""

    def __init__(self, index: int, proc: Proc, launched_t: float):
        self.index, self.name = index, f"peer{index}"
        self.procs, self.lives = [proc], [[launched_t, None]]
        self.state = "up"
        self.reniced = False  # the running incarnation trains at --nice-training already

    @property
    def proc(self) -> Proc:
        return self.procs[-1]

    def rounds(self, t0_wall: float) -> list[dict]:
        return [{**r, "t": r["time"] - t0_wall} for r in self.proc.rounds()]


class Chaos:
    def __init__(self, args: argparse.Namespace, workdir: Path, extra: list[str]):
        self.args, self.workdir, self.extra = args, workdir, extra
        self.launcher = Launcher(workdir)
        self.net: NetnsTopology | None = None
        self.slots: list[Slot] = []
        self.t0_wall = time.time()  # replaced by the clock's zero once every peer has a round
        self.executed: list[dict] = []
        self.samples: list[dict] = []
        self.load_start = os.getloadavg()

    def now(self) -> float:
        return time.time() - self.t0_wall

    # ---- the swarm ------------------------------------------------------------------------------------

    def start(self) -> None:
        n = self.args.peers
        names = ["boot"] + [f"peer{i}" for i in range(n)]
        if self.args.netns:
            half = (n + 1) // 2
            self.net = NetnsTopology({"A": names[:half + 1], "B": names[half + 1:]})
            self.net.__enter__()
        prefix = self.net.prefix("boot") if self.net else ()
        host = self.net.host("boot") if self.net else "127.0.0.1"
        _, bootstrap = self.launcher.bootstrap(host=host, prefix=prefix, timeout_s=START_S)
        a = self.args
        base = ("--preset", a.preset, "--inner-steps", str(a.inner_steps), "--torch-threads", "1",
                "--eval-every", str(a.eval_every), "--eval-batches", "4", "--record-ttl-s", str(a.record_ttl_s),
                "--num-shards", str(n), "--checkpoint-every", str(a.checkpoint_every))
        for i in range(n):
            where = ("--host", self.net.host(f"peer{i}")) if self.net else ()
            proc = self.launcher.peer(f"peer{i}", bootstrap, "--shard", str(i), *where, *self.extra, rounds=0,
                                      linger_s=a.linger_s, base=base,
                                      prefix=self.net.prefix(f"peer{i}") if self.net else ())
            self.slots.append(Slot(i, proc, 0.0))
        wait_until(lambda: all(s.proc.rounds() for s in self.slots), START_S * 2,
                   "every peer to publish its first round", procs=[s.proc for s in self.slots])
        self.t0_wall = time.time()  # the clock's zero: the first incarnations count from here (lives start at 0)

    def execute(self, action: Action) -> None:
        t = self.now()
        record = {"t": t, "scheduled_s": action.at_s, "action": action.action, "peer": action.peer}
        if action.action in ("partition", "heal"):
            self.net.cut() if action.action == "partition" else self.net.heal()
        else:
            slot = self.slots[action.peer]
            if action.action == "kill":
                slot.proc.kill_group()
                slot.proc.wait(30)
                slot.lives[-1][1], slot.state = self.now(), "down"
            elif action.action == "restart":
                proc = self.launcher.restart(slot.proc, f"{slot.name}.{len(slot.procs)}")
                slot.procs.append(proc)
                slot.lives.append([self.now(), None])
                slot.state, slot.reniced = "up", False
            elif action.action == "pause":
                slot.proc.pause()
                slot.state = "paused"
            else:
                slot.proc.resume()
                slot.state = "up"
        self.executed.append(record)

    def run(self, schedule: list[Action]) -> None:
        pending = list(schedule)
        next_sample = next_status = 0.0
        while pending or self.now() < self.args.duration_s:
            t = self.now()
            while pending and pending[0].at_s <= t:
                self.execute(pending.pop(0))
            for slot in self.slots:
                if slot.state == "up" and slot.proc.returncode is not None:
                    raise RuntimeError(f"{slot.name} exited on its own:\n{slot.proc.tail()}")
                self.renice(slot)
            if t >= next_sample:
                self.sample()
                next_sample = t + self.args.sample_s
            if t >= next_status:
                self.status(pending)
                next_status = t + 1.0
            time.sleep(0.1)

    def finish(self) -> float:
        """Every peer up, then SIGUSR1 to all; returns the stop time. Waits until they have exited."""
        for slot in self.slots:
            if slot.state == "down":
                self.execute(Action(self.now(), "restart", slot.index))
            elif slot.state == "paused":
                self.execute(Action(self.now(), "resume", slot.index))
        if self.executed and self.net and sum(a["action"] == "partition" for a in self.executed) > \
                sum(a["action"] == "heal" for a in self.executed):
            self.execute(Action(self.now(), "heal"))
        for slot in self.slots:  # a peer that has not installed its signal handlers yet would die of SIGUSR1
            wait_until(lambda s=slot: len(s.proc.events("start")) >= len(s.procs), START_S,
                       f"{slot.name} to start", procs=[slot.proc])
        t_stop = self.now()
        for slot in self.slots:
            slot.proc.finish()
        for slot in self.slots:
            slot.proc.wait(self.args.linger_s + START_S)
            slot.lives[-1][1] = self.now()
        self.status([], final=True)
        return t_stop

    def renice(self, slot: Slot) -> None:
        """Once an incarnation trains (a round since its launch), lower its whole group to --nice-training: a
        process starting up then gets the CPU first, as it would on its own machine, instead of queueing
        behind the others' training on this shared one."""
        nice = self.args.nice_training
        if slot.reniced or nice <= 0 or slot.state != "up":
            return
        launched_wall = self.t0_wall + slot.lives[-1][0]
        if any(r["time"] > launched_wall for r in slot.proc.rounds()) or len(slot.procs) == 1:
            try:
                os.setpriority(os.PRIO_PGRP, slot.proc.pid, nice)
            except OSError:  # it just died: the kill will be recorded
                return
            slot.reniced = True

    # ---- watching -------------------------------------------------------------------------------------

    def sample(self) -> None:
        """Replica divergence now, from each running peer's newest checkpoint (written at a round's end)."""
        thetas, created = [], []
        for slot in self.slots:
            if slot.state != "up":
                continue
            ckpt = newest_checkpoint(slot.proc.out_dir)
            # only a checkpoint of the running incarnation says what its replica holds now
            if ckpt is not None and ckpt[1] >= self.t0_wall + slot.lives[-1][0]:
                thetas.append(ckpt[0])
                created.append(ckpt[1])
        if len(thetas) >= 2:
            mean = torch.stack(thetas).mean(0)
            div = max(float((t - mean).norm() / mean.norm()) for t in thetas)
            self.samples.append({"t": self.now(), "divergence": div, "replicas": len(thetas),
                                 "skew_s": max(created) - min(created)})

    def status(self, pending: list[Action], final: bool = False) -> None:
        t = self.now()
        parts = [f"[{t:5.0f}s/{self.args.duration_s:.0f}s]", f"faults {len(self.executed)}"]
        if pending:
            parts.append(f"next {pending[0].action} p{pending[0].peer} in {pending[0].at_s - t:.0f}s")
        for slot in self.slots:
            rounds = slot.proc.rounds()
            last = rounds[-1] if rounds else {}
            parts.append(f"{slot.name}:{slot.state} r{last.get('round', 0)} V{last.get('vv_total', 0)}")
        if self.samples:
            parts.append(f"div {self.samples[-1]['divergence']:.1e}")
        line = " | ".join(parts)
        if sys.stdout.isatty():
            sys.stdout.write("\r\x1b[K" + line + ("\n" if final else ""))
            sys.stdout.flush()
        elif final or int(t) % 30 == 0:
            print(line, flush=True)

    # ---- the report -----------------------------------------------------------------------------------

    def report(self, t_stop: float, schedule: list[Action]) -> dict:
        states = [final_state(s.proc.out_dir) for s in self.slots]
        vectors = [vv for _, vv in states]
        senders = set().union(*vectors)
        agreed = {pid: min(vv.get(pid, 0) for vv in vectors) for pid in senders}
        thetas = [theta for theta, _ in states]
        mean = torch.stack(thetas).mean(0)
        final_div = max(float((t - mean).norm() / mean.norm()) for t in thetas)
        pauses = intervals(self.executed, "pause", "resume", t_stop)
        slots, rounds_all = [], {}
        for s in self.slots:
            rounds = s.rounds(self.t0_wall)
            rounds_all[s.name] = rounds
            lives = [(a, b if b is not None else t_stop) for a, b in s.lives]
            g = measure_peer(s.index, lives, rounds, agreed, pauses.get(s.index, []), (0.0, t_stop))
            catchups, starts = ([{**e, "t": e["time"] - self.t0_wall} for e in s.proc.events(kind)]
                                for kind in ("catchup", "start"))
            g.restarts = restart_costs([a for a, _ in s.lives[1:]], rounds, catchups, starts)
            slots.append(g)
        measured = summarize(slots)
        restarts = [r for g in slots for r in g.restarts]
        steady = [r["round_s"] for rs in rounds_all.values() for r in rs if r["round"] > 1]
        phase_s = median_or(steady, 10.0)
        overhead_s = median_or((r["overhead_s"] for r in restarts), self.args.restart_overhead_s)
        published = {}
        for rs in rounds_all.values():
            for r in rs:
                published[r["peer_id"]] = max(published.get(r["peer_id"], 0), r["seq"])
        checkpoints = [c["seconds"] for s in self.slots for c in s.proc.events("checkpoint")]
        return with_replays({
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "workdir": str(self.workdir),
            "machine": {"cpus": os.cpu_count(), "loadavg_start": self.load_start, "loadavg_end": os.getloadavg()},
            "config": {k: v for k, v in vars(self.args).items() if k != "schedule" or v},
            "join_extra": self.extra, "schedule": [vars(a) for a in schedule], "executed": self.executed,
            "t_stop": t_stop, "phase_s": phase_s, "restart_overhead_s": overhead_s,
            "p2p": measured,
            "final": {"divergence": final_div,
                      "digests_equal": len({json.dumps(v, sort_keys=True) for v in vectors}) == 1,
                      "vv_totals": [sum(v.values()) for v in vectors], "published": published,
                      "lost": {pid: n - agreed.get(pid, 0) for pid, n in published.items()
                               if n > agreed.get(pid, 0)}},
            "checkpoint_s_mean": sum(checkpoints) / len(checkpoints) if checkpoints else None,
            "series": {"divergence": self.samples, "rounds": {k: [
                {f: r.get(f) for f in ("t", "round_s", "seq", "vv_total", "loss", "eval_loss", "tau", "peer_id")}
                for r in v] for k, v in rounds_all.items()}},
        })

    def close(self) -> None:
        self.launcher.__exit__(None, None, None)
        if self.net is not None:
            self.net.destroy()


def with_replays(report: dict) -> dict:
    """Add the replays of the report's own fault schedule (and with other restart overheads)."""
    replay = replay_from_report(report)
    return {**report, "replays": replays(replay), "sensitivity": sensitivity(replay)}


def newest_checkpoint(out_dir: Path | None) -> tuple[torch.Tensor, float] | None:
    """(theta, created_at) of a peer's newest checkpoint, or None (none yet, or pruned while we read)."""
    from safetensors.torch import load_file

    folder = Path(out_dir or "") / "checkpoints"
    try:
        ckpts = sorted(p for p in folder.iterdir() if p.name.startswith("ckpt-"))
        if not ckpts:
            return None
        body = json.loads((ckpts[-1] / "manifest.json").read_text())["body"]
        return load_file(str(ckpts[-1] / "state.safetensors"))["theta"], float(body["created_at"])
    except (OSError, ValueError, KeyError, RuntimeError):
        return None


def final_state(out_dir: Path | None) -> tuple[torch.Tensor, dict[str, int]]:
    folder = Path(out_dir or "")
    return torch.load(folder / "theta.pt"), json.loads((folder / "version_vector.json").read_text())["version_vector"]


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Options after -- go to every join.")
    ap.add_argument("--peers", type=int, default=4, help="learner units (default: %(default)s)")
    ap.add_argument("--duration-s", type=float, default=600, help="length of the schedule (default: %(default)s)")
    ap.add_argument("--preset", default="test", help="RunSpec preset (default: %(default)s)")
    ap.add_argument("--inner-steps", type=int, default=400, help="H (default: %(default)s)")
    ap.add_argument("--schedule", help="a JSON schedule file (see above)")
    ap.add_argument("--random", action="store_true", help="draw a random schedule (the options below)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random schedule (default: %(default)s)")
    ap.add_argument("--kill-every-s", type=float, default=120, help="mean time between kills (0: none)")
    ap.add_argument("--down-s", type=float, default=30, help="a killed peer restarts this much later")
    ap.add_argument("--pause-every-s", type=float, default=0, help="mean time between pauses (0: none)")
    ap.add_argument("--pause-s", type=float, default=20, help="length of a pause (SIGSTOP .. SIGCONT)")
    ap.add_argument("--partition-every-s", type=float, default=0, help="mean time between partitions (--netns)")
    ap.add_argument("--partition-s", type=float, default=40, help="length of a partition")
    ap.add_argument("--netns", action="store_true", help="every process in its own network namespace (root)")
    ap.add_argument("--nice-training", type=int, default=10,
                    help="niceness of peers once they train; start-ups run at 0 (0: all equal; default: %(default)s)")
    ap.add_argument("--checkpoint-every", type=int, default=1, help="rounds between checkpoints (0: none)")
    ap.add_argument("--eval-every", type=int, default=5, help="rounds between eval losses")
    ap.add_argument("--record-ttl-s", type=float, default=20, help="peer record lifetime: a dead peer's vanishes")
    ap.add_argument("--linger-s", type=float, default=180, help="at the end, wait this long for a quiet swarm")
    ap.add_argument("--sample-s", type=float, default=5, help="seconds between divergence samples")
    ap.add_argument("--restart-overhead-s", type=float, default=15,
                    help="restart overhead for the replays if no restart was measured")
    ap.add_argument("--workdir", help="keep logs, identities and replicas here (default: a temporary folder)")
    ap.add_argument("--replot", metavar="JSON", help="only redo the replays and outputs of a saved report")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "chaos"),
                    help="output prefix: OUT.json, OUT.png, OUT.md (default: %(default)s)")
    args, extra = ap.parse_known_args()
    return args, [a for a in extra if a != "--"]


def build_schedule(args: argparse.Namespace) -> list[Action]:
    if args.schedule:
        actions = load_schedule(args.schedule)
    elif args.random:
        actions = random_schedule(args.peers, args.duration_s, kill_every_s=args.kill_every_s, down_s=args.down_s,
                                  seed=args.seed, pause_every_s=args.pause_every_s, pause_s=args.pause_s,
                                  partition_every_s=args.partition_every_s, partition_s=args.partition_s)
    else:
        actions = []
    return validate_schedule(actions, args.peers, netns=args.netns)


def main() -> int:
    args, extra = parse_args()
    if args.replot:
        paths = write_outputs(with_replays(json.loads(Path(args.replot).read_text())), Path(args.out))
        print("wrote " + ", ".join(str(p) for p in paths.values()))
        return 0
    if args.netns and (reason := netns_unavailable()):
        print(f"--netns: {reason}", file=sys.stderr)
        return 2
    try:
        schedule = build_schedule(args)
    except (ValueError, KeyError, OSError) as e:
        print(f"bad schedule: {e}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="chaos-"))
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus; "
          f"workdir {workdir}\n# schedule: " + ", ".join(f"{a.action} p{a.peer}@{a.at_s:g}s" for a in schedule),
          flush=True)
    chaos = Chaos(args, workdir, extra)
    try:
        chaos.start()
        chaos.run(schedule)
        t_stop = chaos.finish()
        report = chaos.report(t_stop, schedule)
    finally:
        chaos.close()
    paths = write_outputs(report, Path(args.out))
    print("\n" + Path(paths["md"]).read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
