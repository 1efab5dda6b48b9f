"""The chaos harness's numbers (benchmarks/chaos.py): fault schedules, goodput measured from the peers' JSON
logs, and the same schedule replayed analytically for data-parallel and synchronous DiLoCo.

Goodput (ARCHITECTURE.md "What we measure"): peer-seconds of compute whose updates reached the surviving replicas, over
peer-seconds allocated, crashes, restarts and waiting included. Read here as:

- allocated: the time each peer's process is up inside the measured window (from the clock's zero, when every
  peer has published a round, to the stop signal, extended until the round then in progress ends). A killed
  peer's machine is gone until its restart is launched (`down_s`): that time is not allocated. Paused time is
  (the machine is held, frozen). Restart start-up, catch-up, a phase lost to a kill and barrier waits are all
  allocated and count against goodput. `goodput_with_down` also counts the down time as allocated.
- useful: the wall time of each round (inner phase + signing; pauses inside it removed) whose update (sender,
  seq) is in every surviving replica's final version vector.

Baselines on the same clock, fault times, round time P (measured) and restart overhead R (measured: restart
launch to the first phase start), with no network cost of their own (optimistic for both):
- data-parallel: every step is an all-reduce of all N workers, so whenever any worker is unavailable (killed,
  until its restart plus R; paused; or the swarm partitioned) all N wait; otherwise all N compute.
- synchronous DiLoCo: phases of P; the barrier at each phase's end waits for every peer to complete a phase
  it ran uninterrupted (a killed peer redoes its phase after restart + R, also when it died while waiting at
  the barrier); a partition holds the barrier until healed.
- p2p-diloco (the model of the measured run): each peer trains back to back; a kill loses the phase in
  progress, a restart costs R, a pause costs its length; nobody waits for anybody.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

ACTIONS = ("kill", "restart", "pause", "resume", "partition", "heal")
"""What a schedule can do: kill (SIGKILL to the peer's process group) and restart (same identity, out dir and
checkpoints), pause (SIGSTOP) and resume (SIGCONT), partition (cut the link between the two groups of
namespaces) and heal."""
PAIRS = {"kill": "restart", "pause": "resume", "partition": "heal"}


@dataclass(frozen=True)
class Action:
    """One scheduled fault: at `at_s` seconds after the clock's zero; `peer` is a peer index (None for
    partition and heal, which act on the link between the two groups)."""

    at_s: float
    action: str
    peer: int | None = None


def validate_schedule(actions: Sequence[Action], peers: int, *, netns: bool) -> list[Action]:
    """Sorted actions; ValueError naming the first one that makes no sense (unknown action or peer, a kill of a
    peer that is down, a restart of one that is up, a partition without namespaces)."""
    down: set[int] = set()
    paused: set[int] = set()
    cut = False
    ordered = sorted(actions, key=lambda a: a.at_s)
    for a in ordered:
        where = f"{a.action} at {a.at_s:g}s"
        if a.action not in ACTIONS:
            raise ValueError(f"{where}: unknown action (one of {', '.join(ACTIONS)})")
        if a.at_s < 0:
            raise ValueError(f"{where}: negative time")
        if a.action in ("partition", "heal"):
            if not netns:
                raise ValueError(f"{where}: partitions need --netns (root and `ip netns`)")
            if cut == (a.action == "partition"):
                raise ValueError(f"{where}: the swarm is {'already' if cut else 'not'} partitioned")
            cut = a.action == "partition"
            continue
        if a.peer is None or not 0 <= a.peer < peers:
            raise ValueError(f"{where}: peer must be in [0, {peers}), got {a.peer}")
        state = {"kill": (a.peer not in down and a.peer not in paused), "restart": a.peer in down,
                 "pause": a.peer not in down and a.peer not in paused, "resume": a.peer in paused}[a.action]
        if not state:
            now = "down" if a.peer in down else "paused" if a.peer in paused else "up"
            raise ValueError(f"{where}: peer {a.peer} is {now}")
        {"kill": down.add, "restart": down.discard, "pause": paused.add, "resume": paused.discard}[a.action](a.peer)
    return ordered


def load_schedule(path: str | Path) -> list[Action]:
    """A JSON file: a list (or {"actions": [...]}) of {"at_s", "action", "peer"}; a kill, pause or partition
    may carry "for_s", which adds its restart, resume or heal."""
    data = json.loads(Path(path).read_text())
    items = data["actions"] if isinstance(data, dict) else data
    out = []
    for item in items:
        a = Action(float(item["at_s"]), str(item["action"]), item.get("peer"))
        out.append(a)
        if "for_s" in item:
            out.append(Action(a.at_s + float(item["for_s"]), PAIRS[a.action], a.peer))
    return out


def random_schedule(peers: int, duration_s: float, *, kill_every_s: float, down_s: float, seed: int,
                    pause_every_s: float = 0.0, pause_s: float = 0.0, partition_every_s: float = 0.0,
                    partition_s: float = 0.0, settle_s: float = 60.0) -> list[Action]:
    """Kills about every `kill_every_s` (+-25%), each restarted `down_s` later; likewise pauses and partitions.
    One fault of a kind at a time; every peer is up again `settle_s` before the end."""
    rng = random.Random(seed)
    actions: list[Action] = []
    busy: dict[int, list[tuple[float, float]]] = {i: [] for i in range(peers)}

    def free(peer: int, start: float, end: float) -> bool:
        return all(end < s or start > e for s, e in busy[peer])

    for every_s, length_s, kind in ((kill_every_s, down_s, "kill"), (pause_every_s, pause_s, "pause"),
                                    (partition_every_s, partition_s, "partition")):
        if every_s <= 0:
            continue
        t = every_s * rng.uniform(0.75, 1.25)
        while t + length_s + settle_s <= duration_s:
            if kind == "partition":
                actions += [Action(round(t, 1), "partition"), Action(round(t + length_s, 1), "heal")]
            else:
                candidates = [p for p in range(peers) if free(p, t, t + length_s)]
                if candidates:
                    peer = rng.choice(candidates)
                    busy[peer].append((t, t + length_s))
                    actions += [Action(round(t, 1), kind, peer), Action(round(t + length_s, 1), PAIRS[kind], peer)]
            t += every_s * rng.uniform(0.75, 1.25)
    return sorted(actions, key=lambda a: a.at_s)


# ---------------------------------------------------------------------------------------------- intervals


Spans = list[tuple[float, float]]


def intervals(done: Sequence[dict], start: str, end: str, horizon_s: float) -> dict[int | None, Spans]:
    """From executed actions ({"t", "action", "peer"}): per peer, the [start, end) intervals of one kind
    (an open one ends at `horizon_s`)."""
    out: dict[int | None, list[tuple[float, float]]] = {}
    opened: dict[int | None, float] = {}
    for a in sorted(done, key=lambda a: a["t"]):
        if a["action"] == start:
            opened[a.get("peer")] = a["t"]
        elif a["action"] == end and a.get("peer") in opened:
            out.setdefault(a.get("peer"), []).append((opened.pop(a.get("peer")), a["t"]))
    for peer, t in opened.items():
        out.setdefault(peer, []).append((t, horizon_s))
    return out


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def covered(spans: Iterable[tuple[float, float]], window: tuple[float, float]) -> float:
    """Length of the union of `spans` inside `window`."""
    total, reach = 0.0, window[0]
    for s, e in sorted(spans):
        s, e = max(s, reach), min(e, window[1])
        if e > s:
            total += e - s
            reach = e
    return total


# ---------------------------------------------------------------------------------------------- measured


@dataclass
class PeerGoodput:
    """One peer slot of the measured run (times in seconds on the harness clock)."""

    peer: int
    allocated_s: float
    useful_s: float
    busy_s: float  # rounds' time whether or not their update survived (compute utilization's numerator)
    down_s: float
    rounds: int
    rounds_lost: int  # published but missing from a surviving replica
    restarts: list[dict] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.useful_s / self.allocated_s if self.allocated_s else 0.0

    @property
    def utilization(self) -> float:
        return self.busy_s / self.allocated_s if self.allocated_s else 0.0


def measure_peer(peer: int, lives: Sequence[tuple[float, float]], rounds: Sequence[dict], final_vv: dict[str, int],
                 pauses: Sequence[tuple[float, float]], window: tuple[float, float]) -> PeerGoodput:
    """Goodput of one slot. `lives`: [launch, death or exit) of each incarnation; `rounds`: its round events
    with "t" (end, harness clock), "round_s", "seq", "peer_id"; `final_vv`: the vector every surviving replica
    holds (elementwise min over survivors)."""
    t0, t_stop = window
    end = max([t_stop] + [r["t"] for r in rounds])  # the round in progress at the stop signal is finished
    allocated = sum(overlap(life, (t0, end)) for life in lives)
    down = max(0.0, (end - t0) - allocated)
    latest: dict[int, dict] = {}
    for r in rounds:  # a seq signed twice (a restart without a journal): the later one is the real one
        latest[r["seq"]] = r
    useful = busy = 0.0
    lost = 0
    for r in rounds:
        span = (r["t"] - r["round_s"], r["t"])
        inside = overlap(span, (t0, end)) - sum(overlap(span, p) for p in pauses)
        inside = max(0.0, inside)
        busy += inside
        if latest[r["seq"]] is r and r["seq"] <= final_vv.get(r["peer_id"], 0):
            useful += inside
        else:
            lost += 1
    return PeerGoodput(peer, allocated, useful, busy, down, len(rounds), lost)


def restart_costs(launches: Sequence[float], rounds: Sequence[dict], catchups: Sequence[dict] = (),
                  starts: Sequence[dict] = ()) -> list[dict]:
    """Per restart, seconds from the launch to: the process logging its start (imports, corpus: `to_start_s`),
    its catch-up done (`to_caught_up_s`), its first phase (the overhead R, `overhead_s`), its first update."""
    out = []
    for launch in launches:
        after = [r for r in rounds if r["t"] > launch]
        start = next((e for e in starts if e["t"] > launch), None)
        catchup = next((c for c in catchups if c["t"] > launch), None)
        cost = {"launched_t": launch, "overhead_s": None, "to_first_update_s": None,
                "to_start_s": None if start is None else start["t"] - launch,
                "to_caught_up_s": None if catchup is None else catchup["t"] - launch,
                "catch_up": None if catchup is None else {k: catchup.get(k) for k in ("how", "seconds")}}
        if after:
            first = min(after, key=lambda r: r["t"])
            cost.update(overhead_s=first["t"] - first["round_s"] - launch, to_first_update_s=first["t"] - launch)
        out.append(cost)
    return out


def summarize(slots: Sequence[PeerGoodput]) -> dict:
    allocated = sum(s.allocated_s for s in slots)
    useful = sum(s.useful_s for s in slots)
    with_down = allocated + sum(s.down_s for s in slots)
    return {"goodput": useful / allocated if allocated else 0.0,
            "goodput_with_down": useful / with_down if with_down else 0.0,
            "allocated_peer_s": allocated, "useful_peer_s": useful, "down_peer_s": with_down - allocated,
            "peers": [{**asdict(s), "goodput": s.goodput, "utilization": s.utilization} for s in slots]}


# ---------------------------------------------------------------------------------------------- replays


@dataclass(frozen=True)
class Replay:
    """The measured run's fault times (harness clock, zero = the clock's zero) and costs, for the replays."""

    peers: int
    duration_s: float
    phase_s: float  # P
    restart_overhead_s: float  # R
    kills: dict[int, list[tuple[float, float]]]  # peer -> [kill, restart launch)
    pauses: dict[int, list[tuple[float, float]]]
    cuts: list[tuple[float, float]]

    def unavailable(self, peer: int) -> list[tuple[float, float]]:
        """When `peer` cannot compute: killed until restart + R, and paused."""
        spans = [(k, r + self.restart_overhead_s) for k, r in self.kills.get(peer, [])]
        return sorted(spans + list(self.pauses.get(peer, [])))

    def down_s(self, peer: int) -> float:
        return sum(r - k for k, r in self.kills.get(peer, []))

    def result(self, method: str, useful: Sequence[float], end_s: float) -> dict:
        allocated = [end_s - self.down_s(p) for p in range(self.peers)]
        return {"method": method, "goodput": sum(useful) / sum(allocated), "end_s": end_s,
                "goodput_with_down": sum(useful) / (self.peers * end_s),
                "useful_peer_s": sum(useful), "allocated_peer_s": sum(allocated)}


def replay_data_parallel(r: Replay) -> dict:
    stall = [s for p in range(r.peers) for s in r.unavailable(p)] + list(r.cuts)
    working = r.duration_s - covered(stall, (0.0, r.duration_s))
    return r.result("data-parallel", [working] * r.peers, r.duration_s)


def _phase_end(spans: Sequence[tuple[float, float]], start: float, length: float) -> float:
    """End of the first `length`-long stretch at or after `start` that no span interrupts."""
    t = start
    for s, e in sorted(spans):
        if e <= t:
            continue
        if s >= t + length:
            break
        t = max(t, e)
    return t + length


def replay_sync_diloco(r: Replay) -> dict:
    P = r.phase_s
    spans = {p: r.unavailable(p) for p in range(r.peers)}
    kills = {p: [k for k, _ in r.kills.get(p, [])] for p in range(r.peers)}
    t, rounds = 0.0, 0
    while t < r.duration_s:
        finish = {p: _phase_end(spans[p], t, P) for p in range(r.peers)}
        while True:  # a peer killed while waiting at the barrier lost its phase: it redoes it
            end = max(finish.values())
            end = max([end] + [e for s, e in r.cuts if s < end and e > t])  # the all-reduce waits for the heal
            redo = {p: _phase_end(spans[p], next(k for k in kills[p] if finish[p] <= k < end), P)
                    for p in range(r.peers) if any(finish[p] <= k < end for k in kills[p])}
            if not redo:
                break
            finish.update(redo)
        t, rounds = end, rounds + 1
    return {**r.result("sync-diloco", [rounds * P] * r.peers, t), "rounds": rounds}


def replay_p2p(r: Replay) -> dict:
    P = r.phase_s
    useful, end_s = [], r.duration_s
    for p in range(r.peers):
        total, t = 0.0, 0.0
        kills = sorted(r.kills.get(p, []))
        pauses = sorted(r.pauses.get(p, []))
        while t < r.duration_s:
            stretch = P + sum(e - s for s, e in pauses if t <= s < t + P)  # a pause stretches the phase
            killed = next(((k, back) for k, back in kills if t <= k < t + stretch), None)
            if killed:
                t = killed[1] + r.restart_overhead_s
                continue
            t += stretch
            total += P
        useful.append(total)
        end_s = max(end_s, t)
    return r.result("p2p-diloco (model)", useful, end_s)


def replays(r: Replay) -> list[dict]:
    return [replay_p2p(r), replay_sync_diloco(r), replay_data_parallel(r)]


def sensitivity(r: Replay, overheads_s: Sequence[float] = (5.0, 10.0, 20.0)) -> list[dict]:
    """The same schedule replayed with other restart overheads R (start-up is mostly CPU-queueing on a shared
    machine): goodput of each method per R."""
    out = []
    for overhead_s in overheads_s:
        other = Replay(r.peers, r.duration_s, r.phase_s, overhead_s, r.kills, r.pauses, r.cuts)
        out.append({"restart_overhead_s": overhead_s, **{m["method"]: m["goodput"] for m in replays(other)}})
    return out


def replay_from_report(report: dict) -> Replay:
    """The Replay a chaos report's executed faults, round time and restart overhead describe."""
    done, t_stop = report["executed"], report["t_stop"]
    return Replay(report["config"]["peers"], t_stop, report["phase_s"], report["restart_overhead_s"],
                  kills=intervals(done, "kill", "restart", t_stop), pauses=intervals(done, "pause", "resume", t_stop),
                  cuts=intervals(done, "partition", "heal", t_stop).get(None, []))


def median_or(values: Iterable[float | None], default: float) -> float:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else default
