"""A learner unit across two hosts and a 4-rank FSDP unit in one swarm with a one-process unit, in network
namespaces (needs root and `ip netns`; skipped otherwise).

Group A holds the bootstrap, a one-process unit and a unit of 4 processes that shard the model, its gradients and
AdamW state (`--gpus 4 --training.parallel fsdp`, gloo on the CPU); hosts n0 and n1 run one unit of two processes,
started as the README says:
`torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --master-addr n0 ... -m p2p_diloco join ...`
on each host, the same `join` options on both. Rank 0 (on n0) speaks to the swarm; rank 1 (on n1) only trains,
with gloo over the veths: every inner step it receives its rows of the batch from rank 0 and DDP averages the
gradients across the two hosts. The three units train a few rounds in one swarm and end with equal replicas; rank 1's
host writes nothing (no identity, no out dir). Each host's name resolves to 127.0.0.1 here, as on many Linux
machines, so gloo must not take the hostname's address: the unit picks the interface that routes to the master.

The namespaces are always deleted, and every process left in them (torchrun's workers run in their own sessions,
out of reach of the launcher's process groups) is killed by its pid first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.faults import assert_replicas_agree
from tests.helpers.netns import NetnsTopology, netns_unavailable
from tests.helpers.swarm import PEER_ARGS, Launcher, Proc, wait_until

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(600)]

START_S = 180  # two torchrun agents, their rendezvous and the peer's start-up, on a loaded 2-core machine
ROUNDS = 3
INNER_STEPS = int(PEER_ARGS[PEER_ARGS.index("--inner-steps") + 1])
LINGER_S = 120
MASTER_PORT = 29500  # inside n0's own namespace: nothing else listens there


@contextlib.contextmanager
def _reaped(net: NetnsTopology) -> Iterator[None]:
    """On exit, SIGKILL every process still inside the topology's namespaces (by pid, before they are deleted)."""
    try:
        yield
    finally:
        for ns in net.created:
            listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
            for pid in listed.stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)


def _torchrun(launcher: Launcher, net: NetnsTopology, rank: int, bootstrap: str, workdir: Path) -> Proc:
    """One host's torchrun agent of the 2-host unit; `workdir` holds that host's files (rank 1 must write none)."""
    name = f"n{rank}"
    json_log, out_dir = workdir / "unit.jsonl", workdir / "unit-state"
    argv = [*net.prefix(name), sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--node-rank", str(rank), "--master-addr", net.host("n0"),
            "--master-port", str(MASTER_PORT),
            "-m", "p2p_diloco", "join", *PEER_ARGS, "--identity", str(workdir / "unit.key"),
            "--json-log", str(json_log), "--out-dir", str(out_dir), "--rounds", str(ROUNDS),
            "--linger-s", str(LINGER_S), "--host", net.host(name), "--bootstrap", bootstrap]
    return launcher.start(name, argv, json_log=json_log, out_dir=out_dir)


def test_two_host_and_fsdp_units_train_in_one_swarm_and_agree(tmp_path: Path) -> None:
    if reason := netns_unavailable():
        pytest.skip(f"network namespaces unavailable: {reason}")
    hosts = {name: tmp_path / name for name in ("n0", "n1")}
    for path in hosts.values():
        path.mkdir()
    with NetnsTopology({"A": ["boot", "solo", "fsdp"], "B": ["n0", "n1"]}) as net, _reaped(net), \
            Launcher(tmp_path) as launcher:
        _, bootstrap = launcher.bootstrap(host=net.host("boot"), prefix=net.prefix("boot"), timeout_s=START_S)
        # The one-process unit trains until told to finish: it cannot linger for a unit not yet in the swarm.
        solo = launcher.peer("solo", bootstrap, "--host", net.host("solo"), rounds=0, linger_s=LINGER_S,
                             prefix=net.prefix("solo"), nice=5)
        rank0, rank1 = (_torchrun(launcher, net, r, bootstrap, hosts[f"n{r}"]) for r in (0, 1))
        fsdp = launcher.peer("fsdp", bootstrap, "--host", net.host("fsdp"), "--gpus", "4", "--training.parallel",
                             "fsdp", rounds=ROUNDS, linger_s=LINGER_S, prefix=net.prefix("fsdp"))
        agents = [rank0, rank1, fsdp]
        wait_until(lambda: rank0.rounds() and fsdp.rounds() and solo.rounds(), 2 * START_S,
                   "the three units' first rounds", procs=[solo, *agents])
        solo.finish()
        for proc in [solo, *agents]:
            wait_until(lambda p=proc: p.returncode is not None, START_S + LINGER_S, f"{proc.name} to end",
                       procs=[], interval_s=1.0)

    for proc in [solo, *agents]:
        assert proc.returncode == 0, proc.tail(40)
    start = rank0.events("start")[0]
    assert start["processes"] == 2, start
    assert len(rank0.rounds()) == ROUNDS and len(fsdp.rounds()) == ROUNDS
    assert fsdp.events("start")[0]["processes"] == 4 and "a unit of 4 processes" in fsdp.output(), fsdp.tail()
    # rank 1 took every inner step of the unit's rounds with rank 0 (DDP over the veths), then was told to stop
    assert f"rank 1 of 2: {ROUNDS * INNER_STEPS} inner steps, then rank 0 said stop" in rank1.output(), rank1.tail()
    assert sorted(p.name for p in hosts["n1"].iterdir()) == [], "rank 1's host wrote the unit's files"
    # the three units' updates, merged once each, in equal replicas
    assert_replicas_agree([solo, rank0, fsdp], clean=True)
