"""A 4-process FSDP unit in a swarm with a one-process unit: `join --gpus 4 --training.parallel fsdp`, gloo on the
CPU. The unit's ranks each hold a quarter of the model, its gradients and AdamW state (train/hardware/sharded.py);
rank 0 speaks to the swarm, evaluates the replica with the others (a sharded forward) at the start, every
`--eval-every` rounds and at the end, and writes its checkpoint on exit (without the sharded AdamW state). Both
units end with equal replicas holding each other's updates.
"""

from __future__ import annotations

import pytest

from tests.helpers.faults import assert_replicas_agree
from tests.helpers.swarm import Launcher, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

START_S = 150  # four processes' start-up (torch, the model, the DHT) on a loaded 2-core machine
ROUNDS = 2
LINGER_S = 120


def test_fsdp_unit_trains_in_a_swarm_with_a_one_process_unit_and_agrees(tmp_path):
    with Launcher(tmp_path) as launcher:
        _, bootstrap = launcher.bootstrap()
        # The one-process unit trains until told to finish: it cannot linger for a unit not yet in the swarm.
        solo = launcher.peer("solo", bootstrap, rounds=0, linger_s=LINGER_S, nice=10)
        fsdp = launcher.peer("fsdp", bootstrap, "--gpus", "4", "--training.parallel", "fsdp", rounds=ROUNDS,
                             linger_s=LINGER_S)
        peers = [solo, fsdp]
        wait_until(lambda: fsdp.rounds() and len(solo.rounds()) >= ROUNDS - 1, START_S + 120,
                   "the FSDP unit's first round, and the solo unit in its last", procs=peers)
        solo.finish()
        for proc in peers:
            proc.wait(START_S)
        for proc in peers:
            assert proc.returncode == 0, proc.tail(40)
        assert "a unit of 4 processes" in fsdp.output(), fsdp.tail()
        assert fsdp.events("start")[0]["processes"] == 4
        assert_replicas_agree(peers, clean=True)
        # Evaluated by all four ranks (a sharded forward), during the run and at the end: on the equal final
        # replicas its loss is the one-process unit's (the same eval batches), not merely some number.
        assert fsdp.events("eval"), fsdp.tail()
        final_fsdp, final_solo = (p.events("final")[0]["eval_loss"] for p in (fsdp, solo))
        assert abs(final_fsdp - final_solo) < 1e-4, (final_fsdp, final_solo)
        assert list((tmp_path / "fsdp-state").rglob("*")), "the FSDP unit wrote no checkpoint"
