"""A learner unit of several processes (train/hardware/unit.py): torchrun with the gloo backend on the CPU, 2 ranks.

The update a 2-process unit signs must be the one a 1-process unit signs from the same batches (up to the order of
float additions): rank 1 trains half of each batch, DDP averages, and the parameters rank 0 sets (phase start,
a remote move between phases) reach rank 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("unit_worker.py")


def _run(out: Path, *, ranks: int, micro_batch: int, arch: str = "gpt") -> dict[str, torch.Tensor]:
    if ranks == 1:  # the same worker in this process (torch is loaded already): 5 s sooner than a subprocess
        import unit_worker

        threads = torch.get_num_threads()
        try:
            unit_worker.main(str(out), arch, micro_batch)
        finally:
            torch.set_num_threads(threads)
        return load_file(str(out))
    path = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}  # keep the caller's path (packages there)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(WORKER)]
    proc = subprocess.run([*cmd, str(out), arch, str(micro_batch)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return load_file(str(out))


def test_two_process_unit_signs_the_one_process_update(tmp_path):
    solo = _run(tmp_path / "solo.st", ranks=1, micro_batch=0)
    duo = _run(tmp_path / "duo.st", ranks=2, micro_batch=2)  # 8 rows: 4 per rank, in 2 micro-batches each
    for r in ("0", "1"):
        assert int(duo["samples" + r]) == int(solo["samples" + r]) == 3 * 8  # the unit's whole batch, H=3
        a, b = solo["round" + r], duo["round" + r]
        assert float(a.abs().max()) > 1e-4  # a real update
        assert torch.allclose(a, b, rtol=0, atol=2e-3 * float(a.abs().max())), float((a - b).abs().max())
    # A wrong split (rank 1 training on rank 0's rows, or stale parameters) moves it by far more than that.
    assert not torch.allclose(solo["round0"], solo["round1"], atol=2e-3 * float(solo["round1"].abs().max()))


def test_batch_that_does_not_split_is_refused():
    from p2p_diloco.config import ConfigError
    from p2p_diloco.train.hardware.unit import RankGroup

    group = RankGroup.__new__(RankGroup)
    group.world = 3
    with pytest.raises(ConfigError, match="divisible by 3"):
        group.check_batch(8)
