"""Over the internet in network namespaces (issue 12's benchmark): 4 peers, 2 behind NAT, uplinks capped.

    sudo .venv/bin/python benchmarks/bench_netns_caps.py                 # small preset, caps 100, 20, 5 Mbit/s
    sudo .venv/bin/python benchmarks/bench_netns_caps.py --quick         # tiny preset, to try the script
    .venv/bin/python benchmarks/bench_netns_caps.py --table              # only rewrite the table from the JSON

Per cap, a fresh tests/helpers/netns.py topology: a public bootstrap (uncapped: it is the relay), peers `a`, `b`
behind their own NAT (MASQUERADE, unsolicited inbound dropped) and `p`, `q` with public addresses, every
peer's uplink capped at the cap (tc tbf). All run the README's plain `join --bootstrap ADDR` (reachability
auto) for --rounds rounds of H inner steps on their own data shard. The `small` preset's H=100 is too long for
a 2-core machine that runs 4 peers at once, so H is --inner-steps (default 10) and the run is a few rounds.

Measured, from the peers' JSON logs (tests/helpers/swarm.py Launcher):
- utilization: the round event's `utilization` at the last counted round (compute seconds / seconds since
  training began; eval pauses and anything else that is not an inner step count as idle);
- time to target: the first round event whose `eval_loss` is <= the target, minus the moment the swarm began
  training (the earliest peer's start of training). The target is chosen from the run: the highest last eval
  loss among the peers of the fastest cap (each of them reaches it by its last eval; at a slower cap a peer
  whose updates lag may not: None);
- join -> first merged update of each NATed peer: from its launch to its first round event (its first update),
  and from that to the first round event of every other peer whose version vector holds it (bounds: round
  events are the only clock we have on the receiving side);
- state sync, direct vs through the relay (at --sync-at caps, after the counted rounds, while a and b train
  on): a NATed joiner `jd` syncs while the public peers run (donors rank public first: it dials one directly);
  then p and q are killed, their records expire, and a NATed joiner `jr` syncs from a NATed donor, which it can
  only reach through the bootstrap's relay. Seconds and bytes from its `sync` event; the bootstrap's relay
  counter (`--report-s`) says how many bytes it forwarded meanwhile.

Modeled (analytic, the same caps): synchronous DiLoCo and data-parallel, from each peer's measured compute
seconds per inner step in the p2p run at that cap and the bytes each must move over the capped uplink (ring
all-reduce: 2(N-1)/N x payload per peer). Sync DiLoCo all-reduces the same codec's payload after every H steps
and waits for the slowest peer (no overlap); data-parallel all-reduces fp32 gradients every step, overlapped
with compute (max of the two: optimistic for DP, as in sim/scale_baselines.py). Steps to the target are taken
equal to p2p-diloco's at the same token budget (assumption: the same tokens reach the same loss whichever
method); NAT traversal is free for them, and they have no eval pauses.

Writes OUT.json (the rows: cap_mbit, method, peer, nat, utilization, time_to_target_s), OUT_extra.json
(everything else) and OUT.md (the table, with the command and the date; `--table` rebuilds it from the JSON).
Namespaces and processes are always cleaned up. Needs root, `ip`, `iptables`, `tc`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.helpers: the namespaces and the process launcher the netns tests use

from tests.helpers.netns import NatTopology, nat_unavailable  # noqa: E402
from tests.helpers.swarm import Launcher, Proc, WaitTimeout, wait_until  # noqa: E402

TRAINERS = {"a": "nat", "b": "nat", "p": "public", "q": "public"}
JOINERS = {"jd": "nat", "jr": "nat"}
RESULTS = ROOT / "benchmarks" / "results"
START_S = 300.0  # four peers starting at once on two cores, with margin
METHODS = ("p2p-diloco", "sync-diloco", "data-parallel")
ROW_KEYS = ("cap_mbit", "method", "peer", "nat", "utilization", "time_to_target_s")
INFO_KEYS = ("command", "date", "wall_s", "machine", "preset", "inner_steps", "rounds", "eval_every", "eval_batches",
             "workdir")


# ---------------------------------------------------------------------------------------------- one cap


class CapRun:
    """One cap's topology, swarm and measurements."""

    def __init__(self, cap: float, args: argparse.Namespace, workdir: Path):
        self.cap, self.args, self.workdir = cap, args, workdir
        self.procs: dict[str, Proc] = {}
        self.launched: dict[str, float] = {}  # wall time of each launch
        self.t_begin = time.time()
        self.load_start = self.load_counted = os.getloadavg()[0]
        self.phase = "starting"
        self.next_status = 0.0
        self.relay_samples: list[tuple[float, int, float]] = []  # (wall, streams, MB) from the bootstrap's report

    def base_args(self, shard: int) -> tuple[str, ...]:
        a = self.args
        return ("--preset", a.preset, "--inner-steps", str(a.inner_steps), "--torch-threads", "1",
                "--eval-every", str(a.eval_every), "--eval-batches", str(a.eval_batches), "--record-ttl-s", "12",
                "--num-shards", str(len(TRAINERS)), "--shard", str(shard))

    def run(self) -> dict:
        members = {"boot": "public", **TRAINERS, **JOINERS}
        caps = {m: self.cap for m in members if m != "boot"}
        with NatTopology(members, caps) as topo, Launcher(self.workdir) as launcher:
            self.topo, self.launcher = topo, launcher
            boot, _ = launcher.bootstrap(host="0.0.0.0", prefix=topo.prefix("boot"), extra=("--report-s", "2"),
                                         timeout_s=START_S)
            self.boot = boot
            prefix = f"/ip4/{topo.host('boot')}/"
            self.address = wait_until(lambda: next((ln for ln in boot.output().splitlines()
                                                    if ln.startswith(prefix)), None), 30, "the bootstrap's address",
                                      procs=[boot])
            for i, name in enumerate(TRAINERS):
                self.launch(name, shard=i, rounds=0)
            self.phase = "training"
            rounds = self.args.rounds
            self.wait(lambda: all(len(self.counted(n)) >= rounds for n in TRAINERS),
                      START_S + rounds * self.args.round_timeout_s, f"every peer to train {rounds} rounds",
                      list(TRAINERS))
            self.t_counted = time.time()
            self.load_counted = os.getloadavg()[0]
            syncs = self.state_syncs() if self.cap in self.args.sync_at else []
            self.phase = "done"
            self.status(final=True)
            return self.measure(syncs)

    def launch(self, name: str, *, shard: int, rounds: int) -> Proc:
        proc = self.launcher.peer(name, self.address, rounds=rounds, linger_s=30, base=self.base_args(shard),
                                  prefix=self.topo.prefix(name))
        self.procs[name] = proc
        self.launched[name] = time.time()
        return proc

    def counted(self, name: str) -> list[dict]:
        """The round events that count: the first --rounds of them."""
        return self.procs[name].rounds()[:self.args.rounds]

    def wait(self, condition, timeout_s: float, what: str, names: list[str]) -> Any:
        procs = [self.procs[n] for n in names]

        def check():
            self.status()
            return condition()

        return wait_until(check, timeout_s, what, procs=procs, interval_s=0.5)

    # ---- state sync, direct and through the relay ---------------------------------------------------------

    def state_syncs(self) -> list[dict]:
        out = []
        self.phase = "sync jd (public donor)"
        out.append(self.sync_joiner("jd", shard=0))
        for name in ("p", "q"):  # the public donors go; their records expire (--record-ttl-s 12)
            self.procs[name].kill_group()
            self.procs[name].wait(30)
        self.phase = "waiting for p, q's records to expire"
        deadline = time.time() + 16
        self.wait(lambda: time.time() > deadline, 30, "records to expire", ["a", "b"])
        self.phase = "sync jr (NATed donor, relayed)"
        out.append(self.sync_joiner("jr", shard=1))
        return out

    def sync_joiner(self, name: str, *, shard: int) -> dict:
        """Launch a NATed joiner, wait for its `sync` event or its exit (a sync that failed: recorded, not
        fatal), then stop it."""
        before = self.relay_counter()
        proc = self.launch(name, shard=shard, rounds=1)
        try:
            event = self.wait(lambda: (proc.events("sync") or [None])[-1] or proc.returncode is not None,
                              self.args.sync_timeout_s, f"{name}'s state sync", ["a", "b"])
        except WaitTimeout:  # still syncing: recorded as not done in time, the benchmark goes on
            event = None
        after = self.relay_counter()
        event = event if isinstance(event, dict) else None
        rc = proc.returncode
        proc.kill_group()  # its training would only load the CPU the others train on
        proc.wait(30)
        ids = self.peer_ids()
        out = {"joiner": name, "joiner_reach": self.reach(name), "ok": event is not None,
               "exit_code": rc if event is None else None, "timed_out": event is None and rc is None,
               **joiner_waits(proc.output(), proc.events(), self.launched[name]),
               "error": None if event is not None else next(
                   (ln[:400] for ln in reversed(proc.output().splitlines()) if "error" in ln.lower()), None),
               "relay_mb_during": None if before is None or after is None else after[1] - before[1],
               "relay_streams_during": None if before is None or after is None else after[0] - before[0]}
        if event is None:
            return {**out, "donor": None, "donor_nat": None, "path": "relay" if name == "jr" else "direct",
                    "bytes": None, "seconds": None, "mb_per_s": None}
        donor = next((n for n, pid in ids.items() if pid == event.get("donor")), event.get("donor"))
        return {**out, "donor": donor, "donor_nat": TRAINERS.get(donor) == "nat" if donor in TRAINERS else None,
                "path": "relay" if TRAINERS.get(donor) == "nat" else "direct",
                "bytes": event["bytes"], "seconds": event["seconds"],
                "mb_per_s": event["bytes"] / 1e6 / max(event["seconds"], 1e-9),
                "vv_total": event.get("vv_total"), "candidates": event.get("candidates")}

    def relay_counter(self) -> tuple[int, float] | None:
        found = re.findall(r"relayed streams (\d+) \(([\d.]+) MB\)", self.boot.output())
        return (int(found[-1][0]), float(found[-1][1])) if found else None

    # ---- watching -----------------------------------------------------------------------------------------

    def status(self, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now < self.next_status:
            return
        self.next_status = now + 1.0
        parts = [f"[{self.cap:g} Mbit/s {time.time() - self.t_begin:5.0f}s] {self.phase}"]
        for name in self.procs:
            rounds = self.procs[name].rounds()
            last = rounds[-1] if rounds else {}
            util = last.get("utilization")
            parts.append(f"{name}:r{last.get('round', 0)} V{last.get('vv_total', 0)}"
                         + (f" u{util:.2f}" if util is not None else ""))
        relay = self.relay_counter()
        if relay:
            parts.append(f"relay {relay[0]} ({relay[1]:.0f} MB)")
        line = " | ".join(parts)
        if sys.stdout.isatty():
            sys.stdout.write("\r\x1b[K" + line[:250] + ("\n" if final else ""))
            sys.stdout.flush()
        elif final or int(time.time() - self.t_begin) % 15 == 0:
            print(line, flush=True)

    # ---- measurements -------------------------------------------------------------------------------------

    def peer_ids(self) -> dict[str, str]:
        return {n: p.events("start")[0]["peer_id"] for n, p in self.procs.items() if p.events("start")}

    def reach(self, name: str) -> str | None:
        events = self.procs[name].events("reach")
        return events[0]["reach"] if events else None

    def numel(self) -> int:
        for proc in self.procs.values():
            found = re.search(r"([\d,]+) parameters", proc.output())
            if found:
                return int(found.group(1).replace(",", ""))
        raise RuntimeError("no peer printed its parameter count")

    def measure(self, syncs: list[dict]) -> dict:
        ids = self.peer_ids()
        peers = {}
        for name in TRAINERS:
            rounds = self.counted(name)
            first = rounds[0]
            peers[name] = {
                "nat": TRAINERS[name] == "nat", "reach": self.reach(name), "peer_id": ids.get(name),
                "launched": self.launched[name],
                "started": (self.procs[name].events("start") or [{}])[0].get("time"),
                # when training began: utilization = compute_s / (now - began)
                "training_began": first["time"] - first["compute_s"] / max(first["utilization"], 1e-9),
                "rounds": [{k: r.get(k) for k in ("time", "round", "step", "round_s", "compute_s", "utilization",
                                                  "eval_loss", "loss", "seq", "vv", "vv_total", "bytes_sent",
                                                  "bytes_received", "tau", "peers")} for r in rounds]}
        return {"cap_mbit": self.cap, "peers": peers, "syncs": syncs, "numel": self.numel(),
                "loadavg_1m": {"start": self.load_start, "counted": self.load_counted},
                "relay_at_end": self.relay_counter(), "counted_until": self.t_counted}


def joiner_waits(output: str, events: list[dict], launched: float | None) -> dict:
    """What a state sync's own `seconds` (its last attempt only) leave out: donors dropped, failed attempts, and
    the wall time from the joiner's launch and its start event to the sync event."""
    start = next((e["time"] for e in events if e["event"] == "start"), None)
    sync = next((e["time"] for e in events if e["event"] == "sync"), None)
    return {"donors_dropped": output.count("state sync donor dropped"),
            "donors_dropped_busy": len(re.findall(r"state sync donor dropped .*failed: busy", output)),
            "attempts_failed": output.count("state sync failed, retrying"),
            "launch_to_sync_s": None if launched is None or sync is None else round(sync - launched, 1),
            "start_to_sync_s": None if start is None or sync is None else round(sync - start, 1)}


def enrich_syncs(caps: list[dict], workdir: Path) -> None:
    """Add joiner_waits to the state syncs of a run measured before they were recorded (from its logs)."""
    for cap in caps:
        for sync in cap.get("syncs", []):
            if "donors_dropped" in sync:
                continue
            folder = workdir / f"cap{cap['cap_mbit']:g}"
            out = (folder / f"{sync['joiner']}.out").read_text(errors="replace")
            events = [json.loads(line) for line in (folder / f"{sync['joiner']}.jsonl").read_text().splitlines()
                      if line.strip()]
            sync.update(joiner_waits(out, events, None))


# ---------------------------------------------------------------------------------------------- analysis


def last_eval(rounds: list[dict]) -> float | None:
    evals = [r["eval_loss"] for r in rounds if r.get("eval_loss") is not None]
    return evals[-1] if evals else None


def choose_target(caps: list[dict]) -> float | None:
    """The highest last eval loss among the fastest cap's peers: the loss the least constrained run reaches by
    its last eval on every peer (the highest, not the mean: peers' evals differ by a few hundredths)."""
    if not caps:
        return None
    fastest = max(caps, key=lambda c: c["cap_mbit"])
    finals = [v for v in (last_eval(p["rounds"]) for p in fastest["peers"].values()) if v is not None]
    return max(finals) if finals else None


def reached(rounds: list[dict], target: float) -> dict | None:
    return next((r for r in rounds if r.get("eval_loss") is not None and r["eval_loss"] <= target), None)


def p2p_rows(cap: dict, target: float | None) -> tuple[list[dict], dict]:
    """The measured rows of one cap, and what the models need from it (steps to the target, per-step compute)."""
    t0 = min(p["training_began"] for p in cap["peers"].values())
    rows, steps_at_target, step_s = [], [], {}
    for name, p in cap["peers"].items():
        last = p["rounds"][-1]
        hit = reached(p["rounds"], target) if target is not None else None
        if hit is not None:
            steps_at_target.append(hit["step"])
        step_s[name] = last["compute_s"] / max(last["step"], 1)  # fresh peers: steps and compute since training
        rows.append({"cap_mbit": cap["cap_mbit"], "method": "p2p-diloco", "peer": name, "nat": p["nat"],
                     "utilization": round(last["utilization"], 4),
                     "time_to_target_s": None if hit is None else round(hit["time"] - t0, 1)})
    return rows, {"steps_to_target": statistics.median(steps_at_target) if steps_at_target else None,
                  "step_s": step_s, "t0": t0}


def ring_bytes(n: int, payload: float) -> float:
    """Bytes each peer sends in a ring all-reduce of `payload` bytes among n peers."""
    return 2 * (n - 1) / n * payload if n > 1 else 0.0


def model_rows(cap: dict, measured: dict, steps_to_target: float | None, payload_bytes: int, H: int) -> tuple[
        list[dict], dict]:
    """Sync DiLoCo and data-parallel at this cap, from the measured per-step compute (see the module doc)."""
    n, mbit = len(cap["peers"]), cap["cap_mbit"]
    step_s = measured["step_s"]
    slowest = max(step_s.values())
    link = mbit * 1e6 / 8  # bytes per second
    diloco_comm = ring_bytes(n, payload_bytes) / link
    diloco_round = H * slowest + diloco_comm
    dp_comm = ring_bytes(n, 4 * cap["numel"]) / link
    dp_step = max(slowest, dp_comm)
    rows = []
    for name, p in cap["peers"].items():
        rounds_needed = None if steps_to_target is None else math.ceil(steps_to_target / H)
        rows.append({"cap_mbit": mbit, "method": "sync-diloco", "peer": name, "nat": p["nat"],
                     "utilization": round(H * step_s[name] / diloco_round, 4),
                     "time_to_target_s": None if rounds_needed is None else round(rounds_needed * diloco_round, 1)})
    for name, p in cap["peers"].items():
        rows.append({"cap_mbit": mbit, "method": "data-parallel", "peer": name, "nat": p["nat"],
                     "utilization": round(step_s[name] / dp_step, 4),
                     "time_to_target_s": None if steps_to_target is None else round(steps_to_target * dp_step, 1)})
    return rows, {"sync_diloco": {"allreduce_s": diloco_comm, "round_s": diloco_round,
                                  "bytes_per_peer_per_round": ring_bytes(n, payload_bytes)},
                  "data_parallel": {"allreduce_s_per_step": dp_comm, "step_s": dp_step,
                                    "bytes_per_peer_per_step": ring_bytes(n, 4 * cap["numel"])},
                  "slowest_step_s": slowest}


def time_split(rounds: list[dict]) -> dict:
    """Where a peer's wall time since training began went, up to its last counted round: inner steps, the rest
    of its phases (finishing, compressing, signing, merging its own update), and between phases (eval, hooks)."""
    last = rounds[-1]
    wall = last["compute_s"] / max(last["utilization"], 1e-9)
    phases = sum(r["round_s"] for r in rounds)
    return {"wall_s": round(wall, 1), "inner_steps": round(last["compute_s"] / wall, 4),
            "rest_of_phase": round((phases - last["compute_s"]) / wall, 4),
            "between_phases": round((wall - phases) / wall, 4),
            "utilization_without_between": round(last["compute_s"] / phases, 4)}


def delivery(cap: dict) -> dict:
    """Every counted update of every peer: publish (its round event) -> the first round event of each other peer
    whose vector holds it, by path (sender -> receiver, NATed or public). An upper bound on delivery: receivers
    log their vectors once a round. Updates no receiver's counted rounds hold yet are left out (counted apart)."""
    peers = cap["peers"]
    out: dict[str, list[float]] = {}
    missing: dict[str, int] = {}
    next_round: dict[str, list[bool]] = {}  # held at the receiver's first round event after the publish?
    for name, p in peers.items():
        for r in p["rounds"]:
            for other, q in peers.items():
                if other == name:
                    continue
                path = f"{'nat' if p['nat'] else 'public'}->{'nat' if q['nat'] else 'public'}"
                after = next((x for x in q["rounds"] if x["time"] >= r["time"]), None)
                if after is not None:
                    next_round.setdefault(path, []).append((after.get("vv") or {}).get(p["peer_id"], 0) >= r["seq"])
                got = next((x["time"] for x in q["rounds"] if x["time"] >= r["time"]
                            and (x.get("vv") or {}).get(p["peer_id"], 0) >= r["seq"]), None)
                if got is None:
                    missing[path] = missing.get(path, 0) + 1
                else:
                    out.setdefault(path, []).append(got - r["time"])
    return {path: {"updates": len(v), "median_s": round(statistics.median(v), 1), "max_s": round(max(v), 1),
                   "not_held_by_end": missing.get(path, 0),
                   "held_at_next_round_event": round(sum(next_round.get(path, [])) / max(len(next_round.get(
                       path, [])), 1), 3)} for path, v in sorted(out.items())}


def first_merges(cap: dict) -> list[dict]:
    """For each NATed peer: launch -> its first update (first round event) -> the first round event of each
    other peer whose vector holds it (`merged_by_s`, an upper bound: receivers log once a round), and in which
    of the receiver's rounds: `rounds_late` 0 = held already when the receiver's round that was running at the
    publish ended, 1 = at the end of the next one (within one round), ..."""
    out = []
    peers = cap["peers"]
    for name, p in peers.items():
        if not p["nat"] or not p["rounds"]:
            continue
        published = p["rounds"][0]["time"]
        pid = p["peer_id"]
        receivers = {}
        for other, q in peers.items():
            if other == name:
                continue
            after = [r for r in q["rounds"] if r["time"] >= published]
            late = next((i for i, r in enumerate(after) if (r.get("vv") or {}).get(pid, 0) >= 1), None)
            receivers[other] = {"nat": q["nat"], "rounds_late": late,
                                "merged_by_s": None if late is None else round(after[late]["time"] - published, 1)}
        held = [v for v in receivers.values() if v["rounds_late"] is not None]
        first = min(held, key=lambda v: v["merged_by_s"]) if held else None
        round_s = statistics.median(r["round_s"] for r in p["rounds"])
        out.append({"peer": name, "launch_to_start_s": None if p["started"] is None else
                    round(p["started"] - p["launched"], 1),
                    "launch_to_first_update_s": round(published - p["launched"], 1),
                    "publish_to_first_merge_by_s": None if first is None else first["merged_by_s"],
                    "launch_to_first_merge_by_s": None if first is None else
                    round(first["merged_by_s"] + published - p["launched"], 1),
                    "round_s": round(round_s, 1),
                    "first_merge_within_one_round": None if first is None else first["rounds_late"] <= 1,
                    "all_within_one_round": len(held) == len(receivers) and all(v["rounds_late"] <= 1 for v in held),
                    "receivers": receivers})
    return out


def analyze(caps: list[dict], args_info: dict) -> tuple[list[dict], dict]:
    from p2p_diloco.config.presets import preset
    from p2p_diloco.wire.codecs import get_codec

    spec = preset(args_info["preset"])
    H = args_info["inner_steps"]
    target = choose_target(caps)
    rows: list[dict] = []
    per_cap = []
    measured_by_cap = {}
    for cap in caps:
        r, m = p2p_rows(cap, target)
        rows += r
        measured_by_cap[cap["cap_mbit"]] = m
    # The baselines' steps to the target: p2p-diloco's at the fastest cap, where its updates arrive in time, so
    # that a method's number of steps does not depend on the cap (synchronous methods merge every update).
    fastest = max(caps, key=lambda c: c["cap_mbit"])["cap_mbit"] if caps else None
    steps = measured_by_cap[fastest]["steps_to_target"] if caps else None
    for cap in caps:
        m = measured_by_cap[cap["cap_mbit"]]
        payload = get_codec(spec.outer.codec, spec.outer.codec_block).payload_bytes(cap["numel"])
        r, model = model_rows(cap, m, steps, payload, H)
        rows += r
        peers = cap["peers"]
        per_cap.append({
            "cap_mbit": cap["cap_mbit"], "numel": cap["numel"], "codec": spec.outer.codec, "payload_bytes": payload,
            "reach": {n: p["reach"] for n, p in peers.items()},
            "steps_to_target_baselines": steps, "steps_to_target_p2p_here": m["steps_to_target"],
            "compute_s_per_step": {n: round(v, 3) for n, v in m["step_s"].items()},
            "time_split": {n: time_split(p["rounds"]) for n, p in peers.items()},
            "models": model,
            "mean_round_s": {n: round(statistics.mean(r["round_s"] for r in p["rounds"]), 1)
                             for n, p in peers.items()},
            "steps": {n: p["rounds"][-1]["step"] for n, p in peers.items()},
            "eval_curves": {n: [[round(r["time"] - m["t0"], 1), r["step"], r["eval_loss"]] for r in p["rounds"]
                                if r.get("eval_loss") is not None] for n, p in peers.items()},
            "mbytes_sent": {n: round(p["rounds"][-1]["bytes_sent"] / 1e6, 1) for n, p in peers.items()},
            "mbytes_received": {n: round(p["rounds"][-1]["bytes_received"] / 1e6, 1) for n, p in peers.items()},
            "final_vv_total": {n: p["rounds"][-1]["vv_total"] for n, p in peers.items()},
            "first_merge_of_nat_peers": first_merges(cap),
            "update_delivery_by_s": delivery(cap),
            "state_sync": cap["syncs"],
            "relay_at_end": cap["relay_at_end"], "loadavg_1m": cap.get("loadavg_1m")})
    extra = {**args_info, "target_eval_loss": target,
             "target_rule": "the highest last eval loss among the peers at the fastest cap: each of them reaches "
                            "it by its last counted eval",
             "assumptions": [
                 "sync-diloco and data-parallel are modeled, not run: each peer's compute seconds per inner step "
                 "are the ones it measured in the p2p-diloco run at the same cap (4 peers sharing the machine's "
                 "cores), every step waits for the slowest peer",
                 "steps to the target for sync-diloco and data-parallel = p2p-diloco's at the same token budget: "
                 "the median peer's inner steps when it first reached the target at the fastest cap, where its "
                 "updates arrive in time, used at every cap (synchronous methods merge every update, so their "
                 "steps do not depend on the cap); a data-parallel step of N peers moves N batches, so the same "
                 "number of steps",
                 "ring all-reduce: each peer sends 2(N-1)/N x payload over its capped uplink; sync-diloco sends "
                 "the run's codec payload after every H steps, not overlapped; data-parallel sends fp32 "
                 "gradients every step, overlapped with compute (step = max(compute, all-reduce), optimistic)",
                 "the baselines cross NAT for free and pause for no eval; p2p-diloco's utilization counts its "
                 "eval pauses as idle"],
             "caps": per_cap}
    return rows, extra


# ---------------------------------------------------------------------------------------------- outputs


def fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return format(v, spec)


def table(rows: list[dict], extra: dict) -> str:
    out = ["# Over the internet: capped uplinks, NAT (benchmarks/bench_netns_caps.py)", "",
           f"`{extra.get('command', '')}`, {extra.get('date', '')}; {extra.get('machine', '')}", "",
           f"4 peers (a, b behind NAT; p, q public) + a public bootstrap (the relay, uncapped), preset "
           f"`{extra.get('preset')}` with H={extra.get('inner_steps')} (the preset's own H is shortened for this "
           f"machine), {extra.get('rounds')} rounds per cap, eval every {extra.get('eval_every')} rounds. "
           f"Target eval loss {fmt(extra.get('target_eval_loss'), '.3f')} ({extra.get('target_rule')}). "
           "Time to target counts from the moment the swarm began training. p2p-diloco is measured; "
           "sync-diloco and data-parallel are modeled from the measured compute per step and the caps "
           "(assumptions below).", "",
           "| cap Mbit/s | method | peer | NAT | utilization | time to target s |", "|---|---|---|---|---|---|"]
    order = {m: i for i, m in enumerate(METHODS)}
    for r in sorted(rows, key=lambda r: (-r["cap_mbit"], order.get(r["method"], 9), r["peer"])):
        out.append(f"| {r['cap_mbit']:g} | {r['method']} | {r['peer']} | {fmt(r['nat'])} | "
                   f"{fmt(r['utilization'], '.3f')} | {fmt(r['time_to_target_s'], '.0f')} |")
    out += ["", "## State sync: direct vs through the relay", "",
            "`seconds` is the sync's last attempt (what its `sync` event says); donors dropped / attempts failed "
            "and the wall time from the joiner's start event to its sync event show what came before it.", "",
            "| cap Mbit/s | joiner | donor | path | MB | seconds | MB/s | donors dropped (busy) | attempts failed "
            "| start -> synced s | relay MB meanwhile |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in extra.get("caps", []):
        for s in c.get("state_sync", []):
            if not s.get("ok", True):
                out.append(f"| {c['cap_mbit']:g} | {s['joiner']} ({s['joiner_reach']}) | - | {s['path']} (intended) | "
                           + ("not synced in time" if s.get("timed_out") else f"FAILED: exit {s.get('exit_code')}")
                           + f" | - | - | {fmt(s.get('donors_dropped'))} "
                           f"({fmt(s.get('donors_dropped_busy'))}) | {fmt(s.get('attempts_failed'))} | - | "
                           f"{fmt(s['relay_mb_during'], '.1f')} |")
                continue
            out.append(f"| {c['cap_mbit']:g} | {s['joiner']} ({s['joiner_reach']}) | {s['donor']} | {s['path']} | "
                       f"{s['bytes'] / 1e6:.1f} | {s['seconds']:.1f} | {s['mb_per_s']:.2f} | "
                       f"{fmt(s.get('donors_dropped'))} ({fmt(s.get('donors_dropped_busy'))}) | "
                       f"{fmt(s.get('attempts_failed'))} | {fmt(s.get('start_to_sync_s'), '.0f')} | "
                       f"{fmt(s['relay_mb_during'], '.1f')} |")
    out += ["", "An outer update is one payload of the same bytes over the same path: at the MB/s above, "
            + ", ".join(f"{c['payload_bytes'] / 1e6:.1f} MB at {c['cap_mbit']:g} Mbit/s"
                        for c in extra.get("caps", [])) + ".",
            "", "Outer updates in the run, publish -> held by the receiver's next round event (an upper bound; "
            "median / max s, by path, and the share held already at the receiver's first round event after the "
            "publish; NATed pairs go through the relay or another peer):", ""]
    for c in extra.get("caps", []):
        paths = c.get("update_delivery_by_s", {})
        out.append(f"- {c['cap_mbit']:g} Mbit/s: " + "; ".join(
            f"{k} {v['median_s']:.0f}/{v['max_s']:.0f} s, {100 * v['held_at_next_round_event']:.0f}% "
            f"({v['updates']} updates)" for k, v in paths.items()))
    out += ["", "## Join -> first merged update of a NATed peer", "",
            "Receivers log their vectors once a round, so the merge time is an upper bound; `within one round`: "
            "held by the end of the receiver's round after the one running at the publish (first receiver / "
            "every receiver).", "",
            "| cap Mbit/s | peer | launch -> its first update s | -> first merge by another peer s (at most) "
            "| its round s | within one round (first / all) |", "|---|---|---|---|---|---|"]
    for c in extra.get("caps", []):
        for f in c.get("first_merge_of_nat_peers", []):
            out.append(f"| {c['cap_mbit']:g} | {f['peer']} | {fmt(f['launch_to_first_update_s'], '.0f')} | "
                       f"{fmt(f['publish_to_first_merge_by_s'], '.0f')} | {fmt(f['round_s'], '.0f')} | "
                       f"{fmt(f['first_merge_within_one_round'])} / {fmt(f.get('all_within_one_round'))} |")
    out += ["", "## Per cap", "", "Wall time split per peer (a b p q): inner steps / rest of the phase (finish, "
            "compress, sign, own merge) / between phases (eval, hooks).", "",
            "| cap Mbit/s | compute s/step (a b p q) | time split % | sync-diloco all-reduce s/round | "
            "DP all-reduce s/step | MB sent per peer | relay streams (MB) | load 1m (start, counted) |",
            "|---|---|---|---|---|---|---|---|"]
    for c in extra.get("caps", []):
        m = c["models"]
        relay = c.get("relay_at_end")
        split = ", ".join(f"{100 * t['inner_steps']:.1f}/{100 * t['rest_of_phase']:.1f}/"
                          f"{100 * t['between_phases']:.1f}" for t in c.get("time_split", {}).values())
        out.append(f"| {c['cap_mbit']:g} | {' '.join(f'{v:.2f}' for v in c['compute_s_per_step'].values())} | "
                   f"{split or '-'} | "
                   f"{m['sync_diloco']['allreduce_s']:.1f} | {m['data_parallel']['allreduce_s_per_step']:.1f} | "
                   f"{' '.join(f'{v:.0f}' for v in c['mbytes_sent'].values())} | "
                   + (f"{relay[0]} ({relay[1]:.0f})" if relay else "-") + " | "
                   + (f"{load['start']:.1f}, {load['counted']:.1f}" if (load := c.get("loadavg_1m")) else "-") + " |")
    out += ["", "Assumptions of the models:", ""] + [f"- {a}" for a in extra.get("assumptions", [])]
    return "\n".join(out) + "\n"


def write(rows: list[dict], extra: dict, out: Path) -> list[Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.with_suffix(".json"), out.parent / f"{out.name}_extra.json", out.with_suffix(".md")]
    paths[0].write_text(json.dumps([{k: r[k] for k in ROW_KEYS} for r in rows], indent=1) + "\n")
    paths[1].write_text(json.dumps(extra, indent=1) + "\n")
    paths[2].write_text(table(rows, extra))
    return paths


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caps", default="100,20,5", help="uplink caps in Mbit/s (default: %(default)s)")
    ap.add_argument("--preset", default="small", help="RunSpec preset (default: %(default)s; the issue's)")
    ap.add_argument("--inner-steps", type=int, default=10, help="H (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds counted per cap (default: %(default)s)")
    ap.add_argument("--eval-every", type=int, default=1, help="rounds between evals (default: %(default)s)")
    ap.add_argument("--eval-batches", type=int, default=1, help="batches per eval (default: %(default)s)")
    ap.add_argument("--sync-at", default="20", help="caps at which to time state syncs direct vs relayed "
                    "(comma-separated, empty: none; default: %(default)s)")
    ap.add_argument("--round-timeout-s", type=float, default=240, help="per round, before giving up")
    ap.add_argument("--sync-timeout-s", type=float, default=300,
                    help="a joiner still not synced after this long is recorded as such (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="the tiny preset, H=10, 3 rounds: to try the script")
    ap.add_argument("--workdir", help="keep the logs here (default: a temporary folder)")
    ap.add_argument("--out", help="output prefix (default: benchmarks/results/netns_caps, "
                    "netns_caps_quick with --quick)")
    ap.add_argument("--table", action="store_true", help="only rebuild OUT.md from OUT.json and OUT_extra.json")
    ap.add_argument("--reanalyze", metavar="WORKDIR", help="redo the analysis and outputs from a run's "
                    "WORKDIR/caps.json (its command, date and settings from OUT_extra.json)")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.inner_steps, args.rounds, args.eval_every = "tiny", 10, 3, 1
    args.caps = [float(c) for c in args.caps.split(",") if c]
    args.sync_at = [float(c) for c in args.sync_at.split(",") if c]
    args.out = Path(args.out or RESULTS / ("netns_caps_quick" if args.quick else "netns_caps"))
    return args


def main() -> int:
    args = parse_args()
    if args.table:
        rows = json.loads(args.out.with_suffix(".json").read_text())
        extra = json.loads((args.out.parent / f"{args.out.name}_extra.json").read_text())
        args.out.with_suffix(".md").write_text(table(rows, extra))
        print(args.out.with_suffix(".md").read_text())
        return 0
    if args.reanalyze:
        caps = json.loads((Path(args.reanalyze) / "caps.json").read_text())
        enrich_syncs(caps, Path(args.reanalyze))
        old = json.loads((args.out.parent / f"{args.out.name}_extra.json").read_text())
        info = {k: old[k] for k in INFO_KEYS if k in old}
        paths = write(*analyze(caps, info), args.out)
        print(paths[2].read_text())
        return 0
    if reason := nat_unavailable():
        print(f"cannot build the namespaces: {reason}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="netns-caps-"))
    load_start = os.getloadavg()
    started = time.time()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} load {load_start[0]:.1f} on {os.cpu_count()} cpus; caps "
          f"{', '.join(f'{c:g}' for c in args.caps)} Mbit/s; preset {args.preset} H={args.inner_steps}, "
          f"{args.rounds} rounds each; workdir {workdir}", flush=True)
    caps = []
    for cap in args.caps:
        caps.append(CapRun(cap, args, workdir / f"cap{cap:g}").run())
        (workdir / "caps.json").write_text(json.dumps(caps))  # what was measured so far, if a later cap fails
    info = {"command": "sudo .venv/bin/python benchmarks/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d"), "wall_s": round(time.time() - started),
            "machine": f"{os.cpu_count()} cpus, load {load_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end",
            "preset": args.preset, "inner_steps": args.inner_steps, "rounds": args.rounds,
            "eval_every": args.eval_every, "eval_batches": args.eval_batches, "workdir": str(workdir)}
    rows, extra = analyze(caps, info)
    paths = write(rows, extra, args.out)
    print("\n" + paths[2].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
