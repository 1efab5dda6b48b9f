"""What watching a swarm costs: training speed with the status page off, and on while it is polled hard.

    python benchmarks/bench_status.py --peers 2 --rounds 60 --repeats 3

One run alternates the two modes, repeat by repeat (off, on, off, on, ...), each time a fresh swarm on
127.0.0.1 (a bootstrap and N `p2p-diloco join` peers, the "test" preset, one torch thread each):

- **off**: no status page anywhere;
- **on, watched hard**: `--status-port 0` on every peer and on the bootstrap, and a watcher thread in this
  script that GETs `/api/status` and `/metrics` of every peer and of the bootstrap every 0.5 s while the peers
  train: 4x what one open browser tab does (the page polls `/api/status` every 2 s), plus a Prometheus scrape
  at the same rate. Each request's latency and response size are recorded; a request fails on an error, a
  status other than 200, or an `/api/status` body that is not JSON.

Reported per mode, pooled over its repeats: the median round time (`round_s`), samples/s and utilization over
every peer's rounds after the first 3 (warm-up), and the ratio on/off of those medians (the overhead); for "on"
also the median and p95 latency of `/api/status` and `/metrics`, their median sizes and the number of failed
requests (should be 0). Per-repeat medians are kept in the JSON, to show how noisy a repeat is.

The watcher runs on the same machine as the peers, so its own CPU time (HTTP client, JSON parsing) is counted
in the overhead, as a browser or Prometheus on the same host would be. Every process started here runs in its
own session and its whole group is killed when its repeat ends, whatever happened; every wait has a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP_ROUNDS = 3
POLL_S = 0.5
ENDPOINTS = ("api/status", "metrics")
MODES = ("off", "on")
MODE_NAMES = {"off": "off", "on": "on, watched hard"}


class Child:
    """One process in its own session (its DHT process and p2pd share the group); output goes to a file."""

    def __init__(self, name: str, argv: list[str], workdir: Path):
        self.name = name
        self.log_path = workdir / f"{name}.out"
        self._log = open(self.log_path, "w")  # closed in kill()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=workdir, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, n: int = 20) -> str:
        return f"--- {self.name} (rc={self.proc.poll()}) ---\n" + "\n".join(self.output().splitlines()[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def interrupt(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGINT)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group: the DHT process and p2pd go too
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2p_diloco.cli", *args]


def wait_for(condition, timeout_s: float, what: str, children: list[Child]):
    """Poll `condition` until it returns something truthy; fail on timeout or if one of `children` exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        for child in children:
            if not child.alive():
                raise RuntimeError(f"{child.name} exited while waiting for {what}\n{child.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g}s waiting for {what}\n"
                               + "\n".join(c.tail() for c in children))
        time.sleep(0.2)


