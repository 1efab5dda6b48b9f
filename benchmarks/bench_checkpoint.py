"""Cost of restart support on the compute thread: one checkpoint (save, prune), one journal write per round,
and a restore (verify every digest, load, take back the journal), per preset.

    python benchmarks/bench_checkpoint.py --presets test,tiny,small --repeats 3

Prints one line per preset: parameters, checkpoint bytes, median seconds of save / restore / journal append,
the update's size, and the time of one round of --inner-steps steps measured here (a checkpoint is paid once per
`checkpoint_every` rounds of the run's real H; the journal write once per round).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from p2p_diloco.config import preset
from p2p_diloco.train.data.corpus import load_corpus
from p2p_diloco.train.exchange import CollectingExchange
from p2p_diloco.train.learner import Learner, SwarmView
from p2p_diloco.train.loop import run_rounds
from p2p_diloco.train.state.manager import StateManager
from p2p_diloco.wire.identity import Identity


def measure(name: str, repeats: int, inner_steps: int) -> dict:
    import dataclasses

    spec = preset(name)
    spec = dataclasses.replace(spec, inner=dataclasses.replace(spec.inner, inner_steps=inner_steps))
    corpus = load_corpus(spec.data, block_size=spec.model.block_size)
    identity = Identity.generate()
    folder = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    try:
        learner = Learner(spec, identity, corpus, shard=0, num_shards=4)
        state = StateManager(folder, run_id=spec.run_id, spec_hash=spec.spec_hash(), peer_id=identity.peer_id)
        state.open()
        state.attach(learner)
        exchange = CollectingExchange(SwarmView(num_peers=1, samples_per_round=inner_steps * spec.data.batch_size))
        t0 = time.perf_counter()
        run_rounds(learner, exchange)  # AdamW state exists, one update journaled
        round_s = time.perf_counter() - t0
        saves, appends = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            path = state.save(learner, round=1)
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            state.journal.append(exchange.sent[-1])
            appends.append(time.perf_counter() - t0)
        nbytes = sum(f.stat().st_size for f in path.iterdir())
        state.close()
        restores = []
        for _ in range(repeats):
            fresh = Learner(spec, identity, corpus, shard=0, num_shards=4)
            again = StateManager(folder, run_id=spec.run_id, spec_hash=spec.spec_hash(), peer_id=identity.peer_id)
            again.open()
            again.attach(fresh)
            t0 = time.perf_counter()
            assert again.restore(fresh) is not None
            restores.append(time.perf_counter() - t0)
            again.close()
        return {"preset": name, "numel": learner.numel, "bytes": nbytes, "save_s": statistics.median(saves),
                "restore_s": statistics.median(restores), "journal_s": statistics.median(appends),
                "update_bytes": exchange.sent[-1].nbytes, "round_s": round_s}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="test,tiny,small", help="comma-separated presets (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats, median reported (default: %(default)s)")
    ap.add_argument("--inner-steps", type=int, default=5, help="H of the one round timed (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{'preset':8} {'params':>11} {'ckpt MB':>8} {'save s':>8} {'restore s':>9} {'journal s':>9} "
          f"{'update MB':>9} {'round s':>8} (H={args.inner_steps})")
    for name in args.presets.split(","):
        r = measure(name, args.repeats, args.inner_steps)
        print(f"{r['preset']:8} {r['numel']:>11,} {r['bytes'] / 1e6:>8.2f} {r['save_s']:>8.3f} {r['restore_s']:>9.3f} "
              f"{r['journal_s']:>9.4f} {r['update_bytes'] / 1e6:>9.3f} {r['round_s']:>8.2f}",
              flush=True)


if __name__ == "__main__":
    main()
