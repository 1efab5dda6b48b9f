"""What a fault scenario asserts about real peer processes: whose updates each replica holds, and that the
replicas agree (shared by tests/peer/test_faults.py, test_partition.py, test_restart.py and benchmarks/chaos.py)."""

from __future__ import annotations

import re

from tests.helpers.swarm import Proc, max_relative_difference, wait_until


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