def read_rounds(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:  # the line being written
            continue
        if event.get("event") == "round":
            out.append(event)
    return out


class Watcher(threading.Thread):
    """GETs every endpoint of every target every `POLL_S` (one tick: all of them, one after another) until
    stopped, recording each request's latency and size. A tick that would start late is skipped and counted."""

    def __init__(self, urls: dict[str, str]):
        super().__init__(name="status-watcher", daemon=True)
        self.urls = urls  # name -> base URL ending in "/"
        self.stop = threading.Event()
        self.samples: dict[str, list[tuple[float, int]]] = {e: [] for e in ENDPOINTS}  # (latency s, bytes)
        self.failures: list[str] = []
        self.ticks = self.skipped_ticks = 0

    def get(self, url: str, endpoint: str) -> None:
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(url + endpoint, timeout=5) as response:
                body = response.read()
                status = response.status
            latency = time.perf_counter() - t0
            if status != 200:
                raise ValueError(f"status {status}")
            if endpoint == "api/status":
                json.loads(body)
            self.samples[endpoint].append((latency, len(body)))
        except (OSError, ValueError, urllib.error.URLError) as e:
            self.failures.append(f"{url}{endpoint}: {e!r}")

    def run(self) -> None:
        next_tick = time.monotonic()
        while not self.stop.is_set():
            for url in self.urls.values():
                for endpoint in ENDPOINTS:
                    self.get(url, endpoint)
            self.ticks += 1
            next_tick += POLL_S
            now = time.monotonic()
            while next_tick < now:  # behind schedule: skip ticks rather than fire a burst
                next_tick += POLL_S
                self.skipped_ticks += 1
            self.stop.wait(next_tick - now)


def run_swarm(mode: str, args, workdir: Path) -> dict:
    """One repeat: a fresh bootstrap and `args.peers` peers; with mode "on" the status pages, watched hard."""
    on = mode == "on"
    status = ["--status-port", "0"] if on else []
    children: list[Child] = []
    watcher: Watcher | None = None
    started = time.monotonic()
    try:
        boot = Child("bootstrap", cli("bootstrap", "--host", "127.0.0.1", "--port", "0", "--report-s", "0",
                                      "--identity", str(workdir / "bootstrap.key"), *status), workdir)
        children.append(boot)
        bootstrap = wait_for(lambda: re.search(r"^bootstrap ready.*\n(/ip4/\S+)$", boot.output(), re.MULTILINE),
                             args.start_timeout_s, "the bootstrap's address", children).group(1)
        logs = []
        for i in range(args.peers):
            log = workdir / f"peer{i}.jsonl"
            logs.append(log)
            children.append(Child(f"peer{i}", cli(
                "join", "--bootstrap", bootstrap, "--preset", "test", "--identity", str(workdir / f"peer{i}.key"),
                "--json-log", str(log), "--out-dir", str(workdir / f"peer{i}-state"), "--rounds", str(args.rounds),
                "--linger-s", "10", "--torch-threads", "1", "--checkpoint-every", "0", "--shard", str(i),
                "--num-shards", str(args.peers), "--eval-every", "5", *status), workdir))
        if on:
            page = re.compile(r"^status page: (http://\S+/) ", re.MULTILINE)
            urls = {c.name: wait_for(lambda c=c: page.search(c.output()), args.start_timeout_s,
                                     f"{c.name}'s status page", children).group(1) for c in children}
            watcher = Watcher(urls)
            watcher.start()
        peers = children[1:]
        wait_for(lambda: all(len(read_rounds(log)) >= args.rounds for log in logs), args.train_timeout_s,
                 f"{args.rounds} rounds of every peer", peers)
        if watcher is not None:
            watcher.stop.set()
            watcher.join(10)
        # the peers linger (up to --linger-s 10) until the swarm is quiet, then leave; no need to wait longer
        deadline = time.monotonic() + 25
        while any(c.alive() for c in peers) and time.monotonic() < deadline:
            time.sleep(0.2)
        rounds = [r for log in logs for r in read_rounds(log)[WARMUP_ROUNDS:args.rounds]]
        result = {
            "mode": mode,
            "rounds_counted": len(rounds),
            "round_s": statistics.median(r["round_s"] for r in rounds),
            "samples_per_s": statistics.median(r["samples_per_s"] for r in rounds),
            "utilization": statistics.median(r["utilization"] for r in rounds),
            "raw": {k: [r[k] for r in rounds] for k in ("round_s", "samples_per_s", "utilization")},
            "wall_s": time.monotonic() - started,
        }
        if watcher is not None:
            result["requests"] = {e: {"latency_s": [s[0] for s in watcher.samples[e]],
                                      "bytes": [s[1] for s in watcher.samples[e]]} for e in ENDPOINTS}
            result["failed_requests"] = len(watcher.failures)
            result["failures"] = watcher.failures[:20]
            result["watch_ticks"] = watcher.ticks
            result["skipped_ticks"] = watcher.skipped_ticks
        return result
    finally:
        if watcher is not None:
            watcher.stop.set()
            watcher.join(10)
        for child in children:
            child.interrupt()
        deadline = time.monotonic() + 5
        while any(c.alive() for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        for child in children:
            child.kill()


def p95(values: list[float]) -> float:
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=20, method="inclusive")[18]


def summarize(runs: list[dict]) -> dict:
    out: dict = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        if not mine:
            continue
        pooled = {k: [v for r in mine for v in r["raw"][k]] for k in ("round_s", "samples_per_s", "utilization")}
        m = {"name": MODE_NAMES[mode], "repeats": len(mine), "rounds_counted": len(pooled["round_s"]),
             **{f"median_{k}": statistics.median(v) for k, v in pooled.items()},
             "per_repeat": [{k: r[k] for k in ("round_s", "samples_per_s", "utilization", "wall_s")} for r in mine]}
        if mode == "on":
            for e in ENDPOINTS:
                lat = [v * 1e3 for r in mine for v in r["requests"][e]["latency_s"]]
                size = [v for r in mine for v in r["requests"][e]["bytes"]]
                m[e] = {"requests": len(lat), "median_latency_ms": statistics.median(lat) if lat else None,
                        "p95_latency_ms": p95(lat) if lat else None, "max_latency_ms": max(lat) if lat else None,
                        "median_bytes": statistics.median(size) if size else None}
            m["failed_requests"] = sum(r["failed_requests"] for r in mine)
            m["failures"] = [f for r in mine for f in r["failures"]][:20]
            m["skipped_ticks"] = sum(r["skipped_ticks"] for r in mine)
            m["watch_ticks"] = sum(r["watch_ticks"] for r in mine)
        out[mode] = m
    if "off" in out and "on" in out:
        out["ratio_on_off"] = {k: out["on"][f"median_{k}"] / out["off"][f"median_{k}"]
                               for k in ("round_s", "samples_per_s", "utilization")}
    return out


def table(summary: dict) -> str:
    def ms(m: dict, e: str) -> str:
        s = m.get(e)
        return f"{s['median_latency_ms']:.1f} / {s['p95_latency_ms']:.1f}" if s and s["requests"] else "-"

    def size(m: dict, e: str) -> str:
        s = m.get(e)
        return f"{s['median_bytes']:,.0f}" if s and s["requests"] else "-"

    lines = ["| mode | round time (s) | samples/s | utilization | /api/status ms (median / p95) | "
             "/metrics ms (median / p95) | /api/status bytes | /metrics bytes | requests (failed) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode in MODES:
        if mode not in summary:
            continue
        m = summary[mode]
        reqs = (f"{sum(m[e]['requests'] for e in ENDPOINTS)} ({m['failed_requests']})" if mode == "on" else "-")
        lines.append(f"| {m['name']} | {m['median_round_s']:.3f} | {m['median_samples_per_s']:.1f} | "
                     f"{m['median_utilization']:.1%} | {ms(m, 'api/status')} | {ms(m, 'metrics')} | "
                     f"{size(m, 'api/status')} | {size(m, 'metrics')} | {reqs} |")
    if "ratio_on_off" in summary:
        r = summary["ratio_on_off"]
        lines.append(f"| on / off | {r['round_s']:.3f}x | {r['samples_per_s']:.3f}x | {r['utilization']:.3f}x "
                     f"| | | | | |")
    return "\n".join(lines)


def git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=2, help="peers per swarm (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=60, help="outer rounds per peer (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each mode, alternating (default: "
                                                               "%(default)s)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "status-overhead.json"),
                        help="JSON results (default: %(default)s)")
    parser.add_argument("--workdir", help="keep logs here (default: a temporary folder)")
    parser.add_argument("--start-timeout-s", type=float, default=90, help="wait for a process's address or page")
    parser.add_argument("--train-timeout-s", type=float, default=300, help="wait for the peers' rounds")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks (the kills) on SIGTERM too
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="p2p-diloco-bench-status-"))
    command = shlex.join(["python", os.path.relpath(sys.argv[0], ROOT) if Path(sys.argv[0]).is_absolute()
                          else sys.argv[0], *sys.argv[1:]])
    load_before = os.getloadavg()
    started = time.monotonic()
    runs = []
    print(f"workdir {workdir}", flush=True)
    for rep in range(args.repeats):
        for mode in MODES:
            folder = workdir / f"rep{rep}-{mode}"
            folder.mkdir(parents=True, exist_ok=True)
            run = run_swarm(mode, args, folder)
            runs.append(run)
            extra = (f", {sum(len(run['requests'][e]['latency_s']) for e in ENDPOINTS)} requests, "
                     f"{run['failed_requests']} failed, {run['skipped_ticks']} ticks skipped" if mode == "on" else "")
            print(f"repeat {rep + 1}/{args.repeats} {MODE_NAMES[mode]:<17} round {run['round_s']:.3f}s  "
                  f"{run['samples_per_s']:.1f} samples/s  utilization {run['utilization']:.1%}  "
                  f"({run['rounds_counted']} rounds, {run['wall_s']:.0f}s{extra})", flush=True)
    summary = summarize(runs)
    text = table(summary)
    print("\n" + text)
    result = {
        "command": command,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "code": {"git_head": git_head(), "pythonpath": os.environ.get("PYTHONPATH", "")},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "settings": {"peers": args.peers, "rounds": args.rounds, "repeats": args.repeats,
                     "warmup_rounds_dropped": WARMUP_ROUNDS, "poll_s": POLL_S, "preset": "test", "torch_threads": 1},
        "wall_s": time.monotonic() - started,
        "modes": summary,
        "table": text,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
